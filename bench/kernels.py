"""Decode attention over packed pages: time and bytes/s per implementation, against bf16.

    python -m bench.kernels                      # this device's grid, every available impl
    python -m bench.kernels --device cuda        # the full grid on a GPU
    python -m bench.kernels --quick              # a small grid (smoke test)

One decode step of one layer: ``batch`` requests, one query row each, ``context``
packed tokens each (SmolLM2-135M's attention by default: 9 query heads, 3 KV
heads, head_dim 64; 128-token blocks of 64-token groups, pages scattered over
the cache as vLLM's allocator leaves them). Measured per scheme (``vidkv``,
``vidkv_stp``, ``kivi2`` by default) and per implementation the device has
(:mod:`vllm_lowbit_kv.ops`: ``torch``, the PyTorch fallback; ``cpp`` on the
CPU; ``triton``, ``cuda`` on a GPU), against

* bf16 attention of the same shape: ``scaled_dot_product_attention`` over
  contiguous bf16 K/V, and vLLM's own paged CPU kernel
  (``torch.ops._C.cpu_attention_with_kv_cache``) when vLLM is importable;
* the bandwidth floor: the bytes the implementation must read (the packed
  states of every group; bf16 K and V for the baselines) over the device's
  copy bandwidth, measured here (``dst.copy_(src)`` of a large buffer, bytes
  read + written over time).

Each row records time, bytes read, achieved GB/s, the floor and the fraction
of the floor reached, and speedups over bf16 SDPA, vLLM's kernel and the
PyTorch fallback measured in the same run. JSON (with the command and the
device) and a PNG go to ``bench/results/kernels_<device>.{json,png}``.

``--threads`` sets the CPU threads: on a machine shared with other jobs use 1,
since every parallel region of a multi-threaded kernel waits for its slowest
thread (the JSON records the threads and the load average).

Imports only torch, the codecs and the ops (no vLLM needed): runs on a GPU box
with torch and triton alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import RESULTS, machine, portable
from bench.plotting import pyplot, save
from vllm_lowbit_kv.ops import AUTO_ORDER, IMPLEMENTATIONS, implementation, unsupported_reason
from vllm_lowbit_kv.paged import PagedLayout
from vllm_lowbit_kv.schemes import get_scheme

#: (contexts, batches, most tokens per cell) per device type; the CPU grid is what a
#: 2-core machine measures in minutes, the GPU grid the issue's full one
GRIDS = {
    "cpu": ([1024, 4096, 8192, 16384, 65536], [1, 4, 16], 1 << 17),
    "cuda": ([1024, 4096, 8192, 16384, 32768, 65536], [1, 4, 16, 32, 64], 1 << 22),
}
QUICK = ([1024, 8192], [1, 4], 1 << 15)
POOL_GROUPS = 256  # distinct encoded groups the pages are filled from


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return machine.cpu_name()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device: torch.device, min_time: float, max_reps: int = 200) -> float:
    """Seconds per call: the best of up to 5 batches of calls lasting about min_time / 5
    each (the best, as ``timeit`` advises: on a shared machine the others measure the
    neighbours)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(max_reps, int(min_time / 5 / once)))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / reps)
        if once * reps * len(times) > 4 * min_time:  # slow implementation: enough samples
            break
    return min(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device, min_time=1.0)
    return 2 * nbytes / t


class Case:
    """Pages of one scheme for ``batch`` requests of ``context`` packed tokens each."""

    def __init__(self, scheme: str, context: int, batch: int, args, device: torch.device,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        kc, vc = get_scheme(scheme).codecs(args.head_dim)
        self.layout = L = PagedLayout(kc, vc, args.kv_heads, args.block_size)
        self.groups = -(-context // L.T)
        total = batch * self.groups
        num_blocks = -(-total // L.groups_per_block) + 1
        pool = L.encode(torch.randn(POOL_GROUPS, L.T, L.H, L.D, generator=g) * 2,
                        torch.randn(POOL_GROUPS, L.T, L.H, L.D, generator=g),
                        torch.rand(POOL_GROUPS, L.T, L.H, generator=g))
        self.pages = torch.zeros(L.page_shape(num_blocks), dtype=torch.uint8)
        gids = torch.randperm(num_blocks * L.groups_per_block, generator=g)[:total]
        L.write_states(self.pages, gids, pool[torch.randint(0, POOL_GROUPS, (total,), generator=g)])
        self.pages = self.pages.to(device)
        self.table = gids.reshape(batch, self.groups).to(device)
        self.num_groups = torch.full((batch,), self.groups, device=device)
        self.skip = torch.zeros(batch, dtype=torch.long, device=device)
        self.q_start = torch.arange(batch + 1, device=device)
        self.query = torch.randn(batch, args.q_heads, L.D, generator=g).to(device, torch.bfloat16)
        self.bytes = total * L.H * L.state_bytes  # every group's K and V states

    def run(self, fn) -> None:
        fn(self.query, self.q_start, self.pages, self.layout, self.table, self.num_groups,
           self.skip, self.layout.D ** -0.5)


def bf16_sdpa(context: int, batch: int, args, device: torch.device):
    """(callable, bytes): SDPA over contiguous bf16 K/V of the same shape."""
    k = torch.randn(batch, args.kv_heads, context, args.head_dim, device=device,
                    dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, args.q_heads, 1, args.head_dim, device=device, dtype=torch.bfloat16)
    return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), 2 * k.numel() * 2


def vllm_cpu_attention(context: int, batch: int, args):
    """(callable, bytes) of vLLM's own paged CPU attention over bf16 pages, or None."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # vLLM (CPU build) absent
        return None
    H, Hq, D, bs = args.kv_heads, args.q_heads, args.head_dim, args.block_size
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    blocks = batch * -(-context // bs)
    kv = torch.randn(blocks, H, 2 * bs, D, dtype=torch.bfloat16)
    key_cache, value_cache = kv.chunk(2, dim=2)
    q = torch.randn(batch, Hq, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), context, dtype=torch.int32)
    table = torch.randperm(blocks, dtype=torch.int32).reshape(batch, -1)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=Hq, num_kv_heads=H, head_dim=D, seq_lens=seq,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq, scale=D ** -0.5, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table, softcap=0, scheduler_metadata=meta, s_aux=None)
    return run, batch * context * H * D * 2 * 2


def cells(device: torch.device, quick: bool):
    contexts, batches, budget = QUICK if quick else GRIDS[device.type]
    return [(c, b) for c in contexts for b in batches if c * b <= budget]


def measure(args) -> dict:
    device = torch.device(args.device)
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    bandwidth = copy_bandwidth(device, args.copy_mib << 20)
    print(f"{device_name(device)}: copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"{torch.get_num_threads()} threads", flush=True)
    rows, baselines = [], []
    for context, batch in cells(device, args.quick):
        base = {}
        fn, nbytes = bf16_sdpa(context, batch, args, device)
        base["bf16_sdpa"] = (timeit(fn, device, args.min_time), nbytes)
        if device.type == "cpu" and not args.no_vllm:
            got = vllm_cpu_attention(context, batch, args)
            if got is not None:
                base["vllm_bf16"] = (timeit(got[0], device, args.min_time), got[1])
        for kind, (t, nbytes) in base.items():
            baselines.append(dict(kind=kind, context=context, batch=batch, time_ms=t * 1e3,
                                  bytes=nbytes, GBps=nbytes / t / 1e9,
                                  floor_frac=nbytes / bandwidth / t))
        for scheme in args.schemes:
            case = Case(scheme, context, batch, args, device)
            times = {}
            for impl in args.impls:
                if unsupported_reason(impl, case.layout, device) is None:
                    fn = implementation(impl)
                    times[impl] = timeit(lambda: case.run(fn), device, args.min_time)
            for impl, t in times.items():
                row = dict(scheme=scheme, impl=impl, context=context, batch=batch,
                           time_ms=t * 1e3, bytes=case.bytes, GBps=case.bytes / t / 1e9,
                           floor_ms=case.bytes / bandwidth * 1e3,
                           floor_frac=case.bytes / bandwidth / t)
                for kind, (tb, _) in base.items():
                    row[f"speedup_vs_{kind}"] = tb / t
                if "torch" in times:
                    row["speedup_vs_torch"] = times["torch"] / t
                rows.append(row)
                print(f"{scheme:10s} {impl:6s} ctx {context:6d} batch {batch:3d}: "
                      f"{t * 1e3:9.3f} ms {case.bytes / t / 1e9:7.2f} GB/s "
                      f"floor {100 * row['floor_frac']:5.1f}%  "
                      + " ".join(f"x{row[k]:.2f} {k[11:]}" for k in row if k.startswith("speedup")),
                      flush=True)
    return dict(command=portable.command([sys.executable, "-m", "bench.kernels", *sys.argv[1:]]),
                device=device_name(device), device_type=device.type,
                threads=torch.get_num_threads(), torch=torch.__version__,
                copy_bandwidth_GBps=bandwidth / 1e9,
                load_avg_1min=dict(start=load_before, end=os.getloadavg()[0]),
                shape=dict(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           block_size=args.block_size, query_rows_per_request=1),
                rows=rows, baselines=baselines, summary=summarize(rows))


def summarize(rows: list[dict]) -> dict:
    """Per scheme and implementation at 8K context (the CPU target) and 32K / batch 32 (the
    GPU target): speedups over the fallback and bf16, fraction of the bandwidth floor."""
    out = {}
    for r in rows:
        if (r["context"], r["batch"]) in ((8192, b) for b in (1, 4, 16)) or \
                (r["context"], r["batch"]) == (32768, 32):
            key = f"{r['scheme']}/{r['impl']}/ctx{r['context']}/batch{r['batch']}"
            out[key] = {k: round(v, 3) for k, v in r.items()
                        if k.startswith("speedup") or k == "floor_frac"}
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    batches = sorted({r["batch"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        series = {}
        for r in result["rows"]:
            if r["batch"] == b:
                series.setdefault(f"{r['scheme']} {r['impl']}", []).append(
                    (r["context"], r["time_ms"]))
        for r in result["baselines"]:
            if r["batch"] == b:
                series.setdefault(r["kind"], []).append((r["context"], r["time_ms"]))
        floor = sorted({(r["context"], r["floor_ms"]) for r in result["rows"]
                        if r["batch"] == b and r["scheme"] == "vidkv"})
        for name, pts in sorted(series.items()):
            pts.sort()
            style = "--" if name in ("bf16_sdpa", "vllm_bf16") else "-"
            ax.plot(*zip(*pts), style, marker="o", ms=3, label=name)
        if floor:
            ax.plot(*zip(*floor), ":", color="k", label="vidkv bandwidth floor")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per step",
               title=f"batch {b}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode attention, one layer ({result['shape']['q_heads']} q / "
                 f"{result['shape']['kv_heads']} kv heads, d={result['shape']['head_dim']}): "
                 f"{result['device']}, {result['threads']} threads", fontsize=9)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--schemes", default="vidkv,vidkv_stp,kivi2")
    p.add_argument("--impls", default=",".join(AUTO_ORDER),
                   help="implementations to measure where available (default: all)")
    p.add_argument("--quick", action="store_true", help="a small grid")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    p.add_argument("--copy-mib", type=int, default=512, help="buffer of the bandwidth probe")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's own CPU kernel")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (torch.set_num_threads; default: torch's)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/kernels_<device>.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.schemes = args.schemes.split(",")
    args.impls = args.impls.split(",")
    bad = [i for i in args.impls if i not in IMPLEMENTATIONS]
    if bad:
        p.error(f"--impls: unknown {bad}; choose from {sorted(IMPLEMENTATIONS)}")
    result = measure(args)
    out = args.out or RESULTS / f"kernels_{torch.device(args.device).type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

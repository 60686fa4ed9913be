"""KV capacity (tokens) vLLM's own allocator reaches per KV dtype at one fixed KV memory.

    python -m bench.capacity                       # bfloat16, fp8 and every scheme; 1 GiB
    python -m bench.capacity --dtypes kivi2,vidkv --kv-space-gib 2

For each dtype it starts the real server (``python -m serving --kv-cache-dtype X
--enforce-eager``, ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-space-gib``), reads the
capacity vLLM resolved (``/metrics`` gauge ``vllm:cache_config_info``:
``kv_cache_size_tokens``, the figure of the start-up line "CPU KV cache size:
N tokens") and stops it. A server that refuses to start (a scheme the backend
cannot serve yet) is recorded as ``refused`` with the reason from its log.

Each row: ``dtype``, ``effective_bits`` (the pages' bits, every stored byte
counted: the backend's start-up figure over all layers when it logs one, else
the scheme's), ``effective_bits_at_8k`` (pages plus the model-dtype staging of
one 8,192-token sequence: residual window, partial group; vLLM's token count
already pays for staging, which comes out of the KV budget),
``capacity_tokens``, ``ratio_vs_bf16``, ``target`` = 0.9 x 16 /
effective_bits_at_8k (the issue's bar), ``meets_target``; plus the blocks, block size and the KV bytes
per token vLLM's allocation implies. Writes ``--json`` and ``--png`` (bar chart).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.plotting import pyplot, save
from bench.quality import BITS_AT_TOKENS
from bench.server import Server, ServerRefused, measurement_server
from bench.vllm_engine import NATIVE_DTYPES, VllmEngine

TARGET_FACTOR = 0.9
REFERENCE = "bfloat16"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtypes", default=None,
                   help="comma-separated KV dtypes (default: bfloat16, fp8 and every registered scheme); "
                        "bfloat16 is always included")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens")
    p.add_argument("--json", default="bench/results/capacity.json")
    p.add_argument("--png", default="bench/results/capacity.png")
    p.add_argument("--parallel", type=int, default=1, help="servers booting at once")
    return p


def _row(dtype: str, model: str, srv: Server | None, err: Exception | None) -> dict:
    try:
        eng = VllmEngine(model, dtype)
        bits, bits_at_8k = eng.effective_bits(), eng.effective_bits_at(BITS_AT_TOKENS)
    except ValueError as e:
        bits, bits_at_8k, err = None, None, err or e
    served = srv.served_bits() if srv is not None else None
    if served:  # the backend's own account of what its pages hold (sinks, masks, bf16 layers)
        bits = served["overall"]
    row = dict(dtype=dtype, effective_bits=bits, effective_bits_at_8k=bits_at_8k, status="ok",
               reason=None, capacity_tokens=None, ratio_vs_bf16=None,
               target=(TARGET_FACTOR * 16 / bits_at_8k) if bits_at_8k else None, meets_target=None)
    if err is not None:
        row.update(status="refused", reason=getattr(err, "reason", None) or str(err))
        return row
    info = srv.cache_info()
    row.update(capacity_tokens=info.get("capacity_tokens"), num_blocks=info.get("num_blocks"),
               block_size=info.get("block_size"), kv_cache_memory_bytes=info.get("kv_cache_memory_bytes"),
               server_cache_dtype=info.get("cache_dtype"), source=info.get("source"),
               startup_s=srv.startup_s, served_bits=served)
    if row["capacity_tokens"] and row["kv_cache_memory_bytes"]:
        row["kv_bytes_per_token"] = round(row["kv_cache_memory_bytes"] / row["capacity_tokens"], 2)
    return row


def measure(dtypes: Sequence[str], model: str, kv_space_gib: int, max_model_len: int, chunk: int,
            parallel: int = 1, log=print) -> list[dict]:
    rows: dict[str, dict] = {}
    todo = list(dtypes)
    while todo:
        batch, todo = todo[:max(1, parallel)], todo[max(1, parallel):]
        servers = {}
        try:
            for d in batch:
                try:
                    VllmEngine(model, d)  # refuse names the engine does not run, without a server
                except ValueError as e:
                    rows[d] = _row(d, model, None, e)
                    continue
                servers[d] = measurement_server(model, d, chunk=chunk, max_model_len=max_model_len,
                                                kv_space_gib=kv_space_gib, max_num_seqs=4).launch()
            for d, s in servers.items():
                try:
                    s.wait_ready()
                    rows[d] = _row(d, model, s, None)
                except ServerRefused as e:
                    rows[d] = _row(d, model, None, e)
                finally:
                    s.stop()
                r = rows[d]
                log(f"{d}: {r['status']}  capacity {r['capacity_tokens']}  bits {r['effective_bits']}"
                    + (f"  reason: {r['reason']}" if r["reason"] else ""))
        finally:
            for s in servers.values():
                s.stop()
    out = [rows[d] for d in dtypes]
    ref = rows.get(REFERENCE, {}).get("capacity_tokens")
    for r in out:
        if r["capacity_tokens"] and ref:
            r["ratio_vs_bf16"] = round(r["capacity_tokens"] / ref, 4)
            r["meets_target"] = r["ratio_vs_bf16"] >= r["target"]
    return out


def format_table(rows: list[dict]) -> str:
    head = ["dtype", "bits", "bits@8K", "capacity", "x bf16", "target", "meets", "status"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = [[r["dtype"], fmt(r["effective_bits"], ".3f"), fmt(r.get("effective_bits_at_8k"), ".3f"),
              fmt(r["capacity_tokens"], ","),
              fmt(r["ratio_vs_bf16"], ".2f"), fmt(r["target"], ".2f"),
              "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "NO"),
              r["status"]] for r in rows]
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(ln, widths)))
            for ln in lines]
    refused = [r for r in rows if r["status"] != "ok"]
    out += [f"refused {r['dtype']}: {r['reason']}" for r in refused]
    return "\n".join(out)


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    plt = pyplot()
    ref = next((r["capacity_tokens"] for r in rows if r["dtype"] == REFERENCE), None)
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows) + 2), 5))
    xs = range(len(rows))
    for x, r in zip(xs, rows):
        if r["status"] != "ok":
            ax.bar(x, 0, color="lightgray")
            ax.annotate("refused", (x, 0), rotation=90, ha="center", va="bottom", fontsize=8,
                        xytext=(0, 4), textcoords="offset points", color="tab:red")
            continue
        color = "black" if r["dtype"] == REFERENCE else ("tab:blue" if r["meets_target"] else "tab:red")
        ax.bar(x, r["capacity_tokens"] / 1e3, color=color)
        ax.annotate(f"{r['ratio_vs_bf16']:.2f}x", (x, r["capacity_tokens"] / 1e3), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        if ref and r["target"]:
            ax.hlines(r["target"] * ref / 1e3, x - 0.4, x + 0.4, colors="tab:orange", lw=2,
                      label="target 0.9 x 16/bits x bf16" if x == 0 else None)
    ax.set_xticks(list(xs), [f"{r['dtype']}\n{r['effective_bits']:.2f} b" if r["effective_bits"]
                             else r["dtype"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("vLLM KV cache capacity (thousand tokens)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    save(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from vllm_lowbit_kv.schemes import SCHEMES
    if args.model is None:
        from vllm_lowbit_kv.model import prepare_model
        args.model = str(prepare_model())
    names = ([REFERENCE, "fp8", *SCHEMES] if args.dtypes is None else
             [REFERENCE] + [d.strip() for d in args.dtypes.split(",") if d.strip()])
    names = list(dict.fromkeys(names))
    t0 = time.time()
    rows = measure(names, args.model, args.kv_space_gib, args.max_model_len, args.chunk, args.parallel,
                   log=lambda s: print(s, file=sys.stderr, flush=True))
    probe = measurement_server(args.model, "<dtype>", chunk=args.chunk, max_model_len=args.max_model_len,
                               kv_space_gib=args.kv_space_gib, max_num_seqs=4)
    result = dict(
        command="python -m bench.capacity " + shlex.join(argv),
        # the model by its served name: results name no path of the machine that made them
        server_command=f"VLLM_CPU_KVCACHE_SPACE={args.kv_space_gib} "
        + shlex.join(probe.command()).replace(str(args.model), Path(args.model).name)
        .replace(sys.executable, "python"),
        model=Path(args.model).name, kv_space_gib=args.kv_space_gib, max_model_len=args.max_model_len,
        native_dtypes=sorted(NATIVE_DTYPES), target_factor=TARGET_FACTOR,
        rows=rows, elapsed_s=round(time.time() - t0, 1),
        all_servable_meet_target=all(r["meets_target"] for r in rows if r["status"] == "ok"),
    )
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.png, f"{Path(args.model).name}: KV capacity at VLLM_CPU_KVCACHE_SPACE="
                             f"{args.kv_space_gib} GiB (vLLM's allocator)")
    return result


if __name__ == "__main__":
    main()

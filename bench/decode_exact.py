"""The exact part of decode rows, each way the serving path can take it: the C++ kernel
(``csrc/cpu/exact_decode.cpp``: every key read where it lives, its sinks in the sink area,
its staged run in the staging slots, its fresh token in the step's rows) against the
PyTorch path it replaces where the kernel does not run (the same keys gathered and widened
into one tensor, then :func:`vllm_lowbit_kv.paged.attention.attend_with_lse`, torch's fused
float32 attention), on the same inputs: what the exact part costs per layer and step.

    python -m bench.decode_exact --json bench/results/decode_exact.json

Per batch size, exact positions per request (``--exact``: 4 sink tokens, the staged run
and the fresh token; vidkv's staged leading group and partial group put about 200 there)
and staging dtype (``--staging``: ``int8``, vidkv's, or ``model``, bf16), the two
alternate for ``--rounds`` rounds of ``--calls`` calls each; a row gives each one's median
milliseconds per call and ``x_cpp``, the C++ kernel's median time over the other's (below
1: slower than the kernel). SmolLM2's 9 query and 3 KV heads of 64 channels by default.
The outputs are checked to agree first (both float32). JSON (with the command and the
machine) to ``--json``, a plot to ``--png``.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path

import torch

from bench import machine
from bench.plotting import pyplot, save
from bench.prefill_exact import (add_run_arguments, check_run_arguments, positive_ints,
                                 time_call, write)

SINKS, SLOT_TOKENS = 4, 128


def inputs(batch: int, exact: int, staging: str, args) -> dict:
    """One decode step's exact part: rows, sinks, staged runs and fresh tokens (bf16, as
    the model writes them), every position live."""
    from vllm_lowbit_kv.paged.write import StagedTokens

    g = torch.Generator().manual_seed(batch * 1000 + exact)
    H, Hq, D = args.kv_heads, args.q_heads, args.head_dim
    tail = exact - 1 - SINKS
    slots = max(math.ceil(tail / SLOT_TOKENS), 1)
    staged = [StagedTokens.allocate((batch * slots, SLOT_TOKENS, H, D), torch.bfloat16, staging)
              for _ in range(2)]
    for s in staged:
        if s.scale is None:
            s.data.copy_(torch.randn(s.data.shape, generator=g))
        else:
            s.data.copy_(torch.randint(-127, 128, s.data.shape, generator=g))
            s.scale.copy_(torch.rand(s.scale.shape, generator=g) / 64)
    return dict(query=torch.randn(batch, Hq, D, generator=g).bfloat16(),
                rows=torch.arange(batch), bias=torch.zeros(batch, exact),
                sink_kv=torch.randn(batch, 2, SINKS, H, D, generator=g).bfloat16(),
                sink_blocks=torch.randperm(batch, generator=g), tail=tail,
                staged_k=staged[0], staged_v=staged[1],
                tail_slots=torch.randperm(batch * slots, generator=g).reshape(batch, slots),
                key=torch.randn(batch, H, D, generator=g).bfloat16(),
                value=torch.randn(batch, H, D, generator=g).bfloat16(),
                scale=D ** -0.5)


def kernels() -> dict:
    """name -> f(inputs) -> (out float32 [B, Hq, D], lse [B, Hq])."""
    from vllm_lowbit_kv.ops import cpu
    from vllm_lowbit_kv.paged.attention import attend_with_lse

    def exact_cpp(x):
        out = torch.empty(x["query"].shape)
        lse = torch.empty(x["query"].shape[:2])
        cpu.exact_decode_attention(x["query"], x["rows"], x["bias"], x["sink_kv"],
                                   x["sink_blocks"], SINKS, x["staged_k"], x["staged_v"],
                                   x["tail_slots"], x["key"], x["value"], x["scale"], out, lse)
        return out, lse

    def torch_gathered(x):  # exact_attention's path without the kernel
        rows = x["rows"][:, None]
        sinks = x["sink_kv"][x["sink_blocks"]].float()
        ks = [sinks[:, 0], x["staged_k"].read_run(x["tail_slots"], x["tail"]),
              x["key"][rows].float()]
        vs = [sinks[:, 1], x["staged_v"].read_run(x["tail_slots"], x["tail"]),
              x["value"][rows].float()]
        out, lse = attend_with_lse(x["query"][rows], torch.cat(ks, 1), torch.cat(vs, 1),
                                   x["bias"][:, None, None], x["scale"])
        return out[:, 0], lse[:, 0]

    return {"exact_cpp": exact_cpp, "torch_gathered": torch_gathered}


def measure(batch: int, exact: int, staging: str, args, fns: dict) -> dict:
    x = inputs(batch, exact, staging, args)
    (o1, l1), (o2, l2) = (fns[n](x) for n in fns)  # also each one's warm-up
    out_diff, lse_diff = (o1 - o2).abs().max().item(), (l1 - l2).abs().max().item()
    if out_diff > 1e-3 or lse_diff > 1e-3:  # both float32 attention of the same keys
        raise RuntimeError(f"batch {batch}, {exact} exact positions, {staging} staging: the "
                           f"two differ by {out_diff} (out), {lse_diff} (lse)")
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(args.rounds):
        for name, f in fns.items():
            times[name].append(time_call(f, (x,), args.calls))
    ms = {n: statistics.median(t) for n, t in times.items()}
    return dict(batch=batch, exact=exact, staging=staging, ms=ms, ms_all=times,
                x_cpp={n: round(ms["exact_cpp"] / m, 3) for n, m in ms.items()},
                max_out_diff=out_diff, max_lse_diff=lse_diff)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for staging in result["staging"]:
        for exact in result["exact"]:
            rows = [r for r in result["rows"] if r["staging"] == staging and r["exact"] == exact]
            ax.plot([r["batch"] for r in rows], [r["x_cpp"]["torch_gathered"] for r in rows],
                    marker="o", label=f"{exact} exact positions, {staging} staging")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("C++ kernel's time / PyTorch path's (median)")
    ax.set_title(f"exact part of decode rows, {result['threads']} threads\n"
                 f"{result['machine']['cpu']}", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="4,16,64", help="requests per step, comma-separated")
    p.add_argument("--exact", default="72,200,392",
                   help=f"exact positions per request ({SINKS} sinks + staged run + 1), "
                        "comma-separated")
    p.add_argument("--staging", default="int8,model", help="staging dtypes: int8, model")
    add_run_arguments(p, "decode_exact.json", calls=20)
    args = p.parse_args(argv)
    batches = positive_ints(p, "--batch", args.batch)
    exacts = positive_ints(p, "--exact", args.exact)
    if min(exacts) < SINKS + 2:
        p.error(f"--exact: at least {SINKS + 2} ({SINKS} sinks, a staged token, the fresh one)")
    stagings = args.staging.split(",")
    if not set(stagings) <= {"int8", "model"}:
        p.error(f"--staging: int8 and/or model, not {args.staging!r}")
    check_run_arguments(p, args)
    if args.head_dim % 16:
        p.error(f"--head-dim: a multiple of 16 (the kernel's vectors), not {args.head_dim}")
    from vllm_lowbit_kv.ops import cpu

    error = cpu.load_library()
    if error:
        sys.exit(f"bench.decode_exact: the C++ kernel did not load: {error}")
    fns = kernels()
    result = dict(command="python -m bench.decode_exact " + shlex.join(argv or sys.argv[1:]),
                  machine=machine.describe(), threads=torch.get_num_threads(),
                  torch=torch.__version__, sinks=SINKS, slot_tokens=SLOT_TOKENS,
                  shape=dict(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim),
                  rounds=args.rounds, calls=args.calls, kernels=list(fns), batch=batches,
                  exact=exacts, staging=stagings, rows=[])
    for staging in stagings:
        for exact in exacts:
            for batch in batches:
                r = measure(batch, exact, staging, args, fns)
                result["rows"].append(r)
                print(f"{staging:5s} staging, {exact:4d} exact, batch {batch:3d}: "
                      + ", ".join(f"{n} {m:.3f} ms" for n, m in r["ms"].items())
                      + f"; torch_gathered x{r['x_cpp']['torch_gathered']:.2f} of the kernel's "
                      "speed", flush=True)
    write(result, args, plot)
    return result


if __name__ == "__main__":
    main()

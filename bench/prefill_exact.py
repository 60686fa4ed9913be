"""The exact part of a prefill chunk, each kernel the serving path can take for it: the
C++ dense kernel (``csrc/cpu/dense_attention.cpp``: bf16 products by AMX tiles where the
CPU has them, else AVX-512 BF16 pairs, or float32) against torch's fused CPU attention
(:func:`vllm_lowbit_kv.paged.attention.torch_causal_attend_with_lse`, oneDNN), on the same
rows of the model's dtype (``--dtype``: bfloat16, or float32 as CPUs without AVX-512 BF16
serve): whether the C++ kernel is still the faster choice on this CPU.

    python -m bench.prefill_exact --json bench/results/prefill_exact.json

Causal self-attention of a chunk of ``--rows`` rows (SmolLM2's 9 query and 3 KV heads of 64
channels by default), as :func:`vllm_lowbit_kv.paged.attention.prefill_exact_attention` calls
each kernel (torch's with its KV heads repeated for the query heads, its output widened
to float32). Per chunk size the kernels alternate for ``--rounds`` rounds of ``--calls``
calls each; a row gives each kernel's median milliseconds per call and ``x_dense``, the
dense kernel's median time over the other's (above 1: faster than the dense kernel). The
largest output difference between the two is checked against bf16 rounding first.
JSON (with the command and the machine) to ``--json``, a plot to ``--png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import machine
from bench.plotting import pyplot, save

RESULTS = Path(__file__).resolve().parent / "results"


def kernels(dtype: str) -> dict:
    """name -> f(q, k, v, scale) -> (out float32 [Q, Hq, D], lse [Q, Hq])."""
    from vllm_lowbit_kv.ops import cpu
    from vllm_lowbit_kv.paged.attention import torch_causal_attend_with_lse

    return {"dense_cpp": lambda q, k, v, scale: cpu.dense_attention(q, k, v, scale, causal=True),
            f"torch_{dtype}": torch_causal_attend_with_lse}


def time_call(f, args, calls: int) -> float:
    """Milliseconds per call over ``calls`` calls."""
    t = time.perf_counter()
    for _ in range(calls):
        f(*args)
    return (time.perf_counter() - t) / calls * 1e3


def measure(rows: int, args, fns: dict) -> dict:
    g = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, h, args.head_dim, generator=g).to(getattr(torch, args.dtype))
               for h in (args.q_heads, args.kv_heads, args.kv_heads))
    scale = args.head_dim ** -0.5
    (o1, l1), (o2, l2) = (fns[n](q, k, v, scale) for n in fns)  # also each kernel's warm-up
    out_diff, lse_diff = (o1 - o2).abs().max().item(), (l1 - l2).abs().max().item()
    if out_diff > 0.05 or lse_diff > 0.01:  # both attend to the same rows: at most bf16 rounding
        raise RuntimeError(f"{rows} rows: the kernels differ by {out_diff} (out), {lse_diff} (lse)")
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(args.rounds):
        for name, f in fns.items():
            times[name].append(time_call(f, (q, k, v, scale), args.calls))
    ms = {n: statistics.median(t) for n, t in times.items()}
    return dict(rows=rows, ms=ms, ms_all=times, x_dense={n: round(ms["dense_cpp"] / m, 3)
                                                          for n, m in ms.items()},
                max_out_diff=out_diff, max_lse_diff=lse_diff)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r["rows"] for r in result["rows"]]
    for name in result["kernels"]:
        ax.plot(rows, [r["ms"][name] for r in result["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows of the prefill chunk")
    ax.set_ylabel("ms per call (median)")
    ax.set_title(f"exact part of a prefill chunk, {result['dtype']}, "
                 f"{result['threads']} threads\n"
                 f"{result['machine']['cpu']} (AMX tiles: {result['amx_tiles']})", fontsize=9)
    ax.legend()
    save(fig, path)


def positive_ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A flag's comma-separated positive integers, or the parser's error naming the flag."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        p.error(f"{flag}: comma-separated positive integers, not {text!r}")
    return values


def add_run_arguments(p: argparse.ArgumentParser, json_name: str, calls: int) -> None:
    """The flags both exact-part benchmarks take: the attention's shape (SmolLM2's by
    default), the alternations and calls per cell, and where the results go."""
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7, help="alternations of the kernels per cell")
    p.add_argument("--calls", type=int, default=calls, help="calls per kernel and round")
    p.add_argument("--json", default=str(RESULTS / json_name))
    p.add_argument("--png", default=None, help="default: the JSON's path, .png")


def check_run_arguments(p: argparse.ArgumentParser, args) -> None:
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls: positive integers")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads: a multiple of --kv-heads ({args.kv_heads}), not {args.q_heads}")


def write(result: dict, args, plot) -> None:
    """The result as JSON to --json and its plot to --png (default: beside the JSON)."""
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(args.png) if args.png else out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="256,512,1024,2048", help="chunk sizes, comma-separated")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the rows' dtype (the model's)")
    add_run_arguments(p, "prefill_exact.json", calls=5)
    args = p.parse_args(argv)
    sizes = positive_ints(p, "--rows", args.rows)
    check_run_arguments(p, args)
    from vllm_lowbit_kv.ops import cpu

    error = cpu.load_library()
    if error:
        sys.exit(f"bench.prefill_exact: the C++ kernel did not load: {error}")
    fns = kernels(args.dtype)
    result = dict(command="python -m bench.prefill_exact " + shlex.join(argv or sys.argv[1:]),
                  machine=machine.describe(), amx_tiles="amx_tile" in machine.isa(),
                  threads=torch.get_num_threads(), torch=torch.__version__, dtype=args.dtype,
                  shape=dict(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim),
                  rounds=args.rounds, calls=args.calls, kernels=list(fns), rows=[])
    for rows in sizes:
        result["rows"].append(measure(rows, args, fns))
        r = result["rows"][-1]
        print(f"{rows:5d} rows: " + ", ".join(f"{n} {m:.3f} ms" for n, m in r["ms"].items())
              + f"; torch x{r['x_dense'][f'torch_{args.dtype}']:.2f} of dense_cpp's speed",
              flush=True)
    write(result, args, plot)
    return result


if __name__ == "__main__":
    main()

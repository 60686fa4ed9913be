"""Scale-out with vLLM's tensor and pipeline parallelism (docs/scale_out.md): what it
costs in answers, measured, and what it buys in capacity for a 70B-class model, computed.

    python -m bench.scale_out            # the capacity table of docs/scale_out.md (markdown)
    python -m bench.scale_out --measure --json bench/results/scale_out.json \
        --png bench/results/scale_out.png   # drift of TP3 / PP2 from one process

**Measured drift.** vLLM's own engine is not bit-identical across layouts on the
CPU build: the row-parallel all-reduce sums bf16 partial products in another order
(TP) and each stage is its own graph (PP), so even its bf16 cache gives slightly
other log-probs than one process. A 2-bit cache turns such last-bit differences in
K and V into other codes now and then, so it drifts more. :func:`drift` measures
it where every later token reads the packed pages: the teacher-forced log-prob of
each token of a long text (chunked prefill), scaled server against one process
with the same flags, mean absolute difference in nats per token. The test
(tests/test_serving_scale_out.py) bounds it with :data:`DRIFT_LIMIT_NATS`.

**Computed capacity.** A calculation, not a measurement: the model is Llama-3-70B's shape (80 layers,
8 KV heads, head_dim 128, 70.6e9 parameters in bf16) on 80 GB GPUs at vLLM's
default ``gpu_memory_utilization`` 0.9, with a fixed activation/runtime reserve
per rank. Each rank holds ``layers / pp`` layers and ``kv_heads / tp`` KV heads
(tp <= kv_heads: no replicated heads) of every block, so every rank holds the
same tokens and the engine's capacity is one rank's. A scheme's bits per element
are its honest figure at the context length (:meth:`KVScheme.effective_bits_at`:
every page byte, sink area, and the sequence's bf16 staging), computed for one
head, the unit a rank's pages are made of.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import machine
from serving.__main__ import PP_COMPILATION

GB = 1e9
LAYERS, KV_HEADS, HEAD_DIM, PARAMS = 80, 8, 128, 70.6e9
GPU_GB, UTILIZATION, RESERVE_GB = 80.0, 0.9, 4.0
#: (GPUs, tensor parallel, pipeline parallel): one node of 8; eight nodes (TP in a node,
#: PP across nodes, as vLLM's docs advise)
LAYOUTS = [(8, 8, 1), (64, 8, 8)]
CONTEXTS = [8192, 32768]
DTYPES = ["bfloat16", "vidkv", "kivi2"]


@dataclass
class Row:
    gpus: int
    tp: int
    pp: int
    dtype: str
    context: int
    bits: float
    weights_gb: float
    kv_budget_gb: float
    bytes_per_token: float  # one rank's share of one token (its layers and heads)
    tokens: int  # the engine's KV capacity in tokens
    sequences: int  # sequences of `context` tokens that fit at once


def bits(dtype: str, context: int) -> float:
    if dtype == "bfloat16":
        return 16.0
    from vllm_lowbit_kv.schemes import get_scheme

    # tensor parallelism serves no retrieval heads (they are chosen over the whole model)
    return get_scheme(dtype).with_params(retrieval_heads=0).effective_bits_at(context, HEAD_DIM)


def row(gpus: int, tp: int, pp: int, dtype: str, context: int) -> Row:
    if gpus != tp * pp or KV_HEADS % tp or LAYERS % pp:
        raise ValueError(f"layout {gpus} = tp {tp} x pp {pp} does not split {LAYERS} layers and "
                         f"{KV_HEADS} KV heads evenly")
    b = bits(dtype, context)
    weights = PARAMS * 2 / gpus / GB
    budget = GPU_GB * UTILIZATION - weights - RESERVE_GB
    per_token = (LAYERS // pp) * (KV_HEADS // tp) * HEAD_DIM * 2 * b / 8
    tokens = int(budget * GB // per_token)
    return Row(gpus, tp, pp, dtype, context, round(b, 3), round(weights, 2), round(budget, 2),
               round(per_token, 1), tokens, tokens // context)


def table() -> list[Row]:
    return [row(g, tp, pp, d, c) for g, tp, pp in LAYOUTS for c in CONTEXTS for d in DTYPES]


def markdown(rows: list[Row]) -> str:
    ref = {(r.gpus, r.context): r.tokens for r in rows if r.dtype == "bfloat16"}
    out = ["| GPUs (tp x pp) | context | KV dtype | bits/element | weights / rank | KV budget / rank "
           "| KV bytes / token / rank | engine KV tokens | sequences at once | vs bf16 |",
           "|:--|--:|:--|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        out.append(f"| {r.gpus} ({r.tp} x {r.pp}) | {r.context // 1024}K | `{r.dtype}` | {r.bits:.3f} "
                   f"| {r.weights_gb:.1f} GB | {r.kv_budget_gb:.1f} GB | {r.bytes_per_token:,.0f} B "
                   f"| {r.tokens / 1e6:.2f} M | {r.sequences:,} | "
                   f"{r.tokens / ref[r.gpus, r.context]:.2f}x |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- measured drift
#: scaled-out layouts measured against one process (SmolLM2: 3 KV heads, 30 layers)
PARALLEL = {"tp3": ["--tensor-parallel-size", "3"], "pp2": ["--pipeline-parallel-size", "2"]}
#: chunked prefill in 256-token steps: every token after the first chunk reads packed pages
SERVER_ARGS = ["--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-num-seqs", "4",
               "--no-enable-prefix-caching"]
#: nats per token: measured ~0.1 for vidkv (vLLM's own bf16 cache ~0.04; vidkv against bf16,
#: its quantization error, ~0.5 on the same text); a rank reading another head's or layer's
#: pages would be far above
DRIFT_LIMIT_NATS = 0.25
DRIFT_TEXT_CHARS = 3600


def drift_text(tag: str = "") -> str:
    """A long held-out text (about 800 tokens of SmolLM2), ``tag`` first so that a server
    with prefix caching has no cached block of it."""
    from vllm_lowbit_kv.corpus import default_text

    return tag + default_text()[:DRIFT_TEXT_CHARS]


def teacher_forced(server, text: str) -> torch.Tensor:
    """log p of every token of ``text`` given the ones before it, from one chunked prefill."""
    ids = server.post("/tokenize", {"model": server.model_name, "prompt": text})["tokens"]
    return server.prompt_logprobs(ids)


def drift(reference: torch.Tensor, scaled: torch.Tensor) -> dict[str, float]:
    d = (reference - scaled).abs()
    return dict(tokens=int(d.numel()), mean_abs_nats=round(float(d.mean()), 4),
                max_abs_nats=round(float(d.max()), 3))


#: greedy continuations compared between a scaled server and one process
GREEDY_PROMPTS = ("The capital of France is", "Once upon a time, in a small village,",
                  "The three primary colors are", "def fibonacci(n):")
GREEDY_TOKENS = 32
#: ``--matched``: one process set up as each pipeline rank is, one OpenMP thread and the
#: model traced as the launcher traces it with pipeline parallelism (its PP_COMPILATION),
#: so that the comparison with pp2 leaves only the split into stages
MATCHED_ONE_ARGS = ["--compilation-config", json.dumps(PP_COMPILATION)]
MATCHED_ONE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def greedy(server) -> list[list[int]]:
    """:data:`GREEDY_TOKENS` greedy tokens for each of :data:`GREEDY_PROMPTS`."""
    return [server.post("/v1/completions", {
        "model": server.model_name, "prompt": p, "max_tokens": GREEDY_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})["choices"][0]["token_ids"]
        for p in GREEDY_PROMPTS]


def measure(dtypes: Sequence[str], log=print, matched: bool = False) -> list[dict]:
    """For every dtype: one process, then each of :data:`PARALLEL` (``matched``: pp2 only,
    against one process set up as a pipeline rank), teacher-forced on :func:`drift_text`;
    rows of drift and greedy agreement against one process (and, for the low-bit dtypes,
    the quantization error against one bf16 process, for scale)."""
    from bench.server import Server

    text, rows, one = drift_text(), [], {}
    one_args, one_env = (MATCHED_ONE_ARGS, MATCHED_ONE_ENV) if matched else ([], {})
    layouts = {"one": []} | ({"pp2": PARALLEL["pp2"]} if matched else PARALLEL)
    for dtype in dtypes:
        for layout, flags in layouts.items():
            args, env = (one_args, one_env) if layout == "one" else (flags, {})
            with Server(["--kv-cache-dtype", dtype, *SERVER_ARGS, *args], env=env).start() as s:
                logprobs, tokens = teacher_forced(s, text), greedy(s)
            log(f"{dtype} {layout}: mean log p {float(logprobs.mean()):.4f}")
            if layout == "one":
                one[dtype] = logprobs, tokens
                if dtype != dtypes[0]:
                    rows.append(dict(dtype=dtype, layout="one", against=f"{dtypes[0]} one",
                                     **drift(one[dtypes[0]][0], logprobs)))
                continue
            same = sum(a == b for a, b in zip(tokens, one[dtype][1]))
            rows.append(dict(dtype=dtype, layout=layout, against=f"{dtype} one",
                             **drift(one[dtype][0], logprobs), greedy_equal=same,
                             greedy_prompts=len(GREEDY_PROMPTS)))
    return rows


def plot(rows: list[dict], path: str) -> None:
    from bench.plotting import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r['dtype']} {r['layout']}\nvs {r['against']}" for r in rows]
    ax.bar(range(len(rows)), [r["mean_abs_nats"] for r in rows],
           color=["tab:gray" if r["layout"] == "one" else "tab:blue" for r in rows])
    ax.axhline(DRIFT_LIMIT_NATS, color="tab:red", ls="--", lw=1, label="test's limit for scale-out")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("mean |Δ log p| (nats / token)")
    ax.set_title("SmolLM2-135M-Instruct, CPU build: teacher-forced drift", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


def main(argv: Sequence[str] | None = None) -> str | list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure drift through real servers")
    parser.add_argument("--dtypes", default="auto,vidkv,kivi2", help="first: the reference dtype")
    parser.add_argument("--matched", action="store_true",
                        help="--measure pp2 only, against one process with one OpenMP thread and "
                             "the model traced as pipeline ranks are")
    parser.add_argument("--json", help="--measure: write the rows here")
    parser.add_argument("--png", help="--measure: plot them here")
    args = parser.parse_args(argv)
    if not args.measure:
        text = markdown(table())
        print(text)
        return text
    t0 = time.time()
    rows = measure([d.strip() for d in args.dtypes.split(",")],
                   log=lambda s: print(s, file=sys.stderr, flush=True), matched=args.matched)
    for r in rows:
        print(f"{r['dtype']:>8} {r['layout']:>4} vs {r['against']:<10} mean |d| {r['mean_abs_nats']:.4f} "
              f"max {r['max_abs_nats']:.3f} over {r['tokens']} tokens"
              + (f", greedy equal {r['greedy_equal']}/{r['greedy_prompts']}" if "greedy_equal" in r
                 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            command="python -m bench.scale_out " + " ".join(argv), model="SmolLM2-135M-Instruct",
            server_args=SERVER_ARGS, drift_limit_nats=DRIFT_LIMIT_NATS,
            parallel={"pp2": PARALLEL["pp2"]} if args.matched else PARALLEL,
            one_process=dict(args=MATCHED_ONE_ARGS, env=MATCHED_ONE_ENV) if args.matched else
            "the launcher's defaults", greedy_prompts=GREEDY_PROMPTS, greedy_tokens=GREEDY_TOKENS,
            machine=machine.describe(), rows=rows,
            elapsed_s=round(time.time() - t0, 1)), indent=1))
    if args.png:
        plot(rows, args.png)
    return rows


if __name__ == "__main__":
    main()

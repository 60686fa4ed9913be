"""KV capacity and per-rank memory of a 70B-class model scaled out with vLLM's tensor and
pipeline parallelism, low-bit KV against bf16 (docs/scale_out.md).

    python -m bench.scale_out            # the table of docs/scale_out.md (markdown)

A calculation, not a measurement: the model is Llama-3-70B's shape (80 layers,
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
from collections.abc import Sequence
from dataclasses import dataclass

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

    return get_scheme(dtype).effective_bits_at(context, HEAD_DIM)


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


def main(argv: Sequence[str] | None = None) -> str:
    argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__.splitlines()[0]) \
        .parse_args(argv)
    text = markdown(table())
    print(text)
    return text


if __name__ == "__main__":
    main()

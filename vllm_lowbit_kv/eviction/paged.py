"""Eviction in the packed paged layout (:mod:`vllm_lowbit_kv.paged`): which blocks of a
request survive, the compaction of its kept pairs, and each layer's read plan after it.
Pure PyTorch; the vLLM glue is :mod:`vllm_lowbit_kv.vllm.eviction`.

One block table per request, per-layer budgets. After the prompt's prefill
(N tokens, blocks of ``bs`` tokens, codec groups of ``T`` tokens):

* The prompt's last, partial block (positions ``keep_from = N // bs * bs`` to
  N) stays where it is, untouched: new tokens continue in it, its partial
  group keeps its staging slot. Those positions are protected (always kept).
* Below ``keep_from``, each layer keeps ``kept_len[l]`` pairs, a multiple of T,
  compacted in position order to the front of the request's blocks (group by
  group: ``blocks[0..]``), re-encoded from their decoded values (the vLLM
  pages hold no exact copy; the policy scores decoded K/V too). The sink area
  of the first block is untouched: the kept pairs start with the sinks.
* Every layer's kept pairs fit in ``kept_blocks = ceil(region_cap / bs)``
  blocks, where ``region_cap`` bounds every layer's ``kept_len`` *before* the
  data is seen (``layer_cap`` x the mean retention for policies with per-layer
  budgets, the mean for the others; at least the protected pairs; rounded up
  to T): the scheduler frees blocks ``kept_blocks ..
  keep_from // bs - 1`` in the same step, without waiting for the worker.
* Layer l then attends to ``kept_len[l]`` compacted pairs followed by the
  positions from ``keep_from`` on (RoPE was applied at the original positions
  when they were written; positions of new tokens stay logical).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codecs.base import require
from ..paged import PagedLayout, ReadPlan, Staging, make_read_plan, mask_sink_rows
from .policies import EvictionPolicy

__all__ = ["PagedEvictionGeometry", "paged_geometry", "request_context", "write_compacted",
           "compact_request", "compacted_read_plan"]


@dataclass(frozen=True)
class PagedEvictionGeometry:
    """What one request keeps where; the same numbers in the scheduler and the worker."""

    prompt_tokens: int
    block_size: int
    keep_from: int  # positions >= keep_from stay in place (the last, partial prompt block)
    region_cap: int  # every layer keeps at most this many pairs below keep_from (multiple of T)
    kept_blocks: int  # blocks 0..kept_blocks-1 hold the compacted pairs

    @property
    def max_layer_budget(self) -> int:
        return self.region_cap + self.prompt_tokens - self.keep_from

    @property
    def freed_blocks(self) -> range:
        """Logical block indices the request gives back."""
        return range(self.kept_blocks, self.keep_from // self.block_size)


def paged_geometry(prompt_tokens: int, block_size: int, group_tokens: int,
                   policy: EvictionPolicy, layer_cap: float) -> PagedEvictionGeometry:
    """The geometry of a request of ``prompt_tokens`` under ``policy`` (module docstring)."""
    N, bs, T = prompt_tokens, block_size, group_tokens
    require(bs % T == 0, "block_size", f"a multiple of the group tokens ({T})", bs)
    require(layer_cap >= 1, "eviction_layer_cap", "a number >= 1", layer_cap)
    keep_from = N // bs * bs
    prot = policy.protected(N)[:keep_from]
    if not policy.dynamic_budgets:  # equal budgets: every layer keeps the mean
        layer_cap = 1.0
    cap = max(math.ceil(layer_cap * policy.retention * N), int(prot.sum()))
    region_cap = min(keep_from, -(-cap // T) * T)
    # the first block stays in any case: it carries the sink area and names the request
    kept_blocks = min(keep_from // bs, max(1, -(-region_cap // bs)))
    return PagedEvictionGeometry(N, bs, keep_from, region_cap, kept_blocks)


def _gids(block_ids, groups: torch.Tensor, groups_per_block: int) -> torch.Tensor:
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[groups // groups_per_block] * groups_per_block + groups % groups_per_block


def request_context(layout: PagedLayout, pages: torch.Tensor, staging: Staging, block_ids,
                    num_tokens: int, tail_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K/V [num_tokens, H, D] float32 of a request, as attention reads them:
    decoded groups, the staged partial group (``tail_slot``), the exact sinks."""
    T, N = layout.T, num_tokens
    n_enc, part = divmod(N, T)
    ks, vs = [], []
    if n_enc:
        k, v = layout.decode(layout.read_states(pages, _gids(block_ids, torch.arange(n_enc),
                                                             layout.groups_per_block)))
        ks.append(k.reshape(-1, layout.H, layout.D))
        vs.append(v.reshape(-1, layout.H, layout.D))
    if part:
        require(tail_slot >= 0, "tail_slot", f"the staging slot of the partial group ({part} tokens)",
                tail_slot)
        slot = torch.tensor([tail_slot])
        ks.append(staging.k.read(slot)[0, :part])
        vs.append(staging.v.read(slot)[0, :part])
    k, v = torch.cat(ks), torch.cat(vs)
    n_sink = min(layout.sink_tokens, N)
    if n_sink:
        k[:n_sink], v[:n_sink] = layout.read_sinks(pages, int(block_ids[0]), n_sink)
    return k, v


def write_compacted(layout: PagedLayout, pages: torch.Tensor, block_ids, k: torch.Tensor,
                    v: torch.Tensor, reference_arithmetic: bool = False) -> None:
    """Encode kept pairs K, V [c, H, D] (c a multiple of T, in position order, the sequence's
    sinks first) into the first c / T groups of the request's blocks. Sink rows are
    masked for the statistics (:func:`~vllm_lowbit_kv.paged.mask_sink_rows`), as
    :func:`~vllm_lowbit_kv.paged.apply_writes` does (reads take them from the sink area).
    Encoded as the write path encodes (:func:`~vllm_lowbit_kv.paged.encode_groups`): by the
    C++ encoder where it runs, by the codecs with ``reference_arithmetic``."""
    T = layout.T
    c = k.shape[0]
    require(c % T == 0, "compacted pairs", f"a multiple of the group tokens ({T})", c)
    if c == 0:
        return
    tk = k.float().reshape(c // T, T, layout.H, layout.D).clone()
    tv = v.float().reshape(c // T, T, layout.H, layout.D).clone()
    mask_sink_rows(tk[0], layout.sink_tokens)
    mask_sink_rows(tv[0], layout.sink_tokens)
    gids = _gids(block_ids, torch.arange(c // T), layout.groups_per_block)
    layout.write_states(pages, gids, layout.encode(tk, tv, cpp=not reference_arithmetic))


def compact_request(geo: PagedEvictionGeometry, policy: EvictionPolicy,
                    layers: list[tuple[PagedLayout, torch.Tensor, Staging]], block_ids,
                    tail_slot: int, reference_arithmetic: bool = False) -> list[int]:
    """Evict one request in place: read every layer's prompt K/V (``layers``: layout, pages,
    staging per layer), plan, write each layer's kept pairs below ``keep_from`` to the
    front of its blocks (:func:`write_compacted`). Returns each layer's kept length there
    (a multiple of T)."""
    N, T = geo.prompt_tokens, layers[0][0].T
    kvs = [request_context(layout, pages, staging, block_ids, N, tail_slot)
           for layout, pages, staging in layers]
    plan = policy.plan([k for k, _ in kvs], [v for _, v in kvs], keep_from=geo.keep_from,
                       max_layer_budget=geo.max_layer_budget, group=T)
    kept_lens = []
    for i, ((layout, pages, _), (k, v), pos) in enumerate(zip(layers, kvs, plan.kept)):
        region = pos[pos < geo.keep_from]
        if region.numel() > geo.region_cap:  # the scheduler freed blocks for at most region_cap
            raise RuntimeError(f"lowbit-kv eviction: layer {i} keeps {region.numel()} pairs, more "
                               f"than the {geo.region_cap} its blocks were sized for")
        write_compacted(layout, pages, block_ids, k[region], v[region], reference_arithmetic)
        kept_lens.append(int(region.numel()))
    return kept_lens


def compacted_read_plan(read: ReadPlan, rows: dict[int, tuple[int, int, torch.Tensor]],
                        layout: PagedLayout) -> ReadPlan:
    """One layer's read plan: ``read`` with each compacted row ``r -> (keep_from, kept_len,
    kept_gids)`` reading its ``kept_len`` compacted pairs (groups ``kept_gids``) and then its
    groups from ``keep_from`` on."""
    T = layout.T
    segs, ctx_len = [], list(read.ctx_len)
    for r in range(len(read.ctx_len)):
        seg = read.group_table[r, :int(read.num_groups[r])]
        if r in rows:
            keep_from, kept_len, kept_gids = rows[r]
            require(read.ctx_len[r] >= keep_from, "compacted request context",
                    f">= its kept-in-place start ({keep_from})", read.ctx_len[r])
            require(not read.lead_slots[r], "compacted request's leading window",
                    "released with its pages' compaction", read.lead_slots[r])
            seg = torch.cat([kept_gids.long(), seg[keep_from // T:]])
            ctx_len[r] = kept_len + read.ctx_len[r] - keep_from
        segs.append(seg)
    table = torch.nn.utils.rnn.pad_sequence(segs, batch_first=True) if segs else read.group_table
    num_groups = torch.tensor([x.numel() for x in segs], dtype=torch.long)
    return make_read_plan(table, num_groups, read.tail_slot, ctx_len, read.q_start,
                          read.first_block, T, layout.sink_tokens, read.window_slots,
                          read.lead_slots)

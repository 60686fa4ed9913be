"""One layer, one step: what the attention backend calls (writes, then reads, merged)."""

from __future__ import annotations

import torch

from ..codecs.base import require
from ..ops import merge_attention_into, packed_attention_reference
from ..retrieval_heads import query_heads
from .attention import attention_mass, context_keys, exact_attention, reads_packed_dense
from .layout import HeadSplitLayout, PagedLayout
from .plan import ReadPlan, WritePlan
from .write import Staging, encode_groups, stage_tokens, write_sink_tokens


def forward_layer(wplan: WritePlan, rplan: ReadPlan, layout: PagedLayout, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, staging: Staging,
                  scale: float, out: torch.Tensor, obs_window: int | None = None,
                  packed_attention=None, reference_arithmetic: bool = False) -> None:
    """One layer, one step: encode the groups this step completes (with STP relevance
    when ``obs_window`` is given and the codecs use it) and write sink tokens; then every
    request attends to its context (pages + staged tail + sinks) and its fresh tokens in
    full precision; then the fresh tokens of incomplete groups are staged. Writes
    ``out[:tokens]``.

    Pages are written before anyone reads them because vLLM's prefix cache can hand a
    request, in the same step, a block another request is filling (blocks are cached
    when scheduled): the reader must see it encoded. A request's own completed groups
    are never in its context, and staging is written last, so writing first changes
    nothing for the writer. Relevance is computed from the context as stored, so a
    request reading another's completed groups has its own encoded after them
    (:func:`_encode_in_dependency_order`).

    The packed groups go through ``packed_attention`` (an implementation of the
    contract of :mod:`vllm_lowbit_kv.ops`, default its PyTorch reference), which reads
    packed bytes only (with a rotating layout: the query rotated, the output
    un-rotated, :mod:`vllm_lowbit_kv.rotation`); the exact keys are attended by
    :func:`exact_attention`; the two parts are merged by log-sum-exp. Only steps that complete a group of an STP
    request decode that request's context (its relevance needs the attention mass
    over every key).

    ``reference_arithmetic`` encodes with the codecs and attends to a prefill chunk's exact
    part with torch, the transformers cache's own arithmetic, instead of the C++ encoder
    and dense kernel: for the engines' float32 parity checks, slower."""
    n = rplan.q_start[-1]
    _encode_in_dependency_order(wplan, rplan, layout, query, key, value, pages, staging, scale,
                                obs_window, reference_arithmetic)
    if n:
        dense = reads_packed_dense(packed_attention, layout, query, reference_arithmetic)
        if query.shape[0] != n:
            query, out = query[:n], out[:n]
        # with dense, prefill chunks read theirs in exact_attention
        num_groups, reads_groups = rplan.packed_groups(dense)
        # nothing to merge and no decode rows: the exact part writes out itself
        direct = not reads_groups and rplan.prefill_only
        res, res_lse = exact_attention(rplan, layout, query, key, value, pages, staging, scale,
                                       dense, out if direct else None, reference_arithmetic)
        if reads_groups:
            p_out, p_lse = packed_part(packed_attention or packed_attention_reference, layout,
                                       query, rplan.q_start_t, pages, rplan.group_table,
                                       num_groups, rplan.skip_tokens, scale)
            merge_attention_into(p_out, p_lse, res, res_lse, out)
        elif not direct:
            out.copy_(res)
    stage_tokens(wplan, key, value, staging, query)


def packed_part(packed_attention, layout: PagedLayout, query: torch.Tensor,
                q_start: torch.Tensor, pages: torch.Tensor, group_table: torch.Tensor,
                num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed groups' attention (out, lse) through ``packed_attention``, given a
    rotating layout's matrix (the contract's ``rotation``: the query rotated, the output
    un-rotated, by the kernel where it can)."""
    rot = layout.rotation
    return packed_attention(query, q_start, pages, layout, group_table, num_groups, skip_tokens,
                            scale, rotation=None if rot is None else rot.matrix(query.device))


def forward_split_layer(wplan: WritePlan, rplan: ReadPlan, split: HeadSplitLayout,
                        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        pages: torch.Tensor, staging: Staging, scale: float, out: torch.Tensor,
                        obs_window: int | None = None, packed_attention: list | None = None,
                        reference_arithmetic: bool = False) -> None:
    """:func:`forward_layer` for a layer whose KV heads are split between page formats
    (retrieval heads): each part runs as a layer of its own over its KV heads, their query
    heads (GQA) and its bytes of the page; part i stages its KV heads in staging heads
    ``[sum of the earlier parts' H, + H_i)`` (and its query heads likewise, for STP).
    ``packed_attention[i]`` reads part i. A part whose heads are one range reads and
    writes views of the layer's tensors; the others copies of their heads."""
    n = rplan.q_start[-1]
    group = query.shape[1] // split.H
    lo = 0
    for i, (part, heads, part_pages) in enumerate(zip(split.parts, split.heads,
                                                        split.part_pages(pages))):
        first, count = heads[0], len(heads)
        one_range = tuple(heads) == tuple(range(first, first + count))
        if one_range:  # views of the layer's tensors, no copies
            q_heads = slice(first * group, (first + count) * group)
            kv = slice(first, first + count)
            part_q, part_k, part_v = query[:, q_heads], key[:, kv], value[:, kv]
            part_out = out[:, q_heads]
        else:
            kv = torch.tensor(heads, device=query.device)
            q_heads = query_heads(kv, group)
            part_q, part_k, part_v = (query.index_select(1, q_heads), key.index_select(1, kv),
                                      value.index_select(1, kv))
            part_out = torch.empty(n, q_heads.numel(), split.D, dtype=out.dtype,
                                   device=out.device)
        part_staging = staging.heads(lo, lo + part.H, group)
        forward_layer(wplan, rplan, part, part_q, part_k, part_v, part_pages, part_staging,
                      scale, part_out, obs_window,
                      None if packed_attention is None else packed_attention[i],
                      reference_arithmetic)
        if not one_range:
            out[:n, q_heads] = part_out
        lo += part.H


def _encode_in_dependency_order(wplan: WritePlan, rplan: ReadPlan, layout: PagedLayout,
                                query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                pages: torch.Tensor, staging: Staging, scale: float,
                                obs_window: int | None, reference_arithmetic: bool) -> None:
    """Encode the step's completed groups. Without relevance: all at once. With it, in
    waves: a request's groups once every completed group its context reads is encoded
    (a same-step prefix-cache hit reads groups its writer completes in this step)."""
    E = wplan.enc_gids.numel()
    if obs_window is None or E == 0:
        encode_groups(wplan, layout, key, value, pages, staging,
                      reference_arithmetic=reference_arithmetic)
        return
    require(staging.q is not None, "staging.q", "allocated for relevance", None)
    enc_req = wplan.enc_req
    require(bool((enc_req >= 0).all()), "WritePlan.enc_req", "known for relevance",
            enc_req.tolist())
    rel = torch.zeros(E, layout.T, layout.H, device=key.device)
    # the sinks first: encoding in waves passes rows, which writes no sinks
    write_sink_tokens(wplan, layout, key, value, pages)
    done = torch.zeros(E, dtype=torch.bool, device=enc_req.device)  # plans stay on the CPU
    while not bool(done.all()):
        pending = wplan.enc_gids[~done]
        ready = [r for r in sorted(set(enc_req[~done].tolist()))
                 if not bool(torch.isin(rplan.page_gids[rplan.page_start[r]:rplan.page_start[r + 1]],
                                        pending).any())]
        if not ready:
            raise RuntimeError("lowbit-kv: completed groups read each other in one step; "
                               "refusing to encode with relevance from unwritten pages")
        for r in ready:
            _fill_relevance(rel, r, wplan, rplan, layout, query, key, pages, staging, scale,
                            obs_window)
        wave = ~done & torch.isin(enc_req, torch.tensor(ready, device=enc_req.device))
        encode_groups(wplan, layout, key, value, pages, staging, rel, torch.nonzero(wave).flatten(),
                      reference_arithmetic)
        done |= wave


def _fill_relevance(rel: torch.Tensor, r: int, wplan: WritePlan, rplan: ReadPlan,
                    layout: PagedLayout, query: torch.Tensor, key: torch.Tensor,
                    pages: torch.Tensor, staging: Staging, scale: float, obs_window: int) -> None:
    """``rel`` rows of request r's completed groups: the attention mass its observation
    window puts on each of their tokens."""
    T = layout.T
    qs, qe, ctx = rplan.q_start[r], rplan.q_start[r + 1], rplan.ctx_len[r]
    k_all = torch.cat([context_keys(rplan, r, layout, pages, staging), key[qs:qe].float()])
    p = ctx + (qe - qs) - 1  # last position written in this step
    w0 = max(0, p - obs_window + 1)
    qw = [query[qs + max(0, w0 - ctx):qe]]
    if w0 < ctx:  # earlier queries of the window: staged with the partial group
        gstart = ctx - ctx % T
        require(w0 >= gstart and rplan.tail_slot[r] >= 0, "obs_window",
                f"<= block_tokens ({T})", obs_window)
        qw.insert(0, staging.q[rplan.tail_slot[r], w0 - gstart:ctx - gstart])
    mass = attention_mass(torch.cat(qw), w0, k_all, scale)  # [S, H]
    for e in torch.nonzero(wplan.enc_req == r).flatten().tolist():
        s0 = int(wplan.enc_start[e])
        rel[e] = mass[s0:s0 + T]

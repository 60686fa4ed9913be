"""Attention over what a step reads: the exact parts (sinks, staged window and tail, fresh
tokens), the context keys for relevance, and the attention mass STP scores tokens by
(one definition for this package and :mod:`vllm_lowbit_kv.hf_cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..codecs.base import require
from ..ops import cpu, merge_attention
from ..ops.cpu import dense_attention, exact_decode_attention
from .layout import PagedLayout
from .plan import ReadPlan
from .write import Staging


def attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float
           ) -> torch.Tensor:
    """Causal attention of ``q`` fresh queries at positions ctx_len.. over keys 0..ctx_len+q-1.

    query [q, Hq, D]; k, v [S, Hkv, D] with S = ctx_len + q -> [q, Hq, D] float32.
    """
    q_len, S = query.shape[0], k.shape[0]
    qi = torch.arange(q_len, device=query.device).unsqueeze(1) + ctx_len
    mask = torch.arange(S, device=query.device).unsqueeze(0) <= qi
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1).unsqueeze(0), k.float().transpose(0, 1).unsqueeze(0),
        v.float().transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=query.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def attention_mass(q_win: torch.Tensor, first_pos: int, keys: torch.Tensor, scale: float,
                   key_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mass of an observation window on every key: STP's relevance (VidKV eq. 7
    with the window's queries as the text query), for the pages and for hf_cache alike.

    q_win [w, Hq, D] (queries at positions first_pos..first_pos+w-1), keys [S, H, D]
    (at positions ``key_pos`` [S], default 0..S-1) -> [S, H]: softmax over the keys each
    query may see (causal), summed over the window's queries and the query heads of
    each KV head (head h*G+g uses KV head h).
    """
    w, Hq, D = q_win.shape
    S, H = keys.shape[0], keys.shape[1]
    G = Hq // H
    qg = q_win.float().permute(1, 0, 2).reshape(H, G * w, D)
    scores = torch.matmul(qg, keys.float().permute(1, 2, 0)) * scale  # [H, G*w, S]
    qpos = (first_pos + torch.arange(w, device=keys.device)).repeat(G)
    kpos = torch.arange(S, device=keys.device) if key_pos is None else key_pos.to(keys.device)
    scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=-2).transpose(0, 1)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention with an additive mask, and its log-sum-exp.

    q [B, Q, Hq, D]; k, v [B, E, H, D]; bias [B, 1, Q, E] (every row attends to one key
    at least) -> out [B, Q, Hq, D], lse [B, Q, Hq]. The G = Hq / H query heads of a KV
    head are folded into its rows (row g*Q + i is head h*G+g at query i), so K and V
    are read as stored, never copied G times.
    """
    B, Q, Hq, D = q.shape
    H = k.shape[2]
    G = Hq // H
    q = q.float().transpose(1, 2).reshape(B, H, G * Q, D)
    k = k.float().transpose(1, 2)
    v = v.float().transpose(1, 2)
    bias = bias.repeat(1, 1, G, 1)
    if q.device.type == "cpu":  # fused, no [Q, E] score matrix (prefill chunks)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return (out.reshape(B, Hq, Q, D).transpose(1, 2),
            lse.reshape(B, Hq, Q).transpose(1, 2))


def torch_causal_attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of Q fresh rows over themselves, and its log-sum-exp, by torch
    (q [Q, Hq, D]; k, v [Q, H, D] -> out [Q, Hq, D], lse [Q, Hq] float32): on the CPU its
    fused kernel (with no mask it
    skips the blocks above the diagonal, half of a prefill chunk's work; bf16 inputs stay
    bf16, float32 otherwise), elsewhere plain float32 products."""
    G = q.shape[1] // k.shape[1]
    on_cpu = q.device.type == "cpu"
    bf16 = on_cpu and q.dtype == k.dtype == v.dtype == torch.bfloat16
    dtype = torch.bfloat16 if bf16 else torch.float32
    q = q.to(dtype).transpose(0, 1).unsqueeze(0)
    k = k.to(dtype).repeat_interleave(G, dim=1).transpose(0, 1).unsqueeze(0)
    v = v.to(dtype).repeat_interleave(G, dim=1).transpose(0, 1).unsqueeze(0)
    if on_cpu:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale)
        out = out.float()
    else:
        Q = q.shape[2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(torch.ones(Q, Q, dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


@dataclass
class PackedGroups:
    """A prefill chunk's packed context, read as dense rows (:func:`reads_packed_dense`):
    tokens ``[skip, G T)`` of the groups ``gids`` of ``pages``."""

    pages: torch.Tensor
    layout: PagedLayout
    gids: torch.Tensor
    skip: int

    @property
    def tokens(self) -> int:
        return self.gids.numel() * self.layout.T - self.skip

    def decode_into(self, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
        cpu.decode_groups(self.pages, self.layout, self.gids, self.skip, key_out, value_out)


def dense_kernel_runs(query: torch.Tensor, reference_arithmetic: bool) -> bool:
    """Whether a prefill chunk's exact part goes through the C++ dense kernel: where it
    runs (:func:`~vllm_lowbit_kv.ops.cpu.dense_runs`), unless ``reference_arithmetic``
    asks for torch's attention, the transformers cache's own arithmetic (the engines'
    float32 parity checks: the kernel's summation order moved vidkv's parity perplexity
    by 0.2%, through codes of the next layers flipped at their thresholds)."""
    return not reference_arithmetic and cpu.dense_runs(query)


def reads_packed_dense(packed_attention, layout: PagedLayout, query: torch.Tensor,
                       reference_arithmetic: bool = False) -> bool:
    """Whether prefill chunks read their packed context as dense rows, decoded by the C++
    kernel's arithmetic, in the dense kernel's one pass over [context, own keys] (no
    packed call, no merge): where the C++ kernel reads the pages (``packed_attention``
    is it) and the dense kernel runs (:func:`dense_kernel_runs`), without a rotation (the
    rows would be rotated). Decode rows keep the packed kernel, which reads fewer bytes
    than the rows it would decode."""
    return (packed_attention is cpu.attention and layout.rotation is None
            and dense_kernel_runs(query, reference_arithmetic))


def prefill_exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
                            out: torch.Tensor, lse: torch.Tensor,
                            packed: PackedGroups | None = None,
                            reference_arithmetic: bool = False) -> None:
    """A prefill chunk's exact part: its rows q [Q, Hq, D] over the exact context ``ks``,
    ``vs`` (each [1, E_i, H, D] float32: sinks, staged run) and ``packed`` (its packed
    groups, decoded; only where :func:`reads_packed_dense`) whole and over their own keys
    k, v [Q, H, D] causally -> ``out`` [Q, Hq, D] (float32 or the model's dtype, unit stride
    in the last dim) and ``lse`` [Q, Hq] (float32, contiguous).
    With the dense kernel (:func:`dense_kernel_runs`) one causal call over [context, own
    keys] (row i sees the context and its own keys 0..i), straight into ``out`` and
    ``lse``; otherwise the two parts apart, merged."""
    if dense_kernel_runs(q, reference_arithmetic):
        keys, values = k, v
        if ks or packed is not None:
            # the context is stored in the model dtype: back to it without loss
            E = (packed.tokens if packed is not None else 0) + sum(x.shape[1] for x in ks)
            keys = k.new_empty(E + k.shape[0], *k.shape[1:])
            values = v.new_empty(keys.shape)
            at = 0
            if packed is not None:
                packed.decode_into(keys[:packed.tokens], values[:packed.tokens])
                at = packed.tokens
            for x, y in zip(ks, vs):
                keys[at:at + x.shape[1]] = x[0]
                values[at:at + x.shape[1]] = y[0]
                at += x.shape[1]
            keys[at:] = k
            values[at:] = v
        if dense_attention(q, keys, values, scale, causal=True, out=out, lse=lse) is not None:
            return
    if packed is not None:
        raise RuntimeError("lowbit-kv: a prefill chunk's packed groups given where the dense "
                           "kernel does not run")
    o, l = torch_causal_attend_with_lse(q, k, v, scale)
    if ks:
        po, pl = attend_with_lse(q[None], torch.cat(ks, 1), torch.cat(vs, 1),
                                 q.new_zeros(1, 1, q.shape[0], sum(x.shape[1] for x in ks),
                                             dtype=torch.float32), scale)
        o, l = merge_attention(po[0], pl[0], o, l)
    out.copy_(o)
    lse.copy_(l)


def exact_attention(rplan: ReadPlan, layout: PagedLayout, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, pages: torch.Tensor, staging: Staging, scale: float,
                    packed_dense: bool = False, into: torch.Tensor | None = None,
                    reference_arithmetic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every fresh row over its request's exact keys (:class:`ExactBatch`): out
    [n, Hq, D] float32 and lse [n, Hq], to merge with the packed part; with ``into`` (the
    layer's output [n, Hq, D], unit stride in the last dim) the rows are written there, in its
    dtype: a step of prefill chunks only with nothing to merge. A prefill chunk
    (one request, several rows) sees its sinks and staged run whole and its fresh tokens
    causally (:func:`prefill_exact_attention`); with ``packed_dense``
    (:func:`reads_packed_dense`) its packed groups too, which the packed part then
    leaves out; ``reference_arithmetic``: see :func:`dense_kernel_runs`."""
    n, Hq, D = query.shape[0], query.shape[1], query.shape[2]
    require(into is None or rplan.prefill_only, "into",
            "given for prefill chunks only (decode rows write float32)", "a decode batch")
    out = into if into is not None else torch.empty(n, Hq, D, dtype=torch.float32,
                                                    device=query.device)
    lse = torch.empty(n, Hq, dtype=torch.float32, device=query.device)
    for b in rplan.exact:
        # decode rows: the C++ kernel reads the keys where they live (no gathered copies,
        # a few dozen small tensor operations fewer per layer); what it computes is below
        if b.bias is not None and exact_decode_attention(
                query, b.first_rows, b.bias, layout.sink_kv(pages) if b.sinks else None,
                b.sink_blocks, b.sinks, staging.k, staging.v, b.tail_slots, key, value, scale,
                out, lse):
            continue
        ks, vs = [], []
        if b.sinks:
            sk, sv = layout.read_sinks_batch(pages, b.sink_blocks, b.sinks)
            ks.append(sk)
            vs.append(sv)
        if b.tail > b.staged_skip:
            ks.append(staging.k.read_run(b.tail_slots, b.tail)[:, b.staged_skip:])
            vs.append(staging.v.read_run(b.tail_slots, b.tail)[:, b.staged_skip:])
        if b.bias is None:  # a prefill chunk: its rows are one range
            r = b.requests[0]
            rows = slice(rplan.q_start[r], rplan.q_start[r + 1])
            packed = None
            g0, g1 = rplan.page_start[r], rplan.page_start[r + 1]  # ints: no tensor reads
            if packed_dense and g1 > g0:
                skip = int(rplan.skip_tokens[r])
                if (g1 - g0) * layout.T > skip:
                    packed = PackedGroups(pages, layout, rplan.page_gids[g0:g1], skip)
            prefill_exact_attention(query[rows], key[rows], value[rows], ks, vs, scale,
                                    out[rows], lse[rows], packed, reference_arithmetic)
            continue
        ks.append(key[b.rows].float())
        vs.append(value[b.rows].float())
        o, l = attend_with_lse(query[b.rows], torch.cat(ks, 1), torch.cat(vs, 1),
                               b.bias[:, None, None].to(query.device), scale)
        out[b.rows] = o
        lse[b.rows] = l
    return out, lse


def context_keys(rplan: ReadPlan, r: int, layout: PagedLayout, pages: torch.Tensor,
                 staging: Staging) -> torch.Tensor:
    """Request r's context keys as read before this step, in token order: [ctx, H, D]
    float32 (the staged leading window, packed groups decoded, sink positions from the
    sink area, the staged residual window and tail)."""
    H, D, T = layout.H, layout.D, layout.T
    g, lead = int(rplan.num_groups[r]), rplan.lead_slots[r]
    parts = []
    if lead:
        parts.append(staging.k.read_run(torch.tensor(lead, device="cpu"), len(lead) * T))
    if g:
        dk, _ = layout.decode(layout.read_states(pages, rplan.group_table[r, :g]))
        parts.append(dk.reshape(g * T, H, D))
    part = rplan.ctx_len[r] - (g + len(lead)) * T
    if part:
        slots = rplan.window_slots[r] + ([rplan.tail_slot[r]] if rplan.ctx_len[r] % T else [])
        parts.append(staging.k.read_run(torch.tensor(slots, device="cpu"), part))
    # group 0 read from its page or the leading window: its sink positions from the sink area
    s = int(rplan.skip_tokens[r]) or (layout.sink_tokens if lead else 0)
    if s:
        parts[0][:s] = layout.read_sinks(pages, rplan.first_block[r], s)[0]
    return torch.cat(parts) if parts else torch.empty(0, H, D, device=staging.k.device)

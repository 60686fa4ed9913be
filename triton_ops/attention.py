"""Paged decode attention over packed pages (the contract of :mod:`vllm_lowbit_kv.ops`).

``packed_attention(query, q_start, pages, layout, group_table, num_groups,
skip_tokens, scale) -> (out, lse)``, reading only the packed group states.

Work split. One program handles one *row tile* of a request (up to ``BR``
consecutive query rows) for one KV head and one *split* (a contiguous range
of the request's groups): its ``BLOCK_M`` score rows are the ``BR x G`` (row,
query head) pairs of that KV head (GQA: query head ``h * G + j`` uses KV head
``h``), so every group state is read and decoded once for all of them. A
group is one tile of T tokens; the program runs an online softmax over its
groups. With more than one split, each split writes its normalized output
and log-sum-exp and a second kernel combines them (log-sum-exp weights).
Decode batches (one row per request) use ``BR = 1``; longer query chunks
(chunked prefill attending to its packed context) use bigger tiles.

Decoding in registers, never in memory:

* KIVI keys (per channel): ``s = (q * scale) . codes + q . zero``.
* VidKV keys: the channel mask gives the channel order; the query is gathered
  into the 2-bit and the 1-bit channel orders (``q_a``, ``q_n``). 2-bit part as
  KIVI. 1-bit part: the stored components ``y = lo + bit * (hi - lo)`` rebuild
  the channels as ``x = y @ W`` (W: the fixed real n1 x n1 inverse of the
  unique rfft parts), so ``q_n . x = (q_n @ W.T) . y``: the query is
  transformed once per group (an n1 x n1 matmul) instead of rebuilding T
  tokens.
* Values (KIVI per token / per channel, ternary with or without STP
  protected tokens): the T x D tile is decoded and multiplied with the
  probabilities.

Differences from the reference: float32 throughout, but the summation order
differs (tolerances in tests/test_triton_ops.py); the reference clamps
decoded VidKV keys to +-65504 after the inverse FFT, the query transform
cannot (it matters only for key magnitudes near the fp16 limit). On CUDA the
matmuls use ``tf32x3`` (three TF32 tensor-core passes, about float32
accuracy); in the interpreter (TRITON_INTERPRET=1) they are exact float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_lowbit_kv.codecs.base import require

from ._jit import load_codes, load_f16, load_trits
from .spec import fft_matrix, require_format
from .store import flat_pages, kernel_constants

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _kivi_key_scores(q, base, t, tvalid, D: tl.constexpr, BITS: tl.constexpr,
                     OFF_CODES: tl.constexpr, OFF_SCALE: tl.constexpr, OFF_ZERO: tl.constexpr,
                     PREC: tl.constexpr):
    """q [M, D] (scaled) against KIVI per-channel keys -> scores [M, TP]."""
    c = tl.arange(0, D)
    scale = load_f16(base + OFF_SCALE, c, c < D)
    zero = load_f16(base + OFF_ZERO, c, c < D)
    codes_t = load_codes(base + OFF_CODES, t[None, :] * D + c[:, None], tvalid[None, :],
                         BITS).to(tl.float32)  # [D, TP]
    return _dot(q * scale[None, :], codes_t, PREC) + tl.sum(q * zero[None, :], axis=1)[:, None]


@triton.jit
def _vidkv_key_scores(q_rows, mrows, s_qd, qk_scale, winv_t, base, t, tvalid,
                      T: tl.constexpr, D: tl.constexpr,
                      N2: tl.constexpr, N2P: tl.constexpr, N1: tl.constexpr, N1P: tl.constexpr,
                      FFT: tl.constexpr, SIGN: tl.constexpr,
                      OFF_CMASK: tl.constexpr, OFF_SCALE2: tl.constexpr, OFF_ZERO2: tl.constexpr,
                      OFF_LO: tl.constexpr, OFF_HI: tl.constexpr, OFF_CODES2: tl.constexpr,
                      OFF_CODES1: tl.constexpr, PREC: tl.constexpr):
    """Query rows (pointers ``q_rows`` [M], valid ``mrows``) against VidKV keys -> [M, TP]."""
    c = tl.arange(0, D)
    mbit = (tl.load(base + OFF_CMASK + c // 8).to(tl.int32) >> (c % 8)) & 1
    rank2 = tl.cumsum(mbit, 0) - mbit  # 2-bit channels before c
    i2 = tl.arange(0, N2P)
    i1 = tl.arange(0, N1P)
    chan2 = tl.sum(tl.where((mbit[:, None] == 1) & (rank2[:, None] == i2[None, :]), c[:, None], 0), 0)
    chan1 = tl.sum(tl.where((mbit[:, None] == 0) & ((c - rank2)[:, None] == i1[None, :]),
                            c[:, None], 0), 0)
    q2 = tl.load(q_rows[:, None] + chan2[None, :] * s_qd,
                 mask=mrows[:, None] & (i2 < N2)[None, :], other=0).to(tl.float32) * qk_scale
    q1 = tl.load(q_rows[:, None] + chan1[None, :] * s_qd,
                 mask=mrows[:, None] & (i1 < N1)[None, :], other=0).to(tl.float32) * qk_scale
    scale2 = load_f16(base + OFF_SCALE2, i2, i2 < N2)
    zero2 = load_f16(base + OFF_ZERO2, i2, i2 < N2)
    codes2 = load_codes(base + OFF_CODES2, t[None, :] * N2 + i2[:, None],
                        tvalid[None, :] & (i2 < N2)[:, None], 2).to(tl.float32)  # [N2P, TP]
    s = _dot(q2 * scale2[None, :], codes2, PREC) + tl.sum(q2 * zero2[None, :], axis=1)[:, None]
    hi = load_f16(base + OFF_HI, i1, i1 < N1)
    if SIGN:
        lo = -hi
    else:
        lo = load_f16(base + OFF_LO, i1, i1 < N1)
    if FFT:
        q1 = _dot(q1, winv_t, PREC)  # the query in the component domain
    bits = load_codes(base + OFF_CODES1, t[None, :] * N1 + i1[:, None],
                      tvalid[None, :] & (i1 < N1)[:, None], 1).to(tl.float32)  # [N1P, TP]
    s += _dot(q1 * (hi - lo)[None, :], bits, PREC) + tl.sum(q1 * lo[None, :], axis=1)[:, None]
    return s


@triton.jit
def _value_tile(base, t, tvalid, T: tl.constexpr, D: tl.constexpr, VAL_KIND: tl.constexpr,
                VAL_BITS: tl.constexpr, VAL_GROUP: tl.constexpr, NP: tl.constexpr,
                V_CODES: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
                V_PSCALE: tl.constexpr, V_PZERO: tl.constexpr, V_ALPHA: tl.constexpr,
                V_TOKMASK: tl.constexpr, V_PCODES: tl.constexpr, V_TRITS: tl.constexpr):
    """The decoded values [TP, D] of one group state (0 on padding rows)."""
    c = tl.arange(0, D)
    rows = tvalid[:, None]
    if VAL_KIND == 2:  # ternary, STP-protected tokens 2-bit
        alpha = load_f16(base + V_ALPHA, c, c < D)
        if NP > 0:
            prot = (tl.load(base + V_TOKMASK + t // 8, mask=tvalid, other=0).to(tl.int32)
                    >> (t % 8)) & 1
            prank = tl.cumsum(prot, 0) - prot
            lrank = t - prank
            pscale = load_f16(base + V_PSCALE, c, c < D)
            pzero = load_f16(base + V_PZERO, c, c < D)
            pm = rows & (prot[:, None] == 1)
            pcodes = load_codes(base + V_PCODES, prank[:, None] * D + c[None, :], pm, 2)
            pv = pcodes.to(tl.float32) * pscale[None, :] + pzero[None, :]
            pv = tl.minimum(tl.maximum(pv, -65504.0), 65504.0)
            trits = load_trits(base + V_TRITS, lrank[:, None] * D + c[None, :], rows & ~pm)
            v = tl.where(pm, pv, trits.to(tl.float32) * alpha[None, :])
        else:
            trits = load_trits(base + V_TRITS, t[:, None] * D + c[None, :], rows)
            v = trits.to(tl.float32) * alpha[None, :]
    else:  # KIVI per token (VAL_KIND 0, VAL_GROUP channels per scale) or per channel
        codes = load_codes(base + V_CODES, t[:, None] * D + c[None, :], rows, VAL_BITS)
        if VAL_KIND == 0:
            sidx = t[:, None] * (D // VAL_GROUP) + c[None, :] // VAL_GROUP
        else:
            sidx = c[None, :] + 0 * t[:, None]
        v = codes.to(tl.float32) * load_f16(base + V_SCALE, sidx, rows) + load_f16(
            base + V_ZERO, sidx, rows)
    return tl.where(rows, v, 0.0)


@triton.jit
def _attention_kernel(
        q_ptr, s_qn, s_qh, s_qd, tile_req_ptr, tile_row_ptr, q_start_ptr,
        pages_ptr, s_pb, s_ph, table_ptr, s_tr, s_tg, ngroups_ptr, skip_ptr, winv_ptr,
        out_ptr, s_os, s_on, s_oh, lse_ptr, s_ls, s_ln,
        qk_scale, groups_per_split,
        T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
        SINK: tl.constexpr, STATE: tl.constexpr, KEY_KIND: tl.constexpr, KEY_BITS: tl.constexpr,
        N2: tl.constexpr, N2P: tl.constexpr, N1: tl.constexpr, N1P: tl.constexpr,
        FFT: tl.constexpr, ONE_BIT: tl.constexpr,
        K_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
        K_CMASK: tl.constexpr, K_SCALE2: tl.constexpr, K_ZERO2: tl.constexpr,
        K_LO: tl.constexpr, K_HI: tl.constexpr, K_CODES2: tl.constexpr, K_CODES1: tl.constexpr,
        VAL_KIND: tl.constexpr, VAL_BITS: tl.constexpr, VAL_GROUP: tl.constexpr,
        NP: tl.constexpr,
        V_CODES: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
        V_PSCALE: tl.constexpr, V_PZERO: tl.constexpr, V_ALPHA: tl.constexpr,
        V_TOKMASK: tl.constexpr, V_PCODES: tl.constexpr, V_TRITS: tl.constexpr,
        G: tl.constexpr, BR: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.load(tile_req_ptr + tile)  # -1: a spare tile (the grid is an upper bound)
    m = tl.arange(0, BLOCK_M)
    # (r + 0 * m): the interpreter rejects masks made of a scalar bool & a tensor
    live_m = (r + 0 * m) >= 0
    live = r >= 0
    r = tl.maximum(r, 0)
    row0 = tl.load(tile_row_ptr + tile)
    q_end = tl.load(q_start_ptr + r + 1)
    row = row0 + m // G
    qh = h * G + m % G
    mrows = live_m & (m < BR * G) & (row < q_end)
    c = tl.arange(0, D)
    q_rows = q_ptr + row.to(tl.int64) * s_qn + qh * s_qh
    q = tl.load(q_rows[:, None] + c[None, :] * s_qd, mask=mrows[:, None], other=0).to(
        tl.float32) * qk_scale
    i1 = tl.arange(0, N1P)
    winv_t = tl.load(winv_ptr + i1[:, None] * N1P + i1[None, :]) if FFT else 0.0

    skip = tl.load(skip_ptr + r).to(tl.int32)
    n_groups = tl.where(live, tl.load(ngroups_ptr + r).to(tl.int32), 0)
    g_lo = tl.maximum(split * groups_per_split, skip // T)
    g_hi = tl.minimum((split + 1) * groups_per_split, n_groups)
    t = tl.arange(0, TP)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    page_head = pages_ptr + h.to(tl.int64) * s_ph + SINK
    for g in range(g_lo, g_hi):
        gid = tl.load(table_ptr + r.to(tl.int64) * s_tr + g * s_tg).to(tl.int64)
        base = page_head + (gid // N) * s_pb + (gid % N) * STATE
        tvalid = t < T
        if KEY_KIND == 0:
            s = _kivi_key_scores(q, base, t, tvalid, D, KEY_BITS, K_CODES, K_SCALE, K_ZERO, PREC)
        else:
            s = _vidkv_key_scores(q_rows, mrows, s_qd, qk_scale, winv_t, base, t, tvalid, T, D,
                                  N2, N2P, N1, N1P, FFT, ONE_BIT == 1, K_CMASK, K_SCALE2,
                                  K_ZERO2, K_LO, K_HI, K_CODES2, K_CODES1, PREC)
        keep = tvalid & (g * T + t >= skip)
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        corr = tl.exp2(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, axis=1)
        v = _value_tile(base, t, tvalid, T, D, VAL_KIND, VAL_BITS, VAL_GROUP, NP, V_CODES,
                        V_SCALE, V_ZERO, V_PSCALE, V_PZERO, V_ALPHA, V_TOKMASK, V_PCODES, V_TRITS)
        acc = acc * corr[:, None] + _dot(p, v, PREC)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2,
                   float("-inf"))
    o_rows = row.to(tl.int64) * s_on + qh * s_oh + split * s_os
    tl.store(out_ptr + o_rows[:, None] + c[None, :], out, mask=mrows[:, None])
    tl.store(lse_ptr + row.to(tl.int64) * s_ln + qh + split * s_ls, lse, mask=mrows)


@triton.jit
def _combine_kernel(part_out, part_lse, out_ptr, lse_ptr, num_splits, s_ps, s_ls,
                    D: tl.constexpr, SP: tl.constexpr):
    """out, lse of one (row, query head) from the splits' normalized parts."""
    i = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    c = tl.arange(0, D)
    ls = tl.load(part_lse + s * s_ls + i, mask=s < num_splits, other=float("-inf"))
    mx = tl.max(ls, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(ls - mx_safe)
    total = tl.sum(w, axis=0)
    o = tl.load(part_out + s[:, None] * s_ps + i * D + c[None, :], mask=(s < num_splits)[:, None],
                other=0.0)
    has = total > 0
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(has, total, 1.0)
    tl.store(out_ptr + i * D + c, res)
    tl.store(lse_ptr + i, tl.where(has, mx_safe + tl.log(tl.where(has, total, 1.0)), float("-inf")))


def _row_tiles(q_start: torch.Tensor, n: int, rows_per_tile: int):
    """(request, first row) of every row tile, -1 past the last; shapes depend on n and R
    only (no host sync: the grid is the bound n, R + n // rows_per_tile)."""
    R = q_start.numel() - 1
    q_len = q_start[1:] - q_start[:-1]
    tiles = (q_len + rows_per_tile - 1) // rows_per_tile
    cum = torch.cumsum(tiles, 0)
    bound = min(n, R + n // rows_per_tile)
    tid = torch.arange(bound, device=q_start.device)
    req = torch.searchsorted(cum, tid, right=True)
    live = req < R
    rc = req.clamp(max=R - 1)
    row0 = q_start[:-1][rc] + (tid - (cum - tiles)[rc]) * rows_per_tile
    return torch.where(live, req, -1).to(torch.int32), row0.to(torch.int32), bound


def _default_splits(device: torch.device, programs: int, max_groups: int) -> int:
    """Enough splits to give every SM a few programs; at least 4 groups per split."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-4 * sms // max(programs, 1))
    return max(1, min(want, max_groups // 4))


def packed_attention(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor, layout,
                     group_table: torch.Tensor, num_groups: torch.Tensor,
                     skip_tokens: torch.Tensor, scale: float, *, num_splits: int | None = None,
                     out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :mod:`vllm_lowbit_kv.ops` (see the module doc for the work split).
    ``num_splits`` forces the number of context splits (default: from the device's SM
    count); ``out`` [n, Hq, D] / ``lse`` [n, Hq] (float32, contiguous) may be given."""
    fmt = require_format(layout)
    n, Hq, D = query.shape
    H = fmt.H
    require(D == fmt.D, "query head_dim", f"{fmt.D} (the layout's)", D)
    require(Hq % H == 0, "query heads", f"a multiple of the KV heads ({H})", Hq)
    G = Hq // H
    dev = query.device
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32, device=dev)
    if lse is None:
        lse = torch.empty(n, Hq, dtype=torch.float32, device=dev)
    for name, x, shape in (("out", out, (n, Hq, D)), ("lse", lse, (n, Hq))):
        require(x.dtype == torch.float32 and tuple(x.shape) == shape and x.is_contiguous(),
                name, f"float32 contiguous {shape}", (x.dtype, tuple(x.shape)))
    R = q_start.numel() - 1
    max_groups = group_table.shape[1] if group_table.dim() == 2 else 0
    if n == 0:
        return out, lse
    if R == 0 or max_groups == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    flat = flat_pages(pages, layout)
    q_start = q_start.to(dev, torch.int64)
    rows_per_tile = 1 if n <= R else max(1, 64 // G)
    tile_req, tile_row, n_tiles = _row_tiles(q_start, n, rows_per_tile)
    splits = num_splits or _default_splits(dev, n_tiles * H, max_groups)
    per_split = -(-max_groups // max(1, min(splits, max_groups)))
    splits = -(-max_groups // per_split)
    consts = kernel_constants(fmt)
    winv = fft_matrix("inverse_t", fmt.n1, consts["N1P"], dev) if fmt.fft else flat
    if splits == 1:
        o, ls, s_os, s_ls = out, lse, 0, 0
    else:
        o = torch.empty(splits, n, Hq, D, dtype=torch.float32, device=dev)
        ls = torch.empty(splits, n, Hq, dtype=torch.float32, device=dev)
        s_os, s_ls = o.stride(0), ls.stride(0)
    consts.pop("GAMMA", None)
    _attention_kernel[(n_tiles, H, splits)](
        query, *query.stride(), tile_req, tile_row, q_start,
        flat, flat.stride(0), flat.stride(1), group_table, *group_table.stride(),
        num_groups.to(dev), skip_tokens.to(dev), winv,
        o, s_os, Hq * D, D, ls, s_ls, Hq,
        float(scale) * LOG2E, per_split,
        G=G, BR=rows_per_tile, BLOCK_M=max(16, triton.next_power_of_2(rows_per_tile * G)),
        PREC="tf32x3" if dev.type == "cuda" else "ieee", num_warps=4, **consts)
    if splits > 1:
        _combine_kernel[(n * Hq,)](o, ls, out, lse, splits, o.stride(0), ls.stride(0),
                                   D=D, SP=triton.next_power_of_2(splits))
    return out, lse


__all__ = ["packed_attention"]

"""Paged decode attention over packed pages (the contract of :mod:`vllm_lowbit_kv.ops`).

``packed_attention(query, q_start, pages, page, group_table, num_groups,
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
  protected tokens): ``p @ codes`` times the per-channel factors (alpha,
  scale), plus the zero points' share; per-token factors scale p first.

Every large matmul has one operand made of integer codes (0..255 or trits),
exact in bfloat16: the other (float32) operand is split into three bfloat16
parts that sum to it exactly, so three bf16 tensor-core products with float32
accumulation give float32 accuracy (:func:`_dot_codes`). The interpreter
(TRITON_INTERPRET=1, how CI runs these kernels) runs the same split as
float32 products.

Differences from the reference: the summation order (tolerances in
tests/test_triton_ops.py); the reference clamps decoded VidKV keys and
protected values to +-65504, the factored products cannot (it matters only
for magnitudes at the fp16 limit).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ...codecs.base import require

from ..page_format import PageFormat, PageGeometry, attention_outputs, fft_matrix, rotating
from . import _jit
from ._jit import load_code_rows, load_codes, load_f16, load_trits
from .store_kernel import kernel_constants, readable_format

ATTN_WARPS = 8
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _bf16_head(x):
    """The top 8 significant bits of float32 x (a value exact in bfloat16), by truncation."""
    return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _dot_codes(a, codes, MMA_BF16: tl.constexpr):
    """a [M, K] float32 times integer codes [K, N] (|code| <= 255, exact in bfloat16).

    a = a1 + a2 + a3 exactly, each part 8 significant bits (truncation: a1 the top
    bits of a, a2 of the rest, a3 the last 8), so three bf16 tensor-core products
    with float32 accumulation give float32 accuracy while the large operand, the
    codes, is held once in 16 bits. MMA_BF16 False (the interpreter, whose bf16 dot
    is not usable) runs the same split as float32 products."""
    a1 = _bf16_head(a)
    rest = a - a1
    a2 = _bf16_head(rest)
    a3 = rest - a2
    if MMA_BF16:  # every operand is exact in bfloat16: the casts lose nothing
        b = codes.to(tl.bfloat16)
        acc = tl.dot(a3.to(tl.bfloat16), b)
        acc = tl.dot(a2.to(tl.bfloat16), b, acc)
        return tl.dot(a1.to(tl.bfloat16), b, acc)
    b = codes.to(tl.float32)
    acc = tl.dot(a3, b, input_precision="ieee")
    acc = tl.dot(a2, b, acc, input_precision="ieee")
    return tl.dot(a1, b, acc, input_precision="ieee")


@triton.jit
def _codes_t(ptr, t, tvalid, C: tl.constexpr, CP: tl.constexpr, BITS: tl.constexpr):
    """Transposed codes [CP, TP] of the row-major [T, C] array at ``ptr``: whole-byte rows
    load contiguously (C == CP), others code by code."""
    if C == CP:
        return tl.trans(load_code_rows(ptr, t, tvalid, CP, BITS))
    i = tl.arange(0, CP)
    return load_codes(ptr, t[None, :] * C + i[:, None], tvalid[None, :] & (i < C)[:, None], BITS)


@triton.jit
def _kivi_key_scores(q, base, t, tvalid, D: tl.constexpr, BITS: tl.constexpr,
                     OFF_CODES: tl.constexpr, OFF_SCALE: tl.constexpr, OFF_ZERO: tl.constexpr,
                     MMA_BF16: tl.constexpr):
    """q [M, D] (scaled) against KIVI per-channel keys: (q * scale) . codes + q . zero."""
    c = tl.arange(0, D)
    scale = load_f16(base + OFF_SCALE, c, c < D)
    zero = load_f16(base + OFF_ZERO, c, c < D)
    codes_t = _codes_t(base + OFF_CODES, t, tvalid, D, D, BITS)
    bias = tl.sum(q * zero[None, :], axis=1)
    return _dot_codes(q * scale[None, :], codes_t, MMA_BF16) + bias[:, None]


@triton.jit
def _vidkv_key_scores(q_rows, mrows, s_qd, qk_scale, winv_t, base, t, tvalid,
                      T: tl.constexpr, D: tl.constexpr,
                      N2: tl.constexpr, N2P: tl.constexpr, N1: tl.constexpr, N1P: tl.constexpr,
                      FFT: tl.constexpr, SIGN: tl.constexpr,
                      OFF_CMASK: tl.constexpr, OFF_SCALE2: tl.constexpr, OFF_ZERO2: tl.constexpr,
                      OFF_LO: tl.constexpr, OFF_HI: tl.constexpr, OFF_CODES2: tl.constexpr,
                      OFF_CODES1: tl.constexpr, MMA_BF16: tl.constexpr):
    """Query rows (pointers ``q_rows`` [M], valid ``mrows``) against VidKV keys -> [M, TP]."""
    c = tl.arange(0, D)
    mbit = (tl.load(base + OFF_CMASK + c // 8).to(tl.int32) >> (c % 8)) & 1
    rank2 = tl.cumsum(mbit, 0) - mbit  # 2-bit channels before c
    i2 = tl.arange(0, N2P)
    i1 = tl.arange(0, N1P)
    # the channel order of the state: 2-bit channels, then 1-bit ones (vidkv.front_perm)
    chan2 = tl.sum(tl.where((mbit[:, None] == 1) & (rank2[:, None] == i2[None, :]),
                            c[:, None], 0), 0)
    chan1 = tl.sum(tl.where((mbit[:, None] == 0) & ((c - rank2)[:, None] == i1[None, :]),
                            c[:, None], 0), 0)
    q2 = tl.load(q_rows[:, None] + chan2[None, :] * s_qd,
                 mask=mrows[:, None] & (i2 < N2)[None, :], other=0).to(tl.float32) * qk_scale
    q1 = tl.load(q_rows[:, None] + chan1[None, :] * s_qd,
                 mask=mrows[:, None] & (i1 < N1)[None, :], other=0).to(tl.float32) * qk_scale
    scale2 = load_f16(base + OFF_SCALE2, i2, i2 < N2)
    zero2 = load_f16(base + OFF_ZERO2, i2, i2 < N2)
    codes2 = _codes_t(base + OFF_CODES2, t, tvalid, N2, N2P, 2)
    s = _dot_codes(q2 * scale2[None, :], codes2, MMA_BF16)
    s += tl.sum(q2 * zero2[None, :], axis=1)[:, None]
    hi = load_f16(base + OFF_HI, i1, i1 < N1)
    if SIGN:
        lo = -hi
    else:
        lo = load_f16(base + OFF_LO, i1, i1 < N1)
    if FFT:  # the query in the component domain: q1 . (y @ W) = (q1 @ W.T) . y
        q1 = tl.dot(q1, winv_t, input_precision="ieee")
    bits = _codes_t(base + OFF_CODES1, t, tvalid, N1, N1P, 1)
    s += _dot_codes(q1 * (hi - lo)[None, :], bits, MMA_BF16)
    s += tl.sum(q1 * lo[None, :], axis=1)[:, None]
    return s


@triton.jit
def _values(p, base, t, tvalid, D: tl.constexpr, VAL_KIND: tl.constexpr,
            VAL_BITS: tl.constexpr, VAL_GROUP: tl.constexpr, NP: tl.constexpr,
            V_CODES: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
            V_PSCALE: tl.constexpr, V_PZERO: tl.constexpr, V_ALPHA: tl.constexpr,
            V_TOKMASK: tl.constexpr, V_PCODES: tl.constexpr, V_TRITS: tl.constexpr,
            MMA_BF16: tl.constexpr):
    """p [M, TP] (0 on padding tokens) times the group's decoded values -> [M, D], with the
    per-channel / per-token factors applied outside the code products."""
    c = tl.arange(0, D)
    rows = tvalid[:, None]
    if VAL_KIND == 2:  # ternary: alpha[c] * trit; STP-protected tokens 2-bit
        alpha = load_f16(base + V_ALPHA, c, c < D)
        if NP > 0:
            prot = (tl.load(base + V_TOKMASK + t // 8, mask=tvalid, other=0).to(tl.int32)
                    >> (t % 8)) & 1
            prank = tl.cumsum(prot, 0) - prot  # row among the protected tokens
            pm = rows & (prot[:, None] == 1)
            trits = load_trits(base + V_TRITS, (t - prank)[:, None] * D + c[None, :], rows & ~pm)
            pcodes = load_codes(base + V_PCODES, prank[:, None] * D + c[None, :], pm, 2)
            out = _dot_codes(p, trits, MMA_BF16) * alpha[None, :]
            pscale = load_f16(base + V_PSCALE, c, c < D)
            pzero = load_f16(base + V_PZERO, c, c < D)
            p_prot = tl.sum(tl.where(prot[None, :] == 1, p, 0.0), axis=1)
            out += (_dot_codes(p, pcodes, MMA_BF16) * pscale[None, :]
                    + p_prot[:, None] * pzero[None, :])
        else:
            trits = load_trits(base + V_TRITS, t[:, None] * D + c[None, :], rows)
            out = _dot_codes(p, trits, MMA_BF16) * alpha[None, :]
    elif VAL_KIND == 0:  # KIVI per token: one scale/zero per (token, VAL_GROUP channels)
        codes = load_code_rows(base + V_CODES, t, tvalid, D, VAL_BITS)
        NG: tl.constexpr = D // VAL_GROUP
        out = tl.zeros([p.shape[0], D], tl.float32)
        for gi in tl.static_range(NG):
            scale = load_f16(base + V_SCALE, t * NG + gi, tvalid)
            zero = load_f16(base + V_ZERO, t * NG + gi, tvalid)
            in_g = (c // VAL_GROUP == gi)[None, :]
            part = _dot_codes(p * scale[None, :], tl.where(in_g, codes, 0), MMA_BF16)
            out += part + tl.where(in_g, tl.sum(p * zero[None, :], axis=1)[:, None], 0.0)
    else:  # KIVI per channel
        # code by code (as the ternary codes above), not load_code_rows: its reshaped
        # tile fed straight into tl.dot is the one operand no GPU run had exercised, and
        # vidkv_k15v2 (VidKV keys, these values) hit an illegal memory access on an H200
        # with Triton 3.6 (tests/test_kernel_protocol.py); every path here now builds its
        # dot operands like one that runs there
        codes = load_codes(base + V_CODES, t[:, None] * D + c[None, :], rows, VAL_BITS)
        scale = load_f16(base + V_SCALE, c, c < D)
        zero = load_f16(base + V_ZERO, c, c < D)
        out = (_dot_codes(p, codes, MMA_BF16) * scale[None, :]
               + tl.sum(p, axis=1)[:, None] * zero[None, :])
    return out


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
        G: tl.constexpr, BR: tl.constexpr, BLOCK_M: tl.constexpr, MMA_BF16: tl.constexpr):
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
            s = _kivi_key_scores(q, base, t, tvalid, D, KEY_BITS, K_CODES, K_SCALE, K_ZERO,
                                 MMA_BF16)
        else:
            s = _vidkv_key_scores(q_rows, mrows, s_qd, qk_scale, winv_t, base, t, tvalid, T, D,
                                  N2, N2P, N1, N1P, FFT, ONE_BIT == 1, K_CMASK, K_SCALE2,
                                  K_ZERO2, K_LO, K_HI, K_CODES2, K_CODES1, MMA_BF16)
        keep = tvalid & (g * T + t >= skip)
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        corr = tl.exp2(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, axis=1)
        pv = _values(p, base, t, tvalid, D, VAL_KIND, VAL_BITS, VAL_GROUP, NP, V_CODES,
                     V_SCALE, V_ZERO, V_PSCALE, V_PZERO, V_ALPHA, V_TOKMASK, V_PCODES, V_TRITS,
                     MMA_BF16)
        acc = acc * corr[:, None] + pv
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


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


#: programs per SM the default split aims at: on an H200 at 32K context x batch 32 (96
#: programs before splitting) 4 per SM (6 splits) took 2.0 ms for vidkv and 0.98 ms for
#: kivi2, 16 per SM (22 splits) about 1.8 and 0.81 ms; each program walks its groups one
#: after another, so more of them hide more latency
PROGRAMS_PER_SM = 16


def _default_splits(device: torch.device, programs: int, max_groups: int) -> int:
    """Enough splits for about :data:`PROGRAMS_PER_SM` programs per SM; at least 4 groups
    per split."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device)
    want = -(-PROGRAMS_PER_SM * sms // max(programs, 1))
    return max(1, min(want, max_groups // 4))


@rotating
def packed_attention(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                     page: PageFormat | PageGeometry, group_table: torch.Tensor,
                     num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float, *,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :mod:`vllm_lowbit_kv.ops` (see the module doc for the work split).
    ``num_splits`` forces the number of context splits (default: from the device's SM
    count); ``out`` [n, Hq, D] / ``lse`` [n, Hq] (float32, contiguous) may be given."""
    fmt = readable_format(page)
    n, Hq, D = query.shape
    H = fmt.H
    require(D == fmt.D, "query head_dim", f"{fmt.D} (the format's)", D)
    require(Hq % H == 0, "query heads", f"a multiple of the KV heads ({H})", Hq)
    G = Hq // H
    dev = query.device
    out, lse, nothing = attention_outputs(query, q_start, group_table, out, lse)
    if nothing:
        return out, lse
    R, max_groups = q_start.numel() - 1, group_table.shape[1]
    flat = fmt.flat_pages(pages)
    # the plans may stay on the CPU (paged.forward keeps them there): everything the
    # kernel reads goes to the query's device (a no-op for tensors already there)
    require(flat.device == dev, "pages", f"on the query's device ({dev})", str(flat.device))
    q_start = q_start.to(dev, torch.int64)
    group_table = group_table.to(dev)
    num_groups, skip_tokens = num_groups.to(dev), skip_tokens.to(dev)
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
    _jit.launch(
        _attention_kernel, (n_tiles, H, splits),
        query, *query.stride(), tile_req, tile_row, q_start,
        flat, flat.stride(0), flat.stride(1), group_table, *group_table.stride(),
        num_groups, skip_tokens, winv,
        o, s_os, Hq * D, D, ls, s_ls, Hq,
        float(scale) * LOG2E, per_split,
        G=G, BR=rows_per_tile, BLOCK_M=max(16, triton.next_power_of_2(rows_per_tile * G)),
        MMA_BF16=not isinstance(_attention_kernel, InterpretedFunction), num_warps=ATTN_WARPS,
        **consts)
    if splits > 1:
        _jit.launch(_combine_kernel, (n * Hq,), o, ls, out, lse, splits, o.stride(0),
                    ls.stride(0), D=D, SP=triton.next_power_of_2(splits))
    return out, lse


__all__ = ["packed_attention"]

"""Fused quantize-and-store: the model-dtype K/V of filled groups -> their packed page states.

``quantize_and_store(k, v, gids, pages, page, relevance)`` writes what the
reference store (:func:`vllm_lowbit_kv.ops.reference.store`: encode with the
codecs, write the states) writes, in one kernel launch (one program per (group, KV head)), without
materializing float32 copies or the encoded states.

Agreement with the reference codecs (tests/test_triton_ops.py checks each):

* **Bit-identical**: KIVI (keys per channel; values per token or per channel:
  ``kivi2``, ``kivi4``), and in VidKV keys the channel mask, the 2-bit
  channels' codes, scales and zero points; the STP token mask and the
  protected tokens' codes, scales and zero points. These steps are min/max,
  one subtraction, one division, round-half-even and fp16 rounding, each
  correctly rounded in both implementations (the kernel divides with
  ``div_rn`` and rounds with the 1.5 * 2**23 trick, exact for every value
  that survives the clamp).
* **Identical codes except at ties, levels within one fp16 step**: the VidKV
  1-bit components (``codes1``, ``lo1``/``hi1``/``s1``) and the ternary values
  (``trits``, ``alpha``). Their thresholds and levels are means over tokens:
  a float32 sum whose rounding depends on the summation order, which differs
  between torch (CPU or CUDA) and a Triton reduction tree, and the FFT keys
  go through the DFT, computed here as a float32 matmul with the exact
  (float64-built) unique-rfft matrix while torch uses pocketfft/cuFFT. The
  codes therefore agree except for elements lying within float32 rounding
  of their threshold (the mean, or gamma * mean|v|), and a level (a mean
  rounded to fp16) can land one fp16 step away when its float32 value sits
  at an fp16 rounding midpoint (or when a tie flipped one code of its
  component). Decoded groups then agree to float32 rounding except at such
  elements.
* STP without a relevance (the codec's fallback, token L2 norms): the norms
  are sums too, so the protected set can differ where two norms tie to
  float32 rounding.

Inputs must be finite and within the fp16 range, as the codecs require;
``validate=True`` (default) checks it, and that every gid lies in the pages,
and raises the codecs' error (host syncs: pass False where the caller
guarantees both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...codecs.base import FP16_MAX, require

from ..page_format import (VAL_TERNARY, PageFormat, PageGeometry, fft_matrix, gpu_format_reason,
                           next_pow2, page_format)
from . import _jit
from ._jit import load_f16, pow3, rint, store_f16


@triton.jit
def _pack_store(dst, codes, rowmap, R: tl.constexpr, C: tl.constexpr, SRC_N: tl.constexpr,
                SRC_COLS: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, PER: tl.constexpr,
                BITS: tl.constexpr, REMAP: tl.constexpr):
    """Pack the logical row-major array ``[R, C]`` (row r = row ``rowmap[r]`` of the
    ``codes`` tile when REMAP, else row r; ``SRC_COLS`` columns per tile row) as
    bitpack does: ``BITS``-bit codes little end first, or (``BITS == 0``) trits
    in {-1, 0, 1} base 3, five per byte, padded with zero trits. Writes ``NB`` bytes."""
    flat = tl.reshape(codes, [SRC_N])
    j = tl.arange(0, NBP)[:, None]
    k = tl.arange(0, 8)[None, :]
    e = j * PER + k
    valid = (e < R * C) & (k < PER)
    row = e // C
    if REMAP:
        row = tl.reshape(tl.gather(rowmap, tl.reshape(tl.where(valid, row, 0), [NBP * 8]), 0),
                         [NBP, 8])
    src = tl.where(valid, row * SRC_COLS + e % C, 0)
    code = tl.reshape(tl.gather(flat, tl.reshape(src, [NBP * 8]), 0), [NBP, 8])
    if BITS == 0:
        byte = tl.sum(tl.where(k < PER, tl.where(valid, code + 1, 1) * pow3(k), 0), axis=1)
    else:
        byte = tl.sum(tl.where(valid, code << (k * BITS), 0), axis=1)
    jj = tl.arange(0, NBP)
    tl.store(dst + jj, byte.to(tl.uint8), mask=jj < NB)


@triton.jit
def _minmax_params(lo, hi, LEVELS: tl.constexpr):
    """quant.minmax_params: fp16 zero = lo, fp16 scale = max((hi - zero) / LEVELS, 0)."""
    zero = lo.to(tl.float16).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(hi - zero, tl.full(hi.shape, LEVELS, tl.float32)), 0.0)
    return scale.to(tl.float16).to(tl.float32), zero


@triton.jit
def _quantize(x, scale, zero, LEVELS: tl.constexpr):
    """quant.quantize: round((x - zero) / scale) clamped to [0, LEVELS]; 0 where scale == 0."""
    pos = scale > 0
    v = rint(tl.math.div_rn(x - zero, tl.where(pos, scale, 1.0)))
    v = tl.minimum(tl.maximum(v, 0.0), LEVELS * 1.0)
    return tl.where(pos, v, 0.0).to(tl.int32)


@triton.jit
def _colmin(x, rows):
    return tl.min(tl.where(rows[:, None], x, float("inf")), axis=0)


@triton.jit
def _colmax(x, rows):
    return tl.max(tl.where(rows[:, None], x, float("-inf")), axis=0)


@triton.jit
def _rank_desc(score, valid, idx):
    """Position of each entry in a stable descending sort (vidkv.top_mask: ties go to
    the lower index); invalid entries sort last."""
    a = score[:, None]
    b = score[None, :]
    before = (b > a) | ((b == a) & (idx[None, :] < idx[:, None]))
    return tl.sum((before & valid[None, :]).to(tl.int32), axis=1)


@triton.jit
def _inverse_rank(take, rank, idx, NOUT: tl.constexpr):
    """out[r] = the index i with take[i] and rank[i] == r (r < count of take), else 0."""
    r = tl.arange(0, NOUT)
    hit = take[:, None] & (rank[:, None] == r[None, :])
    return tl.sum(tl.where(hit, idx[:, None], 0), axis=0)


@triton.jit
def _store_kivi(x, rows, dst, T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr,
                BITS: tl.constexpr, PER_TOKEN: tl.constexpr, GROUP: tl.constexpr,
                OFF_CODES: tl.constexpr, OFF_SCALE: tl.constexpr, OFF_ZERO: tl.constexpr):
    """KiviCodec.encode_groups of one (group, head) tile x [TP, D] (rows < T valid)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    t = tl.arange(0, TP)
    if PER_TOKEN:
        NG: tl.constexpr = D // GROUP
        x3 = tl.reshape(x, [TP, NG, GROUP])
        scale, zero = _minmax_params(tl.min(x3, axis=2), tl.max(x3, axis=2), LEVELS)
        codes = tl.reshape(_quantize(x3, scale[:, :, None], zero[:, :, None], LEVELS), [TP, D])
        gi = tl.arange(0, NG)
        idx = t[:, None] * NG + gi[None, :]
        store_f16(dst + OFF_SCALE, idx, scale, rows[:, None])
        store_f16(dst + OFF_ZERO, idx, zero, rows[:, None])
    else:
        scale, zero = _minmax_params(_colmin(x, rows), _colmax(x, rows), LEVELS)
        codes = _quantize(x, scale[None, :], zero[None, :], LEVELS)
        c = tl.arange(0, D)
        store_f16(dst + OFF_SCALE, c, scale, c < D)
        store_f16(dst + OFF_ZERO, c, zero, c < D)
    NB: tl.constexpr = (T * D * BITS + 7) // 8
    _pack_store(dst + OFF_CODES, codes, t, T, D, TP * D, D, NB, triton.next_power_of_2(NB),
                8 // BITS, BITS, False)


@triton.jit
def _store_vidkv_key(x, rows, x_ptr, s_t, s_d, fwd_ptr, dst,
                     T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr,
                     N2: tl.constexpr, N2P: tl.constexpr, N1: tl.constexpr, N1P: tl.constexpr,
                     FFT: tl.constexpr, ONE_BIT: tl.constexpr,
                     OFF_CMASK: tl.constexpr, OFF_SCALE2: tl.constexpr, OFF_ZERO2: tl.constexpr,
                     OFF_LO: tl.constexpr, OFF_HI: tl.constexpr, OFF_CODES2: tl.constexpr,
                     OFF_CODES1: tl.constexpr):
    """VidKVKeyCodec._encode_low (no STP) of one tile x [TP, D]; ``x_ptr`` points at its
    row 0, channel 0 (the channel-permuted parts are re-read from there)."""
    t = tl.arange(0, TP)
    c = tl.arange(0, D)
    # channel selection: the N2 widest ranges, ties to the lower channel (top_mask)
    rng = _colmax(x, rows) - _colmin(x, rows)
    two = _rank_desc(rng, c < D, c) < N2
    mbit = two.to(tl.int32)
    _pack_store(dst + OFF_CMASK, mbit, c, 1, D, D, D, D // 8, triton.next_power_of_2(D // 8),
                8, 1, False)
    rank2 = tl.cumsum(mbit, 0) - mbit  # 2-bit channels before c
    chan2 = _inverse_rank(two, rank2, c, N2P)  # front_perm, first part
    chan1 = _inverse_rank(~two, c - rank2, c, N1P)  # second part
    i2 = tl.arange(0, N2P)
    i1 = tl.arange(0, N1P)
    # 2-bit channels: per-channel min-max over tokens
    m2 = rows[:, None] & (i2 < N2)[None, :]
    x2 = tl.load(x_ptr + t[:, None] * s_t + chan2[None, :] * s_d, mask=m2, other=0).to(tl.float32)
    scale2, zero2 = _minmax_params(_colmin(x2, rows), _colmax(x2, rows), 3)
    codes2 = _quantize(x2, scale2[None, :], zero2[None, :], 3)
    store_f16(dst + OFF_SCALE2, i2, scale2, i2 < N2)
    store_f16(dst + OFF_ZERO2, i2, zero2, i2 < N2)
    NB2: tl.constexpr = (T * N2 * 2 + 7) // 8
    _pack_store(dst + OFF_CODES2, codes2, t, T, N2, TP * N2P, N2P, NB2,
                triton.next_power_of_2(NB2), 4, 2, False)
    # 1-bit channels, in the unique-rfft domain when FFT (y = x1 @ F, F exact in float64)
    m1 = rows[:, None] & (i1 < N1)[None, :]
    y = tl.load(x_ptr + t[:, None] * s_t + chan1[None, :] * s_d, mask=m1, other=0).to(tl.float32)
    if FFT:
        fwd = tl.load(fwd_ptr + i1[:, None] * N1P + i1[None, :])
        y = tl.dot(y, fwd, input_precision="ieee")
    if ONE_BIT == 0:  # "mean": split at the mean over tokens, levels = the two means
        mean = tl.math.div_rn(tl.sum(tl.where(m1, y, 0.0), axis=0), tl.full([N1P], T, tl.float32))
        one = m1 & (y > mean[None, :])
        zero_ = m1 & (y <= mean[None, :])
        n_one = tl.sum(one.to(tl.int32), axis=0)
        n_zero = T - n_one
        hi = tl.math.div_rn(tl.sum(tl.where(one, y, 0.0), axis=0),
                            tl.maximum(n_one, 1).to(tl.float32))
        lo = tl.math.div_rn(tl.sum(tl.where(zero_, y, 0.0), axis=0),
                            tl.maximum(n_zero, 1).to(tl.float32))
        hi = tl.where(n_one > 0, hi, lo)
        lo = tl.where(n_zero > 0, lo, hi)
        bits = one.to(tl.int32)
    elif ONE_BIT == 1:  # "sign": levels -s, +s with s = mean |y|
        s = tl.math.div_rn(tl.sum(tl.where(m1, tl.abs(y), 0.0), axis=0),
                           tl.full([N1P], T, tl.float32))
        hi = s
        lo = -s
        bits = (m1 & (y > 0)).to(tl.int32)
    else:  # "minmax": GQuant(bit=1) between the extremes
        lo = _colmin(y, rows).to(tl.float16).to(tl.float32)
        hi = _colmax(y, rows).to(tl.float16).to(tl.float32)
        step = hi - lo
        v = rint(tl.math.div_rn(y - lo[None, :], tl.where(step > 0, step, 1.0)[None, :]))
        bits = tl.where(step[None, :] > 0, tl.minimum(tl.maximum(v, 0.0), 1.0), 0.0).to(tl.int32)
    store_f16(dst + OFF_HI, i1, hi, i1 < N1)
    if ONE_BIT != 1:
        store_f16(dst + OFF_LO, i1, lo, i1 < N1)
    NB1: tl.constexpr = (T * N1 + 7) // 8
    _pack_store(dst + OFF_CODES1, bits, t, T, N1, TP * N1P, N1P, NB1,
                triton.next_power_of_2(NB1), 8, 1, False)


@triton.jit
def _store_ternary(x, rows, rel, dst, T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr,
                   NP: tl.constexpr, GAMMA: tl.constexpr,
                   OFF_PSCALE: tl.constexpr, OFF_PZERO: tl.constexpr, OFF_ALPHA: tl.constexpr,
                   OFF_TOKMASK: tl.constexpr, OFF_PCODES: tl.constexpr, OFF_TRITS: tl.constexpr):
    """TernaryValueCodec.encode_groups of one tile x [TP, D]; with NP > 0 the NP tokens
    of highest ``rel`` [TP] are coded 2-bit (STP)."""
    t = tl.arange(0, TP)
    c = tl.arange(0, D)
    NL: tl.constexpr = T - NP
    if NP > 0:
        prot = rows & (_rank_desc(rel, rows, t) < NP)
        pbit = prot.to(tl.int32)
        _pack_store(dst + OFF_TOKMASK, pbit, t, 1, T, TP, TP, (T + 7) // 8,
                    triton.next_power_of_2((T + 7) // 8), 8, 1, False)
        prank = tl.cumsum(pbit, 0) - pbit
        pscale, pzero = _minmax_params(_colmin(x, prot), _colmax(x, prot), 3)
        pcodes = _quantize(x, pscale[None, :], pzero[None, :], 3)
        store_f16(dst + OFF_PSCALE, c, pscale, c < D)
        store_f16(dst + OFF_PZERO, c, pzero, c < D)
        NBP_: tl.constexpr = (NP * D * 2 + 7) // 8
        _pack_store(dst + OFF_PCODES, pcodes, _inverse_rank(prot, prank, t, TP), NP, D, TP * D,
                    D, NBP_, triton.next_power_of_2(NBP_), 4, 2, True)
        low = rows & ~prot
        lowmap = _inverse_rank(low, t - prank, t, TP)
    else:
        low = rows
        lowmap = t
    a = tl.abs(x)
    lm = low[:, None]
    mean = tl.math.div_rn(tl.sum(tl.where(lm, a, 0.0), axis=0), tl.full([D], NL, tl.float32))
    keep = lm & (a > GAMMA * mean[None, :])
    trits = tl.where(keep, tl.where(x > 0, 1, -1), 0)
    cnt = tl.sum(keep.to(tl.int32), axis=0)
    alpha = tl.math.div_rn(tl.sum(tl.where(keep, a, 0.0), axis=0),
                           tl.maximum(cnt, 1).to(tl.float32))
    store_f16(dst + OFF_ALPHA, c, alpha, c < D)
    NBT: tl.constexpr = (NL * D + 4) // 5
    _pack_store(dst + OFF_TRITS, trits, lowmap, NL, D, TP * D, D, NBT,
                triton.next_power_of_2(NBT), 5, 0, NP > 0)


@triton.jit
def _store_kernel(k_ptr, v_ptr, rel_ptr, gid_ptr, pages_ptr, fwd_ptr,
                  sk_e, sk_t, sk_h, sk_d, sv_e, sv_t, sv_h, sv_d, sr_e, sr_t, sr_h,
                  sp_b, sp_h,
                  T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
                  SINK: tl.constexpr, STATE: tl.constexpr, KV_BYTES: tl.constexpr,
                  KEY_KIND: tl.constexpr, KEY_BITS: tl.constexpr,
                  N2: tl.constexpr, N2P: tl.constexpr, N1: tl.constexpr, N1P: tl.constexpr,
                  FFT: tl.constexpr, ONE_BIT: tl.constexpr,
                  K_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
                  K_CMASK: tl.constexpr, K_SCALE2: tl.constexpr, K_ZERO2: tl.constexpr,
                  K_LO: tl.constexpr, K_HI: tl.constexpr, K_CODES2: tl.constexpr,
                  K_CODES1: tl.constexpr,
                  VAL_KIND: tl.constexpr, VAL_BITS: tl.constexpr, VAL_GROUP: tl.constexpr,
                  NP: tl.constexpr, GAMMA: tl.constexpr, HAS_REL: tl.constexpr,
                  V_CODES: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
                  V_PSCALE: tl.constexpr, V_PZERO: tl.constexpr, V_ALPHA: tl.constexpr,
                  V_TOKMASK: tl.constexpr, V_PCODES: tl.constexpr, V_TRITS: tl.constexpr):
    """One program per (group e, KV head h): encode K and V of the group into its state."""
    e = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    gid = tl.load(gid_ptr + e).to(tl.int64)
    dst = pages_ptr + (gid // N) * sp_b + h * sp_h + SINK + (gid % N) * STATE
    t = tl.arange(0, TP)
    c = tl.arange(0, D)
    rows = t < T
    kp = k_ptr + e * sk_e + h * sk_h
    xk = tl.load(kp + t[:, None] * sk_t + c[None, :] * sk_d, mask=rows[:, None],
                 other=0).to(tl.float32)
    if KEY_KIND == 0:
        _store_kivi(xk, rows, dst, T, TP, D, KEY_BITS, False, D, K_CODES, K_SCALE, K_ZERO)
    else:
        _store_vidkv_key(xk, rows, kp, sk_t, sk_d, fwd_ptr, dst, T, TP, D, N2, N2P, N1, N1P,
                         FFT, ONE_BIT, K_CMASK, K_SCALE2, K_ZERO2, K_LO, K_HI, K_CODES2, K_CODES1)
    xv = tl.load(v_ptr + e * sv_e + h * sv_h + t[:, None] * sv_t + c[None, :] * sv_d,
                 mask=rows[:, None], other=0).to(tl.float32)
    if VAL_KIND == 2:
        if HAS_REL:
            rel = tl.load(rel_ptr + e * sr_e + h * sr_h + t * sr_t, mask=rows,
                          other=0).to(tl.float32)
        else:  # the codec's fallback: each token's L2 norm
            rel = tl.sqrt_rn(tl.sum(xv * xv, axis=1))
        _store_ternary(xv, rows, rel, dst, T, TP, D, NP, GAMMA, V_PSCALE, V_PZERO, V_ALPHA,
                       V_TOKMASK, V_PCODES, V_TRITS)
    else:
        _store_kivi(xv, rows, dst, T, TP, D, VAL_BITS, VAL_KIND == 0, VAL_GROUP,
                    V_CODES, V_SCALE, V_ZERO)
    if STATE > KV_BYTES:  # alignment padding, zero as in PagedLayout.encode
        PADP: tl.constexpr = triton.next_power_of_2(STATE - KV_BYTES)
        p = tl.arange(0, PADP)
        tl.store(dst + KV_BYTES + p, tl.zeros([PADP], tl.uint8), mask=p < STATE - KV_BYTES)


def kernel_constants(fmt: PageFormat) -> dict:
    """Compile-time constants shared by the store and attention kernels."""
    sign = fmt.sign
    return dict(
        T=fmt.T, TP=next_pow2(fmt.T), D=fmt.D, N=fmt.groups_per_block, SINK=fmt.sink_bytes,
        STATE=fmt.state_bytes, KEY_KIND=fmt.key_kind, KEY_BITS=fmt.key_bits,
        N2=fmt.n2, N2P=next_pow2(fmt.n2), N1=fmt.n1, N1P=next_pow2(fmt.n1), FFT=fmt.fft,
        ONE_BIT=fmt.one_bit,
        K_CODES=fmt.koff("codes"), K_SCALE=fmt.koff("scale"), K_ZERO=fmt.koff("zero"),
        K_CMASK=fmt.koff("chan_mask"), K_SCALE2=fmt.koff("scale2"), K_ZERO2=fmt.koff("zero2"),
        K_LO=fmt.koff("s1" if sign else "lo1"), K_HI=fmt.koff("s1" if sign else "hi1"),
        K_CODES2=fmt.koff("codes2"), K_CODES1=fmt.koff("codes1"),
        VAL_KIND=fmt.val_kind, VAL_BITS=fmt.val_bits, VAL_GROUP=fmt.val_group,
        NP=fmt.n_protect,
        V_CODES=fmt.voff("codes"), V_SCALE=fmt.voff("scale"), V_ZERO=fmt.voff("zero"),
        V_PSCALE=fmt.voff("prot_scale"), V_PZERO=fmt.voff("prot_zero"),
        V_ALPHA=fmt.voff("alpha"), V_TOKMASK=fmt.voff("tok_mask"),
        V_PCODES=fmt.voff("prot_codes"), V_TRITS=fmt.voff("trits"),
    )


def readable_format(page: PageFormat | PageGeometry) -> PageFormat:
    """The page's format; ValueError with the reason when the kernels cannot read it."""
    fmt = page_format(page)
    reason = gpu_format_reason(fmt)
    if reason:
        raise ValueError(f"lowbit-kv Triton kernels: unsupported page format: {reason}")
    return fmt


def quantize_and_store(k: torch.Tensor, v: torch.Tensor, gids: torch.Tensor, pages: torch.Tensor,
                       page: PageFormat | PageGeometry, relevance: torch.Tensor | None = None,
                       validate: bool = True) -> None:
    """Encode the filled groups K, V ``[E, T, H, D]`` (any float dtype, any strides; in codec
    space) with the format's codecs and write them into their page states ``gids`` [E]
    (global group ids), as the reference store does (agreement: module docstring).
    ``relevance`` [E, T, H]: STP scores (used only when the value codec protects tokens;
    None: the codec's fallback)."""
    fmt = readable_format(page)
    T, H, D = fmt.T, fmt.H, fmt.D
    E = k.shape[0]
    for name, x in (("k", k), ("v", v)):
        require(x.dim() == 4 and tuple(x.shape[1:]) == (T, H, D), f"{name}.shape",
                f"[E, {T}, {H}, {D}]", tuple(x.shape))
    require(v.shape[0] == E and gids.shape == (E,), "gids.shape", f"({E},) like k and v",
            tuple(gids.shape))
    flat = fmt.flat_pages(pages)
    if E == 0:
        return
    # group ids and scores may come from plans kept on the CPU: to the K/V device
    require(flat.device == k.device, "pages", f"on the device of k ({k.device})", str(flat.device))
    gids = gids.to(k.device)
    relevance = None if relevance is None else relevance.to(k.device)
    if validate:
        for x in (k, v):
            if not bool((x.float().abs() <= FP16_MAX).all()):
                raise ValueError(
                    "KV block contains NaN, Inf or a magnitude above 65504 (the fp16 metadata "
                    "range); refusing to encode it rather than store a wrong value")
    if validate:
        n_groups = flat.shape[0] * fmt.groups_per_block
        require(bool(((gids >= 0) & (gids < n_groups)).all()), "gids",
                f"group ids in [0, {n_groups}) (num_blocks * groups_per_block)", gids.tolist())
    use_rel = fmt.val_kind == VAL_TERNARY and fmt.n_protect > 0 and relevance is not None
    if use_rel:
        require(tuple(relevance.shape) == (E, T, H), "relevance.shape", f"({E}, {T}, {H})",
                tuple(relevance.shape))
        if validate:
            require(bool(torch.isfinite(relevance).all()), "relevance", "finite scores", "NaN/Inf")
    rel = relevance if use_rel else k  # unused placeholder pointer when not use_rel
    consts = kernel_constants(fmt)
    fwd = fft_matrix("forward", fmt.n1, consts["N1P"], k.device) if fmt.fft else flat
    _jit.launch(
        _store_kernel, (E, H),
        k, v, rel, gids, flat, fwd,
        *k.stride(), *v.stride(), *(rel.stride()[:3]),
        flat.stride(0), flat.stride(1),
        KV_BYTES=fmt.k_bytes + fmt.v_bytes, GAMMA=fmt.gamma, HAS_REL=use_rel,
        num_warps=8, enable_fp_fusion=False, **consts)  # no FMA contraction: exact steps



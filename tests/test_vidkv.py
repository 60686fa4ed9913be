"""Tests for the VidKV codecs (vllm_lowbit_kv/codecs/vidkv.py)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.bitpack import unpack_bits
from vllm_lowbit_kv.codecs.vidkv import (ONE_BIT_MODES, TernaryValueCodec, VidKVKeyCodec,
                                         one_bit_dequantize, one_bit_quantize)

FAST = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def key_like(shape, seed=0):
    """Keys with per-channel offsets and a few wide (outlier) channels: [..., T, H, D]."""
    g = gen(seed)
    D = shape[-1]
    offset = torch.randn(D, generator=g) * 2
    width = torch.ones(D)
    width[torch.randperm(D, generator=g)[: max(1, D // 8)]] = 8.0
    return torch.randn(*shape, generator=g) * width + offset


def f16(v: float) -> float:
    """Round a Python float to the nearest fp16 (half-even), as torch's .half() does."""
    return struct.unpack("<e", struct.pack("<e", v))[0]


def fields(codec, packed):
    """Layout fields of the packed groups, [G, n] each."""
    return codec.layout().split(packed.reshape(-1, codec.nbytes))


def key_codecs(T=16, D=16):
    return [VidKVKeyCodec(T, D), VidKVKeyCodec(T, D, fft=False), VidKVKeyCodec(T, D, k=0.25),
            VidKVKeyCodec(T, D, one_bit="sign"), VidKVKeyCodec(T, D, one_bit="minmax"),
            VidKVKeyCodec(T, D, protect=0.25)]


def value_codecs(T=16, D=16):
    return [TernaryValueCodec(T, D), TernaryValueCodec(T, D, protect=0.25)]


ALL = key_codecs() + value_codecs()
IDS = [c.describe() + getattr(c, "one_bit", "") + str(getattr(c, "fft_active", "")) for c in ALL]


# -- shapes, sizes, accounting ------------------------------------------------------

@pytest.mark.parametrize("codec", ALL, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_round_trip_shapes(codec, dtype, lead):
    T, D, H = codec.block_tokens, codec.head_dim, 2
    x = key_like((*lead, T, H, D)).to(dtype)
    rel = torch.rand(*lead, T, H)
    packed = codec.encode(x, rel)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, H, codec.nbytes)
    y = codec.decode(packed, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isfinite(y.float()).all()
    assert codec.effective_bits == 8 * codec.nbytes / (T * D)
    assert codec.nbytes == sum(n for _, n in codec.layout().fields)
    assert sum(codec.bits_breakdown().values()) == pytest.approx(codec.effective_bits)
    # deterministic and group-independent: each (block, head) encodes alone to the same bytes
    one = codec.encode(x.reshape(-1, T, H, D)[:1, :, :1], rel.reshape(-1, T, H)[:1, :, :1])
    assert torch.equal(one.reshape(-1), packed.reshape(-1, H, codec.nbytes)[0, 0])


def test_default_budget():
    """K k=0.5 FFT + ternary V at head_dim 64, every stored byte counted."""
    got = {}
    for T in (32, 64, 128):
        k, v = VidKVKeyCodec(T, 64), TernaryValueCodec(T, 64)
        assert k.fft_active
        got[T] = (k.effective_bits + v.effective_bits) / 2
        # keys 1.5 + 33/T (+ chan mask rounding), values 1.6 + 16/T (+ trit byte rounding)
        assert k.nbytes == 8 + T * 32 * 2 // 8 + T * 32 // 8 + 4 * 32 * 2
        assert v.nbytes == math.ceil(T * 64 / 5) + 128
        s = VidKVKeyCodec(T, 64, one_bit="sign")
        assert s.nbytes == k.nbytes - 64
    assert got[64] < 2.0
    assert got == pytest.approx({32: 2.3164, 64: 1.9336, 128: 1.7417}, abs=1e-4)


def test_stp_layout_and_relevance_flag():
    T, D = 32, 16
    assert not VidKVKeyCodec(T, D).uses_relevance
    assert not TernaryValueCodec(T, D, protect=0.01).uses_relevance  # round(0.32) = 0
    assert TernaryValueCodec(T, D, protect=0.01).nbytes == TernaryValueCodec(T, D).nbytes
    c = TernaryValueCodec(T, D, protect=0.2)  # n_p = round(6.4) = 6
    assert c.uses_relevance and c.n_protect == 6 and c.n_low == 26
    assert dict(c.layout().fields) == {"tok_mask": 4, "prot_codes": 6 * D * 2 // 8,
                                       "prot_scale": 2 * D, "prot_zero": 2 * D,
                                       "trits": math.ceil(26 * D / 5), "alpha": 2 * D}
    assert VidKVKeyCodec(32, 16, protect=0.5).n_protect == 16  # half rounds up


# -- method-implied error bounds ------------------------------------------------

def twobit_bound(x, dim):
    """Half a 2-bit min-max step plus fp16 slack on scale and zero."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return (hi - lo) / 6 + 2.0 ** -10 * (lo.abs() + hi.abs()) + 1e-6


def check_key_block(codec, x, y, packed, tokens):
    """x, y: [T, D] of one group; ``tokens``: the unprotected token indices."""
    f = {n: p[0] for n, p in fields(codec, packed).items()}
    D = codec.head_dim
    mask = unpack_bits(f["chan_mask"], 1, D).bool()
    assert int(mask.sum()) == codec.n2
    xu, yu = x[tokens], y[tokens]
    rng = xu.amax(0) - xu.amin(0)
    if codec.n2 and codec.n1:
        assert rng[mask].min() >= rng[~mask].max()  # widest-range channels are 2-bit
    err = (yu - xu).abs()
    assert (err[:, mask] <= twobit_bound(xu[:, mask], 0)).all()
    x1, y1 = xu[:, ~mask], yu[:, ~mask]
    if codec.n1 == 0:
        return
    if codec.fft_active:
        # Parseval (norm="forward"): sum_c e_c^2 = n1 * sum_j |E_j|^2 <= 2 n1 sum_unique e_i^2,
        # and each component's 1-bit error is at most its range over tokens (+fp16 slack).
        comp = torch.fft.rfft(x1.double(), dim=-1, norm="forward")
        n1 = codec.n1
        uniq = torch.cat([comp.real, comp.imag[:, 1:(n1 + 1) // 2]], -1)
        crng = uniq.amax(0) - uniq.amin(0) + uniq.abs().amax(0)
        if codec.one_bit != "sign":
            crng = uniq.amax(0) - uniq.amin(0) + 2 ** -10 * uniq.abs().amax(0)
        bound = 2 * n1 * (crng ** 2).sum() * 1.01 + 1e-6
        assert ((y1.double() - x1.double()) ** 2).sum(-1).max() <= bound
        return
    for c in range(codec.n1):
        vals = torch.unique(y1[:, c])
        assert len(vals) <= 2  # 1 bit per element: two levels per channel
        lo, hi = x1[:, c].min(), x1[:, c].max()
        if codec.one_bit == "minmax":
            assert set(vals.tolist()) <= {f16(lo.item()), f16(hi.item())}
        elif codec.one_bit == "sign":
            s = f16(x1[:, c].abs().mean().item())
            assert set(vals.tolist()) <= {s, -s}
            assert torch.equal(y1[:, c] > 0, x1[:, c] > 0) or s == 0
        else:
            slack = 2 ** -10 * max(abs(lo), abs(hi)) + 1e-6
            assert vals.min() >= lo - slack and vals.max() <= hi + slack


def check_value_block(codec, x, y, tokens):
    xu, yu = x[tokens], y[tokens]
    a = xu.abs()
    keep = a > codec.gamma * a.mean(0, keepdim=True)
    assert (yu[~keep] == 0).all()  # dropped entries decode to exactly 0
    for c in range(codec.head_dim):
        kept = a[keep[:, c], c]
        alpha = f16(kept.mean().item()) if len(kept) else 0.0
        # reconstruction is in {-alpha, 0, +alpha} with the sign of v
        expect = torch.where(keep[:, c], torch.sign(xu[:, c]) * alpha, torch.zeros(()))
        assert torch.equal(yu[:, c], expect)


def check_protected(codec, x, y, packed, rel):
    """Returns the unprotected token indices after checking the protected ones."""
    T = codec.block_tokens
    if not codec.n_protect:
        return torch.arange(T)
    f = {n: p[0] for n, p in fields(codec, packed).items()}
    tmask = unpack_bits(f["tok_mask"], 1, T).bool()
    assert int(tmask.sum()) == codec.n_protect
    assert rel[tmask].min() >= rel[~tmask].max()  # highest relevance is protected
    xp = x[tmask]
    assert ((y[tmask] - xp).abs() <= twobit_bound(xp, 0)).all()
    return torch.nonzero(~tmask).flatten()


@st.composite
def configs(draw):
    T = draw(st.integers(1, 40))
    D = draw(st.integers(1, 24))
    p = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.8]))
    if math.floor(p * T + 0.5) >= T:
        p = 0.0
    return T, D, p, draw(st.integers(0, 2 ** 31 - 1))


@FAST
@given(configs(), st.sampled_from([0.0, 0.3, 0.5, 0.6, 0.75, 1.0]), st.booleans(),
       st.sampled_from(ONE_BIT_MODES), st.floats(0.01, 100.0))
def test_key_error_bounds(cfg, k, fft, mode, scale):
    T, D, p, seed = cfg
    codec = VidKVKeyCodec(T, D, k=k, fft=fft, protect=p, one_bit=mode)
    x = key_like((T, 1, D), seed) * scale
    rel = torch.rand(T, 1, generator=gen(seed + 1))
    packed = codec.encode(x, rel)
    y = codec.decode(packed)
    assert packed.shape == (1, codec.nbytes)
    x, y = x[:, 0], y[:, 0]
    tokens = check_protected(codec, x, y, packed, rel[:, 0])
    check_key_block(codec, x, y, packed, tokens)


@FAST
@given(configs(), st.floats(0.05, 3.0), st.floats(0.01, 100.0))
def test_ternary_error_bounds(cfg, gamma, scale):
    T, D, p, seed = cfg
    codec = TernaryValueCodec(T, D, gamma=gamma, protect=p)
    x = torch.randn(T, 1, D, generator=gen(seed)) * scale
    rel = torch.rand(T, 1, generator=gen(seed + 1))
    packed = codec.encode(x, rel)
    y = codec.decode(packed)
    tokens = check_protected(codec, x[:, 0], y[:, 0], packed, rel[:, 0])
    check_value_block(codec, x[:, 0], y[:, 0], tokens)


def test_alpha_is_least_squares_optimum():
    """For fixed trits, alpha = mean |v| over the kept entries minimizes the squared error."""
    codec = TernaryValueCodec(64, 8)
    x = torch.randn(64, 1, 8)
    y = codec.decode(codec.encode(x))[:, 0]
    q = torch.sign(y)
    base = ((y - x[:, 0]) ** 2).sum(0)
    for f in (0.9, 0.99, 1.01, 1.1):
        assert (((y * f - x[:, 0]) ** 2).sum(0) >= base - 1e-4).all()
    # the paper-style magnitude s = mean |v| (BitNet) is worse
    s = x[:, 0].abs().mean(0)
    assert ((q * s - x[:, 0]) ** 2).sum() > base.sum()


def test_stp_fallback_is_token_norm():
    T, D = 32, 8
    x = torch.randn(T, 1, D)
    x[[3, 17, 30]] *= 10
    for codec in (TernaryValueCodec(T, D, protect=0.1), VidKVKeyCodec(T, D, protect=0.1)):
        f = fields(codec, codec.encode(x))  # relevance None
        tmask = unpack_bits(f["tok_mask"][0], 1, T).bool()
        assert torch.nonzero(tmask).flatten().tolist() == [3, 17, 30]
        # an explicit relevance overrides the fallback
        rel = torch.zeros(T, 1)
        rel[[0, 1, 2]] = 1.0
        f = fields(codec, codec.encode(x, rel))
        assert torch.nonzero(unpack_bits(f["tok_mask"][0], 1, T)).flatten().tolist() == [0, 1, 2]


def test_stp_reduces_error_on_protected_tokens():
    T, D = 64, 16
    x = torch.randn(T, 1, D)
    rel = torch.rand(T, 1)
    top = rel[:, 0].argsort(descending=True)[:13]
    for plain, stp in ((TernaryValueCodec(T, D), TernaryValueCodec(T, D, protect=0.2)),
                       (VidKVKeyCodec(T, D), VidKVKeyCodec(T, D, protect=0.2))):
        e0 = (plain.decode(plain.encode(x, rel)) - x)[top].pow(2).mean()
        e1 = (stp.decode(stp.encode(x, rel)) - x)[top].pow(2).mean()
        assert e1 < e0


def test_one_bit_mean_beats_paper_variants():
    """The default 1-bit quantizer has lower squared error than eq. 5 (sign) and Alg. 3 (minmax)."""
    g = gen(1)
    y = torch.randn(256, 64, 32, generator=g) + 3 * torch.randn(256, 1, 32, generator=g)
    err = {}
    for mode in ONE_BIT_MODES:
        bits, lo, hi = one_bit_quantize(y, mode)
        err[mode] = (one_bit_dequantize(bits, lo, hi) - y).pow(2).mean().item()
    assert err["mean"] < err["sign"] and err["mean"] < err["minmax"]


# -- edge cases --------------------------------------------------------------------

@pytest.mark.parametrize("codec", ALL, ids=IDS)
def test_zeros_decode_to_zero(codec):
    x = torch.zeros(2, codec.block_tokens, 3, codec.head_dim)
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("codec", ALL, ids=IDS)
def test_constant_channels(codec):
    T, D = codec.block_tokens, codec.head_dim
    c = torch.randn(D) * 5
    c[0] = 0.0
    x = c.expand(T, 2, D).clone()
    y = codec.decode(codec.encode(x))
    tol = 2 ** -10 * c.abs().max() * (D if getattr(codec, "fft_active", False) else 1) + 1e-6
    assert (y - x).abs().max() <= tol


@pytest.mark.parametrize("codec", ALL, ids=IDS)
def test_huge_magnitudes(codec):
    T, D = codec.block_tokens, codec.head_dim
    x = key_like((T, 2, D), 3)
    x = x / x.abs().max() * 65504.0
    x[0, 0, 0] = 65504.0
    x[1, 0, 0] = -65504.0
    packed = codec.encode(x)
    y = codec.decode(packed)
    assert torch.isfinite(y).all() and y.abs().max() <= 65504.0
    assert torch.isfinite(codec.decode(packed, torch.float16)).all()
    for bad in (65520.0, 1e6, -1e9):
        z = x.clone()
        z[2, 1, 3] = bad
        with pytest.raises(ValueError, match="65504"):
            codec.encode(z)


@pytest.mark.parametrize("codec", ALL, ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected(codec, bad):
    x = torch.randn(codec.block_tokens, 2, codec.head_dim)
    x[5, 1, 2] = bad
    with pytest.raises(ValueError, match="NaN, Inf"):
        codec.encode(x)


def test_nonfinite_relevance_rejected():
    codec = TernaryValueCodec(16, 8, protect=0.25)
    rel = torch.rand(16, 1)
    rel[3] = float("nan")
    with pytest.raises(ValueError, match="^relevance must"):
        codec.encode(torch.randn(16, 1, 8), rel)
    with pytest.raises(ValueError, match="^relevance.shape must"):
        codec.encode(torch.randn(16, 1, 8), torch.rand(16, 2))


def test_corrupt_masks_rejected():
    codec = VidKVKeyCodec(16, 8, protect=0.25)
    packed = codec.encode(torch.randn(16, 1, 8))
    f = codec.layout().split(packed.clone())
    for name in ("tok_mask", "chan_mask"):
        bad = {n: p.clone() for n, p in f.items()}
        bad[name][..., 0] ^= 1
        with pytest.raises(ValueError, match=f"^{name} must"):
            codec.decode(codec.layout().join(bad))


# -- loop transcription of the paper's equations -------------------------------------

def ref_gquant2(col):
    """GQuant(bit=2) over one channel: eq. 3-4 with fp16 zero/scale."""
    z = f16(min(col))
    s = f16(max((max(col) - z) / 3, 0.0))
    out = []
    for v in col:
        q = 0 if s == 0 else min(max(round((v - z) / s), 0), 3)
        out.append(q * s + z)
    return out


def ref_one_bit(col, mode):
    n = len(col)
    if mode == "minmax":  # Algorithm 3, GQuant(bit=1)
        lo, hi = f16(min(col)), f16(max(col))
        bits = [0 if hi - lo <= 0 else min(max(round((v - lo) / (hi - lo)), 0), 1) for v in col]
    elif mode == "sign":  # eq. 5: sign, s = Mean|.|, z = 0
        s = f16(sum(abs(v) for v in col) / n)
        lo, hi = -s, s
        bits = [1 if v > 0 else 0 for v in col]
    else:  # split at the mean, levels = means of each side
        mu = sum(col) / n
        bits = [1 if v > mu else 0 for v in col]
        ones = [v for v, b in zip(col, bits) if b]
        zeros = [v for v, b in zip(col, bits) if not b]
        hi = sum(ones) / len(ones) if ones else sum(zeros) / len(zeros)
        lo = sum(zeros) / len(zeros) if zeros else hi
        lo, hi = f16(lo), f16(hi)
    return [hi if b else lo for b in bits]


def ref_dft_unique(x):
    """F_j = (1/n) sum_c x_c e^{-2 pi i j c / n}; returns [Re F_0..F_{n//2}, Im F_1..]."""
    n = len(x)
    re = [sum(x[c] * math.cos(2 * math.pi * j * c / n) for c in range(n)) / n
          for j in range(n // 2 + 1)]
    im = [-sum(x[c] * math.sin(2 * math.pi * j * c / n) for c in range(n)) / n
          for j in range(1, (n + 1) // 2)]
    return re + im


def ref_idft_unique(u, n):
    """x_c = sum_j F_j e^{2 pi i j c / n} over the full Hermitian spectrum."""
    h = n // 2 + 1
    re, im = u[:h], [0.0] + u[h:]
    out = []
    for c in range(n):
        v = re[0]
        for j in range(1, (n + 1) // 2):
            w = 2 * math.pi * j * c / n
            v += 2 * (re[j] * math.cos(w) - im[j] * math.sin(w))
        if n % 2 == 0:
            v += re[n // 2] * math.cos(math.pi * c)
        out.append(v)
    return out


def ref_mixquant(X, k, fft, mode):
    """Algorithm 3 on a list of token rows; returns the dequantized rows."""
    T, D = len(X), len(X[0])
    cols = [[X[t][c] for t in range(T)] for c in range(D)]
    rng = [max(col) - min(col) for col in cols]
    n2 = math.floor(k * D + 0.5)
    abn = sorted(sorted(range(D), key=lambda c: (-rng[c], c))[:n2])
    nom = [c for c in range(D) if c not in abn]
    out = [[None] * D for _ in range(T)]
    for c in abn:
        for t, v in enumerate(ref_gquant2(cols[c])):
            out[t][c] = v
    n = len(nom)
    if fft and 0.5 <= k <= 0.75 and n:
        spec = [ref_dft_unique([X[t][c] for c in nom]) for t in range(T)]
        qspec = [ref_one_bit([spec[t][i] for t in range(T)], mode) for i in range(n)]
        for t in range(T):
            xt = ref_idft_unique([qspec[i][t] for i in range(n)], n)
            for i, c in enumerate(nom):
                out[t][c] = xt[i]
    else:
        for c in nom:
            for t, v in enumerate(ref_one_bit(cols[c], mode)):
                out[t][c] = v
    return out


def ref_ternary(X, gamma):
    """Algorithm 2 (1.58Quant) per channel, eq. 6, with the least-squares magnitude."""
    T, D = len(X), len(X[0])
    out = [[0.0] * D for _ in range(T)]
    for c in range(D):
        col = [X[t][c] for t in range(T)]
        delta = gamma * sum(abs(v) for v in col) / T
        trits = [(1 if v > 0 else -1) if abs(v) > delta else 0 for v in col]
        kept = [abs(v) for v, q in zip(col, trits) if q]
        alpha = f16(sum(kept) / len(kept)) if kept else 0.0
        for t in range(T):
            out[t][c] = trits[t] * alpha
    return out


def ref_stp(X, rel, p, low):
    """Algorithm 2 STPQuant: top round(p*T) tokens by relevance at 2 bits, the rest ``low``."""
    T, D = len(X), len(X[0])
    n_p = math.floor(p * T + 0.5)
    prot = sorted(sorted(range(T), key=lambda t: (-rel[t], t))[:n_p])
    rest = [t for t in range(T) if t not in prot]
    out = [None] * T
    if prot:
        cols = [ref_gquant2([X[t][c] for t in prot]) for c in range(D)]
        for i, t in enumerate(prot):
            out[t] = [cols[c][i] for c in range(D)]
    for t, row in zip(rest, low([X[t] for t in rest])):
        out[t] = row
    return out


REF_CASES = [(T, D, k, fft, mode, p)
             for (T, D) in ((8, 6), (12, 7), (9, 10))
             for (k, fft) in ((0.5, True), (0.75, True), (0.5, False), (0.3, True))
             for mode in ONE_BIT_MODES
             for p in (0.0, 0.25)]


@pytest.mark.parametrize("T,D,k,fft,mode,p", REF_CASES)
def test_key_matches_loop_reference(T, D, k, fft, mode, p):
    g = gen(T * 100 + D)
    x = key_like((T, 1, D), T + D) + 0.1 * torch.randn(T, 1, D, generator=g)
    rel = torch.rand(T, 1, generator=g)
    codec = VidKVKeyCodec(T, D, k=k, fft=fft, protect=p, one_bit=mode)
    y = codec.decode(codec.encode(x, rel))[:, 0]
    X = x[:, 0].tolist()
    ref = ref_stp(X, rel[:, 0].tolist(), p, lambda rows: ref_mixquant(rows, k, fft, mode))
    assert torch.allclose(y.double(), torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-5)
    if not codec.fft_active:  # no transform: equal up to fp32 arithmetic
        assert torch.allclose(y.double(), torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("T,D,gamma,p", [(8, 6, 0.7, 0.0), (12, 7, 0.7, 0.25),
                                         (16, 5, 0.3, 0.0), (10, 9, 1.5, 0.4)])
def test_ternary_matches_loop_reference(T, D, gamma, p):
    g = gen(T + D)
    x = torch.randn(T, 1, D, generator=g) * torch.rand(D, generator=g) * 4
    rel = torch.rand(T, 1, generator=g)
    codec = TernaryValueCodec(T, D, gamma=gamma, protect=p)
    y = codec.decode(codec.encode(x, rel))[:, 0]
    ref = ref_stp(x[:, 0].tolist(), rel[:, 0].tolist(), p, lambda rows: ref_ternary(rows, gamma))
    assert torch.allclose(y.double(), torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-6)


def test_fft_unique_parts_are_one_bit_per_channel():
    """n1 normal channels give exactly n1 one-bit codes per token, even and odd n1."""
    for D in (7, 8, 64):
        c = VidKVKeyCodec(16, D)
        assert c.fft_active
        assert dict(c.layout().fields)["codes1"] == math.ceil(16 * c.n1 / 8)
        assert dict(c.layout().fields)["lo1"] == dict(c.layout().fields)["hi1"] == 2 * c.n1


# -- validation ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(k=-0.1), "k"), (dict(k=1.01), "k"), (dict(k=float("nan")), "k"), (dict(k=True), "k"),
    (dict(k="0.5"), "k"), (dict(fft=1), "fft"), (dict(one_bit="median"), "one_bit"),
    (dict(protect=-0.1), "protect"), (dict(protect=1.0), "protect"),
    (dict(protect=0.99), "protect"),  # round(0.99 * 32) = 32 leaves no unprotected token
    (dict(protect=float("inf")), "protect"),
])
def test_key_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        VidKVKeyCodec(32, 64, **kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(gamma=0), "gamma"), (dict(gamma=-1.0), "gamma"), (dict(gamma=float("inf")), "gamma"),
    (dict(gamma=None), "gamma"), (dict(protect=1), "protect"), (dict(protect=-1e-9), "protect"),
])
def test_value_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        TernaryValueCodec(32, 64, **kwargs)


@pytest.mark.parametrize("cls", [VidKVKeyCodec, TernaryValueCodec])
def test_shape_validation(cls):
    with pytest.raises(ValueError, match="^block_tokens must"):
        cls(0, 64)
    with pytest.raises(ValueError, match="^head_dim must"):
        cls(32, 0)
    c = cls(32, 64)
    with pytest.raises(ValueError, match="^x.shape must"):
        c.encode(torch.randn(32, 2, 63))
    with pytest.raises(ValueError, match="^packed must"):
        c.decode(torch.zeros(2, c.nbytes - 1, dtype=torch.uint8))


def test_any_head_dim_and_k_extremes():
    """rfft unique parts need no even length; k = 0 and k = 1 leave one side empty."""
    for D in (1, 2, 3, 5, 63):
        for k in (0.0, 0.5, 1.0):
            c = VidKVKeyCodec(8, D, k=k)
            x = torch.randn(8, 2, D)
            y = c.decode(c.encode(x))
            assert y.shape == x.shape and torch.isfinite(y).all()
    assert torch.equal(VidKVKeyCodec(4, 4, k=1.0).decode(VidKVKeyCodec(4, 4, k=1.0).encode(
        torch.arange(16.0).reshape(4, 1, 4))), torch.arange(16.0).reshape(4, 1, 4))

"""QuantileCodec (seed 003): shapes, sizes, error bounds, edge cases, paper transcription."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.bitpack import from_bytes
from vllm_lowbit_kv.codecs.kivi import KiviCodec
from vllm_lowbit_kv.codecs.quantile1 import DEFAULT_ALPHA, QuantileCodec

F32_EPS = float(torch.finfo(torch.float32).eps)


def _blocks(seed, shape, scale=1.0, heavy=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    if heavy:  # sparse large outliers, the case quantile ranges are for
        spikes = (torch.rand(shape, generator=g) < 0.03).float()
        x = x + spikes * torch.randn(shape, generator=g) * scale * 20
    return x.clamp(-65504, 65504)


def _group_view(codec, x_groups):
    """[G, T, D] -> [G, n_groups, members], the codec's grouping."""
    return codec._to_groups(x_groups)


def _meta(codec, packed):
    """Stored fp16 (lo, hi) per group as float32 [G, n_groups, 1]."""
    f = codec.layout().split(packed.reshape(-1, codec.nbytes))
    lo = from_bytes(f["lo"], torch.float16).float().unsqueeze(-1)
    hi = from_bytes(f["hi"], torch.float16).float().unsqueeze(-1)
    return lo, hi


# -- shapes, dtypes, sizes --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
@pytest.mark.parametrize("axis", ["channel", "token", "head"])
@pytest.mark.parametrize("bits", [1, 2])
def test_round_trip_shapes_and_dtypes(dtype, lead, axis, bits):
    T, H, D = 16, 2, 8
    codec = QuantileCodec(T, D, bits=bits, axis=axis)
    x = _blocks(0, (*lead, T, H, D)).to(dtype)
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, H, codec.nbytes)
    y = codec.decode(packed, dtype=dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isfinite(y.float()).all()
    # the head slices are independent groups: decoding one head alone gives the same values
    assert torch.equal(codec.decode(packed[..., 1:, :]), codec.decode(packed)[..., 1:, :])


@pytest.mark.parametrize("bits,axis,group_size,expected", [
    (1, "channel", None, 1.5), (2, "channel", None, 2.5),
    (1, "token", None, 1.5), (2, "token", None, 2.5), (1, "token", 32, 2.0),
    (1, "head", None, 1 + 32 / 4096), (2, "head", None, 2 + 32 / 4096),
])
def test_effective_bits_at_64x64(bits, axis, group_size, expected):
    codec = QuantileCodec(64, 64, bits=bits, axis=axis, group_size=group_size)
    assert codec.effective_bits == pytest.approx(expected)
    assert codec.effective_bits == 8 * codec.nbytes / (64 * 64)
    assert sum(codec.bits_breakdown().values()) == pytest.approx(codec.effective_bits)
    packed = codec.encode(_blocks(1, (64, 3, 64)))
    assert packed.shape[-1] == codec.nbytes


@given(T=st.sampled_from([1, 2, 5, 16]), D=st.sampled_from([1, 3, 8]),
       bits=st.sampled_from([1, 2]), axis=st.sampled_from(["channel", "token", "head"]))
def test_encoded_size_matches_nbytes(T, D, bits, axis):
    codec = QuantileCodec(T, D, bits=bits, axis=axis)
    packed = codec.encode(_blocks(T * D, (2, T, 3, D)))
    assert packed.shape == (2, 3, codec.nbytes)
    assert codec.effective_bits == 8 * codec.nbytes / (T * D)


def test_default_alpha_per_bits():
    assert QuantileCodec(8, 8, bits=1).alpha == DEFAULT_ALPHA[1] == 0.2
    assert QuantileCodec(8, 8, bits=2).alpha == DEFAULT_ALPHA[2] == 0.05
    assert QuantileCodec(8, 8, bits=1, alpha=0.1).alpha == 0.1


# -- error bounds --------------------------------------------------------------------

@given(T=st.sampled_from([1, 4, 16, 33]), D=st.sampled_from([1, 4, 8, 16]),
       bits=st.sampled_from([1, 2]), axis=st.sampled_from(["channel", "token", "head"]),
       alpha=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.49]),
       log_scale=st.floats(-3, 4), heavy=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_error_bounds(T, D, bits, axis, alpha, log_scale, heavy, seed):
    """In-range elements: within half a step; outside [lo, hi]: decoded to the clamp boundary."""
    codec = QuantileCodec(T, D, bits=bits, alpha=alpha, axis=axis)
    x = _blocks(seed, (T, 2, D), 10.0 ** log_scale, heavy)
    packed = codec.encode(x)
    y = codec.decode(packed)
    xg = _group_view(codec, x.movedim(-2, -3).reshape(-1, T, D))
    yg = _group_view(codec, y.movedim(-2, -3).reshape(-1, T, D))
    lo, hi = _meta(codec, packed)
    L = (1 << bits) - 1
    step = (hi - lo) / L
    slack = 4 * F32_EPS * (lo.abs() + hi.abs() + xg.abs())
    assert (hi >= lo).all()
    # every decoded value is a level of the group's grid, inside [lo, hi]
    assert (yg >= lo - slack).all() and (yg <= hi + slack).all()
    err = (yg - xg.clamp(lo, hi)).abs()
    assert (err <= step / 2 + slack).all()
    inside = (xg >= lo) & (xg <= hi)
    assert ((yg - xg).abs() <= step / 2 + slack)[inside].all()
    # lo / hi are the alpha / 1-alpha quantiles (linear interpolation), rounded to fp16
    q_lo = torch.quantile(xg, alpha, dim=-1, keepdim=True)
    q_hi = torch.quantile(xg, 1 - alpha, dim=-1, keepdim=True)
    tol = q_lo.abs().maximum(q_hi.abs()) * 2.0 ** -11 + 1e-30
    assert ((lo - q_lo).abs() <= tol + 6e-8).all() and ((hi - q_hi).abs() <= tol + 6e-8).all()


@given(bits=st.sampled_from([1, 2]), axis=st.sampled_from(["channel", "token"]),
       seed=st.integers(0, 2**31 - 1))
def test_floor_rounding_is_eq8_literal(bits, axis, seed):
    """rounding='floor' (eq. 8): in-range values decode to the level at or below them."""
    T, D = 16, 8
    codec = QuantileCodec(T, D, bits=bits, axis=axis, rounding="floor", alpha=0.1)
    x = _blocks(seed, (T, 1, D))
    packed = codec.encode(x)
    xg = _group_view(codec, x.movedim(-2, -3).reshape(-1, T, D))
    yg = _group_view(codec, codec.decode(packed).movedim(-2, -3).reshape(-1, T, D))
    lo, hi = _meta(codec, packed)
    step = (hi - lo) / ((1 << bits) - 1)
    slack = 4 * F32_EPS * (lo.abs() + hi.abs() + xg.abs())
    inside = (xg >= lo) & (xg < hi)
    assert (yg <= xg + slack)[inside].all()
    assert (xg - yg < step + slack)[inside].all()


def test_one_bit_thresholds_at_midpoint():
    codec = QuantileCodec(64, 64, bits=1, axis="channel")
    x = _blocks(3, (64, 1, 64))
    packed = codec.encode(x)
    y = codec.decode(packed)[:, 0].T  # [D, T]
    xg = x[:, 0].T
    lo, hi = _meta(codec, packed)
    lo, hi = lo[0], hi[0]
    assert ((y == lo) | ((y - hi).abs() <= 4 * F32_EPS * hi.abs())).all()  # only two levels
    mid = (lo + hi) / 2
    assert ((xg > mid + 1e-6) <= (y > mid)).all() and ((xg < mid - 1e-6) <= (y < mid)).all()


def test_quantile_range_beats_minmax_on_outliers():
    """The paper's point: with sparse outliers, the quantile range loses less at 1 bit."""
    x = _blocks(4, (64, 4, 64), heavy=True)
    errs = {}
    for alpha in (0.0, 0.2):
        c = QuantileCodec(64, 64, bits=1, alpha=alpha, axis="channel")
        errs[alpha] = (c.decode(c.encode(x)) - x).pow(2).mean().item()
    assert errs[0.2] < 0.5 * errs[0.0]


@pytest.mark.parametrize("bits", [2])  # KIVI refuses 1 bit
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_alpha_zero_is_kivi(bits, axis):
    """alpha=0 is min-max; it agrees with KIVI except at near-ties (fp16 metadata differs)."""
    x = _blocks(5, (2, 64, 3, 64))
    q = QuantileCodec(64, 64, bits=bits, alpha=0.0, axis=axis)
    k = KiviCodec(64, 64, bits=bits, axis=axis)
    yq, yk = q.decode(q.encode(x)), k.decode(k.encode(x))
    close = (yq - yk).abs() <= 2.0 ** -9 * x.abs().amax()
    assert close.float().mean() > 0.995


# -- edge cases ----------------------------------------------------------------------

@pytest.mark.parametrize("axis", ["channel", "token", "head"])
@pytest.mark.parametrize("bits", [1, 2])
def test_zeros_decode_exactly(axis, bits):
    codec = QuantileCodec(16, 8, bits=bits, axis=axis)
    y = codec.decode(codec.encode(torch.zeros(16, 2, 8)))
    assert torch.equal(y, torch.zeros(16, 2, 8))


@pytest.mark.parametrize("bits", [1, 2])
def test_constant_channels_decode_to_fp16_value(bits):
    codec = QuantileCodec(16, 8, bits=bits, axis="channel")
    x = _blocks(6, (16, 2, 8))
    consts = torch.tensor([0.1, -3.3, 1e4, 7.0])
    x[:, :, :4] = consts
    y = codec.decode(codec.encode(x))
    assert torch.equal(y[:, :, :4], consts.half().float().expand(16, 2, 4))
    # a fully constant block is exact (to fp16) on every axis
    for axis in ("token", "head"):
        c = QuantileCodec(16, 8, bits=bits, axis=axis)
        y = c.decode(c.encode(torch.full((16, 2, 8), 0.1)))
        assert torch.equal(y, torch.full((16, 2, 8), 0.1).half().float())


@pytest.mark.parametrize("axis", ["channel", "token", "head"])
@pytest.mark.parametrize("bits", [1, 2])
def test_huge_magnitudes_stay_finite(axis, bits):
    """Range 131008 overflows an fp16 scale at 1 bit; lo/hi storage keeps it defined."""
    T, D = 8, 4
    x = torch.full((T, 1, D), 65504.0)
    x[::2] = -65504.0
    x[1, 0, 1] = 12.5
    codec = QuantileCodec(T, D, bits=bits, alpha=0.0, axis=axis)
    y = codec.decode(codec.encode(x))
    assert torch.isfinite(y).all()
    L = (1 << bits) - 1
    assert ((y - x).abs() <= 131008 / L / 2 + 1).all()
    assert (y[::2] == -65504.0).all()


@pytest.mark.parametrize("kwargs,field", [
    ({"bits": 3}, "bits"), ({"bits": 0}, "bits"), ({"bits": 4}, "bits"), ({"bits": True}, "bits"),
    ({"alpha": 0.5}, "alpha"), ({"alpha": -0.01}, "alpha"), ({"alpha": float("nan")}, "alpha"),
    ({"alpha": "0.1"}, "alpha"), ({"axis": "batch"}, "axis"),
    ({"axis": "token", "group_size": 3}, "group_size"), ({"axis": "token", "group_size": 0}, "group_size"),
    ({"rounding": "ceil"}, "rounding"), ({"block_tokens": 0}, "block_tokens"),
])
def test_invalid_params_name_the_field(kwargs, field):
    args = {"block_tokens": 8, "head_dim": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        QuantileCodec(**args)


# -- the paper's equations, transcribed as plain loops --------------------------------

def _paper_quantile(vals, p):
    """Linear-interpolated p-quantile of a list (the numpy/torch 'linear' definition).

    The interpolation runs in float32 as the codec's (and a kernel's) does: in float64
    a value that float32 puts exactly on an fp16 rounding tie can round the other way.
    """
    s = sorted(vals)
    pos = p * (len(s) - 1)
    k = math.floor(pos)
    if k + 1 >= len(s):
        return s[k]
    f32 = np.float32
    return float(f32(s[k]) + f32(pos - k) * (f32(s[k + 1]) - f32(s[k])))


def _fp16(v):
    return float(np.float16(v))


def _paper_decode(x, bits, alpha, axis, group_size, rounding):
    """One (block, head) slice x[t][d] (lists of floats) through eq. 7-9 and 6."""
    T, D = len(x), len(x[0])
    if axis == "channel":
        groups = [[(t, d) for t in range(T)] for d in range(D)]
    elif axis == "token":
        groups = [[(t, d) for d in range(g * group_size, (g + 1) * group_size)]
                  for t in range(T) for g in range(D // group_size)]
    else:  # eq. 7: one group per head
        groups = [[(t, d) for t in range(T) for d in range(D)]]
    levels = 2 ** bits - 1
    out = [[0.0] * D for _ in range(T)]
    for members in groups:
        vals = [x[t][d] for t, d in members]
        q_lo = _fp16(_paper_quantile(vals, alpha))        # Q_alpha
        q_hi = _fp16(_paper_quantile(vals, 1 - alpha))    # Q_{1-alpha}
        scale = (q_hi - q_lo) / levels                    # eq. 9
        for t, d in members:
            if scale == 0:
                xq = 0
            else:
                r = (x[t][d] - q_lo) / scale
                xq = round(r) if rounding == "nearest" else math.floor(r)
                xq = max(0, min(xq, levels))              # eq. 8
            out[t][d] = xq * scale + q_lo                 # eq. 6
    return out


@pytest.mark.parametrize("axis,group_size", [("channel", None), ("token", 4), ("token", 8), ("head", None)])
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("rounding", ["nearest", "floor"])
def test_matches_loop_transcription(axis, group_size, bits, rounding):
    T, H, D = 8, 2, 8
    codec = QuantileCodec(T, D, bits=bits, alpha=0.15, axis=axis, group_size=group_size,
                          rounding=rounding)
    x = _blocks(100 + bits, (2, T, H, D), heavy=True)
    y = codec.decode(codec.encode(x))
    for b in range(2):
        for h in range(H):
            xs = x[b, :, h, :].double().tolist()
            ref = torch.tensor(_paper_decode(xs, bits, 0.15, axis, group_size or D, rounding))
            torch.testing.assert_close(y[b, :, h, :].double(), ref.double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T,D,bits", [(1, 3, 2), (1, 8, 1), (3, 3, 1)])
def test_single_group_with_odd_code_bytes(T, D, bits):
    """One (block, head) group whose fp16 fields start at an odd byte offset."""
    codec = QuantileCodec(T, D, bits=bits, axis="token")
    x = _blocks(7, (T, 3, D))
    packed = codec.encode(x)  # [3, nbytes]; row 1 starts at byte nbytes
    assert torch.equal(codec.decode(packed[1:2]), codec.decode(packed)[:, 1:2])
    assert torch.equal(codec.decode(packed[2:]), codec.decode(packed)[:, 2:])

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.kivi import KiviCodec


def kivi_loop_reference(x, bits, axis, group_size):
    """KIVI eq. Q(X) = round((X - z) / s), z = min, s = (max - min) / (2^b - 1),
    X' = Q(X) s + z, written with plain loops over one [T, D] group; s and z in fp16."""
    T, D = x.shape
    out = torch.empty(T, D)
    levels = 2**bits - 1
    groups = ([[(t, c) for t in range(T)] for c in range(D)] if axis == "channel" else
              [[(t, c) for c in range(g, g + group_size)] for t in range(T) for g in range(0, D, group_size)])
    for members in groups:
        vals = [float(x[t, c]) for t, c in members]
        z = torch.tensor(min(vals)).half().item()
        s = torch.tensor(max(0.0, (max(vals) - z) / levels)).half().item()
        for (t, c), v in zip(members, vals):
            q = 0 if s == 0 else min(max(round((v - z) / s), 0), levels)
            out[t, c] = q * s + z
    return out


@st.composite
def block(draw, max_tokens=16):
    T = draw(st.sampled_from([1, 2, 7, 16, max_tokens]))
    D = draw(st.sampled_from([8, 16, 64]))
    H = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    x = torch.randn(T, H, D, generator=torch.Generator().manual_seed(seed)) * scale
    return x


@given(x=block(), bits=st.sampled_from([2, 4]), axis=st.sampled_from(["channel", "token"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_round_trip_shape_size_and_half_step_bound(x, bits, axis, dtype):
    T, H, D = x.shape
    x = x.to(dtype)
    codec = KiviCodec(T, D, bits=bits, axis=axis)
    packed = codec.encode(x)
    assert packed.dtype == torch.uint8 and packed.shape == (H, codec.nbytes)
    assert codec.effective_bits == codec.nbytes * 8 / (T * D)
    y = codec.decode(packed, dtype=dtype)
    assert y.shape == x.shape and y.dtype == dtype
    xf, yf = x.float(), codec.decode(packed)
    dim = 0 if axis == "channel" else 2
    step = (xf.amax(dim, keepdim=True) - xf.amin(dim, keepdim=True)) / (2**bits - 1)
    # half a step, plus fp16 rounding of the stored scale and zero point
    # (relative 2^-11, or absolute 2^-25 in the fp16 subnormal range)
    slack = 2**-10 * (xf.abs().amax(dim, keepdim=True) + step * 2**bits) + 2**-24 * 2**bits
    assert bool(((yf - xf).abs() <= step / 2 + slack).all())


@given(x=block(), bits=st.sampled_from([2, 4]), axis=st.sampled_from(["channel", "token"]))
def test_matches_loop_transcription(x, bits, axis):
    T, H, D = x.shape
    codec = KiviCodec(T, D, bits=bits, axis=axis, group_size=8 if axis == "token" else None)
    y = codec.decode(codec.encode(x))
    for h in range(H):
        ref = kivi_loop_reference(x[:, h], bits, axis, 8)
        # the same levels; zero + q * scale may round differently in the two transcriptions
        # (fp16 terms of the block's magnitude cancel: hypothesis found 0.09375 at |x| ~ 1000),
        # far below one level (range / 2**bits)
        tol = 2**-9 * float(x[:, h].abs().max()) + 1e-6
        torch.testing.assert_close(y[:, h], ref, rtol=0, atol=tol)


def test_leading_block_dims():
    x = torch.randn(5, 4, 16, 2, 32)
    codec = KiviCodec(16, 32, bits=2)
    packed = codec.encode(x)
    assert packed.shape == (5, 4, 2, codec.nbytes)
    for i, j in ((0, 0), (2, 1), (4, 3)):  # each block decodes as if encoded alone
        torch.testing.assert_close(codec.decode(packed)[i, j], codec.decode(codec.encode(x[i, j])))


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_zeros_and_constants_are_exact(axis):
    codec = KiviCodec(8, 16, bits=2, axis=axis)
    for value in (0.0, 3.5, -1000.0):
        x = torch.full((8, 2, 16), value)
        torch.testing.assert_close(codec.decode(codec.encode(x)), x, rtol=0, atol=abs(value) * 2**-10)


def test_fp16_extremes_decode_finite():
    """The full fp16 range is kept (beyond it is refused: test_codec_contract.py)."""
    codec = KiviCodec(4, 8, bits=2)
    ok = torch.full((4, 1, 8), 65504.0)
    ok[0] = -65504.0
    y = codec.decode(codec.encode(ok))
    assert torch.isfinite(y).all()


def test_kivi2_bits_are_honest():
    k, v = KiviCodec(64, 64, bits=2, axis="channel"), KiviCodec(64, 64, bits=2, axis="token")
    assert k.effective_bits == 2 + 32 / 64  # fp16 scale + zero per channel over 64 tokens
    assert v.effective_bits == 2 + 32 / 64  # fp16 scale + zero per token over 64 channels
    assert sum(k.bits_breakdown().values()) == k.effective_bits


@pytest.mark.parametrize("kwargs,field", [
    ({"bits": 3}, "bits"), ({"bits": 1}, "bits"), ({"axis": "head"}, "axis"),
    ({"axis": "token", "group_size": 5}, "group_size"),
    ({"block_tokens": 0}, "block_tokens"), ({"head_dim": -1}, "head_dim")])
def test_invalid_configuration_names_field(kwargs, field):
    args = {"block_tokens": 16, "head_dim": 32, **kwargs}
    with pytest.raises(ValueError, match=field):
        KiviCodec(args.pop("block_tokens"), args.pop("head_dim"), **args)

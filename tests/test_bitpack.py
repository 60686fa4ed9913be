import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.bitpack import (
    MAX_BITS, from_bytes, pack_bits, pack_ternary, packed_len, ternary_packed_len, to_bytes,
    unpack_bits, unpack_ternary)


@given(bits=st.integers(1, MAX_BITS), n=st.integers(1, 200), rows=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_pack_bits_round_trip(bits, n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g, dtype=torch.int32)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, packed_len(n, bits))
    assert packed_len(n, bits) == -(-n * bits // 8)  # no padding beyond the last byte
    out = unpack_bits(packed, bits, n)
    assert out.dtype == (torch.uint8 if bits <= 8 else torch.int32)
    assert torch.equal(out.to(torch.int32), codes)


def bit_stream_reference(codes, bits):
    """The format in words: bit j of code i is stream bit i*bits + j; stream bit k is
    bit k % 8 of byte k // 8 (plain Python over one row)."""
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[b * 8 + k] << k for k in range(8)) for b in range(len(stream) // 8)]


@given(bits=st.integers(1, MAX_BITS), n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_every_width_is_one_little_endian_bit_stream(bits, n, seed):
    # one format for all widths: 1/2/4/8 keep their byte layout, 3/11/... straddle bytes
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int32)
    assert pack_bits(codes, bits).tolist() == bit_stream_reference(codes.tolist(), bits)


def test_eleven_bit_codes_straddle_bytes():
    # 2047 = eleven ones, then 1: bits 0-10 set, bit 11 set -> 0xFF, 0x0F
    assert pack_bits(torch.tensor([2047, 1]), 11).tolist() == [0xFF, 0x0F, 0x00]
    assert unpack_bits(torch.tensor([0xFF, 0x0F, 0x00], dtype=torch.uint8), 11, 2).tolist() == [2047, 1]


def test_pack_bits_layout_is_little_end_first():
    # code i of a byte sits at bit offset i * bits: kernels depend on this.
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1]), 1).item() == 0b10000001
    assert pack_bits(torch.tensor([3, 0, 1, 2]), 2).item() == 3 | (1 << 4) | (2 << 6)


@given(n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_ternary_round_trip(n, seed):
    g = torch.Generator().manual_seed(seed)
    trits = torch.randint(-1, 2, (3, n), generator=g, dtype=torch.int8)
    packed = pack_ternary(trits)
    assert packed.shape == (3, ternary_packed_len(n)) == (3, -(-n // 5))
    assert torch.equal(unpack_ternary(packed, n), trits)


def test_ternary_uses_base3_five_per_byte():
    assert pack_ternary(torch.tensor([1, 1, 1, 1, 1])).item() == 242  # all digits 2
    assert pack_ternary(torch.tensor([-1, -1, -1, -1, -1])).item() == 0


def test_bytes_view_round_trip():
    x = torch.randn(3, 7).half()
    assert torch.equal(from_bytes(to_bytes(x), torch.float16), x)


@pytest.mark.parametrize("bits", [0, MAX_BITS + 1, 2.0, True])
def test_unsupported_bits_named(bits):
    with pytest.raises(ValueError, match=r"bits must be an int in \[1, 16\]"):
        packed_len(10, bits)

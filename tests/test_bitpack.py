import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_lowbit_kv.codecs.bitpack import (
    from_bytes, pack_bits, pack_ternary, packed_len, ternary_packed_len, to_bytes,
    unpack_bits, unpack_ternary)


@given(bits=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 200), rows=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_pack_bits_round_trip(bits, n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, packed_len(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


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


def test_unsupported_bits_named():
    with pytest.raises(ValueError, match="bits"):
        packed_len(10, 3)

"""What BlockCodec promises for every codec: shapes checked on the way in and out, and
no value stored that the fp16 metadata cannot hold."""

import pytest
import torch

from vllm_lowbit_kv.codecs import (DynamicCodec, KiviCodec, QuantileCodec, RVQKeyCodec, RVQValueCodec,
                                   TernaryValueCodec, VidKVKeyCodec)

CODECS = [KiviCodec, QuantileCodec, DynamicCodec, VidKVKeyCodec, TernaryValueCodec, RVQKeyCodec,
          RVQValueCodec]


@pytest.mark.parametrize("cls", CODECS, ids=lambda c: c.__name__)
def test_wrong_shapes_are_refused(cls):
    codec = cls(16, 32)
    with pytest.raises(ValueError, match="x.shape"):
        codec.encode(torch.zeros(8, 2, 32))
    with pytest.raises(ValueError, match="packed"):
        codec.decode(torch.zeros(2, codec.nbytes + 1, dtype=torch.uint8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 70000.0, 1e6])
@pytest.mark.parametrize("cls", CODECS, ids=lambda c: c.__name__)
def test_non_finite_or_beyond_fp16_is_refused(cls, bad):
    codec = cls(16, 32)
    x = torch.zeros(16, 2, 32)
    x[3, 1, 2] = bad
    with pytest.raises(ValueError, match="NaN, Inf"):
        codec.encode(x)

"""The randomized Hadamard rotation: the fast transform against the dense matrix,
orthonormality, seeding, and what it does to outlier channels."""

import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_lowbit_kv.rotation import HadamardRotation, walsh_hadamard
from vllm_lowbit_kv.schemes import get_scheme


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_fast_transform_equals_dense_sylvester_matrix(d):
    x = torch.randn(7, 3, d, dtype=torch.float64)
    dense = torch.tensor(scipy.linalg.hadamard(d), dtype=torch.float64) / d ** 0.5
    torch.testing.assert_close(walsh_hadamard(x), x @ dense, atol=1e-12, rtol=0)


@settings(max_examples=25, deadline=None)
@given(layer=st.integers(0, 200), seed=st.integers(0, 2**31), d=st.sampled_from([16, 64, 128]))
def test_rotation_is_orthonormal_and_inverted_exactly(layer, seed, d):
    rot = HadamardRotation(d, layer, seed)
    m = rot.matrix().double()
    dense = torch.tensor(scipy.linalg.hadamard(d), dtype=torch.float64) / d ** 0.5
    torch.testing.assert_close(m, torch.diag(rot.signs.double()) @ dense, atol=1e-7, rtol=0)
    torch.testing.assert_close(m @ m.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    x = torch.randn(5, d)
    torch.testing.assert_close(rot.rotate(x), x @ rot.matrix(), atol=1e-5, rtol=0)
    torch.testing.assert_close(rot.rotate(x.bfloat16()).float(), x.bfloat16().float() @ rot.matrix(),
                               atol=0.05, rtol=0.01)
    torch.testing.assert_close(rot.unrotate(rot.rotate(x)), x, atol=1e-5, rtol=0)
    # scores and weighted sums survive: (qM)·(kM) = q·k, (p·vM)Mᵀ = p·v
    q, k = torch.randn(d), torch.randn(d)
    assert torch.dot(rot.rotate(q), rot.rotate(k)).item() == pytest.approx(torch.dot(q, k).item(),
                                                                          abs=1e-3)


def test_signs_depend_on_seed_and_layer_only():
    a, b = HadamardRotation(64, 3, 7), HadamardRotation(64, 3, 7)
    assert torch.equal(a.signs, b.signs)
    assert not torch.equal(a.signs, HadamardRotation(64, 4, 7).signs)
    assert not torch.equal(a.signs, HadamardRotation(64, 3, 8).signs)


def test_rotation_spreads_an_outlier_channel():
    """The reason to rotate: one channel 30x larger than the rest stretches every
    token's range; after the rotation no channel stands out."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 30
    peak = lambda t: (t.std(0).max() / t.std(0).median()).item()  # noqa: E731
    assert peak(x) > 25 and peak(HadamardRotation(64).rotate(x)) < 1.5


def test_bad_head_dim_and_rotate_values_are_refused():
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        HadamardRotation(96)
    with pytest.raises(ValueError, match=r"rotate must be one of \['none', 'hadamard'\], got 'dct'"):
        get_scheme("kivi2").with_params(rotate="dct")
    assert get_scheme("kivi2").with_params(rotate="hadamard").rotation(64, 2) is not None


def test_signs_do_not_depend_on_the_default_device():
    """vLLM builds its layers under ``with torch.device("cuda")``: the signs are drawn on
    the CPU all the same (else every device would rotate by other signs, or the draw
    fail). ``meta`` stands in for the GPU here."""
    plain = HadamardRotation(64, 3, 7)
    with torch.device("meta"):
        rot = HadamardRotation(64, 3, 7)
        m = rot.matrix()
    assert rot.signs.device.type == "cpu" and torch.equal(rot.signs, plain.signs)
    assert torch.equal(m, plain.matrix())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rotation_on_cuda_equals_cpu():
    plain = HadamardRotation(64, 5, 1)
    with torch.device("cuda"):
        rot = HadamardRotation(64, 5, 1)
    assert torch.equal(rot.signs, plain.signs)
    x = torch.randn(9, 3, 64)
    torch.testing.assert_close(rot.rotate(x.cuda()).cpu(), plain.rotate(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(rot.unrotate(x.cuda()).cpu(), plain.unrotate(x), atol=1e-6, rtol=0)

"""Randomized Hadamard rotation of head vectors before scalar quantization.

QuaRot (Ashkboos et al. 2024) and TurboQuant rotate each K/V head vector by an
orthonormal matrix ``M = diag(s) · H_d / sqrt(d)`` (``H_d`` the Sylvester
Hadamard matrix, ``s`` random signs) before quantizing: outlier channels are
spread over all channels, so per-channel and per-token ranges shrink. Attention
stays exact in math, because ``M`` is orthonormal (``M Mᵀ = I``):

    q · k = (q M) · (k M)           scores: rotate the query once per step
    Σ p v = (Σ p (v M)) Mᵀ          output: un-rotate the attention output once

so the packed-attention kernels read rotated pages with a rotated query and
need no change to their inner loops: they take ``M`` as the ops contract's
``rotation`` (the C++ kernel multiplies each query vector as it loads it and each
output row as it writes it). The signs are drawn from ``seed`` and the layer index
and stored nowhere but the configuration.

The transform is a fast Walsh-Hadamard transform (``log2 d`` butterfly stages,
``O(d log d)``), checked against the dense matrix in tests/test_rotation.py.
No well-kept CPU implementation exists to reuse: Dao-AILab's
``fast-hadamard-transform`` is CUDA only, and torch has none. The butterfly builds
``M`` once per layer, device and dtype; :meth:`HadamardRotation.rotate` (K and V
before encoding) is then one float32 matrix product, not a dozen small tensor
operations.
"""

from __future__ import annotations

import math

import torch

from .codecs.base import require

#: values of the ``rotate`` field
ROTATIONS = ("none", "hadamard")


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_d / sqrt(d)`` over the last dimension (``d`` a power of two), in x's dtype
    for floating x. ``H_d`` is symmetric and ``(H_d / sqrt(d))² = I``: the transform is
    its own inverse."""
    d = x.shape[-1]
    require(d >= 1 and d & (d - 1) == 0, "head_dim", "a power of two for the Hadamard rotation", d)
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:  # one butterfly stage: pairs (i, i + h) inside blocks of 2h
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(d)).to(x.dtype)


class HadamardRotation:
    """The orthonormal ``M = diag(s) H_d / sqrt(d)`` of one layer: ``rotate(x) = x M``,
    ``unrotate(y) = y Mᵀ``; ``s`` are random signs from ``(seed, layer)``."""

    def __init__(self, head_dim: int, layer: int = 0, seed: int = 0):
        walsh_hadamard(torch.zeros(1, head_dim, device="cpu"))  # validates head_dim
        # drawn on the CPU whatever the default device (vLLM builds layers under
        # ``with torch.device("cuda")``): the same signs, and matrix, on every device
        gen = torch.Generator(device="cpu").manual_seed(1_000_003 * int(seed) + int(layer))
        self.head_dim = head_dim
        self.signs = torch.randint(0, 2, (head_dim,), generator=gen, device="cpu").float() * 2 - 1
        #: (device, dtype) -> M, built once: every use is one matrix product
        self._matrices: dict[tuple, torch.Tensor] = {}

    def matrix(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
        """The dense ``M`` [d, d] on ``device``: the butterfly applied to ``diag(s)`` in
        float32, built once per device and dtype."""
        key = (torch.device(device), dtype)
        m = self._matrices.get(key)
        if m is None:
            m = self._matrices[key] = walsh_hadamard(torch.diag(self.signs)).to(*key)
        return m

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x M`` over the last dimension, computed in float32 (float64 stays), in x's dtype."""
        return self._times(x, transposed=False)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """``y Mᵀ``: the inverse of :meth:`rotate`."""
        return self._times(y, transposed=True)

    def _times(self, x: torch.Tensor, transposed: bool) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        m = self.matrix(x.device, dtype)
        y = torch.matmul(x if x.dtype == dtype else x.to(dtype), m.mT if transposed else m)
        return y if y.dtype == x.dtype else y.to(x.dtype)

"""Orthonormal DCT-II along the token axis and its inverse (FlashCache, seed 002, Eqs. 6-9).

Pure PyTorch, computed with one FFT of length N (Makhoul's reordering), so a
prompt of N tokens costs O(N log N) per channel instead of the N x N basis.

Eq. (6)-(7): C[m] = a[m] * sum_i x[i] * cos(pi * m * (2i + 1) / (2N)),
             a[0] = sqrt(1/N), a[m > 0] = sqrt(2/N)           (scipy's dct(type=2, norm="ortho"))
Eq. (9):     the inverse, x[i] = sum_m a[m] * C[m] * cos(pi * m * (2i + 1) / (2N))
Eq. (8):     the low-pass filter keeps C[m] for m < w = gamma * N and zeroes the rest.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dct2", "idct2", "cutoff"]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _twiddle(N: int, dtype: torch.dtype, device, sign: float) -> torch.Tensor:
    k = torch.arange(N, dtype=dtype, device=device)
    return torch.polar(torch.ones_like(k), sign * math.pi * k / (2 * N))


def _scale(N: int, dtype: torch.dtype, device) -> torch.Tensor:
    a = torch.full((N,), math.sqrt(2.0 / N), dtype=dtype, device=device)
    a[0] = math.sqrt(1.0 / N)
    return a


def dct2(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Orthonormal DCT-II of ``x`` along ``dim`` (Eqs. 6-7); float64 stays float64, else float32."""
    dt = _work_dtype(x)
    y = x.to(dt).movedim(dim, -1)
    N = y.shape[-1]
    # v = x[0], x[2], ..., then the odd samples reversed: X[m] = Re(e^{-i pi m / 2N} FFT(v)[m])
    v = torch.cat([y[..., ::2], y[..., 1::2].flip(-1)], dim=-1)
    X = (torch.fft.fft(v, dim=-1) * _twiddle(N, dt, y.device, -1.0)).real
    return (X * _scale(N, dt, y.device)).movedim(-1, dim)


def idct2(c: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`dct2` along ``dim`` (Eq. 9, the orthonormal DCT-III)."""
    dt = _work_dtype(c)
    C = c.to(dt).movedim(dim, -1)
    N = C.shape[-1]
    X = C / _scale(N, dt, C.device)  # unnormalized DCT-II coefficients
    X_rev = torch.cat([torch.zeros_like(X[..., :1]), X[..., 1:].flip(-1)], dim=-1)  # X[N - m], X[N] = 0
    V = _twiddle(N, dt, C.device, 1.0) * torch.complex(X, -X_rev)
    v = torch.fft.ifft(V, dim=-1).real
    x = torch.empty_like(v)
    half = (N + 1) // 2
    x[..., ::2] = v[..., :half]
    x[..., 1::2] = v[..., half:].flip(-1)
    return x.movedim(-1, dim)


def cutoff(num_tokens: int, gamma: float) -> int:
    """Low-pass cut-off w = gamma * N of Eq. (8), floored, at least 1 (the DC term)."""
    return min(num_tokens, max(1, int(gamma * num_tokens)))

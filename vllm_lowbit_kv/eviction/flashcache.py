"""FlashCache (seed 002): the Outlier KV Recognition Module and the Dynamic Budget
Allocation Module, on one layer's prompt K/V. Pure PyTorch.

Shapes: a layer's keys and values are ``[N, H, D]`` (N prompt tokens, H KV
heads, head dim D), with RoPE applied as the cache stores them.

Outlier KV Recognition (Sec. 3.2.1). The DCT runs along the token axis for
every (KV head, channel) (Eqs. 6-7, :func:`~.dct.dct2`); the low-pass filter
keeps the first ``w = gamma * N`` coefficients (Eq. 8) and the inverse DCT gives
the smooth *Base KV* (Eq. 9). A pair's deviation is
``Dev[x] = MSE(K[x], K_base[x]) + MSE(V[x], V_base[x])`` (Eq. 10), the mean
squared error over the token's H x D elements. Since the transform is linear,
``K - K_base`` is the inverse DCT of the discarded high band, computed directly.

Dynamic Budget Allocation (Sec. 3.2.2). The power spectrum is ``P[m] = C[m]^2``
(Eq. 11, Parseval: the orthonormal DCT preserves energy); a layer's outlier
ratio is the energy of the discarded band over the total, for keys plus values:
``R = R_K + R_V``, ``R_K = sum_{m >= w} P_K[m] / sum_m P_K[m]`` (Eq. 12, summed
over heads and channels; the paper's lower limit "w + 1" contradicts Eq. 8's
``w <= m`` and would leave the m = w term in neither band: we take the band
Eq. 8 discards, so R_K is exactly the relative energy of K - K_base). The
ratios, normalized into weights, split a global budget into per-layer budgets
(:func:`allocate_budgets`).
"""

from __future__ import annotations

import torch

from ..codecs.base import require
from .dct import cutoff, dct2, idct2

__all__ = ["outlier_analysis", "allocate_budgets"]


def _high_band(x: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> (x - base [N, H, D], energy ratio of the band m >= w)."""
    c = dct2(x, dim=0)
    high = c.clone()
    high[:w] = 0
    total = c.pow(2).sum()
    ratio = (high.pow(2).sum() / total) if bool(total > 0) else total.new_zeros(())
    return idct2(high, dim=0), ratio


def outlier_analysis(keys: torch.Tensor, values: torch.Tensor, gamma: float
                     ) -> tuple[torch.Tensor, float]:
    """One layer's per-pair deviation from the Base KV (Eq. 10) and its outlier ratio R
    (Eq. 12). keys, values [N, H, D] -> (deviation float32 [N], R in [0, 2])."""
    require(keys.dim() == 3 and keys.shape == values.shape, "keys/values shape",
            "equal [tokens, kv_heads, head_dim]", (tuple(keys.shape), tuple(values.shape)))
    w = cutoff(keys.shape[0], gamma)
    dk, rk = _high_band(keys, w)
    dv, rv = _high_band(values, w)
    dev = dk.pow(2).mean(dim=(1, 2)) + dv.pow(2).mean(dim=(1, 2))
    return dev.float(), float(rk + rv)


def allocate_budgets(weights: torch.Tensor, total: int, lo: torch.Tensor, hi: torch.Tensor
                     ) -> torch.Tensor:
    """Integer per-layer budgets ``b`` with ``sum(b) == total`` and ``lo <= b <= hi``,
    proportional to ``weights`` where the bounds allow.

    The real-valued allocation is ``b*_l = clamp(s * w_l, lo_l, hi_l)`` with the one
    scale ``s`` that makes it sum to ``total`` (the paper's "normalize the ratios into
    weights and allocate the share of the global budget", with bounds: a layer cannot
    keep more than its N tokens, nor fewer than its protected sinks and recent window).
    Layers of weight 0 stay at ``lo`` unless the others cannot absorb the budget; all
    weights 0 means uniform; weights under 1e-12 of the largest count as 0. Integers by
    largest remainder.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    lo = torch.as_tensor(lo, dtype=torch.long).flatten()
    hi = torch.as_tensor(hi, dtype=torch.long).flatten()
    L = w.numel()
    require(L >= 1 and lo.numel() == L and hi.numel() == L, "weights/lo/hi",
            "1-D of the same length >= 1", (L, lo.numel(), hi.numel()))
    require(bool((w >= 0).all()) and bool(torch.isfinite(w).all()), "weights",
            "finite and >= 0", w.tolist())
    require(bool((lo >= 0).all()) and bool((lo <= hi).all()), "lo/hi", "0 <= lo <= hi",
            (lo.tolist(), hi.tolist()))
    require(int(lo.sum()) <= total <= int(hi.sum()), "total budget",
            f"in [sum(lo)={int(lo.sum())}, sum(hi)={int(hi.sum())}]", total)
    real = _real_allocation(w, float(total), lo.double(), hi.double())
    b = real.floor().long().clamp(lo, hi)
    frac = real - b.double()
    order = sorted(range(L), key=lambda i: (-float(frac[i]), -float(w[i]), i))
    short = total - int(b.sum())
    for i in order:  # largest remainders first
        if short <= 0:
            break
        if b[i] < hi[i]:
            b[i] += 1
            short -= 1
    for i in order[::-1]:  # float slack: take back from the smallest remainders
        if short >= 0:
            break
        if b[i] > lo[i]:
            b[i] -= 1
            short += 1
    return b


def _real_allocation(w: torch.Tensor, total: float, lo: torch.Tensor, hi: torch.Tensor
                     ) -> torch.Tensor:
    if float(w.max()) == 0:
        w = torch.ones_like(w)
    w = w / w.max()
    w = torch.where(w < 1e-12, torch.zeros_like(w), w)  # negligible weights count as 0
    pos = w > 0
    reach = float(torch.where(pos, hi, lo).sum())
    if reach < total:  # weighted layers all full: the rest goes uniformly to the others
        base = torch.where(pos, hi, lo)
        rest = _real_allocation(torch.ones(int((~pos).sum()), dtype=w.dtype), total - float(hi[pos].sum()),
                                lo[~pos], hi[~pos])
        base[~pos] = rest
        return base
    # f(s) = sum clamp(s w, lo, hi) is piecewise linear and nondecreasing: find the
    # segment between consecutive breakpoints (lo/w, hi/w) where it reaches total
    f = lambda s: float(torch.clamp(s * w, lo, hi).sum())  # noqa: E731
    bps = sorted({0.0, *(lo[pos] / w[pos]).tolist(), *(hi[pos] / w[pos]).tolist()})
    prev = bps[0]
    for bp in bps[1:]:
        f_bp = f(bp)
        if f_bp >= total:
            f_prev = f(prev)
            s = prev if f_bp == f_prev else prev + (bp - prev) * (total - f_prev) / (f_bp - f_prev)
            return torch.clamp(s * w, lo, hi)
        prev = bp
    return torch.clamp(prev * w, lo, hi)

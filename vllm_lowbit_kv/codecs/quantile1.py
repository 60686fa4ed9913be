"""Quantile-range 1-/2-bit quantization, group-specific (seed 003).

Zhang et al., "From 16-Bit to 1-Bit: Visual KV Cache Quantization for
Memory-Efficient Multimodal Large Language Models" (seeds/003), section 3.3-3.4:

    eq. 3-6  min-max baseline   scale = (max x - min x) / (2^b - 1),
                                x_q = max(0, min(floor((x - min x) / scale), 2^b - 1)),
                                x'  = x_q * scale + min x
    eq. 7    group-specific     x_q = {Quant(x[..., 1, :]), ..., Quant(x[..., H, :])}:
                                statistics per attention head, not per layer
    eq. 8-9  quantile range     x_q = max(0, min(floor((x - Q_a) / scale), 2^b - 1)),
                                scale = (Q_{1-a} - Q_a) / (2^b - 1)
    eq. 6    dequantization     x' = x_q * scale + Q_a

Q_a is the a-quantile of the group; values outside [Q_a, Q_{1-a}] clamp to the
nearest end of the range.

Decisions (the paper leaves these open or we depart from it on purpose):

* Quantile: linear interpolation between order statistics (numpy's and
  torch's default): with the group sorted into s_0 <= ... <= s_{n-1},
  p = a (n - 1), k = floor(p), Q_a = s_k + (p - k) (s_{k+1} - s_k).
* Rounding: eq. 8 floors. At 1 bit that sends every value below Q_{1-a}
  (a fraction 1 - a of the group) to Q_a. We round to nearest (threshold at
  the midpoint, as KIVI and ``quant.py`` do); ``rounding="floor"`` gives the
  literal eq. 8 for comparison.
* Grouping: eq. 7 reduces over all tokens and channels of a head
  (``axis="head"``: one range per (block, head), the paper's literal choice).
  The paper notes that grouping over more dimensions improves accuracy; at 1
  bit a single range per head leaves two values for the whole block, so the
  defaults go finer inside the head: ``axis="channel"`` (per channel over the
  block's tokens, for keys: key outliers are channel-aligned) and
  ``axis="token"`` (per token over ``group_size`` channels, for values).
  Scheme ``quantile1`` uses K channel / V token.
* alpha: the paper gives no value. Default ``None`` picks per bit width the
  alpha that minimises the MSE of 64-element groups (a sweep over Gaussian,
  Student-t(4) and t(2.5) data, error / variance):

      b=1  a=0: 2.75  0.05: 0.96  0.1: 0.55  0.2: 0.36  0.3: 0.44 (Gaussian)
      b=2  a=0: 0.20  0.02: 0.14  0.05: 0.11  0.1: 0.13  0.2: 0.23 (Gaussian)

  so 0.2 at 1 bit and 0.05 at 2 bits (heavy tails move both lower at 2 bits;
  0.05 is within 1% of the t(4) optimum). alpha=0 is plain min-max (KIVI).
* Metadata: the range ends lo = fp16(Q_a) and hi = fp16(Q_{1-a}) are stored,
  not (scale, zero): at 1 bit the scale equals the range, which overflows fp16
  when |x| is near 65504, while lo and hi are data values and always fit.
  Encoder and decoder both derive step = (hi - lo) / (2^b - 1) in float32
  from the stored fp16 values, so the codes are reproducible bit for bit.
  A group with hi == lo codes everything as 0 and decodes to lo.

Stored per (block, head), T tokens, D channels, b bits:
    codes   T*D*b bits, packed along channels (token-major), bitpack order
    lo      fp16, one per quantization group
    hi      fp16, one per quantization group
Groups: ``channel`` D, ``token`` T*D/group_size, ``head`` 1. Effective bits at
T=64, D=64: channel 1.5 (b=1) / 2.5 (b=2); token with group_size 64 the same;
head 1.008 / 2.008.
"""

from __future__ import annotations

import math

import torch

from .base import BlockCodec, Layout, require
from .bitpack import from_bytes, pack_bits, packed_len, to_bytes, unpack_bits

AXES = ("channel", "token", "head")
ROUNDINGS = ("nearest", "floor")
#: MSE-optimal alpha per bit width on bell-shaped 64-element groups (see module doc).
DEFAULT_ALPHA = {1: 0.2, 2: 0.05}


def _quantile_sorted(s: torch.Tensor, p: float) -> torch.Tensor:
    """Linear-interpolated p-quantile of values already sorted along the last dim."""
    n = s.shape[-1]
    pos = p * (n - 1)
    k = min(int(math.floor(pos)), n - 1)
    w = pos - k
    lo = s[..., k]
    if w == 0.0:
        return lo
    return lo + w * (s[..., min(k + 1, n - 1)] - lo)


class QuantileCodec(BlockCodec):
    """Quantile-range b-bit codec (b in 1, 2); ``axis='channel'`` for keys, ``'token'`` for values."""

    def __init__(self, block_tokens: int, head_dim: int, bits: int = 1,
                 alpha: float | None = None, axis: str = "channel",
                 group_size: int | None = None, rounding: str = "nearest"):
        super().__init__(block_tokens, head_dim)
        require(bits in (1, 2) and not isinstance(bits, bool), "bits", "one of (1, 2)", bits)
        if alpha is None:
            alpha = DEFAULT_ALPHA[bits]
        require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                and 0.0 <= alpha < 0.5, "alpha", "a float in [0, 0.5)", alpha)
        require(axis in AXES, "axis", f"one of {AXES}", axis)
        require(rounding in ROUNDINGS, "rounding", f"one of {ROUNDINGS}", rounding)
        group_size = head_dim if group_size is None else group_size
        require(axis != "token" or (isinstance(group_size, int) and group_size >= 1
                                    and head_dim % group_size == 0),
                "group_size", f"a divisor of head_dim={head_dim}", group_size)
        self.bits, self.alpha, self.axis = bits, float(alpha), axis
        self.group_size, self.rounding = group_size, rounding

    @property
    def n_groups(self) -> int:
        if self.axis == "channel":
            return self.head_dim
        if self.axis == "token":
            return self.block_tokens * self.head_dim // self.group_size
        return 1

    def layout(self) -> Layout:
        return Layout((
            ("codes", packed_len(self.block_tokens * self.head_dim, self.bits)),
            ("lo", 2 * self.n_groups),
            ("hi", 2 * self.n_groups),
        ))

    # -- grouping: [G, T, D] <-> [G, n_groups, group elements] ---------------
    def _to_groups(self, x: torch.Tensor) -> torch.Tensor:
        G = x.shape[0]
        if self.axis == "channel":
            return x.transpose(1, 2)  # [G, D, T]
        return x.reshape(G, self.n_groups, -1)  # token: consecutive channels; head: all

    def _from_groups(self, xg: torch.Tensor) -> torch.Tensor:
        G, T, D = xg.shape[0], self.block_tokens, self.head_dim
        if self.axis == "channel":
            return xg.transpose(1, 2)
        return xg.reshape(G, T, D)

    def _step(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """float32 step from fp16 range ends (eq. 9), identical in encoder and decoder."""
        return (hi.float() - lo.float()) / ((1 << self.bits) - 1)

    def encode_groups(self, x, relevance=None):
        G = x.shape[0]
        L = (1 << self.bits) - 1
        xg = self._to_groups(x)
        s = torch.sort(xg, dim=-1).values
        lo = _quantile_sorted(s, self.alpha).unsqueeze(-1).half()
        hi = _quantile_sorted(s, 1.0 - self.alpha).unsqueeze(-1).half()
        step = self._step(lo, hi)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        t = (xg - lo.float()) / safe
        t = torch.round(t) if self.rounding == "nearest" else torch.floor(t)
        codes = torch.where(step > 0, t.clamp_(0, L), torch.zeros_like(t)).to(torch.uint8)
        return self.layout().join({
            "codes": pack_bits(self._from_groups(codes).reshape(G, -1), self.bits),
            "lo": to_bytes(lo.reshape(G, -1)),
            "hi": to_bytes(hi.reshape(G, -1)),
        })

    def decode_groups(self, packed):
        G, T, D = packed.shape[0], self.block_tokens, self.head_dim
        f = self.layout().split(packed)
        codes = unpack_bits(f["codes"], self.bits, T * D).reshape(G, T, D)
        lo = from_bytes(f["lo"], torch.float16).unsqueeze(-1)
        hi = from_bytes(f["hi"], torch.float16).unsqueeze(-1)
        xg = self._to_groups(codes).float() * self._step(lo, hi) + lo.float()
        return self._from_groups(xg).contiguous()

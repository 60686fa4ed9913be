"""KIVI: asymmetric min-max quantization, K per-channel and V per-token.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"
(2024), the baseline every paper in ../shared/seeds compares against
(seed 000 eq. 3-4, seed 004 eq. 9-10 restate it):

    Q(X) = round((X - z_X) / s_X),  z_X = min X,  s_X = (max X - min X) / (2^b - 1)
    X'   = Q(X) * s_X + z_X

Keys are grouped per channel over the block's tokens (key outliers are
channel-aligned), values per token over ``group_size`` channels.

Stored per (block, head), with T tokens and D channels:
    codes   T*D*b bits, packed along channels (token-major)
    scale   fp16, one per group
    zero    fp16, one per group
Per-channel: D groups (2.0 + 32/T extra bits/element); per-token:
T*D/group_size groups (32/group_size extra).
"""

from __future__ import annotations

import torch

from .base import BlockCodec, Layout, require
from .bitpack import from_bytes, pack_bits, packed_len, to_bytes, unpack_bits
from .quant import dequantize, minmax_quantize

AXES = ("channel", "token")


class KiviCodec(BlockCodec):
    """Min-max b-bit codec; ``axis='channel'`` for keys, ``'token'`` for values."""

    def __init__(self, block_tokens: int, head_dim: int, bits: int = 2,
                 axis: str = "channel", group_size: int | None = None):
        super().__init__(block_tokens, head_dim)
        # 1 bit is refused: its scale (max - min) can overflow fp16 at the input
        # bound; the quantile codec covers 1 bit with stored range ends.
        require(bits in (2, 4, 8), "bits", "one of (2, 4, 8)", bits)
        require(axis in AXES, "axis", f"one of {AXES}", axis)
        group_size = head_dim if group_size is None else group_size
        require(axis == "channel" or (group_size >= 1 and head_dim % group_size == 0),
                "group_size", f"a divisor of head_dim={head_dim}", group_size)
        self.bits, self.axis, self.group_size = bits, axis, group_size

    @property
    def n_groups(self) -> int:
        if self.axis == "channel":
            return self.head_dim
        return self.block_tokens * self.head_dim // self.group_size

    def layout(self) -> Layout:
        return Layout((
            ("codes", packed_len(self.block_tokens * self.head_dim, self.bits)),
            ("scale", 2 * self.n_groups),
            ("zero", 2 * self.n_groups),
        ))

    def _grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """View [G, T, D] so that the reduction dim holds one quantization group."""
        if self.axis == "channel":
            return x, 1  # reduce over tokens
        G, T, D = x.shape
        return x.reshape(G, T, D // self.group_size, self.group_size), -1

    def encode_groups(self, x, relevance=None):
        G = x.shape[0]
        xg, dim = self._grouped(x)
        codes, scale, zero = minmax_quantize(xg, self.bits, dim)
        return self.layout().join({
            "codes": pack_bits(codes.reshape(G, -1), self.bits),
            "scale": to_bytes(scale.reshape(G, -1)),
            "zero": to_bytes(zero.reshape(G, -1)),
        })

    def decode_groups(self, packed):
        G, T, D = packed.shape[0], self.block_tokens, self.head_dim
        f = self.layout().split(packed)
        codes = unpack_bits(f["codes"], self.bits, T * D).reshape(G, T, D)
        scale = from_bytes(f["scale"], torch.float16)
        zero = from_bytes(f["zero"], torch.float16)
        if self.axis == "channel":
            return dequantize(codes, scale.unsqueeze(1), zero.unsqueeze(1))
        cg, _ = self._grouped(codes)
        shape = cg.shape[:-1] + (1,)
        x = dequantize(cg, scale.reshape(shape), zero.reshape(shape))
        return x.reshape(G, T, D)

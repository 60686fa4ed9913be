"""Uniform (min-max) quantization primitives with fp16 metadata, and the symmetric int8
code that staging may hold tokens in (:data:`STAGING_DTYPES`).

Scale and zero point are rounded to fp16 *before* the codes are computed, so
the decoder sees exactly what the encoder used and every kernel can reproduce
the codes bit for bit.
"""

from __future__ import annotations

import torch

from .base import require


def minmax_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, zero) mapping [lo, hi] onto codes 0 .. 2**bits - 1."""
    levels = (1 << bits) - 1
    zero = lo.half()
    scale = ((hi - zero.float()) / levels).clamp_min(0).half()
    return scale, zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round-to-nearest codes; a zero scale (constant group) codes everything as 0."""
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - zero.float()) / safe).clamp_(0, (1 << bits) - 1)
    return torch.where(s > 0, codes, torch.zeros_like(codes)).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


def minmax_quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization with statistics reduced over ``dim``.

    Returns (codes uint8 like x, scale fp16, zero fp16) with ``dim`` kept as size 1.
    Error per element is at most half a step plus fp16 rounding of the metadata.
    """
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    scale, zero = minmax_params(lo, hi, bits)
    return quantize(x, scale, zero, bits), scale, zero


def absmax_int8(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes with one float32 scale (absmax / 127) per slice along ``dim``
    (kept as size 1): error at most half a step, absmax / 254. An all-zero slice gets
    scale 1 and zero codes."""
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def absmax_int8_roundtrip(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` as :func:`absmax_int8` stores it, decoded to float32."""
    codes, scale = absmax_int8(x, dim)
    return codes.float() * scale


#: what staging holds: tokens in the model dtype, or int8 with a float32 scale per
#: (token, head) (:func:`~vllm_lowbit_kv.codecs.quant.absmax_int8`: 8.5 bits per element
#: at head_dim 64, half a step of absmax / 127 at most, for about half the memory)
STAGING_DTYPES = ("model", "int8")


def require_staging_dtype(staging_dtype: str) -> None:
    require(staging_dtype in STAGING_DTYPES, "staging_dtype", f"one of {STAGING_DTYPES}",
            staging_dtype)


def staged_bytes_per_element(staging_dtype: str, head_dim: int, model_dtype_bytes: int) -> float:
    """Bytes per staged K or V element, the scale included."""
    return model_dtype_bytes if staging_dtype == "model" else 1 + 4 / head_dim

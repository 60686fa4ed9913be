"""Bit packing primitives shared by every codec.

Codes live in uint8 tensors; packing is along the last dimension, little-end
first (code i of a byte sits at bit offset ``i * bits``), so a kernel can
unpack with one shift and one mask per code.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)
TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: 1.6 bits per trit


def packed_len(n_codes: int, bits: int) -> int:
    """Bytes that ``n_codes`` codes of ``bits`` bits occupy."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per_byte = 8 // bits
    return -(-n_codes // per_byte)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes in [0, 2**bits) along the last dim into uint8."""
    n = codes.shape[-1]
    per_byte = 8 // bits
    nbytes = packed_len(n, bits)
    pad = nbytes * per_byte - n
    c = codes.to(torch.uint8)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], nbytes, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=c.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 codes, ``n_codes`` along the last dim."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], -1)[..., :n_codes].to(torch.uint8)


def ternary_packed_len(n_trits: int) -> int:
    return -(-n_trits // TRITS_PER_BYTE)


def pack_ternary(trits: torch.Tensor) -> torch.Tensor:
    """Pack values in {-1, 0, +1} base 3, five per byte, along the last dim."""
    n = trits.shape[-1]
    nbytes = ternary_packed_len(n)
    pad = nbytes * TRITS_PER_BYTE - n
    t = (trits.to(torch.int32) + 1)
    if pad:
        t = torch.nn.functional.pad(t, (0, pad), value=1)
    t = t.reshape(*t.shape[:-1], nbytes, TRITS_PER_BYTE)
    powers = 3 ** torch.arange(TRITS_PER_BYTE, device=t.device, dtype=torch.int32)
    return (t * powers).sum(-1).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor, n_trits: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: int8 values in {-1, 0, +1}."""
    powers = 3 ** torch.arange(TRITS_PER_BYTE, device=packed.device, dtype=torch.int32)
    digits = (packed.to(torch.int32).unsqueeze(-1) // powers) % 3
    return (digits.reshape(*packed.shape[:-1], -1)[..., :n_trits] - 1).to(torch.int8)


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a tensor's trailing dim as raw bytes: [..., n] -> uint8 [..., n * itemsize]."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(*t.shape[:-1], -1)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_bytes`. Copies through a flat buffer: a field split
    out of a packed row (or an empty one) can have strides a dtype view rejects."""
    return b.reshape(-1).clone().view(dtype).reshape(*b.shape[:-1], -1)

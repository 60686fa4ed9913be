"""Bit packing primitives shared by every codec.

Codes of any width ``bits`` in [1, MAX_BITS] are packed along the last
dimension as one little-endian bit stream: bit j of code i is stream bit
``i * bits + j``, and stream bit k is bit ``k % 8`` of byte ``k // 8``. For
widths dividing 8 this is the familiar layout (code i of a byte sits at bit
offset ``(i % (8 // bits)) * bits``), so a kernel unpacks with one shift and
one mask per code; wider or odd widths (e.g. 11-bit RVQ indices) straddle
bytes.
"""

from __future__ import annotations

import torch

#: widest code :func:`pack_bits` takes (unpacked codes wider than 8 bits come back as int32)
MAX_BITS = 16
TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: 1.6 bits per trit


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in [1, {MAX_BITS}], got {bits!r}")


def packed_len(n_codes: int, bits: int) -> int:
    """Bytes that ``n_codes`` codes of ``bits`` bits occupy."""
    _check_bits(bits)
    return -(-n_codes * bits // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes in [0, 2**bits) along the last dim into uint8."""
    n = codes.shape[-1]
    nbytes = packed_len(n, bits)
    if 8 % bits == 0:  # whole codes per byte: one shift per code
        per_byte = 8 // bits
        c = codes.to(torch.uint8)
        pad = nbytes * per_byte - n
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*c.shape[:-1], nbytes, per_byte).to(torch.int32)
        shifts = torch.arange(per_byte, device=c.device, dtype=torch.int32) * bits
        return (c << shifts).sum(-1).to(torch.uint8)
    # codes straddle bytes: spell out the bit stream, then gather it 8 bits a byte
    lanes = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.to(torch.int32).unsqueeze(-1) >> lanes) & 1).flatten(-2)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - n * bits))
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream.reshape(*stream.shape[:-1], nbytes, 8) << weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n_codes`` codes along the last dim, uint8 for
    widths up to 8 bits, int32 beyond."""
    _check_bits(bits)
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
        mask = (1 << bits) - 1
        codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*packed.shape[:-1], -1)[..., :n_codes].to(torch.uint8)
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> weights) & 1).flatten(-2)
    stream = stream[..., :n_codes * bits].reshape(*packed.shape[:-1], n_codes, bits)
    lanes = torch.arange(bits, device=packed.device, dtype=torch.int32)
    codes = (stream << lanes).sum(-1, dtype=torch.int32)
    return codes.to(torch.uint8) if bits <= 8 else codes


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

"""Small Triton helpers shared by the kernels: fp16 fields and packed codes as bytes.

Page fields are addressed byte by byte (a field may start at any even or odd
offset of a page), so fp16 values are assembled from two byte loads.
"""

import triton
import triton.language as tl

#: when set, kernel launches go to ``launch_hook(kernel, grid, args, kwargs)`` instead
#: (compile_check collects them to compile for GPU targets without a GPU)
launch_hook = None


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or the :data:`launch_hook` when one is set."""
    if launch_hook is not None:
        return launch_hook(kernel, grid, args, kwargs)
    return kernel[grid](*args, **kwargs)


#: 1.5 * 2**23: (x + M) - M rounds a float32 |x| < 2**22 to the nearest integer, ties to
#: even, exactly like torch.round (larger |x| keep their sign and stay >= 2**22).
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def load_f16(ptr, idx, mask):
    """float32 values of the fp16 at byte ``ptr + 2 * idx`` (0 where masked)."""
    lo = tl.load(ptr + 2 * idx, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 2 * idx + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def store_f16(ptr, idx, val, mask):
    """Round float32 ``val`` to fp16 (to nearest even, as torch's .half()) and store it
    little-endian at byte ``ptr + 2 * idx``."""
    bits = val.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(ptr + 2 * idx, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 2 * idx + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def load_codes(ptr, e, mask, BITS: tl.constexpr):
    """Code number ``e`` of a little-end-first ``BITS``-bit packed array (bitpack.pack_bits)."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(ptr + e // PER, mask=mask, other=0).to(tl.int32)
    return (byte >> ((e % PER) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def load_code_rows(ptr, r, rmask, C: tl.constexpr, BITS: tl.constexpr):
    """Codes [len(r), C] of rows ``r`` of a row-major ``BITS``-bit packed array whose
    rows fill whole bytes (C a power of two, C * BITS % 8 == 0): one contiguous byte
    load per row, unpacked in registers."""
    PER: tl.constexpr = 8 // BITS
    CB: tl.constexpr = C // PER
    b = tl.load(ptr + r[:, None] * CB + tl.arange(0, CB)[None, :], mask=rmask[:, None],
                other=0).to(tl.int32)
    k = tl.arange(0, PER)
    codes = (b[:, :, None] >> (k[None, None, :] * BITS)) & ((1 << BITS) - 1)
    return tl.reshape(codes, [r.shape[0], C])


@triton.jit
def pow3(k):
    """3**k for k in 0..4 (the digit weights of bitpack.pack_ternary)."""
    return tl.where(k == 0, 1, tl.where(k == 1, 3, tl.where(k == 2, 9, tl.where(k == 3, 27, 81))))


@triton.jit
def load_trits(ptr, e, mask):
    """Trit number ``e`` (-1, 0, +1) of a base-3 array, five per byte (bitpack.pack_ternary)."""
    byte = tl.load(ptr + e // 5, mask=mask, other=121).to(tl.int32)  # 121: five zero trits
    return (byte // pow3(e % 5)) % 3 - 1


@triton.jit
def rint(x):
    """torch.round of float32 values (see ROUND_MAGIC)."""
    return (x + ROUND_MAGIC) - ROUND_MAGIC

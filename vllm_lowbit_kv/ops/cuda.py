"""The CUDA paged decode attention (``csrc/cuda/``), implementation ``cuda``: JIT build, call.

Build step (documented; nothing is compiled at import): the first call of
:func:`load_extension` (or of :func:`packed_attention`) compiles
``csrc/cuda/packed_attention.cu`` (the kernel, plain C interface, no torch
headers) and ``csrc/cuda/bindings.cpp`` (the torch binding) with
``torch.utils.cpp_extension.load`` for sm_80 and sm_90 (``-gencode``; override
with ``LOWBIT_KV_CUDA_ARCHS="80;90"``), into torch's extension cache
(``TORCH_EXTENSIONS_DIR``), about a minute once per machine. It needs a CUDA
build of torch, nvcc and ninja. To build ahead of time::

    python -m vllm_lowbit_kv.ops.cuda

Everything here imports without CUDA (and without vLLM): :func:`supports`
says why the kernel cannot run (not a CUDA device, a page format it does not
read, more than :data:`MAX_GQA` query heads per KV head, no CUDA, a failed
build) so a dispatcher can fall back.

Formats: those of :func:`~vllm_lowbit_kv.ops.page_format.gpu_format_reason`
(kivi2, kivi4, vidkv, vidkv_paper, vidkv_retrieval, vidkv_stp, vidkv_k2v2, vidkv_k15v2 at
head_dim 16-256, powers of two). The kernel takes the format as the int32
fields of ``LowbitPageFormat`` (:func:`format_values`, from the
:class:`~vllm_lowbit_kv.ops.page_format.PageFormat`). Like the Triton kernel,
it skips the reference's +-65504 clamp of decoded VidKV keys (only matters at
the fp16 limit). No store kernel: :data:`store` encodes with the codecs on
the tensors' device.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from ..codecs.base import require
from . import reference
from .page_format import (PageFormat, PageGeometry, attention_outputs, fft_matrix,
                          gpu_format_reason, page_format, rotating)

name = "cuda"
SOURCE_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
SOURCES = ("bindings.cpp", "packed_attention.cu")
EXTENSION = "lowbit_kv_cuda"
MAX_GQA = 16  # LOWBIT_MAX_GQA in packed_attention.cuh
LOG2E = 1.4426950408889634

#: LowbitPageFormat's int32 fields in declaration order (csrc/cuda/packed_attention.cuh)
FORMAT_FIELDS = (
    "T", "D", "H", "N", "sink_bytes", "state_bytes", "key_kind", "key_bits", "n2", "n1", "fft",
    "sign", "k_codes", "k_scale", "k_zero", "k_cmask", "k_scale2", "k_zero2", "k_lo", "k_hi",
    "k_codes2", "k_codes1", "val_kind", "val_bits", "val_group", "n_protect", "v_codes",
    "v_scale", "v_zero", "v_pscale", "v_pzero", "v_alpha", "v_tokmask", "v_pcodes", "v_trits",
)

_lock = threading.Lock()
_module = None
_build_error: str | None = None


def cuda_arch_flags() -> list[str]:
    archs = os.environ.get("LOWBIT_KV_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (x.strip() for x in archs) if a]


def load_extension(verbose: bool = False):
    """Build (once per machine) and import the extension; raises RuntimeError when it cannot."""
    global _module, _build_error
    with _lock:
        if _module is not None:
            return _module
        if _build_error is not None:
            raise RuntimeError(_build_error)
        missing = [s for s in SOURCES if not (SOURCE_DIR / s).exists()]
        try:
            if missing:
                raise FileNotFoundError(f"{missing} not in {SOURCE_DIR} (use a source checkout)")
            if torch.version.cuda is None:
                raise RuntimeError(f"torch {torch.__version__} is not a CUDA build")
            from torch.utils.cpp_extension import load

            _module = load(name=EXTENSION, sources=[str(SOURCE_DIR / s) for s in SOURCES],
                           extra_cflags=["-O3"], extra_cuda_cflags=["-O3", *cuda_arch_flags()],
                           extra_include_paths=[str(SOURCE_DIR)], verbose=verbose)
        except Exception as e:  # no nvcc, compile error: report once, let callers fall back
            _build_error = f"lowbit-kv CUDA kernel unavailable: {type(e).__name__}: {e}"
            raise RuntimeError(_build_error) from e
        require(_module.format_fields == len(FORMAT_FIELDS), "LowbitPageFormat fields",
                f"{len(FORMAT_FIELDS)} (FORMAT_FIELDS)", _module.format_fields)
        return _module


def format_values(fmt: PageFormat) -> list[int]:
    """The LowbitPageFormat fields of a page format, in FORMAT_FIELDS order."""
    sign = fmt.sign
    values = dict(
        T=fmt.T, D=fmt.D, H=fmt.H, N=fmt.groups_per_block, sink_bytes=fmt.sink_bytes,
        state_bytes=fmt.state_bytes, key_kind=fmt.key_kind, key_bits=fmt.key_bits, n2=fmt.n2,
        n1=fmt.n1, fft=int(fmt.fft), sign=int(sign),
        k_codes=fmt.koff("codes"), k_scale=fmt.koff("scale"), k_zero=fmt.koff("zero"),
        k_cmask=fmt.koff("chan_mask"), k_scale2=fmt.koff("scale2"), k_zero2=fmt.koff("zero2"),
        k_lo=fmt.koff("s1" if sign else "lo1"), k_hi=fmt.koff("s1" if sign else "hi1"),
        k_codes2=fmt.koff("codes2"), k_codes1=fmt.koff("codes1"),
        val_kind=fmt.val_kind, val_bits=fmt.val_bits, val_group=fmt.val_group,
        n_protect=fmt.n_protect, v_codes=fmt.voff("codes"), v_scale=fmt.voff("scale"),
        v_zero=fmt.voff("zero"), v_pscale=fmt.voff("prot_scale"), v_pzero=fmt.voff("prot_zero"),
        v_alpha=fmt.voff("alpha"), v_tokmask=fmt.voff("tok_mask"),
        v_pcodes=fmt.voff("prot_codes"), v_trits=fmt.voff("trits"))
    return [int(values[name]) for name in FORMAT_FIELDS]


def limits_reason(fmt: PageFormat, gqa: int) -> str | None:
    """None when the kernel reads ``fmt`` with ``gqa`` query heads per KV head, else why not."""
    reason = gpu_format_reason(fmt)
    if reason is None and gqa > MAX_GQA:
        reason = f"{gqa} query heads per KV head (the kernel takes at most {MAX_GQA})"
    return reason


def supports(fmt: PageFormat, device: torch.device | str, gqa: int) -> str | None:
    """None when the kernel runs ``fmt`` with ``gqa`` query heads per KV head on ``device``,
    else why not (builds the extension on first use)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the CUDA kernel runs on CUDA devices, not {device.type}"
    reason = limits_reason(fmt, gqa)
    if reason:
        return reason
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    try:
        load_extension()
    except RuntimeError as e:
        return str(e)
    return None


#: thread blocks per SM the default split aims at: a block is 128 threads (256 at head_dim
#: > 128); at 4 per SM (the first default) an H200 at 32K context x batch 32 ran 576 blocks
#: of 43 groups each, its SMs a quarter occupied. At 7 resident blocks per SM (32 KB of
#: shared memory, 72 registers) 16 per SM ran 2.29 waves and 32 per SM was ~4% faster.
#: The current kernel (~27 KB, 64 registers at GQA 3 and 4: 8 resident blocks) runs 16
#: per SM as 2 full waves of blocks of about 12 groups at that shape
BLOCKS_PER_SM = 16
#: fewest groups a split reads (each split costs a partial output and the combine)
MIN_GROUPS_PER_SPLIT = 4


def split_plan(max_groups: int, num_splits: int | None, device: torch.device | None = None,
               blocks: int = 1, sms: int | None = None) -> tuple[int, int]:
    """(splits, groups per split) over a group table of ``max_groups`` columns: the requested
    number, or enough for :data:`BLOCKS_PER_SM` thread blocks per SM (``sms``, else the
    device's count, else 1) with at least :data:`MIN_GROUPS_PER_SPLIT` groups per split;
    ``blocks``: thread blocks before splitting (query rows x KV heads)."""
    if not num_splits:
        if sms is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device else 1
        num_splits = max(1, min(-(-BLOCKS_PER_SM * sms // max(blocks, 1)),
                                max_groups // MIN_GROUPS_PER_SPLIT))
    per_split = -(-max_groups // max(1, min(num_splits, max_groups)))
    return -(-max_groups // per_split), per_split


@rotating
def packed_attention(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                     page: PageFormat | PageGeometry, group_table: torch.Tensor,
                     num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float, *,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :mod:`vllm_lowbit_kv.ops`, on a CUDA device (all tensors there)."""
    fmt = page_format(page)
    reason = limits_reason(fmt, query.shape[1] // fmt.H)
    if reason:
        raise ValueError(f"lowbit-kv CUDA kernel: {reason}")
    ext = load_extension()
    n, Hq, D = query.shape
    dev = query.device
    out, lse, nothing = attention_outputs(query, q_start, group_table, out, lse)
    if nothing:
        return out, lse
    max_groups = group_table.shape[1]
    splits, per_split = split_plan(max_groups, num_splits, dev, n * fmt.H)
    empty = torch.empty(0, dtype=torch.float32, device=dev)
    part_out = part_lse = empty
    if splits > 1:
        part_out = torch.empty(splits, n, Hq, D, dtype=torch.float32, device=dev)
        part_lse = torch.empty(splits, n, Hq, dtype=torch.float32, device=dev)
    fft = fft_matrix("inverse_t", fmt.n1, fmt.n1, dev) if fmt.fft else empty
    ext.packed_attention(
        query.float(), q_start.to(dev, torch.int64), fmt.flat_pages(pages),
        group_table.to(dev, torch.int32), num_groups.to(dev, torch.int32),
        skip_tokens.to(dev, torch.int32), fft, out, lse, part_out, part_lse,
        format_values(fmt), per_split, splits, float(scale) * LOG2E)
    return out, lse


attention = packed_attention
#: no store kernel: the codecs encode on the tensors' device
store = reference.store


if __name__ == "__main__":
    load_extension(verbose=True)
    print(f"built {EXTENSION} for {cuda_arch_flags()}")

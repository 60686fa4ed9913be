"""The C++ CPU kernel (``csrc/cpu/packed_attention.cpp``), implementation ``cpp``.

The source is compiled on first use with ``torch.utils.cpp_extension.load``
(ninja, gcc, ``-O3 -march=native -fopenmp``) into a build folder under the
project cache (:func:`vllm_lowbit_kv.paths.extension_build_root`, one folder
per hash of the source, the flags, torch's version and the CPU), so later
processes only load the library (about a second); it registers
``torch.ops.lowbit_kv.packed_attention`` (``TORCH_LIBRARY_FRAGMENT``). When the
build cannot run (no compiler, no source tree), :func:`supports` says why and
the dispatcher (:mod:`vllm_lowbit_kv.ops`) uses another implementation.

Page formats the kernel reads (:func:`format_reason`): keys
:class:`~vllm_lowbit_kv.codecs.kivi.KiviCodec` per channel (2, 4, 8 bits) or
:class:`~vllm_lowbit_kv.codecs.vidkv.VidKVKeyCodec` (any k, FFT or not, any
``one_bit``, with or without STP); values ``KiviCodec`` per token or per channel
or :class:`~vllm_lowbit_kv.codecs.vidkv.TernaryValueCodec` (with or without
STP); RVQ keys and values (:mod:`~vllm_lowbit_kv.codecs.rvq`, any K, C up to
2^16, either grouping; the layer's codebooks travel with the call); head_dim a
multiple of 16; any number of query heads per KV head. That covers ``vidkv``,
``vidkv_paper``, ``vidkv_retrieval``, ``vidkv_stp``, ``vidkv_visual``, ``kivi2``, ``kivi4``,
``vidkv_k2v2``, ``vidkv_k15v2`` and the ``rvq*`` schemes. The kernel's arguments are
derived from the :class:`~vllm_lowbit_kv.ops.page_format.PageFormat`
(:class:`Descriptors`). The ISA is the build machine's (``-march=native``, one build
folder per CPU): key columns of low-bit codes are read through lookup tables (T-MAC
style; AVX-512: per nibble of 1-/2-bit codes, AVX2: per pair of 1-bit codes;
``csrc/cpu/code_columns.h``), ternary and KIVI value codes decoded in registers
(``csrc/cpu/value_sums.h``); with AVX-512 VBMI byte-aligned key code rows are
transposed by byte permutes, and with VNNI too consecutive value rows of trits or of 2- and
4-bit codes (head_dim 64 or 128) are summed two at a time as 16-bit integer products: the
probabilities in 32767 steps of their group's largest, so the output is within
T max|code value| / 65534 of float32's (``tests/test_cpu_kernel.py``,
``fixed_point_out_tol``). Builds without VBMI (``LOWBIT_KV_CPU_MARCH=skylake-avx512``),
without AVX-512 (``x86-64-v3``) and without AVX2 (``x86-64-v2``: the portable paths,
scalar conversions) are checked by tests on machines that can run them. One known
difference from the reference codecs: they clamp decoded VidKV/ternary elements to
+-65504, the kernel (which never rebuilds keys) does not; it only matters for K/V
magnitudes near the fp16 limit. :func:`store` encodes with ``csrc/cpu/encode_states.cpp``
(:func:`encode_states`) where it can, else with the codecs.

Work items with many query vectors (a prefill chunk) decode each group once into tiles
and multiply them (``csrc/cpu/micro_gemm.h``: float32, or bf16 pairs for bf16 queries where
the build has AVX-512 BF16, as AMX tile multiplies where it has AMX). The library also
holds :func:`dense_attention` (``csrc/cpu/dense_attention.cpp``): attention over bf16 or
float32 K/V by the same matrix products, which the exact part of a prefill chunk takes
(:mod:`vllm_lowbit_kv.paged.attention`; the engines' float32 parity checks keep torch's
attention, ``reference_arithmetic``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..codecs.base import require_fp16_range
from ..codecs.rvq import joint_codewords
from ..paths import extension_build_root
from . import reference
from .page_format import (KEY_KIVI_CHANNEL, KEY_RVQ, KEY_VIDKV, VAL_KIVI_CHANNEL,
                          VAL_KIVI_TOKEN, VAL_RVQ, VAL_TERNARY, PageFormat, PageGeometry,
                          attention_outputs, fft_matrix, kernel_codec_reason, page_format)

logger = logging.getLogger("vllm.lowbit_kv.ops")

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cpu" / "packed_attention.cpp"
#: dense attention for prefill chunks' exact part (:func:`dense_attention`)
DENSE_SOURCE = SOURCE.with_name("dense_attention.cpp")
#: the codecs' encoders for the serving path's writes (:func:`encode_states`)
ENCODE_SOURCE = SOURCE.with_name("encode_states.cpp")
#: decode rows' exact part, read where it lives (:func:`exact_decode_attention`)
EXACT_DECODE_SOURCE = SOURCE.with_name("exact_decode.cpp")
#: the copies of a step's writes (:func:`stage_rows`, :func:`write_states`)
STAGING_SOURCE = SOURCE.with_name("staging.cpp")
#: the packed and exact parts merged into the layer's output (:func:`merge_attention_into`)
MERGE_SOURCE = SOURCE.with_name("merge.cpp")
SOURCES = (SOURCE, DENSE_SOURCE, ENCODE_SOURCE, EXACT_DECODE_SOURCE, STAGING_SOURCE,
           MERGE_SOURCE)
#: what the sources include (part of the build folder's hash, as the sources are)
HEADERS = tuple(SOURCE.with_name(h) for h in ("vectors.h", "micro_gemm.h", "amx.h", "descriptors.h",
                                              "dtypes.h", "code_columns.h", "value_sums.h"))
#: target ISA: the build machine's own unless LOWBIT_KV_CPU_MARCH names another (the
#: tests build AVX2-only and AVX-512-without-VBMI variants this way to run the other paths)
MARCH = os.environ.get("LOWBIT_KV_CPU_MARCH", "native")
CFLAGS = ("-O3", f"-march={MARCH}", "-fopenmp")
LDFLAGS = ("-fopenmp",)
LIBRARY = "lowbit_kv_cpu"  # the library; its ops are torch.ops.lowbit_kv.*

name = "cpp"
LANES = 16  # floats per vector in the widest build (AVX-512): head_dim must be a multiple
#: what dense_attention takes
DENSE_DTYPES = (torch.bfloat16, torch.float32)

#: an absent optional tensor argument of the kernels (made once: a call per layer and step
#: costs about a microsecond each). The dtypes are explicit: vLLM imports this module under
#: its model-dtype default (bfloat16 in a bf16 server), and the kernels take float32 tables.
_NONE = torch.empty(0, dtype=torch.float32, device="cpu")
_NO_INTS = torch.empty(0, dtype=torch.int32, device="cpu")
_build_lock = threading.Lock()
_build_error: str | None = None
_built = False


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def build_directory() -> Path:
    key = hashlib.sha256("\n".join([
        *(s.read_text() if s.exists() else "" for s in SOURCES + HEADERS),
        " ".join(CFLAGS + LDFLAGS),
        torch.__version__, sys.version, _cpu_signature()]).encode()).hexdigest()[:16]
    return extension_build_root() / f"{LIBRARY}-{key}"


def _ensure_ninja_on_path() -> None:
    # the venv's ninja (a dependency) is not on PATH when .venv/bin/python runs directly
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent),
                                              os.environ.get("PATH", "")])


def load_library() -> str | None:
    """Build (once per machine) and load the kernel; None when it is ready, else why not."""
    global _build_error, _built
    with _build_lock:
        if _built or _build_error is not None:
            return _build_error
        missing = [str(s) for s in SOURCES + HEADERS if not s.exists()]
        if missing:
            _build_error = f"kernel source {missing[0]} not found (install from the source tree)"
            return _build_error
        try:
            from torch.utils import cpp_extension

            _ensure_ninja_on_path()
            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            logger.info("lowbit-kv: loading the C++ CPU kernel (building it first if %s is "
                        "empty, about a minute)", directory)
            cpp_extension.load(name=LIBRARY, sources=[str(s) for s in SOURCES],
                               extra_cflags=list(CFLAGS),
                               extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                               is_python_module=False, verbose=False)
            _built = True
        except Exception as e:  # compiler missing, build error: report, never crash
            _build_error = f"C++ CPU kernel build failed: {type(e).__name__}: {e}"
            logger.warning("lowbit-kv: %s; using another packed-attention implementation",
                           _build_error.splitlines()[0])
        return _build_error


@dataclass(frozen=True)
class Descriptors:
    """A page format as the kernel's integer arguments (csrc/cpu/packed_attention.cpp:
    enums Geometry, KiviKey, VidKey, KiviTokVal, KiviChanVal, TernVal); value offsets
    count from the value bytes."""

    geometry: list[int]
    key: list[int]
    value: list[int]
    fft_map: torch.Tensor  # float32 [n1, n1] (A transposed, A: components -> channels), or empty
    codebooks: torch.Tensor  # float32: RVQ keys' codebooks then values' (the layer's), or empty
    key_columns: torch.Tensor  # float32: RVQ keys' codebooks transposed [K, d^, C] (in search)
    search: torch.Tensor  # float32: the encoder's tables of those codebooks (_search_tables)
    search_pairs: torch.Tensor  # int32: their bf16 pairs (_search_tables)


def _rvq(kind: int, codec, offset) -> list[int]:
    """RVQ descriptor: kind, K, C, index bits, d^, strided, codes, std (enum Rvq)."""
    return [kind, codec.num_codebooks, codec.codebook_size, codec.index_bits, codec.group_size,
            int(codec.grouping == "strided"), offset("codes"), offset("std")]


def _search_tables(codec) -> tuple[torch.Tensor, torch.Tensor]:
    """An RVQ codec's codebooks [K, C, d] as the encoder's search reads them
    (csrc/cpu/encode_states.cpp, RvqBooks): float32 codes transposed [K, d, C], ||c||^2
    [K, C] (as the codec computes them); the bf16 pass's error bound terms, with
    c' = bf16(c): ||c|| + ||c' - c|| and 2 ||c' - c|| [K, C] and each stage's largest of
    both [K, 2], rounded up; and, where d is a multiple of 16 up to 128, the words of bf16
    pairs [K, C, d / 2]: (c'_2j, c'_2j+1), rounded to nearest even, low half first (else
    none)."""
    books = codec.codewords
    norms = (books * books).sum(-1)
    cols = books.transpose(1, 2).contiguous()
    exact = books.double()
    rounding = (books.to(torch.bfloat16).double() - exact).norm(dim=-1)
    spread, twice_rounding = exact.norm(dim=-1) + rounding, 2 * rounding
    largest = torch.stack([spread.amax(1), twice_rounding.amax(1)], 1)
    bounds = [_float32_up(t).reshape(-1) for t in (spread, twice_rounding, largest)]
    floats = torch.cat([cols.reshape(-1), norms.reshape(-1), *bounds])
    d = codec.group_size
    if d % LANES or d > 128:
        return floats, _NO_INTS
    half = books.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return floats, (half[..., 0::2] | (half[..., 1::2] << 16)).reshape(-1)


def rvq_table_bytes(fmt: PageFormat) -> int:
    """Bytes this kernel keeps for one layer of an RVQ ``fmt`` beside the pages and the
    codecs' own codebooks (which it reads as they are): the encoder's search tables
    (:func:`_search_tables`); 0 for formats without RVQ."""
    if fmt.key_kind != KEY_RVQ and fmt.val_kind != VAL_RVQ:
        return 0
    desc = _descriptors(fmt)
    return sum(t.numel() * t.element_size() for t in (desc.search, desc.search_pairs))


def _float32_up(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the float32 at or above each element."""
    y = x.float()
    up = torch.nextafter(y, torch.tensor(float("inf"), device=x.device))
    return torch.where(y.double() < x, up, y)


def _descriptors(fmt: PageFormat) -> Descriptors:
    k = fmt.koff
    v = lambda f: fmt.voff(f) - fmt.k_bytes if f in fmt.val_off else -1  # noqa: E731
    if fmt.key_kind == KEY_RVQ:
        key = _rvq(KEY_RVQ, fmt.key_codec, k)
    elif fmt.key_kind == KEY_KIVI_CHANNEL:
        key = [KEY_KIVI_CHANNEL, fmt.key_bits, k("codes"), k("scale"), k("zero")]
    else:
        lo, hi = ("s1", "s1") if fmt.sign else ("lo1", "hi1")
        key = [KEY_VIDKV, fmt.n2, fmt.n1, fmt.key_protect, int(fmt.sign), k("prot_scale"),
               k("prot_zero"), k("tok_mask"), k("prot_codes"), k("chan_mask"), k("scale2"),
               k("zero2"), k("codes2"), k("codes1"), k(lo), k(hi)]
    if fmt.val_kind == VAL_RVQ:
        value = _rvq(VAL_RVQ, fmt.value_codec, v)
    elif fmt.val_kind == VAL_KIVI_TOKEN:
        value = [VAL_KIVI_TOKEN, fmt.val_bits, fmt.val_group, v("codes"), v("scale"), v("zero")]
    elif fmt.val_kind == VAL_KIVI_CHANNEL:
        value = [VAL_KIVI_CHANNEL, fmt.val_bits, v("codes"), v("scale"), v("zero")]
    else:
        value = [VAL_TERNARY, fmt.n_protect, v("prot_scale"), v("prot_zero"), v("tok_mask"),
                 v("prot_codes"), v("alpha"), v("trits")]
    fft = fft_matrix("inverse_t", fmt.n1, fmt.n1, "cpu") if fmt.fft else _NONE
    geometry = [fmt.T, fmt.D, fmt.H, fmt.groups_per_block, fmt.sink_bytes, fmt.state_bytes,
                fmt.k_bytes]
    # the layer's RVQ codebooks, keys' then values' (values alone: retrieval heads' keys-only)
    rvq = [c for c, kind in ((fmt.key_codec, fmt.key_kind == KEY_RVQ),
                             (fmt.value_codec, fmt.val_kind == VAL_RVQ)) if kind]
    codebooks = (joint_codewords(*rvq) if len(rvq) == 2 else
                 rvq[0].codewords.reshape(-1) if rvq else _NONE)
    tables = [_search_tables(c) for c in rvq]
    search = torch.cat([t[0] for t in tables]) if tables else _NONE
    pairs = torch.cat([t[1] for t in tables]) if tables else _NO_INTS
    # the kernel's key tables read the keys' codebooks transposed: their search tables' head
    key_columns = search[:fmt.key_codec.codewords.numel()] if fmt.key_kind == KEY_RVQ else _NONE
    return Descriptors(geometry, key, value, fft, codebooks, key_columns, search, pairs)


_descriptor_cache: "weakref.WeakKeyDictionary[PageFormat, Descriptors]" = \
    weakref.WeakKeyDictionary()


def format_reason(fmt: PageFormat) -> str | None:
    """None when the kernel reads pages of this format, else why not."""
    if fmt.D % LANES:
        return f"head_dim {fmt.D} (the kernel needs a multiple of {LANES})"
    return kernel_codec_reason(fmt, vidkv_key_stp=True, rvq=True)


def supports(fmt: PageFormat, device: torch.device | str, gqa: int) -> str | None:
    """None when the kernel runs ``fmt`` on ``device`` (any GQA ratio), else why not;
    builds the kernel on first use."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the C++ kernel runs on the CPU, not {device.type}"
    return format_reason(fmt) or load_library()


def _descriptors_of(fmt: PageFormat) -> Descriptors:
    """``fmt``'s kernel arguments; a format's first call checks that the kernel reads it
    (ValueError otherwise) and builds the kernel (RuntimeError where it cannot)."""
    desc = _descriptor_cache.get(fmt)
    if desc is None:
        reason = format_reason(fmt)
        if reason:
            raise ValueError(f"lowbit-kv C++ kernel: unsupported page format: {reason}")
        reason = load_library()
        if reason:
            raise RuntimeError(reason)
        desc = _descriptor_cache[fmt] = _descriptors(fmt)
    return desc


def packed_attention(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor,
                     page: PageFormat | PageGeometry, group_table: torch.Tensor,
                     num_groups: torch.Tensor, skip_tokens: torch.Tensor, scale: float, *,
                     out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                     rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :mod:`vllm_lowbit_kv.ops`; ``out``/``lse`` may be given (float32,
    contiguous) to be overwritten. The kernel applies ``rotation`` itself: to each query
    vector as it loads it, to each output row as it writes it."""
    fmt = page_format(page)
    desc = _descriptors_of(fmt)
    out, lse, nothing = attention_outputs(query, q_start, group_table, out, lse)
    if nothing:
        return out, lse
    if query.stride(-1) != 1:
        query = query.contiguous()
    torch.ops.lowbit_kv.packed_attention(
        query, _int64(q_start), fmt.flat_pages(pages), _int64(group_table),
        _int64(num_groups), _int64(skip_tokens), float(scale),
        desc.geometry, desc.key, desc.value, desc.fft_map, desc.codebooks, desc.key_columns,
        _NONE if rotation is None else _rotation_pair(rotation), out, lse)
    return out, lse


def decode_groups(pages: torch.Tensor, page: PageFormat | PageGeometry, gids: torch.Tensor,
                  skip: int, key_out: torch.Tensor, value_out: torch.Tensor) -> None:
    """Tokens ``[skip, G T)`` of the packed groups ``gids`` [G] (token order) decoded into
    ``key_out`` and ``value_out`` [G T - skip, H, D] (float32, bfloat16 or float16, unit
    stride in the last dim; slices of larger buffers are fine), in the pages' space: a
    prefill chunk's packed context as dense rows, by the kernel's tile-path arithmetic."""
    fmt = page_format(page)
    desc = _descriptors_of(fmt)
    torch.ops.lowbit_kv.decode_groups(
        fmt.flat_pages(pages), _int64(gids), int(skip), desc.geometry, desc.key, desc.value,
        desc.fft_map, desc.codebooks, desc.key_columns, key_out, value_out)


def _int64(t) -> torch.Tensor:
    """An index argument as the kernel takes it, int64 contiguous (the backend's already are:
    then no conversion, which costs a microsecond a call)."""
    if isinstance(t, torch.Tensor) and t.dtype == torch.long and t.is_contiguous():
        return t
    return torch.as_tensor(t).to(torch.long).contiguous()


#: id(M) -> (M, M's version, [M, Mᵀ]): a layer's M is the same tensor at every step
_rotation_pairs: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}


def _rotation_pair(rotation: torch.Tensor) -> torch.Tensor:
    """``[M, Mᵀ]`` float32 contiguous [2, D, D], the kernel's form of the rotation (the
    query times M, the output times Mᵀ, each a product with contiguous columns), made
    once per rotation tensor and reused while the tensor is unchanged: its version
    counter says so, except for a tensor made under ``torch.inference_mode`` (vLLM's
    forward), which has none and is taken as it was first seen (rotation.py builds a
    layer's M once and never writes it again)."""
    version = -1 if rotation.is_inference() else rotation._version
    hit = _rotation_pairs.get(id(rotation))
    if hit is not None and hit[0] is rotation and hit[1] == version:
        return hit[2]
    if len(_rotation_pairs) >= 1024:  # one per layer in serving; tests make many
        _rotation_pairs.clear()
    m = rotation.detach().float()
    pair = torch.stack((m, m.T)).contiguous()
    _rotation_pairs[id(rotation)] = (rotation, version, pair)
    return pair


def dense_runs(query: torch.Tensor) -> bool:
    """Whether :func:`dense_attention` runs for ``query`` (and K, V of its dtype): the kernel
    library loaded, the CPU, a :data:`DENSE_DTYPES` dtype and a head_dim it takes."""
    return (_built and query.device.type == "cpu" and query.dtype in DENSE_DTYPES
            and not query.shape[-1] % LANES)


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    causal: bool, out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of query [n, Hq, D] over key, value [S, H, D], all bfloat16 or all float32
    on the CPU (causal: row i sees keys j <= i + S - n), by the C++ kernel
    (``csrc/cpu/dense_attention.cpp``: bf16 products with float32 sums where the CPU has
    AVX-512 BF16, else float32): out [n, Hq, D] and lse [n, Hq] float32, written into
    ``out`` (float32, bfloat16 or float16, unit stride in the last dim) and ``lse``
    (contiguous) where given. None where it does not run: other dtypes
    (:data:`DENSE_DTYPES`) or devices, a head_dim it does not take, or the kernel library
    not loaded (this never builds it)."""
    if not dense_runs(query) or not query.dtype == key.dtype == value.dtype:
        return None
    n, Hq, D = query.shape
    if out is None:
        out = query.new_empty(n, Hq, D, dtype=torch.float32)
    if lse is None:
        lse = query.new_empty(n, Hq, dtype=torch.float32)
    torch.ops.lowbit_kv.dense_attention(query, key, value, causal, key.shape[0] - n, float(scale),
                                        out, lse)
    return out, lse


def exact_decode_attention(query: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor,
                           sink_kv: torch.Tensor | None, sink_blocks: torch.Tensor, sinks: int,
                           staged_k, staged_v, tail_slots: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, scale: float, out: torch.Tensor,
                           lse: torch.Tensor) -> bool:
    """Decode rows over their exact keys where they live (``csrc/cpu/exact_decode.cpp``):
    request b's row ``rows[b]`` of query [n, Hq, D] over its ``sinks`` sink tokens (the
    sink area ``sink_kv`` [num_blocks, 2, sink_tokens, H, D] of block ``sink_blocks[b]``),
    the staged run in ``tail_slots[b]`` (``staged_k``/``staged_v``: :class:`StagedTokens`)
    and its fresh token (key, value [n, H, D] at that row); position e of request b
    counts where ``bias[b, e]`` [B, E] is finite. Writes those rows of ``out`` [n, Hq, D]
    and ``lse`` [n, Hq] (float32 contiguous) and says True; False where it does not run
    (another device, a head_dim it does not take, the library not loaded: this never
    builds it)."""
    if not _built or query.device.type != "cpu" or query.shape[-1] % LANES:
        return False
    if not (bias.dim() == 2 and bias.dtype == torch.float32 and bias.is_contiguous()):
        bias = bias.reshape(bias.shape[0], -1).float().contiguous()
    torch.ops.lowbit_kv.exact_decode_attention(
        query, _int64(rows), bias, _NONE if sink_kv is None else sink_kv, _int64(sink_blocks),
        int(sinks), staged_k.data, _NONE if staged_k.scale is None else staged_k.scale,
        staged_v.data, _NONE if staged_v.scale is None else staged_v.scale, _int64(tail_slots),
        key, value, float(scale), out, lse)
    return True


def merge_attention_into(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                         lse_b: torch.Tensor, dst: torch.Tensor) -> bool:
    """:func:`~.reference.merge_attention` of the two parts written into ``dst`` [n, Hq, D]
    (a float dtype, unit stride in the last dim) in its dtype (``csrc/cpu/merge.cpp``). True
    where it ran; False where it does not run (another device, the library not loaded: this
    never builds it)."""
    if not _built or dst.device.type != "cpu":
        return False
    torch.ops.lowbit_kv.merge_attention_into(out_a, lse_a, out_b, lse_b, dst)
    return True


def stage_rows(x: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, off: torch.Tensor,
               data: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Rows ``rows`` of x [n, H, D] into staging ``data`` [slots, T, H, D] at (``slot``,
    ``off``) (``csrc/cpu/staging.cpp``): in data's dtype, or, with ``scale`` [slots, T, H,
    1], as int8 codes and scales equal to :func:`~vllm_lowbit_kv.codecs.quant.absmax_int8`'s
    for finite rows. True where it ran; False where it does not run (another device, the
    library not loaded: this never builds it)."""
    if not _built or x.device.type != "cpu" or data.device.type != "cpu":
        return False
    torch.ops.lowbit_kv.stage_rows(x, _int64(rows), _int64(slot), _int64(off), data,
                                   _NONE if scale is None else scale)
    return True


def read_staged(data: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
                n: int) -> torch.Tensor | None:
    """The first ``n`` tokens of each run of staging slots ``slots`` [..., S] (slot after
    slot) of ``data`` [slots, T, H, D] as float32 [..., n, H, D]: int8 codes times their
    ``scale`` [slots, T, H, 1], or the model dtype widened (``csrc/cpu/staging.cpp``).
    None where it does not run (another device, the library not loaded: this never
    builds it)."""
    if not _built or data.device.type != "cpu":
        return None
    lead = slots.shape[:-1]
    flat = _int64(slots.reshape(-1, slots.shape[-1]))
    out = torch.empty(flat.shape[0], n, *data.shape[2:], dtype=torch.float32, device=data.device)
    torch.ops.lowbit_kv.read_staged(
        data, _NONE if scale is None else scale, flat, out)
    return out.view(*lead, n, *data.shape[2:])


def write_states(fmt: PageFormat, pages: torch.Tensor, gids: torch.Tensor,
                 states: torch.Tensor) -> bool:
    """``fmt.write_states(pages, gids, states)`` (states [E, H, state_bytes] of the groups
    ``gids``) by ``csrc/cpu/staging.cpp``, a copy per group and head: True. Where it does
    not run (another device, the library not loaded: this never builds it) by
    ``fmt.write_states`` itself: False."""
    if not _built or pages.device.type != "cpu" or states.device.type != "cpu":
        fmt.write_states(pages, gids, states)
        return False
    torch.ops.lowbit_kv.write_states(states.contiguous(), _int64(gids), fmt.groups_per_block,
                                     fmt.sink_bytes, fmt.flat_pages(pages))
    return True


def encode_reason(fmt: PageFormat) -> str | None:
    """None when :func:`encode_states` writes ``fmt``'s group states, else why not."""
    if fmt.key_kind not in (KEY_KIVI_CHANNEL, KEY_VIDKV, KEY_RVQ) or fmt.key_protect:
        return f"keys {type(fmt.key_codec).__name__} (the encoder: KIVI per channel, VidKV " \
               "without STP, RVQ)"
    if fmt.val_kind not in (VAL_KIVI_TOKEN, VAL_KIVI_CHANNEL, VAL_TERNARY, VAL_RVQ) or \
            fmt.n_protect:
        return f"values {type(fmt.value_codec).__name__} (the encoder: KIVI, ternary " \
               "without STP, RVQ)"
    for codec in (fmt.key_codec, fmt.value_codec):
        if getattr(codec, "codebook_size", LANES) % LANES:
            return f"{type(codec).__name__} codebook_size {codec.codebook_size} (the " \
                   f"encoder: a multiple of {LANES})"
    return None


def encode_states(fmt: PageFormat, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """K, V [E, T, H, D] (codec space; float32, bf16 or fp16, read as they are: a step's
    rows need no copy) -> states [E, H, state_bytes], what
    ``fmt.encode(k, v)`` returns, by ``csrc/cpu/encode_states.cpp``: the codecs' arithmetic
    in one pass per group (bit-identical except codes within float32 rounding of a
    threshold and fp16 levels within one step, where the codecs' sums over tokens or their
    FFT round otherwise). None where it does not run: another device, a format it does not
    write (:func:`encode_reason`: STP needs the relevance), or the library not loaded (this
    never builds it). RVQ: the same greedy search (Algorithm 1), its float32 nearest code
    (with AVX-512 BF16 found by a bf16 first pass and float32 distances of the codes within
    its error bound), so an index may differ from the codecs' only where two codes'
    distances tie within float32 rounding."""
    if not _built or k.device.type != "cpu" or encode_reason(fmt):
        return None
    if not (k.dtype == v.dtype and k.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and k.stride(-1) == v.stride(-1) == 1):
        k, v = k.float().contiguous(), v.float().contiguous()
    desc = _descriptor_cache.get(fmt)
    if desc is None:
        desc = _descriptor_cache[fmt] = _descriptors(fmt)
    fft = fft_matrix("forward", fmt.n1, fmt.n1, "cpu") if fmt.fft else _NONE
    gamma = getattr(fmt.value_codec, "gamma", 0.0)
    states = torch.empty(k.shape[0], fmt.H, fmt.state_bytes, dtype=torch.uint8, device="cpu")
    if not torch.ops.lowbit_kv.encode_states(k, v, desc.geometry, desc.key, desc.value,
                                             fmt.one_bit, gamma, fft, desc.codebooks,
                                             desc.search, desc.search_pairs, states):
        require_fp16_range(k)  # an element the fp16 metadata cannot hold: the codecs' error
        require_fp16_range(v)
    return states


def store(k: torch.Tensor, v: torch.Tensor, gids: torch.Tensor, pages: torch.Tensor,
          page: PageFormat | PageGeometry, relevance: torch.Tensor | None = None) -> None:
    """The contract's store: :func:`encode_states` where it runs, else the codecs
    (:func:`vllm_lowbit_kv.ops.reference.store`)."""
    fmt = page_format(page)
    states = encode_states(fmt, k, v)
    if states is None:
        reference.store(k, v, gids, pages, page, relevance)
    else:
        write_states(fmt, pages, gids, states)


attention = packed_attention

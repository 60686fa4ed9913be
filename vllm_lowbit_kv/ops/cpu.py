"""The C++ CPU kernel (``csrc/cpu/packed_attention.cpp``): build, page formats, call.

The source is compiled on first use with ``torch.utils.cpp_extension.load``
(ninja, gcc, ``-O3 -march=native -fopenmp``) into a build folder under the
project cache (``~/.cache/vllm-lowbit-kv/torch_extensions/<hash>``, the hash
covering the source, the flags, torch's version and the CPU), so later
processes only load the library (about a second); it registers
``torch.ops.lowbit_kv_cpu.packed_attention``. When the build cannot run (no
compiler, no source tree), :func:`unsupported_reason` says why and the
dispatcher (:mod:`vllm_lowbit_kv.ops`) uses another implementation.

Page formats the kernel reads, decided once per layout (:func:`kernel_format`):
keys :class:`~vllm_lowbit_kv.codecs.kivi.KiviCodec` per channel (2, 4, 8 bits)
or :class:`~vllm_lowbit_kv.codecs.vidkv.VidKVKeyCodec` (any k, FFT or not, any
``one_bit``, with or without STP); values ``KiviCodec`` per token or per channel
or :class:`~vllm_lowbit_kv.codecs.vidkv.TernaryValueCodec` (with or without
STP). That covers ``vidkv``, ``vidkv_stp``, ``kivi2``, ``kivi4``,
``vidkv_k2v2`` and ``vidkv_k15v2``. One known difference from the reference
codecs: they clamp decoded VidKV/ternary elements to +-65504, the kernel
(which never rebuilds keys) does not; it only matters for K/V magnitudes
near the fp16 limit.
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

from ..codecs.kivi import KiviCodec
from ..codecs.vidkv import TernaryValueCodec, VidKVKeyCodec, irfft_unique
from ..model import cache_root
from .page_format import attention_outputs

logger = logging.getLogger("vllm.lowbit_kv.ops")

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "packed_attention.cpp"
#: target ISA: the build machine's own unless LOWBIT_KV_CPU_MARCH names another (the
#: tests build an AVX2-only variant this way to run the portable code paths)
MARCH = os.environ.get("LOWBIT_KV_CPU_MARCH", "native")
CFLAGS = ("-O3", f"-march={MARCH}", "-fopenmp")
LDFLAGS = ("-fopenmp",)
LIBRARY = "lowbit_kv_cpu"

# codec kinds of the descriptors (csrc/cpu/packed_attention.cpp: KeyKind, ValueKind)
KEY_KIVI_CHANNEL, KEY_VIDKV = 0, 1
VAL_KIVI_TOKEN, VAL_KIVI_CHANNEL, VAL_TERNARY = 0, 1, 2
LANES = 16  # floats per vector in the kernel: head_dim must be a multiple

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
        SOURCE.read_text() if SOURCE.exists() else "", " ".join(CFLAGS + LDFLAGS),
        torch.__version__, sys.version, _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_root() / "torch_extensions" / f"{LIBRARY}-{key}"


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
        if not SOURCE.exists():
            _build_error = f"kernel source {SOURCE} not found (install from the source tree)"
            return _build_error
        try:
            from torch.utils import cpp_extension

            _ensure_ninja_on_path()
            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            logger.info("lowbit-kv: loading the C++ CPU kernel (building it first if %s is "
                        "empty, about a minute)", directory)
            cpp_extension.load(name=LIBRARY, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                               extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                               is_python_module=False, verbose=False)
            _built = True
        except Exception as e:  # compiler missing, build error: report, never crash
            _build_error = f"C++ CPU kernel build failed: {type(e).__name__}: {e}"
            logger.warning("lowbit-kv: %s; using another packed-attention implementation",
                           _build_error.splitlines()[0])
        return _build_error


@dataclass(frozen=True)
class KernelFormat:
    """A layout as the kernel reads it: geometry and per-codec byte offsets."""

    geometry: list[int]
    key: list[int]
    value: list[int]
    fft_map: torch.Tensor  # float32 [n1, n1] (rfft unique parts -> channels), or empty


def _offsets(codec) -> dict[str, int]:
    out, at = {}, 0
    for name, n in codec.layout().fields:
        out[name] = at
        at += n
    return out


def _key_descriptor(kc) -> list[int] | str:
    off = _offsets(kc)
    if type(kc) is KiviCodec and kc.axis == "channel":
        return [KEY_KIVI_CHANNEL, kc.bits, off["codes"], off["scale"], off["zero"]]
    if type(kc) is VidKVKeyCodec:
        sign = kc.one_bit == "sign"
        return [KEY_VIDKV, kc.n2, kc.n1, kc.n_protect, int(sign),
                off.get("prot_scale", -1), off.get("prot_zero", -1), off.get("tok_mask", -1),
                off.get("prot_codes", -1), off["chan_mask"], off["scale2"], off["zero2"],
                off["codes2"], off["codes1"], off["s1" if sign else "lo1"],
                off["s1" if sign else "hi1"]]
    return f"key codec {kc.describe()} (the kernel reads KIVI per-channel and VidKV keys)"


def _value_descriptor(vc) -> list[int] | str:
    off = _offsets(vc)
    if type(vc) is KiviCodec and vc.axis == "token":
        return [VAL_KIVI_TOKEN, vc.bits, vc.group_size, off["codes"], off["scale"], off["zero"]]
    if type(vc) is KiviCodec and vc.axis == "channel":
        return [VAL_KIVI_CHANNEL, vc.bits, off["codes"], off["scale"], off["zero"]]
    if type(vc) is TernaryValueCodec:
        return [VAL_TERNARY, vc.n_protect, off.get("prot_scale", -1), off.get("prot_zero", -1),
                off.get("tok_mask", -1), off.get("prot_codes", -1), off["alpha"], off["trits"]]
    return (f"value codec {vc.describe()} (the kernel reads KIVI per-token / per-channel and "
            "ternary values)")


_formats: "weakref.WeakKeyDictionary[object, KernelFormat | str]" = weakref.WeakKeyDictionary()


def kernel_format(layout) -> KernelFormat | str:
    """The layout's descriptors, or why the kernel cannot read it (cached per layout)."""
    fmt = _formats.get(layout)
    if fmt is None:
        key, value = _key_descriptor(layout.key_codec), _value_descriptor(layout.value_codec)
        if layout.D % LANES:
            fmt = f"head_dim {layout.D} (the kernel needs a multiple of {LANES})"
        elif isinstance(key, str) or isinstance(value, str):
            fmt = "; ".join(x for x in (key, value) if isinstance(x, str))
        else:
            kc = layout.key_codec
            fft = torch.empty(0)
            if type(kc) is VidKVKeyCodec and kc.fft_active:
                # A: row j = the channels rebuilt from unit component j (x = z @ A); the
                # kernel reads A's columns, so it gets A transposed
                eye = torch.eye(kc.n1, dtype=torch.float64)
                fft = irfft_unique(eye, kc.n1).T.float().contiguous()
            fmt = KernelFormat(
                [layout.T, layout.D, layout.H, layout.groups_per_block, layout.sink_bytes,
                 layout.state_bytes, layout.k_bytes], key, value, fft)
        _formats[layout] = fmt
    return fmt


def unsupported_reason(layout, device: torch.device) -> str | None:
    if torch.device(device).type != "cpu":
        return f"the C++ kernel runs on the CPU, not {device}"
    fmt = kernel_format(layout)
    if isinstance(fmt, str):
        return fmt
    return load_library()


def packed_attention(query: torch.Tensor, q_start: torch.Tensor, pages: torch.Tensor, layout,
                     group_table: torch.Tensor, num_groups: torch.Tensor,
                     skip_tokens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of :mod:`vllm_lowbit_kv.ops`; ``out``/``lse`` may be given (float32,
    contiguous) to be overwritten."""
    fmt = kernel_format(layout)
    if isinstance(fmt, str):
        raise ValueError(f"lowbit-kv C++ kernel: unsupported page format: {fmt}")
    reason = load_library()
    if reason:
        raise RuntimeError(reason)
    out, lse, nothing = attention_outputs(query, q_start, group_table, out, lse)
    if nothing:
        return out, lse
    if query.stride(-1) != 1:
        query = query.contiguous()
    as_long = lambda t: torch.as_tensor(t).to(torch.long).contiguous()  # noqa: E731
    torch.ops.lowbit_kv_cpu.packed_attention(
        query, as_long(q_start), layout._flat(pages), as_long(group_table),
        as_long(num_groups), as_long(skip_tokens), float(scale),
        fmt.geometry, fmt.key, fmt.value, fmt.fft_map, out, lse)
    return out, lse

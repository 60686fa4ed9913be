"""Page format of a :class:`~vllm_lowbit_kv.paged.PagedLayout` as the GPU kernels read it.

The Triton kernels (``triton_ops/``) and the CUDA kernel (``csrc/cuda/``) take the
codec geometry and the byte offset of every field of a group's state as
compile-time constants; this module derives them from the codecs' own
:class:`~vllm_lowbit_kv.codecs.base.Layout`, so no field offset is written
twice. It imports torch and the codecs only (no triton, no vLLM).

Formats the kernels read (anything else is refused, :func:`unsupported_reason`):

* keys: :class:`~vllm_lowbit_kv.codecs.kivi.KiviCodec` per channel (2, 4 or 8
  bits), or :class:`~vllm_lowbit_kv.codecs.vidkv.VidKVKeyCodec` without STP
  (any k, FFT or not, every ``one_bit`` mode);
* values: ``KiviCodec`` per token (any ``group_size``) or per channel, or
  :class:`~vllm_lowbit_kv.codecs.vidkv.TernaryValueCodec` with or without STP;
* head_dim a power of two in [16, 256]; block_tokens in [1, 256].

That covers the schemes ``kivi2``, ``kivi4``, ``vidkv``, ``vidkv_stp``,
``vidkv_k2v2`` and ``vidkv_k15v2``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..codecs.base import require
from ..codecs.kivi import KiviCodec
from ..codecs.vidkv import (ONE_BIT_MODES, TernaryValueCodec, VidKVKeyCodec, irfft_unique,
                            rfft_unique)

# codec kinds (also the integer codes of csrc/cuda/packed_attention.cuh)
KEY_KIVI_CHANNEL, KEY_VIDKV = 0, 1
VAL_KIVI_TOKEN, VAL_KIVI_CHANNEL, VAL_TERNARY = 0, 1, 2
#: ``one_bit`` modes as integers, in :data:`~vllm_lowbit_kv.codecs.vidkv.ONE_BIT_MODES` order
ONE_BIT_CODE = {m: i for i, m in enumerate(ONE_BIT_MODES)}
MAX_HEAD_DIM, MAX_BLOCK_TOKENS = 256, 256


def _offsets(codec, base: int = 0) -> dict[str, int]:
    """Byte offset of every field of one (group, head) state, from the codec's Layout."""
    out, at = {}, base
    for name, n in codec.layout().fields:
        out[name] = at
        at += n
    return out


def next_pow2(n: int, floor: int = 16) -> int:
    """Padded extent of a kernel axis: a power of two >= n and >= ``floor`` (tl.dot's minimum)."""
    p = floor
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class PageFormat:
    """Geometry, codec kinds and field offsets (from the state start, V after K)."""

    T: int
    D: int
    H: int
    groups_per_block: int
    sink_bytes: int
    state_bytes: int
    k_bytes: int
    v_bytes: int
    key_kind: int
    key_bits: int  # KIVI keys: bits per code
    n2: int  # VidKV keys: 2-bit channels (KIVI: 0)
    n1: int  # VidKV keys: 1-bit channels/components (KIVI: 0)
    fft: bool
    one_bit: int  # ONE_BIT_CODE of VidKV keys
    key_off: dict[str, int]
    val_kind: int
    val_bits: int  # KIVI values: bits per code
    val_group: int  # KIVI per-token values: channels per scale
    n_protect: int  # ternary values: protected (2-bit) tokens per group
    gamma: float  # ternary threshold factor
    val_off: dict[str, int]

    @property
    def n_low(self) -> int:
        """Tokens per group coded ternary (the unprotected ones)."""
        return self.T - self.n_protect

    def koff(self, name: str) -> int:
        """Offset of a key field, -1 when the codec has none (one constant per field)."""
        return self.key_off.get(name, -1)

    def voff(self, name: str) -> int:
        return self.val_off.get(name, -1)


def _key_reason(kc) -> str | None:
    if type(kc) is KiviCodec:
        return None if kc.axis == "channel" else "KIVI keys per token"
    if type(kc) is VidKVKeyCodec:
        return None if kc.n_protect == 0 else "VidKV keys with STP (protect > 0 on keys)"
    return f"key codec {type(kc).__name__}"


def _value_reason(vc) -> str | None:
    if type(vc) in (KiviCodec, TernaryValueCodec):
        return None
    return f"value codec {type(vc).__name__}"


_formats: "weakref.WeakKeyDictionary[object, PageFormat | str]" = weakref.WeakKeyDictionary()


def page_format(layout) -> PageFormat | str:
    """The layout's :class:`PageFormat`, or a sentence saying why the kernels cannot read it."""
    fmt = _formats.get(layout)
    if fmt is not None:
        return fmt
    kc, vc = layout.key_codec, layout.value_codec
    reasons = [r for r in (_key_reason(kc), _value_reason(vc)) if r]
    D, T = layout.D, layout.T
    if D & (D - 1) or not 16 <= D <= MAX_HEAD_DIM:
        reasons.append(f"head_dim {D} (a power of two in [16, {MAX_HEAD_DIM}] is needed)")
    if T > MAX_BLOCK_TOKENS:
        reasons.append(f"block_tokens {T} (at most {MAX_BLOCK_TOKENS})")
    if reasons:
        fmt = ("the lowbit-kv GPU kernels read KIVI per-channel / VidKV keys and KIVI / ternary "
               "values, not: " + "; ".join(reasons))
    else:
        vidkv = type(kc) is VidKVKeyCodec
        kivi_v = type(vc) is KiviCodec
        fmt = PageFormat(
            T=T, D=D, H=layout.H, groups_per_block=layout.groups_per_block,
            sink_bytes=layout.sink_bytes, state_bytes=layout.state_bytes,
            k_bytes=layout.k_bytes, v_bytes=layout.v_bytes,
            key_kind=KEY_VIDKV if vidkv else KEY_KIVI_CHANNEL,
            key_bits=0 if vidkv else kc.bits,
            n2=kc.n2 if vidkv else 0, n1=kc.n1 if vidkv else 0,
            fft=bool(vidkv and kc.fft_active),
            one_bit=ONE_BIT_CODE[kc.one_bit] if vidkv else 0,
            key_off=_offsets(kc),
            val_kind=(VAL_TERNARY if not kivi_v else
                      VAL_KIVI_TOKEN if vc.axis == "token" else VAL_KIVI_CHANNEL),
            val_bits=vc.bits if kivi_v else 0,
            val_group=vc.group_size if kivi_v else 0,
            n_protect=0 if kivi_v else vc.n_protect,
            gamma=0.0 if kivi_v else vc.gamma,
            val_off=_offsets(vc, layout.k_bytes),
        )
    _formats[layout] = fmt
    return fmt


def unsupported_reason(layout) -> str | None:
    """None when the GPU kernels read this layout, else why not."""
    fmt = page_format(layout)
    return fmt if isinstance(fmt, str) else None


def attention_outputs(query: torch.Tensor, q_start: torch.Tensor, group_table: torch.Tensor,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The contract's ``out`` [n, Hq, D] and ``lse`` [n, Hq] (float32; allocated unless
    given, then checked) and whether there is nothing for a kernel to read: no query rows,
    no requests or no groups (rows with nothing to attend get out 0 and lse -inf)."""
    n, Hq, D = query.shape
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32, device=query.device)
    if lse is None:
        lse = torch.empty(n, Hq, dtype=torch.float32, device=query.device)
    for name, x, shape in (("out", out, (n, Hq, D)), ("lse", lse, (n, Hq))):
        require(x.dtype == torch.float32 and tuple(x.shape) == shape and x.is_contiguous(),
                name, f"float32 contiguous {shape}", (x.dtype, tuple(x.shape)))
    nothing = n == 0 or q_start.numel() <= 1 or group_table.dim() != 2 \
        or group_table.shape[1] == 0
    if nothing:
        out.zero_()
        lse.fill_(float("-inf"))
    return out, lse, nothing


def require_format(layout) -> PageFormat:
    fmt = page_format(layout)
    if isinstance(fmt, str):
        raise ValueError(f"lowbit-kv kernels: unsupported page format: {fmt}")
    return fmt


_maps: dict[tuple[str, int, int, str], torch.Tensor] = {}


def fft_matrix(kind: str, n1: int, padded: int, device) -> torch.Tensor:
    """The unique-rfft parts as real n1 x n1 maps (vidkv.py): ``"forward"`` F with
    ``rfft_unique(x) = x @ F``, ``"inverse_t"`` the transpose of W with
    ``irfft_unique(y) = y @ W`` (so a query over the 1-bit channels maps to the
    components as ``q @ W.T``). Built in float64 from the reference transforms,
    rounded to float32, zero-padded to ``padded`` x ``padded``."""
    key = (kind, n1, padded, str(device))
    m = _maps.get(key)
    if m is None:
        eye = torch.eye(n1, dtype=torch.float64)
        if kind == "forward":
            core = rfft_unique(eye)  # row c = components of unit channel c
        elif kind == "inverse_t":
            core = irfft_unique(eye, n1).T  # irfft row j = channels of unit component j
        else:
            raise ValueError(f"kind must be 'forward' or 'inverse_t', got {kind!r}")
        m = torch.zeros(padded, padded, dtype=torch.float32)
        m[:n1, :n1] = core.float()
        m = m.to(device).contiguous()
        _maps[key] = m
    return m

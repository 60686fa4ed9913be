"""The page format: the one description of a packed page that every implementation reads.

A :class:`PageFormat` is built once per page layout (``PagedLayout.format``) from
the layout's codecs and geometry: the codecs themselves (the PyTorch reference
decodes with them), the geometry, the codec kinds a kernel dispatches on, and
the byte offset of every field of a group's state, taken from the codecs' own
:class:`~vllm_lowbit_kv.codecs.base.Layout`. The kernels' arguments (the C++
descriptors of :mod:`.cpu`, the ``LowbitPageFormat`` fields of :mod:`.cuda`,
the Triton constants of :mod:`.triton.store_kernel`) are all computed from it, so no
field offset is written twice. It imports torch and the codecs only.

Every layout has a format; codecs that no kernel reads get the kind
:data:`OTHER`, and each implementation's ``supports`` says what it reads
(:func:`kernel_codec_reason`).

Page (see :mod:`vllm_lowbit_kv.paged`): per KV head, ``sink_bytes`` of sink
area, then ``groups_per_block`` group states of ``state_bytes`` each: the key
codec's bytes, the value codec's bytes, zero padding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..codecs.base import BlockCodec, require
from ..codecs.kivi import KiviCodec
from ..codecs.rvq import RVQCodec
from ..codecs.vidkv import (ONE_BIT_MODES, TernaryValueCodec, VidKVKeyCodec, irfft_unique,
                            rfft_unique)

# codec kinds the kernels dispatch on (also the integer codes of csrc/)
KEY_KIVI_CHANNEL, KEY_VIDKV, KEY_RVQ = 0, 1, 2
VAL_KIVI_TOKEN, VAL_KIVI_CHANNEL, VAL_TERNARY, VAL_RVQ = 0, 1, 2, 3
#: a codec no kernel reads (the reference decodes it)
OTHER = -1
#: byte alignment of a group state (vLLM zeroes new blocks in 4-byte words and needs
#: 4-byte page strides; the CUDA kernel reads 4-byte words)
STATE_ALIGN = 4
#: limits of the GPU kernels (Triton and CUDA: power-of-two tiles)
GPU_MAX_HEAD_DIM, GPU_MAX_BLOCK_TOKENS = 256, 256
#: ``one_bit`` modes as integers, in :data:`~vllm_lowbit_kv.codecs.vidkv.ONE_BIT_MODES` order
ONE_BIT_CODE = {m: i for i, m in enumerate(ONE_BIT_MODES)}


class PageGeometry(Protocol):
    """A page layout that carries its format (:class:`vllm_lowbit_kv.paged.PagedLayout`
    builds it once from its codecs and geometry)."""

    format: "PageFormat"


def _offsets(codec: BlockCodec, base: int = 0) -> dict[str, int]:
    """Byte offset of every field of one (group, head) state, from the codec's Layout."""
    out, at = {}, base
    for name, n in codec.layout().fields:
        out[name] = at
        at += n
    return out


def _key_kind(kc: BlockCodec) -> int:
    if type(kc) is KiviCodec and kc.axis == "channel":
        return KEY_KIVI_CHANNEL
    if isinstance(kc, RVQCodec):
        return KEY_RVQ
    return KEY_VIDKV if type(kc) is VidKVKeyCodec else OTHER


def _value_kind(vc: BlockCodec) -> int:
    if type(vc) is KiviCodec:
        return VAL_KIVI_TOKEN if vc.axis == "token" else VAL_KIVI_CHANNEL
    if isinstance(vc, RVQCodec):
        return VAL_RVQ
    return VAL_TERNARY if type(vc) is TernaryValueCodec else OTHER


def _codec_name(codec: BlockCodec) -> str:
    name = type(codec).__name__
    return f"{name} per {codec.axis}" if type(codec) is KiviCodec else name


@dataclass(frozen=True, eq=False)
class PageFormat:
    """Codecs, geometry, codec kinds and field offsets (from the state start, V after K)."""

    key_codec: BlockCodec = field(repr=False)
    value_codec: BlockCodec = field(repr=False)
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
    key_protect: int  # VidKV keys: STP-protected tokens per group
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

    @classmethod
    def build(cls, key_codec: BlockCodec, value_codec: BlockCodec, num_kv_heads: int,
              groups_per_block: int = 1, sink_bytes: int = 0) -> "PageFormat":
        """The format of pages holding ``groups_per_block`` groups of these codecs per KV
        head after ``sink_bytes`` of sink area."""
        kc, vc = key_codec, value_codec
        vidkv, kivi_v = type(kc) is VidKVKeyCodec, type(vc) is KiviCodec
        return cls(
            key_codec=kc, value_codec=vc, T=kc.block_tokens, D=kc.head_dim, H=num_kv_heads,
            groups_per_block=groups_per_block, sink_bytes=sink_bytes,
            state_bytes=-(-(kc.nbytes + vc.nbytes) // STATE_ALIGN) * STATE_ALIGN,
            k_bytes=kc.nbytes, v_bytes=vc.nbytes,
            key_kind=_key_kind(kc), key_bits=kc.bits if type(kc) is KiviCodec else 0,
            key_protect=kc.n_protect if vidkv else 0,
            n2=kc.n2 if vidkv else 0, n1=kc.n1 if vidkv else 0,
            fft=bool(vidkv and kc.fft_active),
            one_bit=ONE_BIT_CODE[kc.one_bit] if vidkv else 0, key_off=_offsets(kc),
            val_kind=_value_kind(vc), val_bits=vc.bits if kivi_v else 0,
            val_group=vc.group_size if kivi_v else 0,
            n_protect=vc.n_protect if type(vc) is TernaryValueCodec else 0,
            gamma=vc.gamma if type(vc) is TernaryValueCodec else 0.0,
            val_off=_offsets(vc, kc.nbytes))

    @property
    def n_low(self) -> int:
        """Tokens per group coded ternary (the unprotected ones)."""
        return self.T - self.n_protect

    @property
    def sign(self) -> bool:
        """VidKV keys with ``one_bit == "sign"`` (levels -s1, +s1, one stored field)."""
        return self.key_kind == KEY_VIDKV and ONE_BIT_MODES[self.one_bit] == "sign"

    @property
    def head_bytes(self) -> int:
        """Bytes of one block of one KV head."""
        return self.sink_bytes + self.groups_per_block * self.state_bytes

    def koff(self, name: str) -> int:
        """Offset of a key field, -1 when the codec has none (one constant per field)."""
        return self.key_off.get(name, -1)

    def voff(self, name: str) -> int:
        return self.val_off.get(name, -1)

    def describe(self) -> str:
        return f"{_codec_name(self.key_codec)}/{_codec_name(self.value_codec)} pages"

    # -- the page bytes, as the reference and the codec store read and write them ------
    def flat_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Any view of a layer's cache -> ``[num_blocks, H, P]`` uint8 sharing its memory."""
        require(pages.dtype == torch.uint8, "pages.dtype", "torch.uint8", pages.dtype)
        # the kernels' calls pass the flat view itself: no new view per call
        flat = pages if pages.dim() == 3 else pages.view(pages.shape[0], self.H, -1)
        if flat.shape[1:] != (self.H, self.head_bytes) or flat.stride(-1) != 1:
            raise ValueError(f"pages must be [num_blocks, {self.H}, {self.head_bytes}] (the "
                             "format's heads and bytes per head), contiguous along the page "
                             f"bytes, got shape {tuple(flat.shape)}, strides {flat.stride()}")
        return flat

    def _group_states(self, pages: torch.Tensor) -> torch.Tensor:
        flat = self.flat_pages(pages)
        return flat[:, :, self.sink_bytes:].view(flat.shape[0], self.H, self.groups_per_block,
                                                  self.state_bytes)

    def read_states(self, pages: torch.Tensor, gids: torch.Tensor) -> torch.Tensor:
        """pages, global group ids [G] -> states [G, H, state_bytes]."""
        N = self.groups_per_block
        return self._group_states(pages)[gids // N, :, gids % N]

    def write_states(self, pages: torch.Tensor, gids: torch.Tensor, states: torch.Tensor) -> None:
        N = self.groups_per_block
        self._group_states(pages)[gids // N, :, gids % N] = states

    def encode(self, k: torch.Tensor, v: torch.Tensor, relevance: torch.Tensor | None = None
               ) -> torch.Tensor:
        """K, V [G, T, H, D] (+ STP relevance [G, T, H]) -> states [G, H, state_bytes]."""
        kb, vb = self.key_codec.encode(k, relevance), self.value_codec.encode(v, relevance)
        pad = kb.new_zeros(*kb.shape[:-1], self.state_bytes - self.k_bytes - self.v_bytes)
        return torch.cat([kb, vb, pad], dim=-1)

    def decode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States [G, H, state_bytes] -> K, V [G, T, H, D] float32, as the codecs stored them."""
        kb = states[..., :self.k_bytes].contiguous()
        vb = states[..., self.k_bytes:self.k_bytes + self.v_bytes].contiguous()
        return self.key_codec.decode(kb), self.value_codec.decode(vb)


def page_format(page: PageFormat | PageGeometry) -> PageFormat:
    """The format of a layout's pages, or ``page`` itself when it is a format already."""
    return page if isinstance(page, PageFormat) else page.format


def kernel_codec_reason(fmt: PageFormat, vidkv_key_stp: bool, rvq: bool = False) -> str | None:
    """None when a kernel reading KIVI per-channel / VidKV keys (with STP-protected key tokens
    when ``vidkv_key_stp``) and KIVI / ternary values (and RVQ keys and values when ``rvq``)
    reads ``fmt``'s codecs, else why not."""
    reasons = []
    if fmt.key_kind == OTHER or (fmt.key_kind == KEY_RVQ and not rvq):
        reasons.append(f"keys {_codec_name(fmt.key_codec)}")
    elif fmt.key_protect and not vidkv_key_stp:
        reasons.append("VidKV keys with STP (protect > 0 on keys)")
    if fmt.val_kind == OTHER or (fmt.val_kind == VAL_RVQ and not rvq):
        reasons.append(f"values {_codec_name(fmt.value_codec)}")
    if not reasons:
        return None
    reads = "KIVI per-channel / VidKV" + (" / RVQ" if rvq else "")
    return (f"it reads {reads} keys and KIVI / ternary{' / RVQ' if rvq else ''} values, not: "
            + "; ".join(reasons))


def gpu_format_reason(fmt: PageFormat) -> str | None:
    """None when the GPU kernels (Triton, CUDA) read pages of this format, else why not: they
    read the codecs of :func:`kernel_codec_reason` without STP on keys, head_dim a power of
    two in [16, 256], block_tokens up to 256."""
    reasons = [r for r in (kernel_codec_reason(fmt, vidkv_key_stp=False),) if r]
    D, T = fmt.D, fmt.T
    if D & (D - 1) or not 16 <= D <= GPU_MAX_HEAD_DIM:
        reasons.append(f"head_dim {D} (a power of two in [16, {GPU_MAX_HEAD_DIM}] is needed)")
    if T > GPU_MAX_BLOCK_TOKENS:
        reasons.append(f"block_tokens {T} (at most {GPU_MAX_BLOCK_TOKENS})")
    return "; ".join(reasons) or None


def _require_output(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    require(x.dtype == torch.float32 and tuple(x.shape) == shape and x.is_contiguous(),
            name, f"float32 contiguous {shape}", (x.dtype, tuple(x.shape)))


def attention_outputs(query: torch.Tensor, q_start: torch.Tensor, group_table: torch.Tensor,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The contract's ``out`` [n, Hq, D] and ``lse`` [n, Hq] (float32; allocated unless
    given, then checked) and whether there is nothing for a kernel to read: no query rows,
    no requests or no groups (rows with nothing to attend get out 0 and lse -inf)."""
    n, Hq, D = query.shape
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32, device=query.device)
    else:
        _require_output("out", out, (n, Hq, D))
    if lse is None:
        lse = torch.empty(n, Hq, dtype=torch.float32, device=query.device)
    else:
        _require_output("lse", lse, (n, Hq))
    nothing = n == 0 or q_start.numel() <= 1 or group_table.dim() != 2 \
        or group_table.shape[1] == 0
    if nothing:
        out.zero_()
        lse.fill_(float("-inf"))
    return out, lse, nothing


def rotating(attention):
    """``attention`` (an implementation of the contract whose kernel does not take
    ``rotation``) with the contract's ``rotation`` applied around it, in float32: the
    query multiplied by ``M`` before, the output by ``Mᵀ`` after, in place."""
    @functools.wraps(attention)
    def wrapped(query: torch.Tensor, *args, rotation: torch.Tensor | None = None, **kwargs
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if rotation is None:
            return attention(query, *args, **kwargs)
        m = rotation.to(query.device, torch.float32)
        out, lse = attention(query.float() @ m, *args, **kwargs)
        out.copy_(out @ m.T)
        return out, lse
    return wrapped


def next_pow2(n: int, floor: int = 16) -> int:
    """Padded extent of a kernel axis: a power of two >= n and >= ``floor`` (tl.dot's minimum)."""
    p = floor
    while p < n:
        p *= 2
    return p


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

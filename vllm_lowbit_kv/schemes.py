"""Named KV schemes: a key codec + a value codec + validated cache defaults.

A scheme name is what users pass as ``--kv-cache-dtype``. Codec parameters
(k, gamma, p, bits, ...) can be overridden per deployment with
:meth:`KVScheme.with_params`; each override goes to the codec(s) whose
constructor takes it, and unknown names are refused. Codecs with learned
per-layer state (RVQ codebooks) take a ``layer`` index, which
:meth:`KVScheme.codecs` passes through; it is not a user parameter.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .codecs.base import BlockCodec, ModelIdentity, require
from .codecs.dynamic import DynamicCodec
from .codecs.kivi import KiviCodec
from .codecs.quant import require_staging_dtype, staged_bytes_per_element
from .codecs.quantile1 import QuantileCodec
from .codecs.rvq import RVQKeyCodec, RVQValueCodec
from .codecs.vidkv import TernaryValueCodec, VidKVKeyCodec, require_protect_first
from .rotation import ROTATIONS, HadamardRotation

if TYPE_CHECKING:
    from .paged import HeadSplitLayout, PagedLayout

#: KIVI's and VidKV's full-precision residual (R = 128 tokens)
DEFAULT_RESIDUAL_TOKENS = 128
#: largest residual or leading window (tokens): staging holds it for every running sequence
MAX_RESIDUAL_TOKENS = 1024
#: tokens per vLLM page (block) by default: the sink area, which every page carries
#: (paged/), is paid once per page, so larger pages make sinks cheap
DEFAULT_PAGE_TOKENS = 512
#: largest page (tokens)
MAX_PAGE_TOKENS = 8192
#: fields of a scheme that shape the cache rather than a codec
CACHE_FIELDS = ("block_tokens", "sink_tokens", "residual_tokens", "leading_tokens",
                "page_tokens", "rotate",
                "rotate_seed", "protect_first", "retrieval_heads", "retrieval_scheme",
                "retrieval_keys_only", "staging_dtype")



@dataclass(frozen=True)
class CodecSpec:
    """A codec class and its keyword arguments, built per (block_tokens, head_dim[, layer])."""

    cls: type[BlockCodec]
    params: dict[str, Any] = field(default_factory=dict)

    def accepts(self, name: str) -> bool:
        return name in inspect.signature(self.cls.__init__).parameters and name not in (
            "self", "block_tokens", "head_dim", "layer")

    def build(self, block_tokens: int, head_dim: int, layer: int | None = None) -> BlockCodec:
        if layer is not None and "layer" in inspect.signature(self.cls.__init__).parameters:
            return self.cls(block_tokens, head_dim, layer=layer, **self.params)
        return self.cls(block_tokens, head_dim, **self.params)


@dataclass(frozen=True)
class KVScheme:
    name: str
    summary: str
    key: CodecSpec
    value: CodecSpec
    block_tokens: int = 64
    #: first tokens of every sequence kept in bf16 (attention sinks)
    sink_tokens: int = 0
    #: the most recent tokens read in the model dtype (KIVI's residual R), beside the pages
    residual_tokens: int = DEFAULT_RESIDUAL_TOKENS
    #: the first tokens read in the staging dtype by the sequence that wrote them (attention
    #: sinks and a system prompt), beside the pages; 0: none
    leading_tokens: int = 0
    #: tokens per vLLM page when --block-size is not given (a multiple of block_tokens);
    #: None: the smallest multiple of block_tokens >= DEFAULT_PAGE_TOKENS
    page_tokens: int | None = None
    #: rotation of head vectors before encoding: "none" or "hadamard" (rotation.py)
    rotate: str = "none"
    #: seed of the rotation's random signs (drawn per layer)
    rotate_seed: int = 0
    #: which tokens STP protects first in a group with visual tokens (:data:`PROTECT_FIRST`)
    protect_first: str = "visual"
    #: KV heads of the model (its highest retrieval scores, :mod:`..retrieval_heads`) coded by
    #: ``retrieval_scheme``'s codecs instead of this scheme's (0: none)
    retrieval_heads: int = 0
    retrieval_scheme: str = "kivi4"
    #: retrieval heads take only the key codec of ``retrieval_scheme``, values keep this scheme's
    retrieval_keys_only: bool = False
    #: what the staged tokens (windows, partial group) are held in: "model" (the
    #: model dtype) or "int8" (a scale per token and head, :data:`~.codecs.quant.STAGING_DTYPES`)
    staging_dtype: str = "model"
    #: the head size the codec parameters were validated for (:meth:`with_params`): the
    #: served model's, 64 where no model is named (head-size limits such as a group_size
    #: dividing head_dim are checked again for the model at start-up)
    checked_head_dim: int = field(default=64, repr=False, compare=False)

    def codecs(self, head_dim: int, block_tokens: int | None = None, layer: int | None = None
               ) -> tuple[BlockCodec, BlockCodec]:
        """The key and value codecs; ``layer`` reaches codecs with per-layer state."""
        T = block_tokens or self.block_tokens
        return self.key.build(T, head_dim, layer), self.value.build(T, head_dim, layer)

    def retrieval_codecs(self, head_dim: int, block_tokens: int | None = None,
                         layer: int | None = None) -> tuple[BlockCodec, BlockCodec]:
        """The key and value codecs of the retrieval heads (the groups of :meth:`codecs`)."""
        T = block_tokens or self.block_tokens
        other = get_scheme(self.retrieval_scheme)
        kc = other.key.build(T, head_dim, layer)
        return kc, (self.value if self.retrieval_keys_only else other.value).build(T, head_dim, layer)

    def retrieval_share(self, model_kv_heads: int | None) -> float:
        """Fraction of the model's packed KV heads (layers x KV heads) that are retrieval heads."""
        if not self.retrieval_heads:
            return 0.0
        require(isinstance(model_kv_heads, int) and model_kv_heads >= self.retrieval_heads,
                "model_kv_heads", f"the model's packed KV heads (>= retrieval_heads "
                f"{self.retrieval_heads}) to count the retrieval heads' bits", model_kv_heads)
        return self.retrieval_heads / model_kv_heads

    def check_model(self, model: ModelIdentity) -> list[str]:
        """Reasons the codecs' learned state (e.g. RVQ codebooks) cannot serve ``model``."""
        reasons = [r for c in self.codecs(model.head_dim) if hasattr(c, "check_model")
                   for r in c.check_model(model)]
        return list(dict.fromkeys(reasons))

    def effective_bits(self, head_dim: int, block_tokens: int | None = None,
                       model_kv_heads: int | None = None) -> float:
        """Bits per element over K and V together, every stored byte counted; with
        retrieval heads, over all ``model_kv_heads`` (layers x KV heads) of the model."""
        return sum(w * (k.effective_bits + v.effective_bits) / 2
                   for w, (k, v) in self._weighted_codecs(head_dim, model_kv_heads, block_tokens))

    def _weighted_codecs(self, head_dim: int, model_kv_heads: int | None,
                         block_tokens: int | None = None) -> list[tuple[float, tuple]]:
        """(share of the model's KV heads, (key codec, value codec)): the scheme's own
        codecs, and with retrieval heads theirs."""
        share = self.retrieval_share(model_kv_heads)
        pairs = [(1 - share, self.codecs(head_dim, block_tokens))]
        if share:
            pairs.append((share, self.retrieval_codecs(head_dim, block_tokens)))
        return pairs

    @property
    def staged_groups(self) -> int:
        """Groups per running sequence held in :attr:`staging_dtype` beside the pages: the
        leading and residual windows' groups and the partial last group."""
        return (self.leading_tokens + self.residual_tokens) // self.block_tokens + 1

    @property
    def page_size(self) -> int:
        """Tokens per vLLM page (``--block-size``) unless the user sets one."""
        T = self.block_tokens
        return self.page_tokens or -(-DEFAULT_PAGE_TOKENS // T) * T

    def effective_bits_at(self, context_tokens: int, head_dim: int, block_size: int | None = None,
                          model_dtype_bytes: int = 2, model_kv_heads: int | None = None) -> float:
        """Honest bits per element of one sequence of ``context_tokens`` tokens: every page
        byte of its blocks of ``block_size`` tokens (default :attr:`page_size`; sink area
        in the model dtype and padding included) plus its staging (leading and residual
        windows and partial group, :attr:`staged_groups` groups in :attr:`staging_dtype`, as
        allocated),
        over its K and V elements; with retrieval heads, over all ``model_kv_heads`` of the
        model."""
        from .paged import PagedLayout, sink_dtype

        T = self.block_tokens
        block_size = block_size or self.page_size
        sinks = sink_dtype(model_dtype_bytes)
        head_page = sum(w * PagedLayout(kc, vc, 1, block_size, self.sink_tokens, sinks).page_bytes
                        for w, (kc, vc) in self._weighted_codecs(head_dim, model_kv_heads))
        blocks = -(-context_tokens // block_size)
        staged = self.staged_groups * T * 2 * head_dim * staged_bytes_per_element(
            self.staging_dtype, head_dim, model_dtype_bytes)
        return (blocks * head_page + staged) * 8 / (context_tokens * 2 * head_dim)

    def layout(self, head_dim: int, num_kv_heads: int, block_size: int,
               dtype: torch.dtype = torch.bfloat16, layer: int | None = None,
               retrieval_heads: tuple[int, ...] = ()) -> PagedLayout | HeadSplitLayout:
        """The pages of one layer (sink area in ``dtype``): a
        :class:`~vllm_lowbit_kv.paged.PagedLayout` of the scheme's codecs, or, when the layer
        has ``retrieval_heads`` (KV heads coded by the retrieval codecs,
        :mod:`vllm_lowbit_kv.retrieval_heads`), a :class:`~vllm_lowbit_kv.paged.HeadSplitLayout`
        (the other heads, then those). ``layer`` reaches codecs and rotations with per-layer
        state."""
        from .paged import HeadSplitLayout, PagedLayout
        from .retrieval_heads import layer_parts

        def part(retrieval: bool, heads: int) -> PagedLayout:
            kc, vc = (self.retrieval_codecs if retrieval else self.codecs)(head_dim, layer=layer)
            return PagedLayout(kc, vc, heads, block_size, self.sink_tokens, dtype,
                               self.rotation(head_dim, layer), self.protect_first)
        parts = layer_parts(retrieval_heads, num_kv_heads)
        layouts = [part(retrieval, len(heads)) for retrieval, heads in parts]
        return layouts[0] if len(parts) == 1 else HeadSplitLayout(layouts, [hs for _, hs in parts])

    def retrieval_layout(self, head_dim: int, num_kv_heads: int, block_size: int,
                         dtype: torch.dtype = torch.bfloat16, layer: int | None = None
                         ) -> PagedLayout:
        """The pages of ``num_kv_heads`` heads all coded by the retrieval codecs: the
        retrieval heads' part of a :meth:`layout`, alone."""
        return self.layout(head_dim, num_kv_heads, block_size, dtype, layer,
                           tuple(range(num_kv_heads)))

    def rotation(self, head_dim: int, layer: int | None) -> HadamardRotation | None:
        """The head-vector rotation of ``layer`` (None: not rotated)."""
        if self.rotate == "none":
            return None
        return HadamardRotation(head_dim, layer or 0, self.rotate_seed)

    @property
    def uses_relevance(self) -> bool:
        """True when a codec protects tokens by relevance (STP), so callers supply scores."""
        return any(c.uses_relevance for c in self.codecs(self.checked_head_dim))

    def with_params(self, head_dim: int | None = None, **overrides: Any) -> "KVScheme":
        """A copy with codec parameters and cache defaults overridden, validated for
        ``head_dim`` (the model's head size; default: the one this scheme was checked for).

        A parameter goes to the codec(s) whose spec already sets it; if neither
        does, to every codec that accepts it (e.g. ``protect`` on vidkv reaches
        the value codec only, as in the paper's STP).
        """
        cache_fields = set(CACHE_FIELDS)
        scheme_kw = {k: v for k, v in overrides.items() if k in cache_fields}
        key_p, value_p = dict(self.key.params), dict(self.value.params)
        for name, val in overrides.items():
            if name in cache_fields:
                continue
            targets = [p for s, p in ((self.key, key_p), (self.value, value_p)) if name in s.params]
            if not targets:
                targets = [p for s, p in ((self.key, key_p), (self.value, value_p)) if s.accepts(name)]
            for params in targets:
                params[name] = val
            hit = bool(targets)
            allowed = sorted(cache_fields | {p for s in (self.key, self.value)
                                             for p in inspect.signature(s.cls.__init__).parameters
                                             if s.accepts(p)})
            require(hit, f"{self.name} parameter name", f"one of {allowed}", name)
        new = dataclasses.replace(self, key=CodecSpec(self.key.cls, key_p),
                                  value=CodecSpec(self.value.cls, value_p),
                                  checked_head_dim=head_dim or self.checked_head_dim, **scheme_kw)
        new.validate()
        return new

    def validate(self) -> None:
        """Build both codecs once (at :attr:`checked_head_dim`) so that every parameter is
        range-checked."""
        head_dim = self.checked_head_dim
        require(isinstance(self.sink_tokens, int) and self.sink_tokens >= 0,
                "sink_tokens", "an int >= 0", self.sink_tokens)
        require_staging_dtype(self.staging_dtype)
        self.codecs(head_dim)  # validates block_tokens and the codec parameters
        T = self.block_tokens
        for name in ("residual_tokens", "leading_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and 0 <= value <= MAX_RESIDUAL_TOKENS
                    and value % T == 0, name,
                    f"a multiple of block_tokens ({T}) in [0, {MAX_RESIDUAL_TOKENS}] (0: no window)",
                    value)
        require(self.page_tokens is None or (isinstance(self.page_tokens, int) and
                0 < self.page_tokens <= MAX_PAGE_TOKENS and self.page_tokens % T == 0),
                "page_tokens", f"a multiple of block_tokens ({T}) in [{T}, {MAX_PAGE_TOKENS}]",
                self.page_tokens)
        require(self.rotate in ROTATIONS, "rotate", f"one of {list(ROTATIONS)}", self.rotate)
        require(isinstance(self.rotate_seed, int), "rotate_seed", "an int", self.rotate_seed)
        require_protect_first(self.protect_first)
        require(self.protect_first == "visual" or self.uses_relevance, "protect_first",
                "'visual' unless the scheme protects tokens (protect > 0)", self.protect_first)
        if self.rotate != "none":
            HadamardRotation(head_dim)
        require(isinstance(self.retrieval_heads, int) and self.retrieval_heads >= 0,
                "retrieval_heads", "an int >= 0 (KV heads of the model; 0: none)",
                self.retrieval_heads)
        require(isinstance(self.retrieval_keys_only, bool), "retrieval_keys_only", "true or false",
                self.retrieval_keys_only)
        if self.retrieval_heads:
            other = SCHEMES.get(self.retrieval_scheme)
            require(other is not None and not other.retrieval_heads, "retrieval_scheme",
                    f"a scheme without retrieval heads, one of "
                    f"{sorted(n for n, s in SCHEMES.items() if not s.retrieval_heads)}",
                    self.retrieval_scheme)


SCHEMES: dict[str, KVScheme] = {}


def register(scheme: KVScheme) -> KVScheme:
    scheme.validate()
    SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> KVScheme:
    require(name in SCHEMES, "kv_cache_dtype", f"one of {sorted(SCHEMES)}", name)
    return SCHEMES[name]


for _bits in (2, 4, 8):
    register(KVScheme(f"kivi{_bits}", f"KIVI {_bits}-bit: K per-channel, V per-token",
                      CodecSpec(KiviCodec, {"bits": _bits, "axis": "channel"}),
                      CodecSpec(KiviCodec, {"bits": _bits, "axis": "token"})))

VIDKV_KEY = CodecSpec(VidKVKeyCodec, {"k": 0.5, "fft": True})
VIDKV_VALUE = {"gamma": 0.7, "protect": 0.0}
# vidkv: the best VidKV configuration at <= 2.25 bits per element at 8K tokens (and
# <= 2.0 in the pages), picked by the yardstick. 4 exact sink tokens bring most of the
# perplexity back (1.44x -> 1.08x bf16, bench/results/quality_tuning_hf.md). Retrieval
# (passkey) needs more: the needle must win a softmax over thousands of filler keys, and
# the answer's first token is a close call even in bf16 at 2K-4K tokens on SmolLM2, so
# small damage flips it. Few heads do that copying (retrieval heads, Wu et al. 2024): the
# 7 of SmolLM2's 90 KV heads with the highest retrieval scores keep 4-bit KIVI keys and
# values (their values matter too at 3K-4K tokens). They are paid for by 128-token groups
# (the per-channel scales cost half as much, at no measurable loss) and no window beyond
# the partial group (0-127 tokens), staged in int8 (a scale per token and head: the same
# perplexity, passkeys and chats as bf16 staging, 0.12 bits less at 8K,
# bench/results/quality_vllm_int8staging.md); 2048-token pages pay the sink area once
# per page. Pages 1.98 bits, 2.11 at 8K with staging. No rotation: the Hadamard rotation
# lowers perplexity a little but costs retrieval (bench/results/quality_vllm.md).
VIDKV_CACHE = dict(block_tokens=128, sink_tokens=4, residual_tokens=0, page_tokens=2048,
                   staging_dtype="int8")
# The bits left up to 2.25 at 8K hold a sequence's first group staged (a leading window,
# 2.24 bits at 8K): answers follow a system prompt's instructions as bf16's do (chats
# equal to bf16's from 13 to 18 of 20 on the same machine, where a 128-token residual
# window at the end changes none; bench/results/quality_vllm_leading.md).
register(KVScheme("vidkv", "VidKV: K 1.5-bit (range-selected 2/1-bit, FFT), V ternary "
                           "per-channel, 128-token groups; 7 retrieval heads with 4-bit keys and "
                           "values; 4 exact sink tokens; the first 128 tokens and the partial "
                           "group staged in int8",
                  VIDKV_KEY, CodecSpec(TernaryValueCodec, VIDKV_VALUE), retrieval_heads=7,
                  leading_tokens=128, **VIDKV_CACHE))
# vidkv_retrieval: what the int8 staging pays for within 2.25 bits at 8K. Passkeys are
# lost in the heads that are not retrieval heads, to their 1-bit key channels
# (bench/results/quality_vllm_k2keys.md): 13 of 16 key channels at 2 bits and 6
# retrieval heads find bf16's passkeys on three draws, at 1.08x bf16's perplexity
# (bench/results/quality_vllm_int8staging.md). Pages 2.10 bits, 2.23 at 8K.
register(KVScheme("vidkv_retrieval", "VidKV for retrieval: K 1.8-bit (13/16 of the channels at "
                                     "2 bits, FFT), V ternary per-channel, 128-token groups; 6 "
                                     "retrieval heads with 4-bit keys and values; 4 exact sink "
                                     "tokens; int8 staging",
                  CodecSpec(VidKVKeyCodec, {**VIDKV_KEY.params, "k": 0.8125}),
                  CodecSpec(TernaryValueCodec, VIDKV_VALUE), retrieval_heads=6, **VIDKV_CACHE))
register(KVScheme("vidkv_paper", "VidKV as in the paper: K 1.5-bit FFT, V ternary per-channel, "
                                 "full-precision residual of the last 128 tokens, no sinks",
                  VIDKV_KEY, CodecSpec(TernaryValueCodec, VIDKV_VALUE), residual_tokens=128))
register(KVScheme("vidkv_stp", "VidKV with Semantic Token Protection: top 20% tokens of V at 2-bit",
                  VIDKV_KEY, CodecSpec(TernaryValueCodec, {**VIDKV_VALUE, "protect": 0.2})))
# The visual-only mode (seed 003's setting: visual KV low-bit, text KV at a higher
# precision) in fixed-size pages: STP's protected rows (a quarter of each group, 2-bit K
# and V with their own per-channel ranges, a token mask saying which) go to text tokens
# first, the rest of the group is VidKV's low-bit code. Text beyond a group's protected
# rows is coded low-bit too; every byte is counted in the bits (2.56 per element).
register(KVScheme("vidkv_visual", "visual-only mode (seed 003): text tokens first at 2-bit K and V "
                                  "(STP rows, 25% of each group), visual tokens VidKV 1.5-bit K / "
                                  "ternary V; 4 exact sink tokens, 64-token residual window",
                  CodecSpec(VidKVKeyCodec, {**VIDKV_KEY.params, "protect": 0.25}),
                  CodecSpec(TernaryValueCodec, {**VIDKV_VALUE, "protect": 0.25}), sink_tokens=4,
                  residual_tokens=64, page_tokens=1024, protect_first="text"))
register(KVScheme("vidkv_k2v2", "VidKV Table 1 row: K and V both 2-bit per-channel",
                  CodecSpec(KiviCodec, {"bits": 2, "axis": "channel"}),
                  CodecSpec(KiviCodec, {"bits": 2, "axis": "channel"})))
register(KVScheme("vidkv_k15v2", "VidKV Table 1 row: K 1.5-bit FFT, V 2-bit per-channel",
                  VIDKV_KEY, CodecSpec(KiviCodec, {"bits": 2, "axis": "channel"})))
register(KVScheme("quantile1", "1-bit quantile range: K per-channel, V per-token (seed 003)",
                  CodecSpec(QuantileCodec, {"bits": 1, "axis": "channel"}),
                  CodecSpec(QuantileCodec, {"bits": 1, "axis": "token"})))
for _bits in (4, 2):
    register(KVScheme(f"dynamic{_bits}",
                      f"Dynamic {_bits}-bit: K per-channel, V per-token normalized by EMA recorders, "
                      "outlier-proportional fine groups (seed 004)",
                      CodecSpec(DynamicCodec, {"bits": _bits, "axis": "channel"}),
                      CodecSpec(DynamicCodec, {"bits": _bits, "axis": "token"})))

# RVQ (seed 001): the paper's K=8 x C=2048 and smaller quantizers down to about 1 bit.
# Bits at head_dim 64 (indices + fp16 std per token): 3.0, 2.25, 1.25, 0.75. Every one
# needs a codebook file (lowbit_kv field ``codebook``; python -m vllm_lowbit_kv.calibrate).
for _name, _k, _c in (("rvq", 8, 2048), ("rvq8x256", 8, 256), ("rvq4x256", 4, 256),
                      ("rvq2x256", 2, 256)):
    _rvq = {"num_codebooks": _k, "codebook_size": _c}
    register(KVScheme(_name, f"RVQ {_k} codebooks x {_c} codes per 32-channel group, std-scaled "
                             "(K strided groups, V contiguous; learned codebooks, seed 001)",
                      CodecSpec(RVQKeyCodec, _rvq), CodecSpec(RVQValueCodec, _rvq)))

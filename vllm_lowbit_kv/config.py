"""The low-bit KV configuration: a scheme's parameters, validated with pydantic.

Set without code changes, in either form::

    vllm serve MODEL --kv-cache-dtype vidkv_stp \\
        --additional-config '{"lowbit_kv": {"protect": 0.25, "sink_tokens": 4, "skip_layers": [0]}}'
    python -m serving --kv-cache-dtype vidkv_stp --lowbit-config lowbit.json

(``lowbit.json`` holds the same object: ``{"protect": 0.25, ...}``; the launcher
turns it into the additional config.) Every field is optional; absent fields keep
the scheme's defaults (:mod:`vllm_lowbit_kv.schemes`).

Fields
------
Cache layout (any scheme):

* ``block_tokens``: tokens per quantization group (codec statistics run over
  them; vLLM's ``--block-size`` must be a multiple).
* ``sink_tokens``: first tokens of every sequence also kept exactly in the model
  dtype (attention sinks), at most ``block_tokens``; costs
  ``2 * sink_tokens * head_dim`` model-dtype elements per KV head in every
  page (see :mod:`vllm_lowbit_kv.paged`).
* ``residual_tokens``: the most recent tokens of every sequence (a multiple of
  ``block_tokens``, at most 1024; 0: none) read in the model dtype, KIVI's and
  VidKV's full-precision residual (R = 128 by default). The pages are still
  written as groups fill; the window is a model-dtype copy beside them that only
  the sequence that wrote it reads (:mod:`vllm_lowbit_kv.paged`), counted in
  ``effective_bits_at`` and inside the KV budget.
* ``leading_tokens``: the first tokens of every sequence (a multiple of
  ``block_tokens``, at most 1024; 0: none) read as staged, the residual window's
  counterpart at the start: attention sinks and a system prompt's instructions,
  which every later answer attends to. The same rules as the residual window: the
  pages are written as groups fill, only the sequence that wrote the copy reads it
  (another one sharing the first page through the prefix cache reads the page and
  its sink area), counted in ``effective_bits_at`` and inside the KV budget.
* ``staging_dtype``: ``model`` or ``int8``: what the staged tokens (the leading
  and residual windows and the partial last group) are held in: the model dtype, or int8 with a
  float32 scale per token and KV head (8.5 bits per element at head_dim 64, an error
  of at most absmax / 254 per element), about half the staging memory and 0.12 bits
  per element at 8K with 128-token groups. The current step's tokens are always
  attended exactly, and a completing group is encoded from its staged tokens as held.
* ``page_tokens``: tokens per vLLM page (block) when ``--block-size`` is not
  given (a multiple of ``block_tokens``; default: 512 rounded up to one). Every
  page carries the sink area, so larger pages make sinks cheap;
  ``effective_bits_at`` counts pages of this size.
* ``rotate``: ``none`` or ``hadamard``: multiply K and V head vectors by a fixed
  randomized Hadamard matrix (per layer, signs from ``rotate_seed``) before
  encoding (:mod:`vllm_lowbit_kv.rotation`); attention stays exact in math.
* ``protect_first``: ``visual`` or ``text``: which tokens of a group that holds
  visual (image, video-frame) tokens STP's protected rows go to first. ``visual``
  (default) is VidKV's rule (the visual tokens the text attends to most); ``text``
  is the visual-only mode (seed 003's setting, scheme ``vidkv_visual``): text
  tokens at the protected rows' 2 bits, visual tokens at the low-bit code, the rows
  text leaves over to the most relevant visual tokens. Needs a scheme that protects
  tokens (``protect`` > 0).
* ``retrieval_heads``: how many KV heads of the model (layers x KV heads; the
  highest retrieval scores, measured once per model on held-out needle prompts and
  cached, :mod:`vllm_lowbit_kv.retrieval_heads`) are coded by ``retrieval_scheme``'s
  codecs (default ``kivi4``) instead of the scheme's: the few heads that copy facts
  from far back (vidkv: 6 of SmolLM2's 90). ``retrieval_keys_only``: those heads take
  only the key codec of ``retrieval_scheme``, their values keep the scheme's. Their
  bytes are in the pages of their layers and in every bits figure; 0 turns it off.
  Not with STP or RVQ codecs, nor with eviction.
* ``skip_layers``: layer indices kept entirely in the model dtype (bf16 pages of
  their own size, vLLM's own attention).
* ``obs_window``: queries in the STP observation window (relevance schemes such
  as ``vidkv_stp``), at most ``block_tokens``.

Eviction (:mod:`vllm_lowbit_kv.vllm.eviction`; off unless ``eviction`` is set):

* ``eviction``: the policy, one of ``flashcache``, ``uniform``, ``random``,
  ``recency`` (:mod:`vllm_lowbit_kv.eviction.policies`); evicts once per request,
  after its prefill, prompt tokens only, and gives the freed blocks back.
* ``retention``: kept fraction of the prompt's KV pairs, in (0, 1] (required
  with ``eviction``).
* ``eviction_gamma``: FlashCache's low-pass cut-off factor, in (0, 1).
* ``eviction_sinks``, ``recent_window``: first / last prompt tokens every
  policy keeps.
* ``eviction_layer_cap``: a layer keeps at most this multiple of the mean
  retention (>= 1): bounds the blocks a request keeps before its K/V are seen.

Kernels:

* ``attention_impl``: the packed-attention implementation, ``auto`` (the fastest
  that can run the scheme on the device), ``torch`` (the PyTorch reference),
  ``cpp`` (the C++ CPU kernel), ``triton`` or ``cuda`` (GPU); unset: the
  environment variable ``LOWBIT_KV_ATTENTION_IMPL``, else ``auto``. A named
  implementation that cannot run is refused at start-up with the reason
  (:mod:`vllm_lowbit_kv.ops`).
* ``reference_arithmetic``: ``true`` encodes groups with the codecs and attends to a
  prefill chunk's exact part with torch, the transformers cache's own arithmetic,
  instead of the C++ encoder and dense kernel (default ``false``): what the engines'
  float32 parity checks need, where the kernels' float32 rounding flips a few codes
  at their thresholds; slower.

Codec parameters (each reaches the scheme's codec(s) that take it, see
:meth:`vllm_lowbit_kv.schemes.KVScheme.with_params`; a parameter no codec of
the scheme takes is refused with the names it does take): ``k``, ``fft``,
``one_bit`` (VidKV keys), ``gamma``, ``protect`` (VidKV ternary values / STP),
``bits``, ``axis``, ``group_size`` (KIVI, quantile, dynamic), ``alpha``,
``rounding`` (quantile), ``ema``, ``normalize``, ``fine_group_size``,
``fine_fraction``, ``tau``, ``eps`` (dynamic), ``num_codebooks``,
``codebook_size``, ``grouping`` and ``codebook`` (RVQ: ``group_size`` is the
code dimension; ``codebook`` the safetensors file of learned codebooks that
``python -m vllm_lowbit_kv.calibrate`` writes, refused at start-up when missing
or made for another model or configuration).

Errors (:class:`LowBitKVConfigError`, a ValueError) name the field and what it
accepts; unknown fields are refused with the list of known ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .codecs.base import ModelIdentity, require
from .codecs.quant import STAGING_DTYPES
from .codecs.quantile1 import ROUNDINGS
from .codecs.rvq import GROUPINGS
from .eviction.policies import DEFAULT_GAMMA, DEFAULT_RECENT_WINDOW, DEFAULT_SINK_TOKENS, POLICIES
from .codecs.vidkv import ONE_BIT_MODES, PROTECT_FIRST
from .ops import CHOICES as ATTENTION_IMPLS
from .rotation import ROTATIONS
from .schemes import CACHE_FIELDS as SCHEME_CACHE_FIELDS
from .schemes import MAX_PAGE_TOKENS, MAX_RESIDUAL_TOKENS, KVScheme, get_scheme

#: key of vLLM's ``--additional-config`` object holding our configuration
ADDITIONAL_CONFIG_KEY = "lowbit_kv"
DEFAULT_OBS_WINDOW = 32
#: context lengths (tokens) of the bits-with-staging figures in the start-up line
BITS_AT_CONTEXTS = (4096, 8192, 32768)

EVICTION_FIELDS = ("eviction", "retention", "eviction_gamma", "eviction_sinks", "recent_window",
                   "eviction_layer_cap")
CACHE_FIELDS = (*SCHEME_CACHE_FIELDS, "skip_layers", "obs_window", *EVICTION_FIELDS)
DEFAULT_LAYER_CAP = 2.0
KERNEL_FIELDS = ("attention_impl", "reference_arithmetic")


class LowBitKVConfigError(ValueError):
    """A bad lowbit_kv configuration; the message names the field and its allowed values."""


class LowBitKVConfig(BaseModel):
    """``{"lowbit_kv": {...}}`` of vLLM's additional config (every field optional)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # cache layout
    block_tokens: int | None = Field(None, ge=1, le=4096,
                                     description="tokens per quantization group")
    sink_tokens: int | None = Field(None, ge=0, le=4096,
                                    description="first tokens of a sequence kept exact")
    residual_tokens: int | None = Field(None, ge=0, le=MAX_RESIDUAL_TOKENS,
                                        description="most recent tokens read in the model dtype")
    leading_tokens: int | None = Field(None, ge=0, le=MAX_RESIDUAL_TOKENS,
                                       description="first tokens read as staged by their writer")
    page_tokens: int | None = Field(None, ge=1, le=MAX_PAGE_TOKENS,
                                    description="tokens per vLLM page unless --block-size is given")
    rotate: Literal[ROTATIONS] | None = None  # type: ignore[valid-type]
    rotate_seed: int | None = None
    protect_first: Literal[PROTECT_FIRST] | None = None  # type: ignore[valid-type]
    retrieval_heads: int | None = Field(None, ge=0, le=1 << 16,
                                        description="KV heads coded by retrieval_scheme")
    retrieval_scheme: str | None = None
    retrieval_keys_only: bool | None = None
    staging_dtype: Literal[STAGING_DTYPES] | None = None  # type: ignore[valid-type]
    skip_layers: list[int] = Field(default_factory=list,
                                   description="layer indices kept in the model dtype")
    obs_window: int = Field(DEFAULT_OBS_WINDOW, ge=1, le=4096,
                            description="queries in the STP observation window")
    # eviction (None: off)
    eviction: Literal[tuple(POLICIES)] | None = None  # type: ignore[valid-type]
    retention: float | None = None
    eviction_gamma: float = DEFAULT_GAMMA
    eviction_sinks: int = Field(DEFAULT_SINK_TOKENS, ge=0, le=1 << 20)
    recent_window: int = Field(DEFAULT_RECENT_WINDOW, ge=0, le=1 << 20)
    eviction_layer_cap: float = DEFAULT_LAYER_CAP
    # kernels
    attention_impl: Literal[ATTENTION_IMPLS] | None = None  # type: ignore[valid-type]
    reference_arithmetic: bool = False
    # codec parameters (None: the scheme's default)
    k: float | None = None
    fft: bool | None = None
    one_bit: Literal[ONE_BIT_MODES] | None = None  # type: ignore[valid-type]
    gamma: float | None = None
    protect: float | None = None
    bits: int | None = None
    axis: Literal["channel", "token", "head"] | None = None
    group_size: int | None = None
    alpha: float | None = None
    rounding: Literal[ROUNDINGS] | None = None  # type: ignore[valid-type]
    ema: float | None = None
    normalize: bool | None = None
    fine_group_size: int | None = None
    fine_fraction: float | None = None
    tau: float | None = None
    eps: float | None = None
    num_codebooks: int | None = None
    codebook_size: int | None = None
    grouping: Literal[GROUPINGS] | None = None  # type: ignore[valid-type]
    codebook: str | None = Field(None, description="RVQ codebook file (safetensors)")

    @field_validator("skip_layers")
    @classmethod
    def _layers(cls, v: list[int]) -> list[int]:
        bad = [i for i in v if i < 0]
        if bad:
            raise ValueError(f"layer indices must be >= 0, got {bad}")
        return sorted(set(v))

    @field_validator("retention")
    @classmethod
    def _retention(cls, v: float | None) -> float | None:
        if v is not None:
            require(0 < v <= 1, "retention", "a number in (0, 1] (kept fraction of the prompt's "
                    "KV pairs)", v)
        return v

    @field_validator("eviction_gamma")
    @classmethod
    def _gamma(cls, v: float) -> float:
        require(0 < v < 1, "eviction_gamma", "a number in (0, 1) (low-pass cut-off w = gamma * N)", v)
        return v

    @field_validator("eviction_layer_cap")
    @classmethod
    def _layer_cap(cls, v: float) -> float:
        require(v >= 1, "eviction_layer_cap", "a number >= 1 (a layer's budget over the mean)", v)
        return v

    @model_validator(mode="after")
    def _eviction_complete(self) -> "LowBitKVConfig":
        require(self.eviction is None or self.retention is not None, "retention",
                "set with eviction (a number in (0, 1])", None)
        return self

    def eviction_policy(self):
        """The configured eviction policy (None when eviction is off)."""
        if self.eviction is None:
            return None
        from .eviction import make_policy
        return make_policy(self.eviction, self.retention, gamma=self.eviction_gamma,
                           sink_tokens=self.eviction_sinks, recent_window=self.recent_window)

    # -- construction ---------------------------------------------------------------
    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> "LowBitKVConfig":
        """Validate a mapping (e.g. the ``lowbit_kv`` object); errors name the field."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise LowBitKVConfigError(
                f"lowbit_kv config must be a JSON object of fields {sorted(cls.model_fields)}, "
                f"got {type(raw).__name__}: {raw!r}")
        try:
            return cls.model_validate(dict(raw))
        except ValidationError as e:
            raise LowBitKVConfigError(_explain(e)) from None

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "LowBitKVConfig":
        """The ``lowbit_kv`` entry of vLLM's ``additional_config`` (absent: defaults)."""
        raw = None
        if isinstance(additional_config, Mapping):
            raw = additional_config.get(ADDITIONAL_CONFIG_KEY)
        return cls.parse(raw)

    # -- use --------------------------------------------------------------------------
    def codec_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items()
                if k not in CACHE_FIELDS + KERNEL_FIELDS and v is not None}

    def explicit(self) -> dict[str, Any]:
        """The fields that were set (for logs)."""
        return self.model_dump(exclude_unset=True)

    def scheme(self, name: str, head_dim: int = 64) -> KVScheme:
        """The registered scheme ``name`` with these overrides, as the vLLM backend runs it,
        validated for a model of head size ``head_dim``.

        Codecs that thread per-sequence state through ``encode_stream`` (the dynamic
        schemes' EMA recorders) run stateless in vLLM: a block's bytes may be shared
        by prefix caching across sequences with different histories, so every block
        is encoded with its own statistics, i.e. ``ema = 0``. The returned scheme
        says so (``ema=0.0``, what the transformers yardstick must use to give the
        same numbers); an explicit ``ema`` other than 0 is refused.
        """
        try:
            base = get_scheme(name)
        except ValueError as e:
            raise LowBitKVConfigError(str(e)) from None
        params = self.codec_params()
        params.update({f: getattr(self, f) for f in SCHEME_CACHE_FIELDS
                       if getattr(self, f) is not None})
        try:
            base.codecs(head_dim)
        except ValueError:
            head_dim = 64  # a head size the scheme cannot serve: check_model says so, not us
        kc, vc = base.codecs(head_dim)
        if any(hasattr(c, "encode_stream") for c in (kc, vc)):
            ema = params.get("ema", 0.0)
            if ema != 0:
                raise LowBitKVConfigError(
                    f"ema must be 0 for --kv-cache-dtype {name} in the vLLM backend, got {ema!r}: "
                    "per-sequence EMA recorders cannot follow blocks shared by prefix caching, "
                    "so every block is encoded with its own statistics")
            params["ema"] = 0.0
        try:
            return base.with_params(head_dim, **params) if params else base
        except ValueError as e:
            raise LowBitKVConfigError(f"lowbit_kv config for {name}: {e}") from None

    def check_model(self, scheme: KVScheme, *, head_dim: int, num_layers: int,
                    block_size: int | None = None, model: ModelIdentity | None = None) -> list[str]:
        """Reasons this configuration cannot serve a model (empty: it can). With ``model``,
        learned codec state (RVQ codebooks) is checked against it too."""
        reasons = []
        T = scheme.block_tokens
        try:
            scheme.codecs(head_dim)
        except ValueError as e:
            reasons.append(f"head_dim {head_dim}: {e}")
        else:
            if model is not None:
                reasons += scheme.check_model(model)
        if block_size is not None and block_size % T:
            reasons.append(f"--block-size {block_size} is not a multiple of the scheme's "
                           f"block_tokens ({T})")
        if scheme.sink_tokens > T:
            reasons.append(f"sink_tokens must be at most block_tokens ({T}) in the vLLM backend "
                           f"(the sinks live in a sequence's first group), got {scheme.sink_tokens}")
        if scheme.uses_relevance and self.obs_window > T:
            reasons.append(f"obs_window must be at most block_tokens ({T}) in the vLLM backend "
                           f"(earlier queries of the window are kept with the partial group), "
                           f"got {self.obs_window}")
        bad = [i for i in self.skip_layers if i >= num_layers]
        if bad:
            reasons.append(f"skip_layers must be layer indices in [0, {num_layers}), got {bad}")
        elif self.skip_layers and len(self.skip_layers) == num_layers:
            reasons.append("skip_layers lists every layer: nothing would be packed "
                           "(use --kv-cache-dtype auto)")
        return reasons

    def bits_per_element(self, scheme: KVScheme, *, head_dim: int, num_kv_heads: int,
                         num_layers: int, block_size: int,
                         model_dtype_bytes: int = 2) -> dict[str, Any]:
        """Honest bits per K/V element: ``groups`` (the codec groups), ``pages`` (every
        byte of a page: sink area, padding), ``overall`` (over all layers, the
        ``skip_layers`` in the model dtype), ``at_context`` (one sequence of L tokens, L in
        :data:`BITS_AT_CONTEXTS`: its pages plus its staging, residual window and partial
        group in the scheme's ``staging_dtype``, over all layers); ``layout`` is the page layout."""
        from .paged import sink_dtype

        dtype = sink_dtype(model_dtype_bytes)
        n_skip = len(self.skip_layers)
        heads = (num_layers - n_skip) * num_kv_heads  # KV heads of the packed layers
        share = scheme.retrieval_share(heads)
        layout = scheme.layout(head_dim, num_kv_heads, block_size, dtype)
        page = layout.bits_per_element
        if share:  # the retrieval heads' pages, weighted by their share of the heads
            retrieval = scheme.retrieval_layout(head_dim, num_kv_heads, block_size, dtype)
            page = (1 - share) * page + share * retrieval.bits_per_element

        def over_layers(packed: float) -> float:
            return (packed * (num_layers - n_skip) + 8 * model_dtype_bytes * n_skip) / num_layers
        # one sequence of L tokens: its pages plus its staging (residual window, partial group)
        at = {L: over_layers(scheme.effective_bits_at(L, head_dim, block_size, model_dtype_bytes,
                                                      heads))
              for L in BITS_AT_CONTEXTS}
        return dict(groups=scheme.effective_bits(head_dim, model_kv_heads=heads), pages=page,
                    overall=over_layers(page), at_context=at, layout=layout)

    def summary(self, name: str, scheme: KVScheme, *, head_dim: int, num_kv_heads: int,
                num_layers: int, block_size: int, model_dtype_bytes: int = 2,
                kernel_table_bytes: int = 0) -> str:
        """The start-up log line: the effective configuration and its honest bits;
        ``kernel_table_bytes``: what the packed-attention kernel keeps per packed layer
        beside the codecs' learned state (the C++ kernel's RVQ tables)."""
        kc, vc = scheme.codecs(head_dim)
        bits = self.bits_per_element(scheme, head_dim=head_dim, num_kv_heads=num_kv_heads,
                                     num_layers=num_layers, block_size=block_size,
                                     model_dtype_bytes=model_dtype_bytes)
        packed, page, overall = bits["groups"], bits["pages"], bits["overall"]
        layout = bits["layout"]
        n_skip = len(self.skip_layers)
        params = {"k": kc, "v": vc}
        # learned state kept outside the pages, for the packed layers (RVQ codebooks)
        packed_layers = num_layers - n_skip
        side = sum(getattr(c, "codebook_bytes", 0) for c in (kc, vc)) * packed_layers
        # and in memory: the file's tensors, each layer's float32 copy, the kernel's tables
        held = side + (sum(getattr(c, "working_bytes", 0) for c in (kc, vc))
                       + kernel_table_bytes) * packed_layers
        codec_desc = "; ".join(f"{w} {describe_codec(c)}" for w, c in params.items())
        return (
            f"lowbit-kv: --kv-cache-dtype {name} ({scheme.summary}); {codec_desc}; "
            f"block_tokens={scheme.block_tokens} sink_tokens={scheme.sink_tokens} "
            f"residual_tokens={scheme.residual_tokens} leading_tokens={scheme.leading_tokens} "
            f"staging_dtype={scheme.staging_dtype} "
            f"rotate={scheme.rotate} "
            f"{f'protect_first={scheme.protect_first} ' if scheme.uses_relevance else ''}"
            + (f"retrieval_heads={scheme.retrieval_heads} ({scheme.retrieval_scheme} "
               f"{'keys' if scheme.retrieval_keys_only else 'keys and values'}) "
               if scheme.retrieval_heads else "") +
            f"skip_layers={self.skip_layers} obs_window={self.obs_window}"
            f"{' (STP relevance)' if scheme.uses_relevance else ''}; set: {self.explicit() or '{}'}. "
            f"Effective bits/element: groups {packed:.3f} (K {kc.effective_bits:.3f}, "
            f"V {vc.effective_bits:.3f}), pages {page:.3f} with sink area, "
            f"{overall:.3f} over all {num_layers} layers ({n_skip} in the model dtype), "
            f"with staging at " + "/".join(f"{L // 1024}K" for L in bits["at_context"]) + " tokens: "
            + "/".join(f"{b:.3f}" for b in bits["at_context"].values()) + "; "
            f"{layout.page_bytes} B per {block_size}-token page per layer"
            f"{' without retrieval heads' if scheme.retrieval_heads else ''} "
            f"({layout.bytes_per_token:.1f} B/token vs {2 * num_kv_heads * head_dim * model_dtype_bytes} "
            f"in the model dtype)"
            + (f"; outside the pages: codebooks {side / 2**20:.2f} MiB in fp16, held in "
               f"memory with their float32 copies and the kernel's search tables "
               f"{held / 2**20:.2f} MiB" if side else ""))


def describe_codec(codec) -> str:
    """``VidKVKeyCodec(k=0.5, fft=True, ...)``: the class and its constructor parameters."""
    return f"{type(codec).__name__}({', '.join(f'{p}={getattr(codec, p)!r}' for p in _shown(codec))})"


def _shown(codec) -> list[str]:
    import inspect

    names = [p for p in inspect.signature(type(codec).__init__).parameters
             if p not in ("self", "block_tokens", "head_dim", "layer")]
    return [p for p in names if hasattr(codec, p)]


def _explain(e: ValidationError) -> str:
    known = sorted(LowBitKVConfig.model_fields)
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(config)"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {loc!r}; known fields: {known}")
        else:
            field = LowBitKVConfig.model_fields.get(str(err["loc"][0])) if err["loc"] else None
            ann = getattr(field, "annotation", None)
            allowed = f" (type {_type_name(ann)})" if ann is not None else ""
            msg = err["msg"].removeprefix("Value error, ")
            got = "" if err["type"] == "value_error" else f", got {err.get('input')!r}"
            parts.append(f"field {loc!r}: {msg}{got}{allowed}")
    return "lowbit_kv config: " + "; ".join(parts)


def _type_name(ann: Any) -> str:
    s = str(ann)
    return s.replace("typing.", "").replace("NoneType", "None")


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a ``--lowbit-config`` JSON file: the fields, or ``{"lowbit_kv": {fields}}``."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise LowBitKVConfigError(f"--lowbit-config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise LowBitKVConfigError(f"--lowbit-config {path}: not valid JSON ({e})") from None
    if isinstance(raw, dict) and set(raw) == {ADDITIONAL_CONFIG_KEY}:
        raw = raw[ADDITIONAL_CONFIG_KEY]
    if not isinstance(raw, dict):
        raise LowBitKVConfigError(f"--lowbit-config {path}: must hold a JSON object, got "
                                  f"{type(raw).__name__}")
    return raw

"""A transformers ``Cache`` that stores K/V through our block codecs.

This is the public way to use the codecs from transformers::

    from vllm_lowbit_kv.hf_cache import LowBitKVCache

    cache = LowBitKVCache("kivi2", model=model)          # or model_config=model.config
    out = model(input_ids, past_key_values=cache, use_cache=True)
    out = model.generate(input_ids, past_key_values=LowBitKVCache("kivi2", model=model))
    print(cache.memory_report())

Storage, per layer and per sequence (tokens in position order)::

    [ block 0 | block 1 | ... | tail ]      + sinks: exact copies of the first tokens
      packed uint8 (codec)      model dtype, < block_tokens tokens

* The first ``sink_tokens`` tokens (attention sinks) are also kept in the model
  dtype and read from there, as the vLLM pages do (:mod:`vllm_lowbit_kv.paged`):
  block 0 is coded with the sink rows replaced by the mean of its other rows,
  so they do not stretch its statistics.
* Every complete group of ``block_tokens`` tokens (from position 0) is encoded
  by the scheme's key and value codecs, and only the packed bytes are kept
  (``[B, n_blocks, kv_heads, nbytes]`` uint8, exactly ``codec.nbytes`` per
  (block, head)).
* The incomplete last block (the tail) stays in the model dtype; it is encoded
  as soon as it fills, whether by a prefill chunk or by decode steps.
* Residual window (the scheme's ``residual_tokens`` R, KIVI's and VidKV's
  full-precision residual): the last ``R / block_tokens`` encoded blocks are
  also kept exactly, and attention reads those copies instead of their codes,
  as the vLLM backend does (:mod:`vllm_lowbit_kv.paged`).
* Rotation (the scheme's ``rotate``): blocks are rotated per layer before
  encoding and un-rotated after decoding (:mod:`vllm_lowbit_kv.rotation`).
* Layers in ``skip_layers`` keep everything in the model dtype.
* Codecs with per-sequence state (``encode_stream(blocks, state) -> (packed,
  state)``, e.g. the dynamic scheme's EMA recorders) get their blocks in
  order with the state threaded per layer; each block still decodes alone.

What attention sees: ``update`` returns ``decode(packed blocks before the
window) ++ window ++ tail``, the sink positions taken from the sinks. The tokens written by the current forward are attended at model
precision in that forward (``attend_new_exact=True``, the default, as in KIVI /
VidKV Algorithm 1 and a fused kernel that attends the chunk it just wrote);
every later forward sees them through the codec once their block is full.
With ``attend_new_exact=False`` the blocks completed by this update are
already seen through the codec.

Relevance (Semantic Token Protection, for schemes with ``uses_relevance``):
the relevance of a token is the attention mass it receives from an
*observation window*: the ``obs_window`` most recent queries of the layer
(RoPE applied, softmax over every cached key with the causal mask, summed over
the window's queries and over the query heads sharing the KV head). The
queries are captured by a forward pre-hook on each attention module
(:func:`install_query_hooks`, installed when ``model=`` is given). When a block
is encoded, the window holds the last queries of the forward that completed
it: for a prefill chunk, the chunk's last tokens (DESIGN.md: "scores of prompt
tokens against the queries of the last text tokens"); in decode, the last
``obs_window`` generated tokens. Without a model (``model_config`` only) the
proxy is ``relevance="keynorm"``: minus the L2 norm of the key (low-norm keys
draw high attention; Devoto et al. 2024, "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression"). A callable can also be given
(see :data:`RelevanceFn`). Only the ranking inside a (block, head) matters to
the codecs.

Eviction (FlashCache and baselines, :mod:`vllm_lowbit_kv.eviction`): a cache
made with ``evictable=True`` also keeps the exact K/V of every token until
:meth:`LowBitKVCache.evict` runs, once, after the prompt's prefill (prompt
tokens only). The policy scores the *exact* prompt K/V of every layer (never
their codec reconstruction) and picks each layer's kept positions; each layer
then rebuilds its storage from its kept pairs, in position order, exactly as if
that compacted sequence had been written: the first ``sink_tokens`` kept pairs
in the sink area, every full group of ``block_tokens`` kept pairs encoded
from the exact values (each kept pair is quantized once, in a group of kept
pairs; STP relevance from the prompt's last queries, causal by original
position), the rest in the tail. Later tokens append as usual. Positions stay
logical (``get_seq_length()`` counts every token ever written, so RoPE
positions continue from the prompt's length), while the layers now hold
different numbers of pairs: :meth:`~LowBitKVCache.evict` switches the model to
:data:`COMPACTED_ATTENTION`, SDPA with the causal mask aligned to each layer's
own key count. ``scheme=None`` keeps every layer in the model dtype (the bf16
cache with eviction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .codecs.base import BlockCodec, ModelIdentity, require
from .paged import SINK_RELEVANCE, attention_mass, mask_sink_rows
from .rotation import HadamardRotation
from .schemes import KVScheme, get_scheme

if TYPE_CHECKING:
    from .eviction import EvictionPlan, EvictionPolicy

__all__ = ["LowBitKVCache", "LowBitLayer", "install_query_hooks", "RelevanceFn",
           "RELEVANCE_MODES", "COMPACTED_ATTENTION", "use_compacted_attention"]

#: ``fn(layer_idx, keys, values, start, end) -> relevance``: ``keys``/``values`` are
#: every token of the layer so far, [B, kv_heads, N, D]; return the relevance of
#: tokens ``start:end`` as [B, end - start, kv_heads] (higher = more important).
RelevanceFn = Callable[[int, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
RELEVANCE_MODES = ("auto", "attention", "keynorm", "none")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _query_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Record the last queries of a Llama-style attention module into a LowBitKVCache."""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, LowBitKVCache) or not cache.records_queries:
        return
    layer = cache.layers[module.layer_idx]
    if not layer.wants_queries:
        return
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs["position_embeddings"]
    w = min(layer.obs_window, hidden.shape[1])
    B = hidden.shape[0]
    with torch.no_grad():
        q = module.q_proj(hidden[:, -w:]).view(B, w, -1, module.head_dim)
        if getattr(module, "q_norm", None) is not None:  # Qwen3-style per-head norm before RoPE
            q = module.q_norm(q)
        q = q.transpose(1, 2)
        cos, sin = cos[:, -w:].unsqueeze(1), sin[:, -w:].unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
    first = layer.length + hidden.shape[1] - w  # position of the first recorded query
    layer.record_queries(q, first, float(getattr(module, "scaling", module.head_dim ** -0.5)))


def install_query_hooks(model: torch.nn.Module) -> int:
    """Install (once) the pre-hooks that feed attention-mass relevance; returns how many.

    Supports Llama-style attention modules: ``q_proj``, ``head_dim``, ``layer_idx``,
    rotary ``position_embeddings=(cos, sin)`` passed as a keyword (Llama, Mistral,
    Qwen2/3, SmolLM2). Anything else is refused rather than scored wrongly.
    """
    if getattr(model, "_lowbit_query_hooks", None):
        return len(model._lowbit_query_hooks)
    handles = []
    for mod in model.modules():
        if hasattr(mod, "q_proj") and hasattr(mod, "layer_idx") and hasattr(mod, "head_dim"):
            handles.append(mod.register_forward_pre_hook(_query_pre_hook, with_kwargs=True))
    if not handles:
        raise ValueError(
            f"relevance='attention' needs Llama-style attention modules (q_proj, head_dim, "
            f"layer_idx, rotary position_embeddings); none found in {type(model).__name__}. "
            "Use relevance='keynorm' or pass a callable.")
    model._lowbit_query_hooks = handles
    return len(handles)


#: transformers attention implementation for caches whose layers hold different numbers
#: of pairs (after eviction); registered by :func:`use_compacted_attention`
COMPACTED_ATTENTION = "lowbit_kv_compacted"


def _compacted_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    """transformers' SDPA, with the causal mask aligned bottom-right on this layer's keys.

    The model builds one mask for all layers from the logical length; a compacted
    layer holds fewer keys, all of them before the fresh queries except the fresh
    tokens themselves, so query i sees every key up to ``k - q + i``. Where the
    mask already fits the keys (no eviction) it is used unchanged: same numbers
    as ``sdpa``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k = query.shape[-2], key.shape[-2]
    if attention_mask is not None and attention_mask.shape[-1] != k:
        require(query.shape[0] == 1, "batch size with an evicted cache",
                "1 (a padding mask cannot be mapped onto compacted keys)", query.shape[0])
        attention_mask = None
    if attention_mask is None and 1 < q != k:
        attention_mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_compacted_attention(model: torch.nn.Module) -> None:
    """Register :data:`COMPACTED_ATTENTION` (once) and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(COMPACTED_ATTENTION, _compacted_sdpa)
    AttentionMaskInterface.register(COMPACTED_ATTENTION, sdpa_mask)
    if model.config._attn_implementation != COMPACTED_ATTENTION:
        model.set_attn_implementation(COMPACTED_ATTENTION)


class LowBitLayer(DynamicLayer):
    """One layer's K/V: sinks and tail in the model dtype, full blocks packed by codecs."""

    is_croppable = False

    def __init__(self, layer_idx: int, key_codec: BlockCodec | None, value_codec: BlockCodec | None,
                 block_tokens: int, sink_tokens: int = 0, relevance: str | RelevanceFn = "none",
                 obs_window: int = 32, attend_new_exact: bool = True, evictable: bool = False,
                 residual_tokens: int = 0, rotation: HadamardRotation | None = None):
        super().__init__()
        require(isinstance(residual_tokens, int) and residual_tokens >= 0
                and (residual_tokens == 0 or residual_tokens % block_tokens == 0), "residual_tokens",
                f"a multiple of block_tokens ({block_tokens}), >= 0", residual_tokens)
        #: complete groups of the residual window, read exactly instead of their codes
        self.window_groups = residual_tokens // block_tokens if residual_tokens else 0
        self.rotation = rotation
        self.layer_idx = layer_idx
        self.evictable = evictable
        self.key_codec, self.value_codec = key_codec, value_codec
        self.skip = key_codec is None
        self.block_tokens, self.sink_tokens = block_tokens, sink_tokens
        self.obs_window, self.attend_new_exact = obs_window, attend_new_exact
        needs = not self.skip and (key_codec.uses_relevance or value_codec.uses_relevance)
        self.relevance = relevance if needs else "none"
        self.wants_queries = self.relevance == "attention"
        self._reset_state()

    def _reset_state(self) -> None:
        self.length = 0
        self.sink_k = self.sink_v = None
        self.packed_k = self.packed_v = None  # uint8 [B, n_blocks, H, nbytes]
        self.window_k = self.window_v = None  # exact copies of the last window_groups blocks
        self.q_obs: torch.Tensor | None = None  # float32 [B, Hq, w, D]
        self.q_first = 0
        self.q_scale = 1.0
        self.stream_state: dict[str, Any] = {"k": None, "v": None}  # encode_stream recorders
        self.exact_k: list[torch.Tensor] = []  # exact K/V of every token until eviction
        self.exact_v: list[torch.Tensor] = []
        self.key_pos: torch.Tensor | None = None  # logical position of each stored pair, once evicted

    # -- transformers layer API --------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H, _, D = key_states.shape
        if not self.skip:
            require(D == self.key_codec.head_dim, "head_dim", f"{self.key_codec.head_dim} (the codecs')", D)
        empty = key_states.new_zeros(B, H, 0, D)
        self.keys, self.values = empty, value_states.new_zeros(B, H, 0, value_states.shape[-1])
        self.sink_k, self.sink_v = empty.clone(), self.values.clone()

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("LowBitKVCache cannot crop: packed blocks are not re-openable")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        self.keys, self.values = self.keys.index_select(0, idx), self.values.index_select(0, idx)
        self.sink_k, self.sink_v = self.sink_k.index_select(0, idx), self.sink_v.index_select(0, idx)
        if self.packed_k is not None:
            self.packed_k = self.packed_k.index_select(0, idx)
            self.packed_v = self.packed_v.index_select(0, idx)
        if self.window_k is not None:
            self.window_k = self.window_k.index_select(0, idx)
            self.window_v = self.window_v.index_select(0, idx)
        if self.q_obs is not None:
            self.q_obs = self.q_obs.index_select(0, idx)
        self.exact_k = [t.index_select(0, idx) for t in self.exact_k]
        self.exact_v = [t.index_select(0, idx) for t in self.exact_v]
        for name, st in self.stream_state.items():
            if st is not None:
                vals = [t.index_select(0, idx) for t in st]
                self.stream_state[name] = type(st)(*vals) if hasattr(st, "_fields") else tuple(vals)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        idx = torch.as_tensor(indices, device=self.device)
        self.reorder_cache(idx.nonzero().flatten() if idx.dtype == torch.bool else idx.flatten())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            B = self.keys.shape[0]
            self.reorder_cache(torch.arange(B, device=self.device).repeat_interleave(repeats))

    def offload(self):
        raise NotImplementedError("LowBitKVCache does not support offloading")

    # -- queries for the observation window ----------------------------------------
    def record_queries(self, q: torch.Tensor, first_pos: int, scale: float) -> None:
        q = q.float()
        if self.q_obs is None or self.q_obs.shape[0] != q.shape[0]:
            self.q_obs, self.q_first = q, first_pos
        else:
            prev_end = self.q_first + self.q_obs.shape[2]
            if prev_end != first_pos:  # a gap (a new chunk longer than the window): restart
                self.q_obs, self.q_first = q, first_pos
            else:
                self.q_obs = torch.cat([self.q_obs, q], dim=2)
                drop = max(self.q_obs.shape[2] - self.obs_window, 0)
                self.q_obs, self.q_first = self.q_obs[:, :, drop:], self.q_first + drop
        self.q_scale = scale

    def _attention_mass(self, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Attention mass of the observation window on tokens start:end -> [B, H, end - start]
        (:func:`~vllm_lowbit_kv.paged.attention_mass`, the pages' definition)."""
        if self.q_obs is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: relevance='attention' but no queries were recorded; "
                "create the cache with model=... (installs the query hooks) or call "
                "install_query_hooks(model), or use relevance='keynorm'")
        mass = torch.stack([attention_mass(q.transpose(0, 1), self.q_first, k.transpose(0, 1),
                                           self.q_scale, self.key_pos)
                            for q, k in zip(self.q_obs, keys)])  # [B, N, H]
        return mass[:, start:end].transpose(1, 2)

    def _relevance(self, keys: torch.Tensor, values: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """Relevance of tokens start:end as [B, end - start, H], or None."""
        mode = self.relevance
        if mode == "none":
            return None
        if callable(mode):
            return mode(self.layer_idx, keys, values, start, end)
        if mode == "keynorm":
            return -keys[:, :, start:end].float().norm(dim=-1).transpose(1, 2)
        return self._attention_mass(keys, start, end).transpose(1, 2)

    # -- blocks <-> [B, H, S, D] ------------------------------------------------
    def _encode(self, which: str, codec: BlockCodec, x: torch.Tensor, rel: torch.Tensor | None) -> torch.Tensor:
        if self.rotation is not None:
            x = self.rotation.rotate(x.float())
        B, H, S, D = x.shape
        n, T = S // self.block_tokens, self.block_tokens
        blocks = x.reshape(B, H, n, T, D).permute(0, 2, 3, 1, 4)  # [B, n, T, H, D]
        if hasattr(codec, "encode_stream") and rel is None:
            # codecs with per-sequence state (e.g. EMA recorders) thread it block to block
            packed, self.stream_state[which] = codec.encode_stream(blocks, self.stream_state[which])
            return packed
        if rel is not None:
            rel = rel.reshape(B, n, T, H)
        return codec.encode(blocks, rel)

    def _decode(self, codec: BlockCodec, packed: torch.Tensor) -> torch.Tensor:
        B, n, H, _ = packed.shape
        x = codec.decode(packed, self.dtype if self.rotation is None else torch.float32)
        if self.rotation is not None:
            x = self.rotation.unrotate(x).to(self.dtype)
        return x.permute(0, 3, 1, 2, 4).reshape(B, H, n * self.block_tokens, codec.head_dim)

    @property
    def n_window(self) -> int:
        """Encoded blocks read from their exact copies (the residual window)."""
        return 0 if self.window_k is None else self.window_k.shape[-2] // self.block_tokens

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token as attention sees it: decode(blocks before the window) ++ the
        window's blocks exact ++ tail, the sink positions exact."""
        ks, vs = [], []
        n_packed = self.n_blocks - self.n_window
        if n_packed:
            ks.append(self._decode(self.key_codec, self.packed_k[:, :n_packed]))
            vs.append(self._decode(self.value_codec, self.packed_v[:, :n_packed]))
        if self.n_window:
            ks.append(self.window_k)
            vs.append(self.window_v)
        ks.append(self.keys)
        vs.append(self.values)
        k, v = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
        n = self.sink_k.shape[-2]  # sink positions are read from their exact copies
        k[:, :, :n], v[:, :, :n] = self.sink_k, self.sink_v
        return k, v

    @property
    def n_blocks(self) -> int:
        return 0 if self.packed_k is None else self.packed_k.shape[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        S = key_states.shape[-2]
        if self.key_pos is not None:
            self.key_pos = torch.cat([self.key_pos, torch.arange(self.length, self.length + S)])
        elif self.evictable and not self.skip:
            self.exact_k.append(key_states)
            self.exact_v.append(value_states)
        self.length += S
        return self._store(key_states, value_states)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append pairs after the stored ones; what attention sees (stored ++ new, exact)."""
        if self.skip:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values
        # 1. the first tokens are also kept exactly, as sinks
        n_sink = min(max(self.sink_tokens - self.sink_k.shape[-2], 0), key_states.shape[-2])
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :n_sink]], dim=-2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :n_sink]], dim=-2)
        # 2. everything joins the tail; what attention sees now (new tokens exact)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        full_k, full_v = self.decoded()
        # 3. encode every full block of the tail
        n_full = self.keys.shape[-2] // self.block_tokens
        if n_full:
            m = n_full * self.block_tokens
            start = self.n_blocks * self.block_tokens
            rel = self._relevance(full_k, full_v, start, start + m)
            keys, values = self.keys[:, :, :m], self.values[:, :, :m]
            s = min(self.sink_tokens, self.block_tokens)
            if start == 0 and s:  # group 0, as the pages code it: sink rows never count
                keys, values = keys.clone(), values.clone()
                mask_sink_rows(keys[:, :, :self.block_tokens], s, dim=-2)
                mask_sink_rows(values[:, :, :self.block_tokens], s, dim=-2)
                if rel is not None:
                    rel = rel.clone()
                    rel[:, :s] = SINK_RELEVANCE
            pk = self._encode("k", self.key_codec, keys, rel if self.key_codec.uses_relevance else None)
            pv = self._encode("v", self.value_codec, values,
                              rel if self.value_codec.uses_relevance else None)
            self.packed_k = pk if self.packed_k is None else torch.cat([self.packed_k, pk], dim=1)
            self.packed_v = pv if self.packed_v is None else torch.cat([self.packed_v, pv], dim=1)
            if self.window_groups:
                keep = self.window_groups * self.block_tokens
                self.window_k = torch.cat([x for x in (self.window_k, self.keys[:, :, :m])
                                           if x is not None], dim=-2)[:, :, -keep:].clone()
                self.window_v = torch.cat([x for x in (self.window_v, self.values[:, :, :m])
                                           if x is not None], dim=-2)[:, :, -keep:].clone()
            self.keys = self.keys[:, :, m:].clone()
            self.values = self.values[:, :, m:].clone()
            if not self.attend_new_exact:
                full_k, full_v = self.decoded()
        return full_k, full_v

    # -- eviction ----------------------------------------------------------------
    def exact(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V [B, H, length, D] of every token written so far (before eviction)."""
        require(self.key_pos is None, f"layer {self.layer_idx} state", "not evicted yet", "evicted")
        if self.skip:
            return self.keys, self.values
        require(self.evictable, f"layer {self.layer_idx}", "made with evictable=True to evict", False)
        return torch.cat(self.exact_k, dim=-2), torch.cat(self.exact_v, dim=-2)

    def compact(self, kept: torch.Tensor) -> None:
        """Keep only the pairs at sorted positions ``kept``, stored as if written in order."""
        k, v = self.exact()
        kept = kept.to(torch.long).cpu()
        require(kept.numel() == 0 or (int(kept.min()) >= 0 and int(kept.max()) < self.length
                                      and bool((kept[1:] > kept[:-1]).all())),
                "kept positions", f"sorted, unique, in [0, {self.length})", kept.tolist()[:16])
        k, v = k[:, :, kept.to(k.device)], v[:, :, kept.to(k.device)]
        if self.skip:
            self.keys, self.values = k, v
        else:
            length, queries = self.length, (self.q_obs, self.q_first, self.q_scale)
            self._reset_state()
            self.lazy_initialization(k[:, :, :0], v[:, :, :0])
            self.length = length
            self.q_obs, self.q_first, self.q_scale = queries
            self.key_pos = kept  # before _store: relevance is causal by original position
            self._store(k, v)
            # rewritten groups are read from their codes, as the vLLM backend does after
            # compacting (its window slots are released); later groups refill the window
            self.window_k = self.window_v = None
        self.key_pos = kept
        self.exact_k, self.exact_v = [], []

    # -- accounting ------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes held by this layer (K and V together), and their bf16 equivalents."""
        if not self.is_initialized:
            return dict(tokens=0, stored_tokens=0, packed_tokens=0, packed_bytes=0, full_precision_bytes=0,
                        total_bytes=0, bf16_bytes=0)
        B, H = self.keys.shape[:2]
        D = self.keys.shape[-1]
        packed_tokens = self.n_blocks * self.block_tokens
        packed = 0 if self.packed_k is None else self.packed_k.numel() + self.packed_v.numel()
        fp = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.keys, self.values,
                                                         self.window_k, self.window_v)
                 if t is not None)
        stored = packed_tokens + self.keys.shape[-2]
        return dict(tokens=self.length, stored_tokens=stored, packed_tokens=packed_tokens, packed_bytes=packed,
                    full_precision_bytes=fp, total_bytes=packed + fp,
                    bf16_bytes=B * H * D * 2 * 2 * self.length)


class LowBitKVCache(Cache):
    """transformers ``Cache`` storing K/V through a registered scheme's codecs.

    Args:
        scheme: scheme name (``get_scheme``) or a :class:`KVScheme`; ``None``: every
            layer in the model dtype (with ``evictable``: the bf16 cache with eviction).
        model_config: the model's config (``num_hidden_layers``, ``num_key_value_heads``,
            ``head_dim``); taken from ``model.config`` when omitted.
        model: the model; enables ``relevance="attention"`` (installs the query hooks).
        block_tokens, sink_tokens, residual_tokens: override the scheme's defaults.
        skip_layers: layer indices kept entirely in the model dtype.
        relevance: ``"auto"`` (attention if ``model`` is given, else keynorm),
            ``"attention"``, ``"keynorm"``, ``"none"`` or a :data:`RelevanceFn`; used only
            by schemes whose codecs use relevance.
        obs_window: queries in the observation window (``relevance="attention"``).
        attend_new_exact: see the module docstring.
        evictable: keep the exact K/V until :meth:`evict` (see the module docstring).
    """

    def __init__(self, scheme: str | KVScheme, model_config: Any = None, *,
                 model: torch.nn.Module | None = None, block_tokens: int | None = None,
                 sink_tokens: int | None = None, residual_tokens: int | None = None, skip_layers: Iterable[int] = (),
                 relevance: str | RelevanceFn = "auto", obs_window: int = 32,
                 attend_new_exact: bool = True, evictable: bool = False):
        self.scheme = get_scheme(scheme) if isinstance(scheme, str) else scheme
        self.evictable = evictable
        if model_config is None:
            require(model is not None, "model_config", "given (or model=...)", None)
            model_config = model.config
        cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        bad = set(layer_types) - {"full_attention"}
        require(not bad, "model layer types", "only full_attention", sorted(bad))
        n_layers = cfg.num_hidden_layers
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if self.scheme is None:  # the model dtype everywhere
            skip_layers = range(n_layers)
        self.block_tokens = block_tokens or (self.scheme.block_tokens if self.scheme else 0)
        self.sink_tokens = sink_tokens if sink_tokens is not None else \
            (self.scheme.sink_tokens if self.scheme else 0)
        require(isinstance(self.sink_tokens, int) and self.sink_tokens >= 0
                and (self.scheme is None or self.sink_tokens <= self.block_tokens), "sink_tokens",
                f"an int in [0, block_tokens={self.block_tokens}] (the sinks live in a sequence's "
                "first group, as in the vLLM pages)", self.sink_tokens)
        self.residual_tokens = residual_tokens if residual_tokens is not None else \
            (self.scheme.residual_tokens if self.scheme else 0)
        self.skip_layers = frozenset(int(i) for i in skip_layers)
        require(all(0 <= i < n_layers for i in self.skip_layers), "skip_layers",
                f"indices in [0, {n_layers})", sorted(self.skip_layers))
        require(callable(relevance) or relevance in RELEVANCE_MODES, "relevance",
                f"one of {RELEVANCE_MODES} or a callable", relevance)
        require(isinstance(obs_window, int) and obs_window >= 1, "obs_window", "an int >= 1", obs_window)
        if relevance == "auto":
            relevance = "attention" if model is not None else "keynorm"
        self.head_dim = head_dim
        # learned codec state (RVQ codebooks) must have been made for this model
        reasons = self.scheme.check_model(ModelIdentity.from_hf_config(model_config)) \
            if self.scheme else []
        if reasons:
            raise ValueError(f"scheme {self.scheme.name}: " + "; ".join(reasons))
        layers = []
        for i in range(n_layers):
            if i in self.skip_layers:
                kc = vc = None
            else:  # codecs built per layer: a codec may keep per-layer state (codebooks)
                kc, vc = self.scheme.codecs(head_dim, self.block_tokens, layer=i)
            layers.append(LowBitLayer(
                i, kc, vc, self.block_tokens, self.sink_tokens, relevance, obs_window,
                attend_new_exact, evictable,
                self.residual_tokens if kc is not None else 0,
                self.scheme.rotation(head_dim, i) if kc is not None else None))
        self.records_queries = any(layer.wants_queries for layer in layers)
        if self.records_queries:
            require(model is not None, "model", "given for relevance='attention'", None)
            install_query_hooks(model)
        super().__init__(layers=layers)

    @property
    def effective_bits(self) -> float:
        """Bits per element of the packed blocks (K and V averaged), every stored byte counted."""
        if self.scheme is None:
            return 16.0
        return self.scheme.effective_bits(self.head_dim, self.block_tokens)

    def evict(self, policy: "EvictionPolicy", model: torch.nn.Module) -> "EvictionPlan":
        """Evict once, after the prompt's prefill: plan on every layer's exact prompt K/V,
        compact each layer to its kept pairs, switch ``model`` to
        :data:`COMPACTED_ATTENTION`. Batch size 1; needs ``evictable=True``."""
        require(self.evictable, "LowBitKVCache", "made with evictable=True to evict", False)
        exact = [layer.exact() for layer in self.layers]
        require(exact[0][0].shape[0] == 1, "batch size", "1 to evict", exact[0][0].shape[0])
        # [B, H, N, D] -> [N, H, D]
        plan = policy.plan([k[0].transpose(0, 1) for k, _ in exact], [v[0].transpose(0, 1) for _, v in exact])
        for layer, kept in zip(self.layers, plan.kept):
            layer.compact(kept)
        use_compacted_attention(model)
        return plan

    def memory_report(self) -> dict[str, Any]:
        """Bytes stored: packed blocks vs model-dtype parts (sinks, tails, skipped layers),
        and the bf16 equivalent of every cached token."""
        per_layer = [layer.memory() for layer in self.layers]
        tot = {k: sum(m[k] for m in per_layer) for k in per_layer[0]} if per_layer else {}
        packed_bf16 = sum(layer.keys.shape[0] * layer.keys.shape[1] * self.head_dim * 4 * m["packed_tokens"]
                          for layer, m in zip(self.layers, per_layer) if layer.is_initialized)
        return dict(
            scheme=self.scheme.name if self.scheme else None, block_tokens=self.block_tokens, sink_tokens=self.sink_tokens,
            skip_layers=sorted(self.skip_layers), tokens=self.get_seq_length(),
            stored_tokens=tot.get("stored_tokens", 0),
            packed_bytes=tot.get("packed_bytes", 0),
            packed_bf16_bytes=packed_bf16,
            full_precision_bytes=tot.get("full_precision_bytes", 0),
            total_bytes=tot.get("total_bytes", 0),
            bf16_bytes=tot.get("bf16_bytes", 0),
            compression=(tot["bf16_bytes"] / tot["total_bytes"]) if tot.get("total_bytes") else None,
            # bits per packed element: packed_bf16 / 2 elements
            packed_bits_per_element=(16 * tot["packed_bytes"] / packed_bf16) if packed_bf16 else None,
            per_layer=per_layer,
        )

"""The transformers ``Cache``: one :class:`~.layer.LowBitLayer` per model layer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from ..codecs.base import ModelIdentity, require
from ..retrieval_heads import layer_parts, model_retrieval_heads
from ..schemes import KVScheme, get_scheme
from .hooks import RELEVANCE_MODES, RelevanceFn, install_query_hooks, use_compacted_attention
from .layer import HeadSplitLayer, LowBitLayer, VisualTokens

if TYPE_CHECKING:
    from ..eviction import EvictionPlan, EvictionPolicy

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
        self.visual = VisualTokens(self.scheme.protect_first if self.scheme else "visual")
        #: {layer: its retrieval KV heads} (:mod:`vllm_lowbit_kv.retrieval_heads`)
        self.retrieval = self._retrieval_heads(model, model_config, n_layers)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.model_kv_heads = (n_layers - len(self.skip_layers)) * kv_heads

        def layer(i: int, codecs: tuple | None) -> LowBitLayer:
            kc, vc = codecs or (None, None)
            return LowBitLayer(i, kc, vc, self.block_tokens, self.sink_tokens, relevance, obs_window,
                               attend_new_exact, evictable,
                               self.residual_tokens if kc is not None else 0,
                               self.scheme.rotation(head_dim, i) if kc is not None else None,
                               self.visual, self.scheme.staging_dtype if kc is not None else "model",
                               self.scheme.leading_tokens if kc is not None else 0)
        layers = []
        for i in range(n_layers):
            if i in self.skip_layers:
                layers.append(layer(i, None))
            else:  # codecs built per layer: a codec may keep per-layer state (codebooks)
                parts = layer_parts(self.retrieval.get(i, ()), kv_heads)
                built = [layer(i, (self.scheme.retrieval_codecs if retrieval else self.scheme.codecs)(
                    head_dim, self.block_tokens, layer=i)) for retrieval, _ in parts]
                if len(parts) > 1:
                    require(not evictable, "retrieval_heads", "0 with eviction (plans whole layers)",
                            self.scheme.retrieval_heads)
                layers.append(built[0] if len(parts) == 1 else
                              HeadSplitLayer(built, [hs for _, hs in parts]))
        self.records_queries = any(layer.wants_queries for layer in layers)
        if self.records_queries:
            require(model is not None, "model", "given for relevance='attention'", None)
            install_query_hooks(model)
        super().__init__(layers=layers)

    def _retrieval_heads(self, model, model_config, n_layers: int) -> dict[int, tuple[int, ...]]:
        """{layer: retrieval KV heads} of the scheme's ``retrieval_heads`` for this model:
        the top scores of :func:`~vllm_lowbit_kv.retrieval_heads.model_scores`, measured on
        the model's folder (skip_layers take none)."""
        if not self.scheme or not self.scheme.retrieval_heads:
            return {}
        folder = getattr(model_config, "_name_or_path", "") or getattr(
            getattr(model, "config", None), "_name_or_path", "")
        require(bool(folder), "model", "loaded from a folder (its retrieval heads are measured "
                "there)", folder)
        heads = model_retrieval_heads(folder, self.scheme.retrieval_heads, self.skip_layers)
        require(max(heads, default=0) < n_layers, "retrieval heads' layers", f"< {n_layers} "
                "(measured on another model?)", max(heads, default=0))
        return heads

    def mark_visual(self, mask: torch.Tensor) -> None:
        """Mark which tokens of the next forward are visual (image or video-frame
        placeholders): ``mask`` [B, S] bool, e.g. ``input_ids == config.image_token_id``.
        STP then protects a group's most relevant visual tokens first (or its text tokens,
        with the scheme's ``protect_first: text``), as the vLLM backend does with the
        placeholder positions vLLM gives it; unmarked tokens are text."""
        self.visual.mark(self.get_seq_length(), mask)

    @property
    def effective_bits(self) -> float:
        """Bits per element of the packed blocks (K and V averaged), every stored byte counted."""
        if self.scheme is None:
            return 16.0
        return self.scheme.effective_bits(self.head_dim, self.block_tokens, self.model_kv_heads)

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
        packed_bf16 = tot.get("packed_bf16_bytes", 0)
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

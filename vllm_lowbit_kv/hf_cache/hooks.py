"""transformers model hooks of the cache: the query pre-hooks that feed STP's attention-mass
relevance, and the SDPA variant for layers compacted by eviction."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..codecs.base import require

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
    if not getattr(cache, "records_queries", False):  # a LowBitKVCache that scores by attention
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

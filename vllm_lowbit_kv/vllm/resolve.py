"""What a vLLM config asks of us: the scheme named by ``--kv-cache-dtype`` with the
``lowbit_kv`` overrides of ``--additional-config``, its page layout, its staging."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.config import get_current_vllm_config_or_none

from ..config import ADDITIONAL_CONFIG_KEY, LowBitKVConfig
from ..codecs.quant import staged_bytes_per_element
from ..paged import HeadSplitLayout, PagedLayout
from ..schemes import KVScheme

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_resolved: dict[tuple, tuple[KVScheme, LowBitKVConfig]] = {}
#: what this process resolved last (hooks such as customize_spec run outside
#: vLLM's config context; one process serves one engine config)
_last: tuple[KVScheme, LowBitKVConfig] | None = None
#: the model dtype of the config resolved last, for the same hooks: the sink area and the
#: staging hold model-dtype values, so the page size depends on it
_last_model_dtype: torch.dtype | None = None
#: the model folder of the config resolved last (its retrieval heads), for the same hooks
_last_model: str | None = None
#: {(model, retrieval_heads, skip_layers): {layer: retrieval KV heads}}
_retrieval: dict[tuple, dict[int, tuple[int, ...]]] = {}
#: attribute naming the layer of a KV cache spec (set by the ``get_kv_cache_spec`` patch)
SPEC_LAYER_ATTR = "_lowbit_kv_layer"


def resolve(vllm_config: "VllmConfig | None" = None) -> tuple[KVScheme, LowBitKVConfig]:
    """(scheme, lowbit_kv config) of ``vllm_config``, else of the config in scope, else of
    the last one resolved. Raises :class:`~vllm_lowbit_kv.config.LowBitKVConfigError`."""
    global _last, _last_model_dtype, _last_model
    vllm_config = vllm_config or get_current_vllm_config_or_none()
    if vllm_config is None:
        if _last is None:
            raise RuntimeError("lowbit-kv: no vLLM config in scope and no scheme resolved yet")
        return _last
    if vllm_config.model_config is not None:
        _last_model_dtype = vllm_config.model_config.dtype
        _last_model = vllm_config.model_config.model
    name = vllm_config.cache_config.cache_dtype
    raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) \
        if isinstance(vllm_config.additional_config, dict) else None
    # the overrides are checked against the served model's head size (64 without a model)
    head_dim = vllm_config.model_config.get_head_size() if vllm_config.model_config else 64
    key = (name, repr(raw), head_dim)
    if key not in _resolved:
        cfg = LowBitKVConfig.parse(raw)
        _resolved[key] = (cfg.scheme(name, head_dim), cfg)
    _last = _resolved[key]
    return _last


def resolve_scheme(vllm_config: "VllmConfig | None" = None) -> KVScheme:
    """The scheme as the backend runs it (:meth:`LowBitKVConfig.scheme`)."""
    return resolve(vllm_config)[0]


def resolve_config(vllm_config: "VllmConfig | None" = None) -> LowBitKVConfig:
    return resolve(vllm_config)[1]


def page_layout(scheme: KVScheme, head_size: int, num_kv_heads: int, block_size: int,
                dtype: torch.dtype, layer: int | None = None, retrieval: bool = False
                ) -> PagedLayout:
    """The page layout of the scheme's codecs (``retrieval``: of its retrieval heads' codecs)
    over ``num_kv_heads`` heads; codecs with per-layer state (RVQ codebooks) need ``layer``
    to code, the byte layout is the same for every layer."""
    return (scheme.retrieval_layout if retrieval else scheme.layout)(
        head_size, num_kv_heads, block_size, dtype, layer)


def retrieval_layers(vllm_config: "VllmConfig | None" = None) -> dict[int, tuple[int, ...]]:
    """{layer: its retrieval KV heads} for the served model (empty without retrieval
    heads): the scheme's ``retrieval_heads`` top scores of
    :func:`vllm_lowbit_kv.retrieval_heads.model_scores` (measured on first use, cached),
    none in ``skip_layers``."""
    scheme, cfg = resolve(vllm_config)
    if not scheme.retrieval_heads:
        return {}
    vllm_config = vllm_config or get_current_vllm_config_or_none()
    model = vllm_config.model_config.model if vllm_config is not None else _last_model
    key = (model, scheme.retrieval_heads, tuple(cfg.skip_layers))
    if key not in _retrieval:
        import logging

        from ..retrieval_heads import model_retrieval_heads
        _retrieval[key] = model_retrieval_heads(model, scheme.retrieval_heads, cfg.skip_layers,
                                                log=logging.getLogger("vllm.lowbit_kv").info)
    return _retrieval[key]


def layer_layout(scheme: KVScheme, head_size: int, num_kv_heads: int, block_size: int,
                 dtype: torch.dtype, layer: int | None) -> PagedLayout | HeadSplitLayout:
    """The pages of one layer: :func:`page_layout`, or for a layer with retrieval heads a
    :class:`~vllm_lowbit_kv.paged.HeadSplitLayout` (the other heads, then those)."""
    return scheme.layout(head_size, num_kv_heads, block_size, dtype, layer,
                         retrieval_layers().get(layer, ()) if layer is not None else ())


def model_dtype() -> torch.dtype:
    """The model dtype of the config in scope, else of the config resolved last (the page
    size hook runs outside vLLM's config context), else bfloat16."""
    cfg = get_current_vllm_config_or_none()
    if cfg is not None and cfg.model_config is not None:
        return cfg.model_config.dtype
    return _last_model_dtype or torch.bfloat16


def device_type(vllm_config: "VllmConfig") -> str:
    """Where this engine's tensors live: vLLM's device type (cpu, cuda)."""
    return getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"


def staging_slots(vllm_config: "VllmConfig") -> int:
    """Staging slots per layer: the residual window's groups and the partial group of
    every running request (:class:`~vllm_lowbit_kv.paged.StagingAllocator`); the slots of
    ended/preempted requests are returned before the next step."""
    return int(vllm_config.scheduler_config.max_num_seqs) * resolve_scheme(vllm_config).staged_groups


def staging_bytes(vllm_config: "VllmConfig") -> int:
    """Bytes of staging in all packed layers of this worker (K and V, and for STP the
    queries)."""
    scheme, cfg = resolve(vllm_config)
    mc, par = vllm_config.model_config, vllm_config.parallel_config
    kv_heads = mc.get_num_kv_heads(par)
    layers = mc.get_total_num_hidden_layers() - len(cfg.skip_layers)
    elt = torch.empty(0, dtype=mc.dtype).element_size()
    kv = staged_bytes_per_element(scheme.staging_dtype, mc.get_head_size(), elt) * 2 * kv_heads
    q = elt * mc.get_num_attention_heads(par) if scheme.uses_relevance else 0  # STP's queries
    return round(staging_slots(vllm_config) * scheme.block_tokens * (kv + q) * mc.get_head_size()
               * layers)

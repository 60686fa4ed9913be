"""Engine-side KV figures that only the worker knows: staging slots, evicted pairs, KV bytes.

vLLM's API server (where ``/v1/kv_cache/stats`` and ``/metrics`` live) and the
engine core with its workers are separate processes. Block usage reaches the
API server through vLLM's own ``SchedulerStats``; what only the worker knows
is fetched with ``engine_client.collective_rpc(WORKER_METHOD)``, the channel
vLLM's endpoint-plugin contract names for this. The general plugin
(:func:`vllm_lowbit_kv.vllm.plugin.register`, loaded in every process)
installs :data:`WORKER_METHOD` on vLLM's ``WorkerBase``; it returns
:func:`worker_snapshot` of the worker's staging pools.

Eviction feeds :data:`EVICTION` in the worker process: it is enabled when the
worker's config names an eviction policy, and
:func:`vllm_lowbit_kv.vllm.eviction.compact_ordered` calls ``EVICTION.record(n)``
for the ``n`` K/V pairs each compaction drops (one pair = one token's key and
value of one KV head in one layer, of this worker's heads). The API server
reads it with :data:`WORKER_METHOD`, as it reads the staging figures; under
tensor or pipeline parallelism every rank answers for its own layers and heads
and the server adds them up.

:func:`scheme_config` is the effective scheme configuration as one plain
object: the start-up log prints it (``lowbit-kv: scheme_config {...}``, once per
server) and ``/v1/kv_cache/stats`` serves it as ``scheme``, so the two cannot
disagree.

No vLLM import at module level: the worker side reads what vLLM objects it is handed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..codecs.base import require

#: name of the worker method the general plugin installs (collective_rpc target)
WORKER_METHOD = "lowbit_kv_stats"


@dataclass
class EvictionCounter:
    """K/V pairs dropped by KV eviction in this worker (monotonic)."""

    enabled: bool = False
    evicted_pairs: int = 0

    def enable(self) -> None:
        self.enabled = True

    def record(self, pairs: int) -> None:
        require(isinstance(pairs, int) and pairs >= 0, "pairs", "an int >= 0", pairs)
        self.evicted_pairs += pairs


EVICTION = EvictionCounter()


@dataclass
class VisualCounter:
    """Visual (image, video-frame) tokens this worker encoded into pages, and how many of
    them STP protected (monotonic; counted once per token, not per layer or head)."""

    encoded: int = 0
    protected: int = 0

    def record(self, encoded: int, protected: int) -> None:
        require(0 <= protected <= encoded, "protected", f"an int in [0, encoded={encoded}]",
                protected)
        self.encoded += encoded
        self.protected += protected


VISUAL = VisualCounter()

#: packed-attention implementations this worker's layers run (``cpp``, ``torch``, ...: the
#: backend adds each one as it logs choosing it)
ATTENTION_IMPLS: set[str] = set()


def scheme_config(vllm_config: Any) -> dict[str, Any]:
    """The effective configuration of a lowbit-kv ``--kv-cache-dtype``, as the engine runs it,
    from a ``VllmConfig`` that vLLM has checked (:func:`~vllm_lowbit_kv.vllm.checks.check_vllm_config`
    merged ``--kv-cache-dtype-skip-layers`` and set the page size): plain JSON data."""
    from ..config import describe_codec
    from .resolve import resolve

    cc, mc = vllm_config.cache_config, vllm_config.model_config
    scheme, cfg = resolve(vllm_config)
    skip = sorted({int(x) for x in (cc.kv_cache_dtype_skip_layers or []) if str(x).isdigit()}
                  | set(cfg.skip_layers))
    kc, vc = scheme.codecs(mc.get_head_size())
    eviction = None
    if cfg.eviction is not None:
        eviction = dict(policy=cfg.eviction, retention=cfg.retention, gamma=cfg.eviction_gamma,
                        sinks=cfg.eviction_sinks, recent_window=cfg.recent_window,
                        layer_cap=cfg.eviction_layer_cap)
    return dict(
        name=str(cc.cache_dtype), summary=scheme.summary, key_codec=describe_codec(kc),
        value_codec=describe_codec(vc), block_tokens=scheme.block_tokens,
        sink_tokens=scheme.sink_tokens, residual_tokens=scheme.residual_tokens,
        leading_tokens=scheme.leading_tokens,
        rotate=scheme.rotate, protect_first=scheme.protect_first,
        retrieval_heads=scheme.retrieval_heads, retrieval_scheme=scheme.retrieval_scheme,
        retrieval_keys_only=scheme.retrieval_keys_only,
        page_tokens=int(cc.block_size), skip_layers=skip, obs_window=cfg.obs_window,
        stp_relevance=bool(scheme.uses_relevance), eviction=eviction,
        attention_impl=cfg.attention_impl or "auto", set_fields=cfg.explicit())


def _eviction_configured(vllm_config: Any) -> bool:
    extra = getattr(vllm_config, "additional_config", None)
    lowbit = extra.get("lowbit_kv") if isinstance(extra, dict) else None
    return isinstance(lowbit, dict) and bool(lowbit.get("eviction"))


def worker_snapshot(worker: Any = None, pools: Sequence[Any] = ()) -> dict[str, Any]:
    """Plain data (it crosses process boundaries with msgpack) about this worker's KV.

    ``kv_cache_bytes``: bytes vLLM allocated for the KV cache (the backing
    allocation its ``KVCacheConfig.kv_cache_tensors`` share), ``num_blocks`` the
    blocks it holds;
    ``staging_*``: slots of the staging ``pools`` (the
    :class:`~vllm_lowbit_kv.paged.StagingAllocator` of each of the worker's metadata builders),
    which the KV budget pays for (:func:`~vllm_lowbit_kv.vllm.resolve.staging_bytes`);
    ``eviction_enabled`` / ``evicted_pairs``: :data:`EVICTION`;
    ``visual_tokens`` / ``visual_tokens_protected``: :data:`VISUAL`;
    ``attention_impls``: :data:`ATTENTION_IMPLS`.
    """
    if not EVICTION.enabled and _eviction_configured(getattr(worker, "vllm_config", None)):
        EVICTION.enable()
    out: dict[str, Any] = dict(
        staging_pools=len(pools),
        staging_slots_total=sum(p.num_slots for p in pools),
        staging_slots_in_use=sum(p.in_use for p in pools),
        staging_stale_reused=sum(p.stale_reused for p in pools),
        eviction_enabled=EVICTION.enabled,
        evicted_pairs=EVICTION.evicted_pairs,
        visual_tokens=VISUAL.encoded,
        visual_tokens_protected=VISUAL.protected,
        attention_impls=sorted(ATTENTION_IMPLS),
        kv_cache_bytes=None,
        num_blocks=None,
    )
    kv_config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    if kv_config is not None:
        # every KVCacheTensor places its layers in one shared backing allocation of `size` bytes
        out["kv_cache_bytes"] = int(max((t.size for t in kv_config.kv_cache_tensors), default=0))
        out["num_blocks"] = int(kv_config.num_blocks)
    return out

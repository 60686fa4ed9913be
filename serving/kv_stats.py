"""``GET /v1/kv_cache/stats`` and the same figures as ``lowbit_kv:*`` gauges on ``/metrics``.

A vLLM endpoint plugin (entry point group ``vllm.endpoint_plugins``, name
``lowbit_kv_stats``, see pyproject.toml). vLLM loads endpoint plugins only when
they are named in ``VLLM_PLUGINS``, which then also filters the general
plugins, so with ``vllm serve`` name both of ours::

    VLLM_PLUGINS=lowbit_kv,lowbit_kv_stats vllm serve MODEL --kv-cache-dtype vidkv

``python -m serving`` attaches it itself (:func:`attach_in_process`), without
touching ``VLLM_PLUGINS`` (and without vLLM's warning that an installed endpoint
plugin is not allowlisted, which would be about ours). The route answers for every KV dtype (bfloat16 and
fp8 too, with ``scheme: null``), which makes the figures comparable.

The API server is not the engine process, so every figure says where it comes
from; none is invented:

* configuration (dtype, scheme, block size, layers, ``kv_cache_size_tokens``,
  ``num_gpu_blocks``): the API process's ``VllmConfig``, which vLLM updates
  from the engine core once the KV cache is allocated;
* bits per element: the scheme's honest account
  (:meth:`vllm_lowbit_kv.config.LowBitKVConfig.bits_per_element`), and
  ``allocated``: the KV bytes the worker really allocated
  (``KVCacheConfig.kv_cache_tensors``) over the K/V elements its blocks hold;
* blocks used/free, running/waiting requests: vLLM's own ``SchedulerStats``
  (what ``vllm:kv_cache_usage_perc`` and ``vllm:num_requests_running`` show),
  which the engine core sends with its outputs; a stat logger appended to the
  engine client's logger manager keeps the latest. vLLM's usage is
  ``1 - free / (num_gpu_blocks - 1)`` (block 0 is its reserved null block), so
  ``used = round(usage * (num_gpu_blocks - 1))`` exactly and
  ``used + free = num_gpu_blocks - 1``. Not available with ``--disable-log-stats``;
* staging slots, evicted pairs: only the workers know them. They come from
  ``engine_client.collective_rpc("lowbit_kv_stats")``
  (:mod:`vllm_lowbit_kv.kv_stats`) on every call of the route and, in the
  background, every :data:`REFRESH_S` seconds (``LOWBIT_KV_STATS_REFRESH_S``)
  while the engine runs steps (they change in steps only; an idle engine is not
  asked, see :meth:`KVStats.refresh_while_stepping`);
  the gauges show the latest answer and the route states its age. Every rank
  answers (tensor / pipeline parallelism): its staging slots, KV bytes and
  evicted pairs are added up (:func:`merge_ranks`), so the figures are the
  whole engine's. Evicted pairs count the K/V pairs (token x KV head x layer)
  each compaction dropped (:func:`vllm_lowbit_kv.vllm.eviction.evicted_pairs`),
  ``enabled: false`` when no eviction policy is configured. Visual tokens
  (multimodal requests): image and video-frame tokens encoded into pages and
  those STP protected, counted once per token; every rank sees the same
  tokens, so rank 0's figures stand for the engine.

Gauges (labels ``model_name``, ``kv_cache_dtype``), each figure of the route:
``lowbit_kv:effective_bits{part=groups|pages|overall|allocated}``,
``lowbit_kv:capacity_tokens``, ``lowbit_kv:capacity_bf16_equivalent_tokens``,
``lowbit_kv:kv_cache_bytes``, ``lowbit_kv:blocks_total``, ``lowbit_kv:blocks_used``,
``lowbit_kv:blocks_free``, ``lowbit_kv:staging_slots_total``,
``lowbit_kv:staging_slots_in_use``, ``lowbit_kv:evicted_pairs_total``,
``lowbit_kv:visual_encoded_tokens_total``, ``lowbit_kv:visual_protected_tokens_total``
(counters).
A figure that is unknown (e.g. no engine step yet) is left out rather than
reported as 0. One API server process (vLLM's default): with
``--api-server-count > 1`` vLLM exports metrics from files and these are absent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("vllm.lowbit_kv.stats")

PLUGIN_NAME = "lowbit_kv_stats"
ROUTE = "/v1/kv_cache/stats"
METRIC_PREFIX = "lowbit_kv:"
REFRESH_S = float(os.environ.get("LOWBIT_KV_STATS_REFRESH_S", "2"))
#: the route waits at most this long for the worker (a long prefill step delays it)
RPC_TIMEOUT_S = 10.0
#: bits per element of vLLM's own KV dtypes (auto / bfloat16: the model dtype)
NATIVE_BITS = {"fp8": 8.0, "fp8_e4m3": 8.0, "fp8_e5m2": 8.0}


# --------------------------------------------------------------------------- response
class SchemeInfo(BaseModel):
    """The effective scheme configuration: the very object the start-up log prints
    (``lowbit-kv: scheme_config {...}``, :func:`vllm_lowbit_kv.kv_stats.scheme_config`)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    summary: str = Field(description="the scheme's one-line description")
    key_codec: str
    value_codec: str
    block_tokens: int = Field(description="tokens per quantization group")
    sink_tokens: int
    residual_tokens: int = Field(description="most recent tokens read in bf16 from staging")
    leading_tokens: int = Field(description="first tokens read from staging by their writer")
    rotate: str
    protect_first: str = Field(description="which tokens STP protects first: visual or text")
    retrieval_heads: int = Field(description="KV heads coded by retrieval_scheme (0: none)")
    retrieval_scheme: str = Field(description="the scheme whose codecs code the retrieval heads")
    retrieval_keys_only: bool = Field(description="retrieval heads take only its key codec")
    page_tokens: int = Field(description="tokens per vLLM page (the block size)")
    skip_layers: list[int] = Field(description="layers kept in the model dtype")
    obs_window: int = Field(description="queries scoring STP relevance")
    stp_relevance: bool = Field(description="the scheme uses STP relevance (obs_window applies)")
    eviction: dict[str, Any] | None = Field(description="KV eviction after prefill (None: off)")
    attention_impl: str
    set_fields: dict[str, Any] = Field(description="lowbit_kv fields set explicitly")


class EffectiveBits(BaseModel):
    groups: float | None = Field(description="codec groups only (None for vLLM's own dtypes)")
    pages: float | None = Field(description="every byte of a packed page (sink area, padding)")
    overall: float = Field(description="over all layers, skipped layers in the model dtype")
    allocated: float | None = Field(
        description="KV bytes the worker allocated x 8 / K and V elements its blocks hold")


class Capacity(BaseModel):
    tokens: int = Field(description="vLLM's kv_cache_size_tokens")
    bf16_equivalent_tokens: int | None = Field(
        description="tokens a bfloat16 cache holds in the same allocated bytes (whole blocks)")
    x_bf16: float | None = Field(description="tokens / bf16_equivalent_tokens")
    kv_cache_bytes: int | None = Field(description="bytes the worker allocated for the KV cache")
    kv_cache_memory_bytes: int | None = Field(description="the KV memory budget vLLM was given")
    block_size: int
    num_layers: int


class Blocks(BaseModel):
    total: int = Field(description="vLLM's num_gpu_blocks (block 0 is its reserved null block)")
    used: int | None
    free: int | None = Field(description="allocatable: unused or only prefix-cached")
    kv_cache_usage: float | None = Field(description="vLLM's own figure (vllm:kv_cache_usage_perc)")
    running_requests: int | None
    waiting_requests: int | None
    age_s: float | None = Field(description="seconds since the engine's last scheduler stats")
    source: str


class Staging(BaseModel):
    pools: int = Field(description="staging allocators (one per KV cache group of ours)")
    slots_total: int
    slots_in_use: int
    stale_reused: int
    age_s: float = Field(description="seconds since the worker answered")


class Eviction(BaseModel):
    enabled: bool = Field(description="an eviction policy feeds these figures")
    evicted_pairs: int = Field(description="K/V pairs dropped (token x KV head x layer)")


class Visual(BaseModel):
    encoded_tokens: int = Field(description="image and video-frame tokens written into pages")
    protected_tokens: int = Field(description="of those, tokens STP kept at higher precision")


class KVCacheStats(BaseModel):
    model: str
    kv_cache_dtype: str
    model_dtype: str
    lowbit: bool = Field(description="a lowbit-kv scheme (else vLLM's own KV dtype)")
    scheme: SchemeInfo | None
    effective_bits: EffectiveBits
    capacity: Capacity
    blocks: Blocks
    staging: Staging | None = Field(description="None for vLLM's own dtypes (no staging)")
    eviction: Eviction | None
    visual: Visual | None = Field(description="multimodal requests' visual tokens (every rank "
                                  "sees the same tokens: rank 0's figures)")
    attention_impls: list[str] | None = Field(
        None, description="packed-attention implementations the workers run (cpp, torch, "
        "...); None for vLLM's own dtypes")
    workers: int | None = Field(None, description="worker ranks whose figures are added up "
                                "(tensor x pipeline parallel size)")
    worker_error: str | None = Field(None, description="why the worker figures are stale")


# --------------------------------------------------------------------------- sources
#: worker figures that add up over the ranks of a tensor/pipeline-parallel engine
SUMMED = ("staging_pools", "staging_slots_total", "staging_slots_in_use", "staging_stale_reused",
          "evicted_pairs", "kv_cache_bytes")


def merge_ranks(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's figures from every worker's answer (one per rank: under tensor
    parallelism each holds its share of the KV heads, under pipeline parallelism its
    layers, each its own staging pools and its own evicted pairs)."""
    if not answers:
        raise RuntimeError("no worker answered")
    out = dict(answers[0])
    for key in SUMMED:
        values = [a.get(key) for a in answers]
        out[key] = None if any(v is None for v in values) else sum(values)
    out["eviction_enabled"] = any(a.get("eviction_enabled") for a in answers)
    out["attention_impls"] = sorted({i for a in answers for i in a.get("attention_impls", ())})
    out["ranks"] = len(answers)
    return out


@functools.cache
def _scheduler_tap_class():
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class SchedulerStatsTap(AggregateStatLoggerBase):
        """Keeps the latest SchedulerStats of each engine (vLLM calls ``record`` in the
        API process for every batch of engine outputs)."""

        def __init__(self, vllm_config=None, engine_indexes=None, *, sink: "KVStats"):
            self.sink = sink

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                self.sink.latest_scheduler[engine_idx] = (time.monotonic(), scheduler_stats)

        def log_engine_initialized(self):
            pass

    return SchedulerStatsTap


class KVStats:
    """Everything the route and the gauges report, for one engine client."""

    def __init__(self, engine_client: Any):
        self.engine_client = engine_client
        cfg = engine_client.vllm_config
        self.vllm_config = cfg
        mc, cc, pc = cfg.model_config, cfg.cache_config, cfg.parallel_config
        self.model = mc.served_model_name
        self.kv_cache_dtype = str(cc.cache_dtype)
        import torch
        from vllm_lowbit_kv.vllm import is_lowbit_dtype

        self.model_dtype = str(mc.dtype).removeprefix("torch.")
        self.model_dtype_bytes = torch.empty(0, dtype=mc.dtype).element_size()
        self.lowbit = is_lowbit_dtype(self.kv_cache_dtype)
        self.num_layers = mc.get_total_num_hidden_layers()
        # the whole engine's (every rank's figures are added up: :func:`merge_ranks`)
        self.num_kv_heads = mc.get_total_num_kv_heads()
        self.ranks = int(pc.world_size)
        self.head_dim = mc.get_head_size()
        self.block_size = int(cc.block_size)
        self.num_blocks = int(cc.num_gpu_blocks or 0)
        self.capacity_tokens = int(cc.kv_cache_size_tokens or self.num_blocks * self.block_size)
        self.kv_cache_memory_bytes = cc.kv_cache_memory_bytes
        self.scheme_info, self.bits = self._describe()
        self.latest_scheduler: dict[int, tuple[float, Any]] = {}
        self.worker: dict[str, Any] | None = None
        self.worker_t = 0.0
        self.worker_error: str | None = None
        self._rpc_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.stats_source = "vLLM SchedulerStats (engine core -> API server)"
        manager = getattr(engine_client, "logger_manager", None)
        if manager is None:
            self.stats_source = "unavailable: vLLM stats are off (--disable-log-stats)"
        else:
            manager.stat_loggers.append(_scheduler_tap_class()(sink=self))

    def _describe(self) -> tuple[SchemeInfo | None, dict[str, float | None]]:
        if not self.lowbit:
            native = NATIVE_BITS.get(self.kv_cache_dtype, 8.0 * self.model_dtype_bytes)
            return None, dict(groups=None, pages=None, overall=native)
        from vllm_lowbit_kv.vllm.stats import scheme_config
        from vllm_lowbit_kv.vllm.resolve import resolve_config, resolve_scheme

        info = SchemeInfo(**scheme_config(self.vllm_config))
        cfg = resolve_config(self.vllm_config).model_copy(update={"skip_layers": info.skip_layers})
        bits = cfg.bits_per_element(resolve_scheme(self.vllm_config), head_dim=self.head_dim,
                                    num_kv_heads=self.num_kv_heads, num_layers=self.num_layers,
                                    block_size=self.block_size,
                                    model_dtype_bytes=self.model_dtype_bytes)
        return info, dict(groups=bits["groups"], pages=bits["pages"], overall=bits["overall"])

    # ------------------------------------------------------------------ worker
    async def refresh_worker(self, timeout: float = RPC_TIMEOUT_S) -> None:
        """Ask the worker (rank 0) for its figures; on failure keep the last answer and say why."""
        from vllm_lowbit_kv.vllm.stats import WORKER_METHOD

        async with self._rpc_lock:
            try:
                answers = await asyncio.wait_for(
                    self.engine_client.collective_rpc(WORKER_METHOD), timeout)
                self.worker, self.worker_t, self.worker_error = merge_ranks(answers), \
                    time.monotonic(), None
            except Exception as e:  # noqa: BLE001 - a dead or busy engine must not break the route
                self.worker_error = f"{type(e).__name__}: {e}"[:500]

    def stepped_since_answer(self) -> bool:
        """The engine reported a step after the worker's last answer (vLLM's SchedulerStats;
        never without them, ``--disable-log-stats``: then only the route refreshes)."""
        return any(t > self.worker_t for t, _ in self.latest_scheduler.values())

    async def refresh_while_stepping(self) -> None:
        """Every :data:`REFRESH_S` seconds, ask the workers only if the engine stepped since
        their last answer. Asking an idle engine would cost a core: after every message
        vLLM's worker busy-polls its queue for a second (``SpinCondition.busy_loop_s``),
        so an RPC every 2 s kept an idle server's worker at 50-90% CPU."""
        while True:
            await asyncio.sleep(REFRESH_S)
            if self.stepped_since_answer():
                await self.refresh_worker()

    async def start(self) -> "KVStats":
        await self.refresh_worker(timeout=120.0)
        self._task = asyncio.get_running_loop().create_task(self.refresh_while_stepping())
        return self

    # ------------------------------------------------------------------ figures
    def snapshot(self) -> KVCacheStats:
        now = time.monotonic()
        w = self.worker or {}
        kv_bytes = w.get("kv_cache_bytes")
        elements = self.num_blocks * self.block_size * self.num_layers * self.num_kv_heads \
            * self.head_dim * 2
        allocated = round(kv_bytes * 8 / elements, 4) if kv_bytes and elements else None
        bf16_block = self.block_size * 2 * self.num_kv_heads * self.head_dim * 2 * self.num_layers
        bf16_tokens = (kv_bytes // bf16_block) * self.block_size if kv_bytes else None
        capacity = Capacity(
            tokens=self.capacity_tokens, bf16_equivalent_tokens=bf16_tokens,
            x_bf16=round(self.capacity_tokens / bf16_tokens, 4) if bf16_tokens else None,
            kv_cache_bytes=kv_bytes, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            block_size=self.block_size, num_layers=self.num_layers)
        blocks = Blocks(total=self.num_blocks, used=None, free=None, kv_cache_usage=None,
                        running_requests=None, waiting_requests=None, age_s=None,
                        source=self.stats_source)
        if not self.latest_scheduler and self.stats_source.startswith("vLLM") and self.num_blocks > 1:
            # the engine sends its first SchedulerStats with the first step's outputs: until
            # then no request has held a block (vLLM's own gauge reads 0 too)
            blocks = blocks.model_copy(update=dict(
                used=0, free=self.num_blocks - 1, kv_cache_usage=0.0, running_requests=0,
                waiting_requests=0, source="no engine step yet (empty since start-up)"))
        elif len(self.latest_scheduler) == 1 and self.num_blocks > 1:
            t, s = next(iter(self.latest_scheduler.values()))
            usable = self.num_blocks - 1
            used = round(s.kv_cache_usage * usable)
            blocks = blocks.model_copy(update=dict(
                used=used, free=usable - used, kv_cache_usage=s.kv_cache_usage,
                running_requests=s.num_running_reqs,
                waiting_requests=s.num_waiting_reqs + s.num_skipped_waiting_reqs,
                age_s=round(now - t, 3)))
        elif len(self.latest_scheduler) > 1:
            blocks = blocks.model_copy(update=dict(
                source="unavailable: several engines (data parallel) share num_gpu_blocks"))
        staging = eviction = visual = None
        if w and self.lowbit:
            staging = Staging(pools=w["staging_pools"], slots_total=w["staging_slots_total"],
                              slots_in_use=w["staging_slots_in_use"],
                              stale_reused=w["staging_stale_reused"],
                              age_s=round(now - self.worker_t, 3))
            eviction = Eviction(enabled=w["eviction_enabled"], evicted_pairs=w["evicted_pairs"])
            visual = Visual(encoded_tokens=w["visual_tokens"],
                            protected_tokens=w["visual_tokens_protected"])
        return KVCacheStats(
            model=self.model, kv_cache_dtype=self.kv_cache_dtype, model_dtype=self.model_dtype,
            lowbit=self.lowbit, scheme=self.scheme_info,
            effective_bits=EffectiveBits(**self.bits, allocated=allocated), capacity=capacity,
            blocks=blocks, staging=staging, eviction=eviction, visual=visual,
            attention_impls=w.get("attention_impls") if w and self.lowbit else None,
            workers=w.get("ranks"),
            worker_error=self.worker_error)


# --------------------------------------------------------------------------- /metrics
class KVStatsCollector:
    """A prometheus_client collector: the route's figures at scrape time."""

    def __init__(self, stats: KVStats):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats.snapshot()
        labels = ["model_name", "kv_cache_dtype"]
        values = [s.model, s.kv_cache_dtype]

        def gauge(name: str, doc: str, value: float | None):
            g = GaugeMetricFamily(METRIC_PREFIX + name, doc, labels=labels)
            if value is not None:
                g.add_metric(values, float(value))
            return g

        bits = GaugeMetricFamily(METRIC_PREFIX + "effective_bits", "KV bits per element "
                                 "(groups, pages, overall over all layers, allocated)",
                                 labels=labels + ["part"])
        for part, v in s.effective_bits.model_dump().items():
            if v is not None:
                bits.add_metric(values + [part], float(v))
        yield bits
        yield gauge("capacity_tokens", "KV cache capacity in tokens (vLLM)", s.capacity.tokens)
        yield gauge("capacity_bf16_equivalent_tokens", "tokens a bfloat16 cache holds in the "
                    "same bytes", s.capacity.bf16_equivalent_tokens)
        yield gauge("kv_cache_bytes", "bytes allocated for the KV cache", s.capacity.kv_cache_bytes)
        yield gauge("blocks_total", "KV blocks (vLLM num_gpu_blocks)", s.blocks.total)
        yield gauge("blocks_used", "KV blocks in use (from vLLM's kv_cache_usage)", s.blocks.used)
        yield gauge("blocks_free", "KV blocks allocatable", s.blocks.free)
        st = s.staging
        yield gauge("staging_slots_total", "bf16 staging slots (inside the KV budget)",
                    st.slots_total if st else None)
        yield gauge("staging_slots_in_use", "bf16 staging slots holding a partial group",
                    st.slots_in_use if st else None)
        ev = CounterMetricFamily(METRIC_PREFIX + "evicted_pairs", "K/V pairs dropped by eviction",
                                 labels=labels)
        if s.eviction is not None:
            ev.add_metric(values, float(s.eviction.evicted_pairs))
        yield ev
        for name, doc in (("encoded_tokens", "image and video-frame tokens written into pages"),
                          ("protected_tokens", "visual tokens STP kept at higher precision")):
            c = CounterMetricFamily(METRIC_PREFIX + "visual_" + name, doc, labels=labels)
            if s.visual is not None:
                c.add_metric(values, float(getattr(s.visual, name)))
            yield c


_collector: KVStatsCollector | None = None


def _register_collector(stats: KVStats) -> None:
    global _collector
    from prometheus_client import REGISTRY

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning("lowbit-kv: several API server processes (PROMETHEUS_MULTIPROC_DIR): the "
                       "lowbit_kv:* gauges are not exported; %s still answers", ROUTE)
    if _collector is not None:
        REGISTRY.unregister(_collector)
    _collector = KVStatsCollector(stats)
    REGISTRY.register(_collector)


# --------------------------------------------------------------------------- route + plugin
router = APIRouter()


@router.get(ROUTE, response_model=KVCacheStats, tags=["lowbit-kv"])
async def kv_cache_stats(request: Request) -> KVCacheStats:
    """The KV cache as served: dtype, scheme, bits, capacity, blocks, staging, eviction."""
    stats: KVStats | None = getattr(request.app.state, "lowbit_kv_stats", None)
    if stats is None:
        raise HTTPException(status_code=503, detail="lowbit-kv stats: no engine attached")
    await stats.refresh_worker()
    return stats.snapshot()


class KVStatsPlugin:
    """Factory of the ``vllm.endpoint_plugins`` entry point (vLLM's EndpointPlugin protocol)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)  # needs an engine (not the render-only server)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        stats = await KVStats(engine_client).start()
        state.lowbit_kv_stats = stats
        _register_collector(stats)
        logger.info("lowbit-kv: %s and lowbit_kv:* gauges on /metrics (%s)", ROUTE,
                    stats.kv_cache_dtype)


def attach_in_process() -> None:
    """Make this process's vLLM API server load :class:`KVStatsPlugin`, whether or not the
    entry point is installed or allowlisted (``python -m serving``). Idempotent."""
    import vllm.plugins as plugins

    original = plugins.load_endpoint_plugins
    if getattr(original, "_lowbit_kv_wrapped", False):
        return

    def load_endpoint_plugins(supported_tasks=None):
        import vllm.envs as envs
        from importlib.metadata import entry_points

        others = [p.name for p in entry_points(group="vllm.endpoint_plugins") if p.name != PLUGIN_NAME]
        # With VLLM_PLUGINS unset vLLM loads no endpoint plugin and warns about every one
        # installed, ours included, which this launcher attaches anyway: ask only when
        # another plugin is installed (the warning is then about it, rightly).
        found = original(supported_tasks) if envs.VLLM_PLUGINS is not None or others else []
        if not any(getattr(p, "name", None) == PLUGIN_NAME for p in found) and \
                supported_tasks is not None and set(KVStatsPlugin.required_tasks) & set(supported_tasks):
            found.append(KVStatsPlugin())
        return found

    load_endpoint_plugins._lowbit_kv_wrapped = True  # type: ignore[attr-defined]
    plugins.load_endpoint_plugins = load_endpoint_plugins

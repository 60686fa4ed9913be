"""KV eviction in vLLM: a scheduler that frees a compacted request's blocks, and the
worker-side compaction (glue over :mod:`vllm_lowbit_kv.eviction.paged`).

Enabled by ``{"lowbit_kv": {"eviction": "flashcache", "retention": 0.2}}`` (or the
launcher's ``--kv-eviction flashcache --kv-retention 0.2``) with a lowbit-kv
``--kv-cache-dtype``; :func:`vllm_lowbit_kv.vllm.checks.check_vllm_config`
validates it (:func:`eviction_refusals`) and names :class:`EvictingScheduler` as
vLLM's scheduler class.

Once per request, in the first step after its prefill (the prompt's KV is in
the pages, its first token sampled):

1. Scheduler (engine-core process), before scheduling the step: from the prompt
   length alone it knows the request's :class:`PagedEvictionGeometry`, so it
   frees the blocks past the compacted region (``_remove_blocks_in_range``:
   vLLM's own mechanism for giving back blocks of a running request, replacing
   them by the null block, as sliding-window and R-SWA attention do) and
   attaches an order to the step's ``SchedulerOutput`` (attribute
   ``lowbit_kv_evictions``, pickled to the worker with the rest). The step then
   schedules with those blocks free: other requests may take them at once.
2. Worker, first thing in that step (the runner's ``_update_states`` hook of
   :mod:`.patches`, before vLLM zeroes
   reallocated blocks and before any forward writes into them): reads every
   layer's prompt K/V of the request, plans with the policy, writes each layer's
   kept pairs to the front of its blocks, replaces the freed block ids of the
   request by the null block (id 0) so nothing of ours touches them again, and
   records each layer's kept length under the request's first block.
3. Metadata builder / attention: rows whose first block is recorded read, per
   layer, the compacted pairs and then everything from ``keep_from`` on
   (:func:`~vllm_lowbit_kv.eviction.paged.compacted_read_plan`). Positions (RoPE,
   slots of new tokens) stay logical: the scheduler's and the worker's block
   tables keep their lengths, the freed entries pointing at the null block.

A request preempted after its eviction recomputes its whole KV when it resumes
(vLLM's recompute preemption) and is not evicted again: it continues exactly,
without eviction.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm.v1.core.sched.scheduler import Scheduler

from . import stats
from ..eviction.paged import (PagedEvictionGeometry, compact_request, compacted_read_plan,
                              paged_geometry)
from .resolve import resolve

logger = logging.getLogger("vllm.lowbit_kv")

#: SchedulerOutput attribute: {request id: PagedEvictionGeometry} to compact in this step
ORDERS_ATTR = "lowbit_kv_evictions"
#: vLLM's null block (the block pool's first block, never handed to a request)
NULL_BLOCK_ID = 0
SCHEDULER_CLS = f"{__name__}.EvictingScheduler"

#: worker process: first block id of a compacted request -> (keep_from, {layer name: kept_len})
_COMPACTED: dict[int, tuple[int, dict[str, int]]] = {}


def _policy_and_cap(vllm_config) -> tuple[Any, float, int]:
    scheme, cfg = resolve(vllm_config)
    return cfg.eviction_policy(), cfg.eviction_layer_cap, scheme.block_tokens


class EvictingScheduler(Scheduler):
    """vLLM's scheduler, plus: once per request, after its prefill, free the blocks its
    eviction will not need and tell the worker to compact (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        if self.scheduler_config.async_scheduling or self.defer_block_free:
            raise ValueError("lowbit_kv eviction needs synchronous scheduling (it frees blocks "
                             "of the step that just ran); async scheduling is on")
        self.policy, self.layer_cap, self.group_tokens = _policy_and_cap(vllm_config)
        self.block_size = self.cache_config.block_size
        self._settled: set[str] = set()  # evicted, or never to be
        #: blocks given back so far (all requests), for logs and tests
        self.freed_blocks_total = 0

    def _evict_ready(self) -> dict[str, PagedEvictionGeometry]:
        orders = {}
        for req in list(self.running):
            rid = req.request_id
            if rid in self._settled or req.num_computed_tokens < req.num_prompt_tokens \
                    or req.num_output_tokens < 1:
                continue
            self._settled.add(rid)
            geo = paged_geometry(req.num_prompt_tokens, self.block_size, self.group_tokens,
                                 self.policy, self.layer_cap)
            if len(geo.freed_blocks) == 0:
                continue
            pool = self.kv_cache_manager.block_pool
            before = pool.get_num_free_blocks()
            for mgr in self.kv_cache_manager.coordinator.single_type_managers:
                mgr._remove_blocks_in_range(rid, geo.freed_blocks.start, geo.freed_blocks.stop)
            freed = pool.get_num_free_blocks() - before
            self.freed_blocks_total += freed
            orders[rid] = geo
            logger.info("lowbit-kv eviction: request %s (%d prompt tokens, %s @ %g): keeps %d "
                        "blocks + its last prompt block, freed %d blocks (%d free now)",
                        rid, geo.prompt_tokens, self.policy.name, self.policy.retention,
                        geo.kept_blocks, freed, pool.get_num_free_blocks())
        return orders

    def schedule(self, *args, **kwargs):
        orders = self._evict_ready()
        out = super().schedule(*args, **kwargs)
        setattr(out, ORDERS_ATTR, orders)
        return out

    def _free_request(self, request, *args, **kwargs):
        self._settled.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)


# ----------------------------------------------------------------------------- worker side
def forget_requests(first_blocks) -> None:
    """The requests owning these first blocks ended or were preempted."""
    for b in first_blocks:
        _COMPACTED.pop(int(b), None)


def compact_ordered(runner, scheduler_output, builders) -> None:
    """Run the step's eviction orders (called from the ``_update_states`` hook, after ended
    requests were released and before vLLM touches anything of the step)."""
    orders: dict[str, PagedEvictionGeometry] = getattr(scheduler_output, ORDERS_ATTR, None) or {}
    if not orders:
        return
    gone = set(scheduler_output.finished_req_ids) | set(
        getattr(scheduler_output, "preempted_req_ids", None) or ())
    stats.EVICTION.enable()
    policy, _, T = _policy_and_cap(runner.vllm_config)
    ctx = runner.compilation_config.static_forward_context
    names = [n for g in runner.kv_cache_config.kv_cache_groups for n in g.layer_names]
    builder = next(iter(builders))
    for rid, geo in orders.items():
        state = runner.requests.get(rid)
        if rid in gone or state is None:
            continue
        block_ids = state.block_ids[0]
        for b in builders:  # its window copies hold positions the compaction rewrites
            b.alloc.release_window(rid)
        layers = [ctx[n] for n in names]
        with torch.inference_mode():
            kept = _compact(geo, policy, T, layers, block_ids, builder)
        dropped = evicted_pairs(geo, kept, [_kv_heads(layer) for layer in layers])
        stats.EVICTION.record(dropped)
        for i in geo.freed_blocks:  # never ours again: the scheduler handed them back
            block_ids[i] = NULL_BLOCK_ID
        _COMPACTED[int(block_ids[0])] = (geo.keep_from, dict(zip(names, kept)))
        logger.info("lowbit-kv eviction: request %s compacted, kept pairs per layer %d..%d "
                    "(mean %.1f) of %d, dropped %d K/V pairs (%d in this worker so far)", rid,
                    min(kept), max(kept), sum(kept) / len(kept), geo.prompt_tokens, dropped,
                    stats.EVICTION.evicted_pairs)


def evicted_pairs(geo: PagedEvictionGeometry, kept: list[int], kv_heads: list[int]) -> int:
    """K/V pairs one compaction dropped (token x KV head x layer): each layer keeps its
    ``kept`` pairs of the ``keep_from`` positions below its last, partial prompt block
    (which stays whole), for each of its KV heads in this worker."""
    return sum((geo.keep_from - n) * h for n, h in zip(kept, kv_heads, strict=True))


def _kv_heads(layer) -> int:
    """KV heads of one attention layer in this worker (its share under tensor parallelism)."""
    return int(layer.impl._layout_for(layer.kv_cache, layer.layer_name).H)


def _compact(geo: PagedEvictionGeometry, policy, T: int, layers, block_ids, builder) -> list[int]:
    n_enc = geo.prompt_tokens // T
    slot = -1
    if geo.prompt_tokens % T:  # the prompt's partial group, staged
        Ng = builder.layout.groups_per_block
        slot = builder.alloc.slot_of.get(int(block_ids[n_enc // Ng]) * Ng + n_enc % Ng, -1)
    return compact_request(geo, policy,
                           [(layer.impl._layout_for(layer.kv_cache, layer.layer_name), layer.kv_cache,
                             layer.impl.staging) for layer in layers], block_ids, slot,
                           layers[0].impl.reference_arithmetic)


def compacted_rows(block_table: torch.Tensor, num_reqs: int) -> dict[int, tuple[int, dict[str, int]]]:
    """Rows of this step whose request was compacted: row -> (keep_from, kept lengths)."""
    if not _COMPACTED:
        return {}
    first = block_table[:num_reqs, 0].tolist()
    return {r: _COMPACTED[b] for r, b in enumerate(first) if b in _COMPACTED}


def layer_read_plan(read, rows: dict, layer_name: str, block_table: torch.Tensor, layout):
    """The read plan of one layer given the step's compacted rows."""
    T, groups_per_block = layout.T, layout.groups_per_block
    per_row = {}
    for r, (keep_from, kept) in rows.items():
        n = kept[layer_name]
        g = torch.arange(n // T)
        blocks = block_table[r].to("cpu", torch.long)
        per_row[r] = (keep_from, n, blocks[g // groups_per_block] * groups_per_block
                      + g % groups_per_block)
    return compacted_read_plan(read, per_row, layout)


# ----------------------------------------------------------------------------- start-up
def eviction_refusals(vllm_config, scheme, cfg) -> list[str]:
    """Why eviction as configured cannot run on this engine (empty: it can)."""
    if cfg.eviction is None:
        return []
    reasons = []
    cache, sched, par = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.parallel_config
    if cache.enable_prefix_caching:
        reasons.append("eviction rewrites a request's blocks, which prefix caching would share "
                       "with later requests: pass --no-enable-prefix-caching")
    if cfg.skip_layers:
        reasons.append(f"eviction with skip_layers {cfg.skip_layers}: those layers use vLLM's own "
                       "attention, which cannot read per-layer kept lengths")
    if scheme.retrieval_heads:
        reasons.append(f"eviction with retrieval_heads {scheme.retrieval_heads}: compaction "
                       "re-encodes whole layers with one codec pair (set retrieval_heads 0)")
    if scheme.uses_relevance:
        reasons.append("eviction with an STP scheme: compaction re-encodes groups without the "
                       "observation-window queries their relevance needs")
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        reasons.append("eviction with tensor/pipeline parallelism: every worker must plan on "
                       "every layer and head of the request")
    if sched.async_scheduling:
        reasons.append("eviction with async scheduling: blocks are freed right after the "
                       "step that filled them")
    if sched.scheduler_cls not in (None, SCHEDULER_CLS, EvictingScheduler):
        reasons.append(f"eviction with a custom --scheduler-cls {sched.scheduler_cls!r}: eviction "
                       f"needs its own ({SCHEDULER_CLS})")
    if cfg.eviction_sinks < scheme.sink_tokens:
        reasons.append(f"eviction_sinks ({cfg.eviction_sinks}) must be >= sink_tokens "
                       f"({scheme.sink_tokens}): the exact sink area holds the first tokens")
    return reasons


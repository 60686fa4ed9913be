"""The parts of the KV stats route that need no server: the eviction counter the
eviction code feeds, the worker's KV-bytes figure, and the entry points in pyproject.toml."""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_lowbit_kv.vllm.stats import WORKER_METHOD, EvictionCounter, worker_snapshot

ROOT = Path(__file__).resolve().parents[1]


def test_eviction_counter_counts_and_names_bad_input():
    c = EvictionCounter()
    assert (c.enabled, c.evicted_pairs) == (False, 0)
    c.enable()
    c.record(3)
    c.record(0)
    c.record(5)
    assert (c.enabled, c.evicted_pairs) == (True, 8)
    with pytest.raises(ValueError, match=r"pairs must be an int >= 0, got -1"):
        c.record(-1)


def test_worker_snapshot_reads_the_shared_kv_allocation():
    """Every KVCacheTensor names the one backing allocation: its size, not the sum."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    size = 10 * 585_504
    tensors = [KVCacheTensor(size=size, layers=[f"l{i}"], layer_stride=0, block_stride=0)
               for i in range(3)]
    cfg = KVCacheConfig(num_blocks=10, kv_cache_tensors=tensors, kv_cache_groups=[])
    snap = worker_snapshot(SimpleNamespace(model_runner=SimpleNamespace(kv_cache_config=cfg)))
    assert snap["kv_cache_bytes"] == size and snap["num_blocks"] == 10
    assert worker_snapshot(None)["kv_cache_bytes"] is None


def test_entry_points_resolve_to_vllm_plugins():
    pytest.importorskip("vllm")
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin
    from vllm.v1.worker.worker_base import WorkerBase

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    (name, value), = eps["vllm.endpoint_plugins"].items()
    plugin = EntryPoint(name, value, "vllm.endpoint_plugins").load()()
    assert isinstance(plugin, EndpointPlugin) and plugin.name == name == "lowbit_kv_stats"
    (gname, gvalue), = eps["vllm.general_plugins"].items()
    EntryPoint(gname, gvalue, "vllm.general_plugins").load()()  # register(): idempotent
    assert callable(getattr(WorkerBase, WORKER_METHOD))

"""The e2e tests' servers, on the one harness that the benchmarks use too (bench/server.py).

``server`` (session fixture, made visible to every test module by conftest.py) is
the ONE shared vidkv server of a test session, about 30 s to start on the
embedded SmolLM2, configured to exercise everything at once: STP (``protect``
0.2, relevance from the prefill queries), 4 bf16 sink tokens, a 128-token
residual window (two groups per sequence in staging), layer 0 kept in
bf16 (``skip_layers``), chunked prefill (max_num_batched_tokens=256, so a long
prompt's later chunks read the packed pages), prefix caching (vLLM's default),
and only :data:`NUM_BLOCKS` KV blocks (``--num-gpu-blocks-override``) so that
concurrent requests get preempted; it runs vLLM's default process layout (a
separate worker process; the other test servers run the worker inside the engine
core, tests/conftest.py). Tests that use it must leave it idle
(:func:`wait_idle`): every KV block and staging slot back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench.server as harness
from bench.server import (ROOT, SERVING, STATS_ROUTE, STOCK_VLLM, Server, get_json, metrics_text,  # noqa: F401
                          post)

KV_SPACE_GIB = 1
COMMON = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4", "--block-size", "128",
          "--max-num-batched-tokens", "256", "--host", "127.0.0.1"]
#: the shared server's fields (vidkv with STP and a window), also the VLM's (vidkv_stp), so
#: that both run one packed KV configuration: int8 staging, vidkv's default, for both
LOWBIT = {"protect": 0.2, "sink_tokens": 4, "residual_tokens": 128, "skip_layers": [0],
          "staging_dtype": "int8"}
NUM_BLOCKS = 10
#: the test modules that use ``server``: pytest-xdist runs them in one process, so that it
#: starts once (tests/conftest.py, which refuses to run a user missing here)
SHARED_SERVER_MODULES = ("test_kv_stats.py", "test_load_fault.py", "test_prefix_same_step.py",
                         "test_serving_launcher.py", "test_vllm_multimodal.py", "test_vllm_plugin.py")
#: for servers whose test is about the path (blocks, eviction, a split, ours vs stock vLLM),
#: not the model's dtype: on CPUs without AVX-512 BF16 (CI's) vLLM's bf16 GEMMs take ~5x
#: float32's time (512x576 by 576x1536, one thread: 115 vs 21 ms), and long prefills
#: dominate those tests. The shared server and the dtype-bound comparisons stay bf16.
FLOAT32_WEIGHTS = ["--dtype", "float32"]
#: KV memory of a measurement server that holds a couple of short sequences (about 2,900
#: float32 tokens of the reference): vLLM touches all of it at start-up, and at the default
#: GiB the test modules' servers took CI's 24 GiB to its last 1.5 GiB
SMALL_KV_BYTES = 128 << 20
#: env of a server with several ranks (tensor/pipeline parallel): the launcher binds each
#: rank to its CPUs, not to the one share tests/conftest.py gives a pytest-xdist worker
MULTI_RANK_ENV = {"VLLM_CPU_OMP_THREADS_BIND": None}
#: env of a server in vLLM's default process layout (the worker in a process of its own), as
#: users run it; the other test servers run the worker in the engine core (tests/conftest.py)
DEFAULT_LAYOUT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": None}


def start_server(tmp, name, args, stock=False, model=None, **env_extra) -> Server:
    """``python -m serving ARGS`` (with ``stock``: vLLM's own server, without our plugin),
    launched with :data:`KV_SPACE_GIB` of KV cache, on ``model`` (default the embedded
    one); its log is ``tmp/NAME.log``."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), **env_extra}
    launcher = SERVING
    if stock:
        from vllm_lowbit_kv.model import prepare_model

        env["VLLM_PLUGINS"] = "none"
        args, launcher = ["--model", str(model or prepare_model()), *args], STOCK_VLLM
    elif model is not None:
        args = ["--model", str(model), *args]
    return Server(args, launcher=launcher, env=env, log=tmp / f"{name}.log").launch()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("server")
    cfg = tmp / "lowbit.json"
    cfg.write_text(json.dumps(LOWBIT))
    s = start_server(tmp, "vidkv", ["--kv-cache-dtype", "vidkv", "--lowbit-config", str(cfg),
                                    "--num-gpu-blocks-override", str(NUM_BLOCKS), *COMMON],
                     LOWBIT_KV_LOG_STAGING="1", **DEFAULT_LAYOUT_ENV)
    try:
        yield s.wait_ready(timeout=300)
    finally:
        s.stop()


def model_name(port):
    return get_json(port, "/v1/models")["data"][0]["id"]


def metric(port, name, text: str | None = None, **labels) -> float:
    """The value of ``name`` (``vllm:`` prefixed unless it has a prefix) whose labels
    include ``labels``."""
    name = name if ":" in name else f"vllm:{name}"
    value = harness.metric_value(metrics_text(port) if text is None else text, name, **labels)
    assert value is not None, f"metric {name} {labels or ''} not found"
    return value


def wait_idle(server: Server, timeout=60) -> dict:
    """Every block back in vLLM's free pool, every staging slot returned (route and log),
    nothing running or waiting."""
    idle, state, _ = harness.wait_idle(server.port, server.log, timeout)
    assert idle, state
    return state


def long_prompt(i: int = 0, chars: int = 3000) -> str:
    corpus = Path(os.environ.get("VLLM_LOWBIT_KV_CACHE", Path.home() / ".cache/vllm-lowbit-kv"))
    p = corpus / "corpus" / "lee_background.txt"
    if p.is_file():
        lines = p.read_text().splitlines()
        text = " ".join(lines[i * 6:(i + 1) * 6] + lines[:6])
    else:
        text = f"Story {i}. " + "The quick brown fox jumps over the lazy dog. " * 80
    return text[:chars] + "\n\nSummary:"


def fluent(text: str, min_words: int = 15) -> bool:
    words = text.split()
    return len(words) > min_words and len(set(words)) > min_words // 2  # not a collapsed loop

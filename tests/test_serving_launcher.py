"""What a new user gets from the launcher (issue #17): safe defaults, clear start-up
output, eviction counters that cross processes, the stats equal to the start-up log,
``--api-key``.

Two servers of their own, started together through ``bash scripts/main.sh`` (set-up,
then ``exec python -m serving "$@"``), besides the session's shared one:

* ``plain``: no flag but ``--port`` (a free one) and no ``VLLM_CPU_KVCACHE_SPACE``
  in its environment: it must listen on 127.0.0.1 only, serve the embedded model
  as ``SmolLM2-135M-Instruct`` (its folder's path still accepted), hold 2 GiB of
  vidkv KV cache, and print no warning of ours;
* ``evicting``: ``--kv-eviction flashcache --kv-retention 0.2 --api-key KEY`` (and
  128-token pages, so that a 1.5K-token prompt frees blocks): evicted pairs reach
  ``/v1/kv_cache/stats`` and ``/metrics`` equal to the sum the worker logged, the
  key guards ``/v1/kv_cache/stats`` and ``/v1/completions``.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from _servers import ROOT, STATS_ROUTE, long_prompt
from bench.server import Server, request

KEY = "lowbit-test-key"
GiB = 1 << 30
SHORT = "SmolLM2-135M-Instruct"
SCHEME_LOG = re.compile(r"lowbit-kv: scheme_config (\{.*\})\s*$", re.M)
DROPPED_LOG = re.compile(r"compacted, kept pairs per layer .* dropped (\d+) K/V pairs")

#: vLLM's and torch's own start-up notices about this machine and build, none about us:
#: each names its cause (a missing optional library, the build, a flag's consequence)
VLLM_NOTICES = [
    r"Found ulimit of \d+ and failed to automatically increase",
    r"Enforce eager set, disabling torch\.compile",
    r"Inductor compilation was disabled by user settings",
    r"Triton is not installed\. triton-cpu is expected on x86 CPUs",
    r"Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'",
    r"Model Runner V2 requires Triton; using the V1 model runner instead",
    r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
    r"NUMA binding: Using MEMBIND policy",
    r"FutureWarning: `torch\.distributed\.reduce_op` is deprecated",
]
#: the one notice eviction brings, named by the issue: vLLM's about a custom scheduler
SCHEDULER_NOTICE = r"Using custom scheduler class vllm_lowbit_kv\.vllm\.eviction\.EvictingScheduler"
OURS = re.compile(r"lowbit|VLLM_PLUGINS|endpoint plugin|additional_config|\[(plugin|patches|checks|"
                  r"resolve|backend|eviction|kv_stats|hf_cache|paged|schemes)\.py:\d+\]", re.I)


# ----------------------------------------------------------------------------- no server
def test_main_sh_is_setup_then_the_launcher():
    lines = [ln.strip() for ln in (ROOT / "scripts" / "main.sh").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[-2:] == ["bash scripts/setup.sh", 'exec .venv/bin/python -m serving "$@"'], lines
    assert not any("--host" in ln or "KVCACHE" in ln for ln in lines)  # the launcher's defaults


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_docker_binds_every_interface_explicitly(dockerfile):
    text = (ROOT / "docker" / dockerfile).read_text()
    entry = json.loads(next(ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT"))[10:])
    assert entry[:3] == ["python", "-m", "serving"]
    assert entry[entry.index("--host") + 1] == "0.0.0.0"


def test_launcher_defaults():
    pytest.importorskip("vllm")
    from serving.__main__ import build_argv, defaults
    from vllm_lowbit_kv.model import prepare_model

    embedded = str(prepare_model())
    argv = build_argv([])
    assert argv == ["--model", embedded]
    add, env = defaults(argv, environ={}, cpu=True)
    assert add == ["--host", "127.0.0.1", "--served-model-name", SHORT, embedded,
                   "--kv-cache-dtype", "vidkv", "--enforce-eager", "--max-num-seqs", "32"]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    # a flag, in any of vLLM's spellings, or the environment, wins
    add, env = defaults([*argv, "--host=0.0.0.0", "--served_model_name", "m", "--kv-cache-dtype",
                         "kivi2", "-O3", "--max-num-seqs=4"], environ={}, cpu=True)
    assert add == [] and env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert defaults(argv, environ={"VLLM_CPU_KVCACHE_SPACE": "5"}, cpu=True)[1] == {}
    assert defaults([*argv, "--kv-cache-memory-bytes", "1000000"], environ={}, cpu=True)[1] == {}
    assert "--enforce-eager" not in defaults([*argv, "--compilation-config.mode", "3"], {}, True)[0]
    # another model keeps its name; off the CPU platform only the host is ours
    assert defaults(["--model", "Qwen/Qwen3-0.6B"], environ={}, cpu=False) == (
        ["--host", "127.0.0.1"], {})
    # the test VLM's folder is served by its name too
    from vllm_lowbit_kv.model import VLM_NAME, prepare_vlm

    vlm = str(prepare_vlm(progress=False))
    assert defaults(["--model", vlm], environ={}, cpu=False)[0] == [
        "--host", "127.0.0.1", "--served-model-name", VLM_NAME, vlm]


def test_launcher_reads_a_config_file(tmp_path):
    pytest.importorskip("vllm")
    from serving.__main__ import defaults

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("host: 0.0.0.0\nmax_num_seqs: 8\nkv_cache_memory_bytes: 1000000\n")
    add, env = defaults(["--model", "m", "--config", str(cfg)], environ={}, cpu=True)
    assert add == ["--kv-cache-dtype", "vidkv", "--enforce-eager"] and env == {}


def test_worker_figures_add_up_over_ranks():
    pytest.importorskip("vllm")
    from serving.kv_stats import merge_ranks

    rank = dict(staging_pools=1, staging_slots_total=12, staging_slots_in_use=3, staging_stale_reused=0,
                eviction_enabled=True, evicted_pairs=100, kv_cache_bytes=1000, num_blocks=10,
                attention_impls=["cpp"])
    merged = merge_ranks([rank, {**rank, "evicted_pairs": 50, "eviction_enabled": False,
                                 "attention_impls": ["cpp", "torch"]}])
    assert merged == {**rank, "staging_pools": 2, "staging_slots_total": 24, "staging_slots_in_use": 6,
                      "evicted_pairs": 150, "kv_cache_bytes": 2000, "ranks": 2,
                      "attention_impls": ["cpp", "torch"]}
    assert merge_ranks([rank, {**rank, "kv_cache_bytes": None}])["kv_cache_bytes"] is None
    with pytest.raises(RuntimeError):
        merge_ranks([])


def test_evicted_pairs_per_compaction():
    pytest.importorskip("vllm")
    from vllm_lowbit_kv.eviction.paged import PagedEvictionGeometry
    from vllm_lowbit_kv.vllm.eviction import evicted_pairs

    geo = PagedEvictionGeometry(prompt_tokens=1500, block_size=128, keep_from=1408, region_cap=640,
                                kept_blocks=5)
    # two layers keeping 640 and 320 of the 1408 positions below the last prompt block, 3 heads
    assert evicted_pairs(geo, [640, 320], [3, 3]) == (768 + 1088) * 3
    with pytest.raises(ValueError):
        evicted_pairs(geo, [640], [3, 3])


# ----------------------------------------------------------------------------- servers
def _request(port, method, path, body=None, key=None):
    auth = {"Authorization": f"Bearer {key}"} if key else None
    status, data = request(port, method, path, body, headers=auth)
    try:
        return status, json.loads(data)
    except json.JSONDecodeError:
        return status, data.decode()


def _main_sh(tmp, name, args, kv_space_gib):
    """``bash scripts/main.sh ARGS --port P``; ``kv_space_gib`` None: the launcher's default."""
    env = {"VLLM_CPU_KVCACHE_SPACE": None if kv_space_gib is None else str(kv_space_gib)}
    return Server(args, launcher=["bash", "scripts/main.sh"], env=env, log=tmp / f"{name}.log").launch()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("launcher")
    started = dict(
        plain=_main_sh(tmp, "plain", [], kv_space_gib=None),
        evicting=_main_sh(tmp, "evicting", ["--kv-eviction", "flashcache", "--kv-retention", "0.2",
                                            "--block-size", "128", "--max-model-len", "2048",
                                            "--max-num-seqs", "4", "--api-key", KEY], kv_space_gib=1))
    try:
        for s in started.values():
            s.wait_ready(timeout=400)
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.mark.slow
def test_plain_launcher_listens_on_loopback_only(servers):
    import psutil

    s = servers["plain"]
    listening = [c.laddr for c in psutil.Process(s.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.port == s.port for a in listening), listening
    assert {a.ip for a in listening} == {"127.0.0.1"}, listening


@pytest.mark.slow
def test_plain_launcher_serves_the_short_name(servers):
    from vllm_lowbit_kv.model import prepare_model

    port = servers["plain"].port
    status, models = _request(port, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == SHORT
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    status, out = _request(port, "POST", "/v1/completions", {**body, "model": SHORT})
    assert status == 200 and out["model"] == SHORT, out
    status, out = _request(port, "POST", "/v1/completions", {**body, "model": str(prepare_model())})
    assert status == 200 and out["model"] == SHORT, out  # the folder's path still works
    status, out = _request(port, "POST", "/v1/completions", {**body, "model": "SmolLM2"})
    assert status == 404, out
    assert f"Valid aliases: {SHORT}" in out["error"]["message"], out  # vLLM's body names it
    assert out["error"]["param"] == "model"


@pytest.mark.slow
def test_plain_launcher_kv_defaults(servers):
    status, stats = _request(servers["plain"].port, "GET", STATS_ROUTE)
    assert status == 200
    assert stats["kv_cache_dtype"] == "vidkv" and stats["model"] == SHORT
    assert stats["capacity"]["kv_cache_memory_bytes"] == 2 * GiB
    assert stats["staging"]["slots_total"] > 0 and stats["eviction"]["enabled"] is False


def _warnings(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if re.search(r"\bWARN(ING)?\b|Warning", ln)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "evicting"])
def test_startup_prints_no_warning_of_ours(servers, name):
    warnings = _warnings(servers[name].log.read_text())
    assert warnings, "no warning at all: is vLLM's log format still the same?"
    ours = [w for w in warnings if OURS.search(w) and not re.search(SCHEDULER_NOTICE, w)]
    assert ours == [], ours
    unknown = [w for w in warnings if not any(re.search(p, w) for p in VLLM_NOTICES)
               and not re.search(SCHEDULER_NOTICE, w)]
    assert unknown == [], f"a warning that is not one of vLLM's known notices: {unknown}"
    assert any(re.search(SCHEDULER_NOTICE, w) for w in warnings) == (name == "evicting")


def _scheme_config_logged(log: str) -> dict:
    found = SCHEME_LOG.findall(log)
    assert len(found) == 1, f"{len(found)} scheme_config lines"  # once per server
    return json.loads(found[0])


@pytest.mark.slow
def test_stats_scheme_is_the_logged_scheme_config(servers, server):
    """The shared session server (skip_layers, protect, sinks, window set) and the
    evicting one (eviction set): the route's ``scheme`` is the logged object."""
    for s, key in ((server, None), (servers["evicting"], KEY), (servers["plain"], None)):
        logged = _scheme_config_logged(s.log.read_text())
        status, stats = _request(s.port, "GET", STATS_ROUTE, key=key)
        assert status == 200 and stats["scheme"] == logged
    shared = _scheme_config_logged(server.log.read_text())
    assert shared["skip_layers"] == [0] and "protect=0.2" in shared["value_codec"]
    ev = _scheme_config_logged(servers["evicting"].log.read_text())
    assert ev["eviction"]["policy"] == "flashcache" and ev["eviction"]["retention"] == 0.2
    assert ev["page_tokens"] == 128


@pytest.mark.slow
def test_api_key_guards_stats_and_completions(servers):
    port = servers["evicting"].port
    body = {"model": SHORT, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert _request(port, "GET", STATS_ROUTE)[0] == 401
    assert _request(port, "GET", STATS_ROUTE, key="wrong")[0] == 401
    assert _request(port, "POST", "/v1/completions", body)[0] == 401
    assert _request(port, "POST", "/v1/completions", body, key="wrong")[0] == 401
    assert _request(port, "GET", STATS_ROUTE, key=KEY)[0] == 200
    assert _request(port, "POST", "/v1/completions", body, key=KEY)[0] == 200


def _evicted_metric(port) -> float:
    status, text = _request(port, "GET", "/metrics", key=KEY)
    m = re.search(r"^lowbit_kv:evicted_pairs_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert status == 200 and m, "lowbit_kv:evicted_pairs_total missing"
    return float(m.group(1))


@pytest.mark.slow
def test_eviction_counters_reach_the_api_server(servers):
    s = servers["evicting"]
    status, before = _request(s.port, "GET", STATS_ROUTE, key=KEY)
    assert status == 200 and before["eviction"]["enabled"] is True
    body = {"model": SHORT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for i in range(2):  # two requests of about 1.5K tokens: 11 of 12 blocks below keep_from
        status, out = _request(s.port, "POST", "/v1/completions",
                               {**body, "prompt": long_prompt(i, chars=6500)}, key=KEY)
        assert status == 200 and out["usage"]["prompt_tokens"] > 1200, out
    deadline = time.time() + 30
    while True:
        dropped = [int(x) for x in DROPPED_LOG.findall(s.log.read_text())]
        status, stats = _request(s.port, "GET", STATS_ROUTE, key=KEY)
        if len(dropped) == 2 and stats["eviction"]["evicted_pairs"] == sum(dropped) or \
                time.time() > deadline:
            break
        time.sleep(1)
    assert len(dropped) == 2 and all(d > 0 for d in dropped), dropped
    assert stats["eviction"]["evicted_pairs"] == sum(dropped) > 0, (stats["eviction"], dropped)
    assert stats["workers"] == 1
    # the gauges (refreshed every LOWBIT_KV_STATS_REFRESH_S, and by the route's call above)
    assert _evicted_metric(s.port) == sum(dropped)
    assert "freed" in s.log.read_text()


def test_eviction_turns_retrieval_heads_off_unless_asked():
    """--kv-eviction compacts whole layers with one codec pair: the launcher sets
    retrieval_heads 0 (vidkv's default is 6) unless the user gives a value."""
    pytest.importorskip("vllm")
    from serving.__main__ import _merge_lowbit_config

    def lowbit(argv):
        out = _merge_lowbit_config(argv)
        return json.loads(out[out.index("--additional-config") + 1])["lowbit_kv"]

    assert lowbit(["--kv-eviction", "flashcache", "--kv-retention", "0.2"])["retrieval_heads"] == 0
    asked = lowbit(["--kv-eviction", "flashcache", "--kv-retention", "0.2", "--additional-config",
                    '{"lowbit_kv": {"retrieval_heads": 6}}'])
    assert asked["retrieval_heads"] == 6  # kept: the server refuses it with the reason
    assert "--additional-config" not in _merge_lowbit_config(["--kv-cache-dtype", "vidkv"])

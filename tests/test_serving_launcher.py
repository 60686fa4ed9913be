"""What a new user gets from the launcher (issue #17): safe defaults, clear start-up
output, eviction counters that cross processes, the stats equal to the start-up log,
``--api-key``.

Two servers of their own, started together through ``bash scripts/main.sh`` (set-up,
then ``exec python -m serving "$@"``), besides the session's shared one:

* ``plain``: no flag but ``--port`` (a free one) and no ``VLLM_CPU_KVCACHE_SPACE``
  in its environment: it must listen on 127.0.0.1 only, serve the embedded model
  as ``SmolLM2-135M-Instruct`` (its folder's path still accepted), hold 2 GiB of
  vidkv KV cache, print no warning of ours, and run with tcmalloc and Intel OpenMP
  preloaded where this machine has them (vLLM's "not found in LD_PRELOAD" warning
  only for what the launcher's start-up line says it did not find);
* ``evicting``: ``--kv-eviction flashcache --kv-retention 0.2 --api-key KEY`` (and
  128-token pages, so that a 1.5K-token prompt frees blocks): evicted pairs reach
  ``/v1/kv_cache/stats`` and ``/metrics`` equal to the sum the worker logged, the
  key guards ``/v1/kv_cache/stats`` and ``/v1/completions``; started with
  ``LOWBIT_KV_PRELOAD=0``, it preloads nothing (and vLLM warns about both libraries).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from _servers import DEFAULT_LAYOUT_ENV, FLOAT32_WEIGHTS, ROOT, STATS_ROUTE, long_prompt
from bench.server import Server, request

KEY = "lowbit-test-key"
GiB = 1 << 30
SHORT = "SmolLM2-135M-Instruct"
SCHEME_LOG = re.compile(r"lowbit-kv: scheme_config (\{.*\})\s*$", re.M)
PRELOAD_LOG = re.compile(r"^lowbit-kv: LD_PRELOAD.*$", re.M)
#: vLLM's CPU worker, for each library it wants preloaded and does not find in LD_PRELOAD
NOT_PRELOADED = re.compile(r"(libtcmalloc|libiomp) is not found in LD_PRELOAD")
#: vLLM's name for each library -> the launcher's
PRELOAD_NAMES = {"libtcmalloc": "tcmalloc", "libiomp": "Intel OpenMP"}
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
    r"NUMA binding: Using MEMBIND policy",
    r"FutureWarning: `torch\.distributed\.reduce_op` is deprecated",
    # CPUs without AVX-512 BF16 (an AVX2-only EPYC): vLLM's bf16 linear layers in torch
    r"Failed to create oneDNN linear, fallback to torch linear",
    # machines of two CPUs: the launcher's VLLM_CPU_NUM_OF_RESERVED_CPU=0 (its own line says why)
    r"VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement",
    # ... and vLLM's own OMP_NUM_THREADS for a worker on both of them
    r"OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving",
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
    add, env = defaults(argv, environ={}, cpu=True, cpus=list(range(8)))
    assert add == ["--host", "127.0.0.1", "--served-model-name", SHORT, embedded,
                   "--kv-cache-dtype", "vidkv", "--enforce-eager", "--max-num-seqs", "32"]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    # a flag, in any of vLLM's spellings, or the environment, wins
    add, env = defaults([*argv, "--host=0.0.0.0", "--served_model_name", "m", "--kv-cache-dtype",
                         "kivi2", "-O3", "--max-num-seqs=4"], environ={}, cpu=True, cpus=[0, 1, 2])
    assert add == [] and env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert defaults(argv, environ={"VLLM_CPU_KVCACHE_SPACE": "5"}, cpu=True, cpus=[0, 1, 2])[1] == {}
    assert defaults([*argv, "--kv-cache-memory-bytes", "1000000"], environ={}, cpu=True,
                    cpus=[0, 1, 2])[1] == {}
    assert "--enforce-eager" not in defaults([*argv, "--compilation-config.mode", "3"], {}, True)[0]


def test_launcher_gives_the_worker_every_cpu_of_a_small_machine():
    """Up to two CPUs, vLLM's one CPU reserved for its engine process would leave the model
    one: the launcher sets VLLM_CPU_NUM_OF_RESERVED_CPU=0 (one rank only, never over the
    user's own setting or explicit binding) and says so in one start-up line."""
    pytest.importorskip("vllm")
    from serving.__main__ import defaults, defaults_line

    argv = ["--model", "m"]
    for cpus, reserved in (([0], "0"), ([0, 1], "0"), ([0, 1, 2], None), (list(range(64)), None)):
        env = defaults(argv, environ={}, cpu=True, cpus=cpus)[1]
        assert env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") == reserved, cpus
        assert (defaults_line(env) is not None) == (reserved == "0")
    for environ in ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, {"VLLM_CPU_OMP_THREADS_BIND": "0"}):
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in defaults(argv, environ, True, [0, 1])[1]
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in defaults([*argv, "-tp", "2"], {}, True, [0, 1])[1]
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in defaults(argv, {}, False, [0, 1])[1]
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
    add, env = defaults(["--model", "m", "--config", str(cfg)], environ={}, cpu=True,
                        cpus=list(range(8)))
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


# ----------------------------------------------------------------------------- LD_PRELOAD
TCMALLOC, IOMP = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"


def _preload(environ, found=(TCMALLOC, IOMP), machine="x86_64", cpu=True):
    """serving.__main__.preload with this machine left out: ``(line, [exec'd env])``."""
    from serving.__main__ import preload

    execs = []
    paths = {"tcmalloc": found[0], "Intel OpenMP": found[1]}
    line = preload(["--port", "8001"], environ, execve=lambda exe, argv, env: execs.append((argv, env)),
                   cpu=cpu, machine=machine, find=lambda lib: paths[lib.what], loaded=lambda p: True)
    for argv, _ in execs:
        assert argv == [sys.executable, "-m", "serving", "--port", "8001"]
    return line, [env for _, env in execs]


def test_launcher_preloads_once_keeping_the_users_ld_preload():
    pytest.importorskip("vllm")
    user = {"LD_PRELOAD": "/opt/libmine.so", "PATH": "/bin"}
    line, execs = _preload(user)
    assert line is None and len(execs) == 1  # the launcher re-executes itself...
    env = execs[0]
    assert env["LD_PRELOAD"] == f"/opt/libmine.so:{TCMALLOC}:{IOMP}"  # appended, not clobbered
    assert env["PATH"] == "/bin" and user["LD_PRELOAD"] == "/opt/libmine.so"
    line, again = _preload(env)
    assert again == []  # ...once: the re-executed launcher only reports
    assert line == (f"lowbit-kv: LD_PRELOAD: preloaded tcmalloc ({TCMALLOC}), Intel OpenMP ({IOMP}) "
                    "(LOWBIT_KV_PRELOAD=0 turns this off)")
    # nothing to add: no exec, the line says so
    line, execs = _preload({"LD_PRELOAD": f"{TCMALLOC}:{IOMP}"})
    assert execs == [] and line.startswith("lowbit-kv: LD_PRELOAD: nothing preloaded; tcmalloc: "
                                           "LD_PRELOAD already has libtcmalloc; Intel OpenMP:")


def test_launcher_preload_opt_out_conflicts_and_missing_libraries():
    pytest.importorskip("vllm")
    for off in ("0", "off", "false"):
        line, execs = _preload({"LOWBIT_KV_PRELOAD": off, "LD_PRELOAD": "/opt/libmine.so"})
        assert execs == [] and line.startswith(f"lowbit-kv: LD_PRELOAD left as it is (LOWBIT_KV_PRELOAD={off})")
    # another allocator or another OpenMP runtime already preloaded: ours is not added
    # (vLLM asserts that LD_PRELOAD does not hold both libgomp and libiomp)
    line, execs = _preload({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2:/torch/lib/libgomp.so.1"})
    assert execs == [] and "jemalloc" in line and "already has libgomp" in line
    _, [env] = _preload({"LD_PRELOAD": "/torch/lib/libgomp.so.1"})
    assert env["LD_PRELOAD"] == f"/torch/lib/libgomp.so.1:{TCMALLOC}"
    # a library not found is named, with where to get it; the other is still preloaded
    _, [env] = _preload({}, found=(None, IOMP))
    assert env["LD_PRELOAD"] == IOMP
    line, _ = _preload(env, found=(None, IOMP))
    assert line.startswith(f"lowbit-kv: LD_PRELOAD: preloaded Intel OpenMP ({IOMP}); tcmalloc not found "
                           "(Debian: apt-get install libtcmalloc-minimal4)")
    # Intel OpenMP is x86 only; off vLLM's CPU platform nothing is preloaded, nothing said
    assert _preload({}, machine="aarch64")[1][0]["LD_PRELOAD"] == TCMALLOC
    assert _preload({}, cpu=False) == (None, [])


def test_find_library_order(tmp_path):
    pytest.importorskip("vllm")
    from serving.__main__ import PRELOAD_LIBS, find_library

    tcmalloc = PRELOAD_LIBS[0]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert find_library(tcmalloc, [str(tmp_path / "a")], {}) is None
    (tmp_path / "b" / "libtcmalloc.so.4").touch()
    assert find_library(tcmalloc, [str(tmp_path / "a"), str(tmp_path / "b")], {}) == str(
        tmp_path / "b" / "libtcmalloc.so.4")
    (tmp_path / "b" / "libtcmalloc_minimal.so.4").touch()  # the minimal one first, as vLLM's guide
    assert find_library(tcmalloc, [str(tmp_path / "a"), str(tmp_path / "b")], {}).endswith(
        "b/libtcmalloc_minimal.so.4")


def test_launcher_really_reexecutes_once(tmp_path):
    """The real re-exec, stopped before vLLM starts (a missing --lowbit-config file): one
    start-up line, from the re-executed process, with the libraries mapped in it."""
    pytest.importorskip("vllm")
    from serving.__main__ import plan_preload

    if not sys.platform.startswith("linux"):
        pytest.skip("LD_PRELOAD is Linux's")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_KV_PRELOAD", "LD_PRELOAD"))}
    expected, _ = plan_preload(env)
    run = subprocess.run([sys.executable, "-m", "serving", "--lowbit-config", str(tmp_path / "none.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "--lowbit-config" in run.stderr and "no such file" in run.stderr, run.stderr
    lines = PRELOAD_LOG.findall(run.stderr)
    assert len(lines) == 1, run.stderr
    if expected:
        assert lines[0].startswith("lowbit-kv: LD_PRELOAD: preloaded " + ", ".join(
            f"{lib.what} ({path})" for lib, path in expected)), lines
    else:
        assert lines[0].startswith("lowbit-kv: LD_PRELOAD: nothing preloaded"), lines
    # opted out: the same process, LD_PRELOAD as it was
    run = subprocess.run([sys.executable, "-m", "serving", "--lowbit-config", str(tmp_path / "none.json")],
                         cwd=ROOT, env={**env, "LOWBIT_KV_PRELOAD": "0"}, capture_output=True, text=True,
                         timeout=120)
    assert PRELOAD_LOG.findall(run.stderr) == [
        "lowbit-kv: LD_PRELOAD left as it is (LOWBIT_KV_PRELOAD=0); LD_PRELOAD=''"], run.stderr


# ----------------------------------------------------------------------------- servers
def _request(port, method, path, body=None, key=None):
    auth = {"Authorization": f"Bearer {key}"} if key else None
    status, data = request(port, method, path, body, headers=auth)
    try:
        return status, json.loads(data)
    except json.JSONDecodeError:
        return status, data.decode()


def _main_sh(tmp, name, args, kv_space_gib, env=None):
    """``bash scripts/main.sh ARGS --port P``, in vLLM's default process layout as users run
    it; ``kv_space_gib`` None: the launcher's default."""
    env = {"VLLM_CPU_KVCACHE_SPACE": None if kv_space_gib is None else str(kv_space_gib),
           "LD_PRELOAD": None, "LOWBIT_KV_PRELOAD": None, "LOWBIT_KV_PRELOADED": None,
           **DEFAULT_LAYOUT_ENV, **(env or {})}
    return Server(args, launcher=["bash", "scripts/main.sh"], env=env, log=tmp / f"{name}.log").launch()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("launcher")
    started = dict(
        # no binding of the test harness's (tests/conftest.py): vLLM's own, as users get it
        plain=_main_sh(tmp, "plain", [], kv_space_gib=None, env={"VLLM_CPU_OMP_THREADS_BIND": None}),
        evicting=_main_sh(tmp, "evicting", ["--kv-eviction", "flashcache", "--kv-retention", "0.2",
                                            "--block-size", "128", "--max-model-len", "2048",
                                            "--max-num-seqs", "4", "--api-key", KEY, *FLOAT32_WEIGHTS],
                          kv_space_gib=1,
                          env={"LOWBIT_KV_PRELOAD": "0"}))
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


@pytest.mark.slow
def test_plain_launcher_worker_cpus(servers):
    """vLLM's worker computes on every CPU of a machine of two or fewer (the launcher's
    start-up line says why), on all but one reserved CPU elsewhere (vLLM's default)."""
    from serving.__main__ import FEW_CPUS

    log = servers["plain"].log.read_text()
    cpus = sorted(os.sched_getaffinity(0))
    bound = re.findall(r"local_rank=0, core ids=(\[[\d, ]*\])", log)
    lines = re.findall(r"^lowbit-kv: VLLM_CPU_NUM_OF_RESERVED_CPU=0: .*$", log, re.M)
    assert len(bound) == 1, "vLLM's binding log line is gone: is its format still the same?"
    if len(cpus) <= FEW_CPUS:
        assert json.loads(bound[0]) == cpus and len(lines) == 1, (bound, lines)
        assert f"runs on all {len(cpus)} CPUs" in lines[0]
    else:
        assert len(json.loads(bound[0])) == len(cpus) - 1 and lines == [], (bound, lines)


@pytest.mark.slow
def test_plain_launcher_names_float32_without_bf16_hardware(servers):
    """The embedded model is bfloat16: the start-up line naming --dtype float32 appears
    exactly where this x86 CPU has no AVX-512 BF16, once per server."""
    import platform

    import torch

    log = servers["plain"].log.read_text()
    lines = re.findall(r"lowbit-kv: this CPU has no AVX-512 BF16.*$", log, re.M)
    slow = platform.machine().lower() in ("x86_64", "amd64") and \
        not torch.cpu._is_avx512_bf16_supported()
    assert len(lines) == (1 if slow else 0), lines


def _mapped_libs(pid: int) -> list[set[str]]:
    """For the server process and each of its children (vLLM's engine core and worker):
    the preloadable libraries mapped in it."""
    import psutil

    p = psutil.Process(pid)
    return [{key for m in q.memory_maps() for key in PRELOAD_NAMES if key in m.path}
            for q in [p, *p.children(recursive=True)]]


@pytest.mark.slow
def test_launcher_preloads_what_it_finds(servers):
    """The plain server: tcmalloc and Intel OpenMP (those this machine has) preloaded in
    every process of the server, said in one start-up line; vLLM's "not found in
    LD_PRELOAD" warning only for a library that line says was not found. The evicting
    server (``LOWBIT_KV_PRELOAD=0``): nothing preloaded, and vLLM says so."""
    import platform

    from serving.__main__ import plan_preload

    wanted = {"libtcmalloc"} | ({"libiomp"} if platform.machine() == "x86_64" else set())
    found, _ = plan_preload({})
    found = {lib.key for lib, _ in found}
    log = servers["plain"].log.read_text()
    lines = PRELOAD_LOG.findall(log)
    assert len(lines) == 1, lines
    for key in wanted:
        what = PRELOAD_NAMES[key]
        assert (f"{what} (/" in lines[0].split(";")[0]) == (key in found), lines[0]
        assert (f"{what} not found" in lines[0]) == (key not in found), lines[0]
    assert set(NOT_PRELOADED.findall(log)) == wanted - found  # vLLM agrees
    mapped = _mapped_libs(servers["plain"].proc.pid)
    assert len(mapped) >= 3 and all(m >= found for m in mapped), mapped
    log = servers["evicting"].log.read_text()
    assert PRELOAD_LOG.findall(log) == ["lowbit-kv: LD_PRELOAD left as it is (LOWBIT_KV_PRELOAD=0); "
                                        "LD_PRELOAD=''"]
    assert set(NOT_PRELOADED.findall(log)) == wanted
    assert not any(m & {"libtcmalloc", "libiomp"} for m in _mapped_libs(servers["evicting"].proc.pid))


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
               and not re.search(SCHEDULER_NOTICE, w) and not NOT_PRELOADED.search(w)]
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

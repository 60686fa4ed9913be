"""bench/server.py, the one server harness of the benchmarks and the tests.

Its lifecycle (launch, ready, refusal with the log's reason, timeout, stop of the
whole process group) runs here on stand-in servers: tiny Python scripts that print
what vLLM prints, so no test here needs vLLM. Real servers refusing:
test_vllm_engine.py; real servers serving: every e2e test.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

import bench.server as harness
from bench.server import READY_LINE, Server, ServerRefused, measurement_server, refusal_reason

#: a stand-in server: logs its arguments and its child's pid, says it is ready, waits
READY = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("args", sys.argv[1:], "child", child.pid, flush=True)
print("INFO: {READY_LINE}.", flush=True)
time.sleep(600)
"""
#: one that dies at start-up, leaving a child behind (as a dying API server can leave vLLM's engine)
REFUSES = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, "\\nINFO starting\\nERROR Traceback\\nValueError: --kv-cache-dtype kivi2 cannot "
      "serve this model: block size 32. Refusing to start.", flush=True)
sys.exit(1)
"""


def stand_in(tmp_path: Path, script: str, args=("--kv-cache-dtype", "kivi2"), name="server") -> Server:
    return Server(args, launcher=[sys.executable, "-c", script], log=tmp_path / f"{name}.log")


def gone(pid: int) -> bool:
    """No such process, or a zombie that nobody reaps (its group was killed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_child_gone(log: str) -> None:
    child = int(log.split("child ")[1].split()[0])
    deadline = time.time() + 10
    while not gone(child):
        assert time.time() < deadline, "the server's child outlived it"
        time.sleep(0.1)


def test_ready_then_stopped_with_its_children(tmp_path):
    s = stand_in(tmp_path, READY).start(timeout=60)
    assert s.alive and s in harness._LIVE and s.startup_s is not None
    assert f"args ['--kv-cache-dtype', 'kivi2', '--port', '{s.port}']" in s.log_text()
    s.stop()
    assert not s.alive and s not in harness._LIVE
    assert_child_gone(s.log_text())


def test_refusal_names_the_reason_and_shows_the_log(tmp_path):
    s = stand_in(tmp_path, REFUSES)
    with pytest.raises(ServerRefused) as e:
        s.start(timeout=60)
    assert e.value.reason == ("--kv-cache-dtype kivi2 cannot serve this model: block size 32. "
                              "Refusing to start.")
    assert str(e.value).startswith("vLLM server for --kv-cache-dtype kivi2 did not start: --kv-cache-dtype")
    assert "ERROR Traceback" in str(e.value)  # the end of the log comes with it
    assert not s.alive and s not in harness._LIVE
    assert_child_gone(s.log_text())


def test_not_ready_in_time_is_a_refusal_and_stops_it(tmp_path):
    s = stand_in(tmp_path, "import time; time.sleep(600)", args=())
    with pytest.raises(ServerRefused, match="vLLM server did not start: not ready after 1 s"):
        s.start(timeout=1)
    assert not s.alive


#: one that binds its --port as vLLM's API server does, then says it is ready
BINDS_PORT = f"""
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
sock = socket.socket()
sock.bind(("127.0.0.1", port))
print("INFO: {READY_LINE}.", flush=True)
time.sleep(600)
"""


def test_free_port_is_outside_the_ephemeral_range():
    port = harness.free_port()
    assert port in harness.PORT_RANGE
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not low <= port <= high


def test_port_taken_at_bind_is_relaunched_on_another(tmp_path, monkeypatch):
    """The port was free when picked and taken before the server bound it (another
    worker's server): the harness starts it again on a new port, not a refusal."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        picks = iter([taken.getsockname()[1], harness.free_port()])
        monkeypatch.setattr(harness, "free_port", lambda: next(picks))
        s = stand_in(tmp_path, BINDS_PORT).start(timeout=60)
        try:
            assert s.port != taken.getsockname()[1] and s.alive
        finally:
            s.stop()


def test_port_taken_every_time_is_a_refusal(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        monkeypatch.setattr(harness, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(ServerRefused, match="Address already in use"):
            stand_in(tmp_path, BINDS_PORT).start(timeout=60)


def test_stop_all_keeps_one(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "_LIVE", set())
    a = stand_in(tmp_path, "import time; time.sleep(600)", name="a").launch()
    b = stand_in(tmp_path, "import time; time.sleep(600)", name="b").launch()
    harness.stop_all(keep=b)
    assert not a.alive and b.alive and harness._LIVE == {b}
    harness.stop_all()
    assert not b.alive and not harness._LIVE


def test_refusal_reason():
    log = ("INFO starting\nERROR Traceback\nValueError: --kv-cache-dtype vidkv_stp cannot serve this "
           "model: scheme needs STP. Refusing to start rather than serve wrong outputs.\nmore\n")
    assert refusal_reason(log).startswith("--kv-cache-dtype vidkv_stp cannot serve this model: scheme")
    why = ("lowbit-kv: staging (residual window and partial group, in the model dtype) for "
           "--max-num-seqs 32 sequences takes 90.0 MiB of the 96.0 MiB KV cache budget")
    engine = (f"ERROR ValueError: {why}\nERROR RuntimeError: Worker failed with error '{why}', "
              "please check\nRuntimeError: Engine core initialization failed. See root cause "
              "above.\n")
    assert refusal_reason(engine) == f"ValueError: {why}"
    fp8 = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."  # vLLM's, on an AVX2 CPU
    engine = (f"(Worker pid=1) ERROR NotImplementedError: {fp8}\n(EngineCore pid=2) ERROR "
              f"RuntimeError: Worker failed with error '{fp8}', please check the stack trace above "
              "for the root cause\n    raise RuntimeError(\nRuntimeError: Engine core "
              "initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert refusal_reason(engine) == f"NotImplementedError: {fp8}"
    assert "invalid choice: 'x'" in refusal_reason("usage: ...\nerror: argument --kv-cache-dtype: "
                                                   "invalid choice: 'x' (choose from a, b)\n")
    assert refusal_reason("") == "no output"


def test_measurement_server_is_chunked_prefill_without_prefix_cache():
    cmd = measurement_server("/m", "kivi2", chunk=96, max_model_len=1024).command(8123)
    assert cmd[1:3] == ["-m", "serving"] and cmd[-2:] == ["--port", "8123"]
    args = dict(zip(cmd[3::], cmd[4::]))
    assert args["--kv-cache-dtype"] == "kivi2" and args["--max-num-batched-tokens"] == "96"
    assert args["--max-model-len"] == "1024" and args["--host"] == "127.0.0.1"
    assert "--enforce-eager" in cmd and "--no-enable-prefix-caching" in cmd
    assert "--additional-config" not in cmd and "--dtype" not in cmd  # the model's own
    cmd2 = measurement_server("/m", "kivi2", chunk=96, max_model_len=1024, model_dtype="float32",
                              additional_config={"block_tokens": 32}).command()
    assert cmd2[cmd2.index("--dtype") + 1] == "float32"
    assert json.loads(cmd2[cmd2.index("--additional-config") + 1]) == {"lowbit_kv": {"block_tokens": 32}}
    assert "--port" not in cmd2  # as a result records it


def test_kv_memory_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("LOWBIT_KV_CONFIG_LOGGED", "1")
    monkeypatch.setenv("LOWBIT_KV_BF16_NOTED", "1")
    env = measurement_server("/m", "fp8", chunk=8, max_model_len=64).env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "LOWBIT_KV_CONFIG_LOGGED" not in env
    assert "LOWBIT_KV_BF16_NOTED" not in env  # each server notes a slow bf16 CPU once
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert measurement_server("/m", "fp8", chunk=8, max_model_len=64).env()["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert measurement_server("/m", "fp8", chunk=8, max_model_len=64,
                              kv_space_gib=2).env()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    exact = measurement_server("/m", "fp8", chunk=8, max_model_len=64, kv_cache_bytes=1 << 26)
    assert "VLLM_CPU_KVCACHE_SPACE" not in exact.env()  # it would override the flag's bytes
    assert exact.command()[-2:] == ["--kv-cache-memory-bytes", str(1 << 26)]
    assert "X" not in Server(env={"X": None}).env() and Server(env={"X": "y"}).env()["X"] == "y"

"""Real ``python -m serving`` servers for the e2e tests, and a small HTTP client for them.

``server`` (session fixture, made visible to every test module by conftest.py) is
the ONE shared vidkv server of a test session, about 30 s to start on the
embedded SmolLM2, configured to exercise everything at once: STP (``protect``
0.2, relevance from the prefill queries), 4 bf16 sink tokens, a 128-token
residual window (two groups per sequence in staging), layer 0 kept in
bf16 (``skip_layers``), chunked prefill (max_num_batched_tokens=256, so a long
prompt's later chunks read the packed pages), prefix caching (vLLM's default),
and only :data:`NUM_BLOCKS` KV blocks (``--num-gpu-blocks-override``) so that
concurrent requests get preempted. Tests that use it must leave it idle
(:func:`wait_idle`): every KV block and staging slot back.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KV_SPACE_GIB = 1
COMMON = ["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4", "--block-size", "128",
          "--max-num-batched-tokens", "256", "--host", "127.0.0.1"]
LOWBIT = {"protect": 0.2, "sink_tokens": 4, "residual_tokens": 128, "skip_layers": [0]}
NUM_BLOCKS = 10
STATS_ROUTE = "/v1/kv_cache/stats"
#: the backend's staging log line (LOWBIT_KV_LOG_STAGING=1)
STAGING_LOG = re.compile(r"freed \d+ staging slots of ended requests \((\d+) in use\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd, log, env):
        self.log = log
        self.port = int(cmd[cmd.index("--port") + 1])
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_ready(self, timeout=300):
        deadline = time.time() + timeout
        while "Application startup complete" not in self.log.read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"server did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(1)
        return self

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_server(tmp, name, args, stock=False, **env_extra) -> Server:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB), **env_extra)
    env.pop("LOWBIT_KV_CONFIG_LOGGED", None)
    port = str(free_port())
    if stock:
        from vllm_lowbit_kv.model import prepare_model

        env["VLLM_PLUGINS"] = "none"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(prepare_model()), "--port", port, *args]
    else:
        cmd = [sys.executable, "-m", "serving", "--port", port, *args]
    return Server(cmd, tmp / f"{name}.log", env)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("server")
    cfg = tmp / "lowbit.json"
    cfg.write_text(json.dumps(LOWBIT))
    s = start_server(tmp, "vidkv", ["--kv-cache-dtype", "vidkv", "--lowbit-config", str(cfg),
                                    "--num-gpu-blocks-override", str(NUM_BLOCKS), *COMMON],
                     LOWBIT_KV_LOG_STAGING="1")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def model_name(port):
    return get_json(port, "/v1/models")["data"][0]["id"]


def get_json(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("GET", path)
    r = c.getresponse()
    assert r.status == 200, (path, r.status)
    return json.loads(r.read())


def metrics_text(port) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/metrics")
    return c.getresponse().read().decode()


def metric(port, name, text: str | None = None, **labels) -> float:
    """The value of ``name`` (``vllm:`` prefixed unless it has a prefix) whose labels
    include ``labels``."""
    name = name if ":" in name else f"vllm:{name}"
    text = metrics_text(port) if text is None else text
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"metric {name} {labels or ''} not found")


def post(port, path, body, stream=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    if not stream:
        return json.loads(r.read())
    events = []
    for line in r:
        line = line.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            events.append(json.loads(line[5:]))
    return events


def long_prompt(i: int = 0, chars: int = 3000) -> str:
    corpus = Path(os.environ.get("VLLM_LOWBIT_KV_CACHE", Path.home() / ".cache/vllm-lowbit-kv"))
    p = corpus / "corpus" / "lee_background.txt"
    if p.is_file():
        lines = p.read_text().splitlines()
        text = " ".join(lines[i * 6:(i + 1) * 6] + lines[:6])
    else:
        text = f"Story {i}. " + "The quick brown fox jumps over the lazy dog. " * 80
    return text[:chars] + "\n\nSummary:"


def idle_state(server) -> dict:
    """vLLM's KV usage, the backend's staging slots in use (route and log), requests running."""
    text = metrics_text(server.port)
    staged = STAGING_LOG.findall(server.log.read_text())
    return dict(kv_cache_usage=metric(server.port, "kv_cache_usage_perc", text),
                running=metric(server.port, "num_requests_running", text),
                staging_in_use=get_json(server.port, STATS_ROUTE)["staging"]["slots_in_use"],
                staging_log=int(staged[-1]) if staged else 0)


def wait_idle(server, timeout=60) -> dict:
    """Every block back in vLLM's free pool, every staging slot returned, nothing running."""
    deadline = time.time() + timeout
    while True:
        state = idle_state(server)
        if not any(state.values()):
            return state
        assert time.time() < deadline, state
        time.sleep(1)


def fluent(text: str, min_words: int = 15) -> bool:
    words = text.split()
    return len(words) > min_words and len(set(words)) > min_words // 2  # not a collapsed loop

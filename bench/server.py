"""The one harness that starts vLLM servers, for the benchmarks and the tests alike.

:class:`Server` is one server process on 127.0.0.1 with its log in a file. It runs
``LAUNCHER ARGS --port P``: our launcher ``python -m serving`` by default, vLLM's own
API server (:data:`STOCK_VLLM`, with ``VLLM_PLUGINS=none`` to leave our plugin out),
or any command that takes ``--port`` (``bash scripts/main.sh``, ``vllm serve MODEL``).
:meth:`Server.launch` starts it in a session of its own (stopping the session stops
vLLM's engine processes too), :meth:`Server.wait_ready` waits for vLLM's
``Application startup complete`` or raises :class:`ServerRefused` with the reason
read from the log, :meth:`Server.stop` ends it, and every server still alive when
the program exits (or gets SIGTERM) is stopped. :func:`measurement_server` is the
server the benchmarks measure (chunked prefill, no prefix cache).

The HTTP helpers take a port, so that they serve a server this harness did not
start as well (``python -m bench.load_fault --port 8000``); :func:`wait_idle` checks
what every test and the load run must leave behind: no KV block, staging slot or
request in use.

The library never imports this module (tests/test_imports.py): it lives in
``bench``, the package both the benchmarks and the tests import.
"""

from __future__ import annotations

import atexit
import http.client
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_lowbit_kv.vllm import LOGGED_ONCE_ENVS

ROOT = Path(__file__).resolve().parents[1]
SERVING = (sys.executable, "-m", "serving")
STOCK_VLLM = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
DEFAULT_KV_SPACE_GIB = 1
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_ENGINE_STARTUP_TIMEOUT", "600"))
REQUEST_TIMEOUT_S = 3600.0
READY_LINE = "Application startup complete"
STATS_ROUTE = "/v1/kv_cache/stats"
#: the backend's staging log line (LOWBIT_KV_LOG_STAGING=1)
STAGING_LOG = re.compile(r"freed \d+ staging slots of ended requests \((\d+) in use\)")


class ServerRefused(RuntimeError):
    """The server exited (or never became ready) at start-up; ``reason`` says why,
    the message adds the end of its log."""

    def __init__(self, what: str, reason: str, log: str):
        tail = "\n".join(log.splitlines()[-40:])
        super().__init__(f"{what} did not start: {reason}\n--- end of its log ---\n{tail}")
        self.reason, self.log = reason, log


def refusal_reason(log: str) -> str:
    """The most telling line of a failed start-up log."""
    for pat in (r"(--kv-cache-dtype \S+ cannot serve[^\n]*)", r"(invalid choice:[^\n]*)",
                r"(\w*Error: lowbit-kv: [^\n']*)",  # ours, not the engine's "see root cause above"
                r"((?:ValueError|TypeError|RuntimeError|NotImplementedError|ValidationError|"
                r"AssertionError): [^\n]*)",  # a message, not a traceback's "raise X("
                r"(error:[^\n]*)"):
        # the engine's wrappers point at the root cause ("see root cause above"): skip them
        hits = [h for h in re.findall(pat, log) if "root cause" not in h]
        if hits:
            return hits[-1].strip()
    lines = [ln for ln in log.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "no output"


#: where :func:`free_port` looks: below Linux's ephemeral range (32768-60999), so that
#: no client socket or bind-to-0 takes the port between picking it and the server's bind
PORT_RANGE = range(20000, 32768)
#: a start-up that lost its port anyway (another worker's server) is relaunched this often
PORT_RETRIES = 3


def free_port() -> int:
    """A port that nothing on 127.0.0.1 holds now, outside the ephemeral range."""
    # the OS's randomness: a test that seeds `random` must not give two workers one sequence
    for port in random.SystemRandom().sample(PORT_RANGE, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")


class Server:
    """One vLLM server process: ``launcher`` + ``args`` + ``--port`` (a free one, picked
    at launch), its log in ``log`` (a temporary file unless given).

    ``env`` overrides this process's environment (a ``None`` value removes the
    variable); by default the server gets ``VLLM_CPU_KVCACHE_SPACE`` =
    :data:`DEFAULT_KV_SPACE_GIB` unless the environment sets it.
    """

    def __init__(self, args: Sequence[str] = (), *, launcher: Sequence[str] = SERVING,
                 env: Mapping[str, str | None] | None = None, log: str | Path | None = None):
        self.args, self.launcher = [str(a) for a in args], [str(a) for a in launcher]
        self.env_overrides = dict(env or {})
        self.log = Path(log) if log else None
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.startup_s: float | None = None
        self._model_name: str | None = None

    def arg(self, flag: str) -> str | None:
        """The value this server was given for ``flag`` (None: not given)."""
        return self.args[self.args.index(flag) + 1] if flag in self.args[:-1] else None

    @property
    def kv_cache_dtype(self) -> str | None:
        return self.arg("--kv-cache-dtype")

    # ------------------------------------------------------------------ lifecycle
    def command(self, port: int | None = None) -> list[str]:
        """The command line; without ``port``, as a result records it."""
        return [*self.launcher, *self.args, *(["--port", str(port)] if port is not None else [])]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_SPACE_GIB))
        # one prefill step of a long chunk can take minutes on a loaded 2-core machine; vLLM's
        # default (300 s) then kills the engine ("RPC call to execute_model timed out")
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        for logged in LOGGED_ONCE_ENVS:  # the backend logs its config (and notes) once per server
            env.pop(logged, None)
        for name, value in self.env_overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = str(value)
        return env

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace") if self.log else ""
        except FileNotFoundError:
            return ""

    def launch(self) -> "Server":
        """Start the process; :meth:`wait_ready` waits for it (so several can boot at once)."""
        if self.alive:
            return self
        if self.log is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm_{self.kv_cache_dtype or 'server'}_", suffix=".log")
            os.close(fd)
            self.log = Path(name)
        self.port = free_port()
        self.startup_s, self._model_name = None, None
        self._launched_at = time.time()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.command(self.port), cwd=ROOT, env=self.env(), stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        _LIVE.add(self)
        _exit_on_sigterm()
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "Server":
        """Block until the server is up; :class:`ServerRefused` (server stopped) if it is not."""
        if self.startup_s is not None and self.alive:
            return self
        if self.proc is None:
            raise RuntimeError("launch() first")
        relaunches = 0
        try:
            while READY_LINE not in self.log_text():
                if self.proc.poll() is not None:
                    log = self.log_text()
                    if "Address already in use" in log and relaunches < PORT_RETRIES:
                        relaunches += 1  # another server took the port first: pick a new one
                        self.stop()
                        self.launch()
                        continue
                    raise self._refused(refusal_reason(log))
                if time.time() - self._launched_at > timeout:
                    raise self._refused(f"not ready after {timeout:.0f} s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.time() - self._launched_at, 1)
        return self

    def _refused(self, reason: str) -> ServerRefused:
        dtype = self.kv_cache_dtype
        return ServerRefused("vLLM server" + (f" for --kv-cache-dtype {dtype}" if dtype else ""), reason,
                             self.log_text())

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "Server":
        return self.launch().wait_ready(timeout)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        try:  # the whole session, even where the server itself has died: vLLM's engine processes
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP
    @property
    def model_name(self) -> str:
        """The served model's name (the first of ``/v1/models``)."""
        if self._model_name is None:
            self._model_name = self.get("/v1/models")["data"][0]["id"]
        return self._model_name

    def get(self, path: str) -> Any:
        return get_json(self.port, path)

    def post(self, path: str, body: dict) -> dict:
        return post(self.port, path, body)

    def completion(self, **body: Any) -> dict:
        return self.post("/v1/completions", {"model": self.model_name, **body})["choices"][0]

    # ------------------------------------------------------------------ numbers
    def prompt_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 [len(ids) - 1]: log p(ids[i+1] | ids[:i+1]) from one prefill of ``ids``."""
        ids = [int(i) for i in ids]
        ch = self.completion(prompt=ids, max_tokens=1, temperature=0, prompt_logprobs=0)
        plp = ch["prompt_logprobs"]
        if plp is None or len(plp) != len(ids):
            raise RuntimeError(f"expected {len(ids)} prompt_logprobs entries, got "
                               f"{None if plp is None else len(plp)}")
        out = []
        for i, entry in enumerate(plp[1:], start=1):
            lp = (entry or {}).get(str(ids[i]))
            if lp is None:
                raise RuntimeError(f"prompt_logprobs[{i}] lacks the prompt token {ids[i]}: {entry}")
            out.append(lp["logprob"])
        return torch.tensor(out, dtype=torch.float32)

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        ch = self.completion(prompt=[int(i) for i in ids], max_tokens=int(n), temperature=0,
                             ignore_eos=True, return_token_ids=True)
        return [int(t) for t in ch["token_ids"]]

    def served_bits(self) -> dict[str, float] | None:
        """The backend's own start-up account of bits per element, if it logged one.

        ``groups``: the codec groups; ``pages``: with whatever else a page holds
        (sink area, STP masks); ``overall``: over all layers, bf16-skipped ones included.
        """
        m = re.search(r"Effective bits/element: groups ([\d.]+).*?pages ([\d.]+)[^,;]*, "
                      r"([\d.]+) over all", self.log_text())
        if not m:
            return None
        return dict(groups=float(m.group(1)), pages=float(m.group(2)), overall=float(m.group(3)))

    def attention_impls(self) -> list[str]:
        """The packed-attention implementations the backend logged choosing (``cpp``,
        ``torch``, ...; empty for vLLM's own dtypes)."""
        return sorted(set(re.findall(r"packed attention implementation: (\w+)", self.log_text())))

    def cache_info(self) -> dict[str, Any]:
        """vLLM's resolved KV cache: tokens, bytes, blocks (from /metrics, else the log)."""
        info: dict[str, Any] = {}
        status, data = request(self.port, "GET", "/metrics")
        if status == 200:
            m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", data.decode(errors="replace"), re.M)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
                for key, out in (("kv_cache_size_tokens", "capacity_tokens"),
                                 ("kv_cache_memory_bytes", "kv_cache_memory_bytes"),
                                 ("num_gpu_blocks", "num_blocks"), ("block_size", "block_size")):
                    if labels.get(key, "None") not in ("None", ""):
                        info[out] = int(labels[key])
                info["cache_dtype"] = labels.get("cache_dtype")
                info["source"] = "/metrics vllm:cache_config_info"
        if "capacity_tokens" not in info:
            m = re.search(r"KV cache size: ([\d,]+) tokens", self.log_text())
            if m:
                info["capacity_tokens"] = int(m.group(1).replace(",", ""))
                info["source"] = "start-up log"
        return info


#: vLLM's --dtype for the model (None: the model's own, bfloat16 here) -> the KV dtype the
#: benchmarks measure the others against: the model's dtype. On CPUs without AVX-512 BF16
#: float32 weights serve fastest (torch has no fast bf16 matrix multiply there), and a
#: float32 model over a 16-bit cache is refused at start-up (vLLM's CPU attention answers
#: garbage for it), so there the reference is ``auto``, a float32 cache.
REFERENCE_KV_DTYPE = {None: "bfloat16", "bfloat16": "bfloat16", "float32": "auto"}


def measurement_server(model: str | Path, kv_cache_dtype: str, *, chunk: int, max_model_len: int,
                       max_num_seqs: int = 4, prefix_caching: bool = False,
                       model_dtype: str | None = None,
                       additional_config: dict | None = None, kv_space_gib: int | None = None,
                       kv_cache_bytes: int | None = None, extra_args: Sequence[str] = (),
                       env: Mapping[str, str | None] | None = None,
                       log: str | Path | None = None) -> Server:
    """The server the benchmarks measure, not yet launched::

        python -m serving --model MODEL --kv-cache-dtype X --host 127.0.0.1 --enforce-eager
            --max-num-batched-tokens CHUNK --max-model-len L --max-num-seqs N
            --no-enable-prefix-caching [--dtype MODEL_DTYPE]
            [--additional-config '{"lowbit_kv": {...}}']

    ``chunk`` is vLLM's chunked-prefill step, so a long prompt's later chunks attend to
    the cached (quantized) KV; prefix caching is off unless asked for, so every request
    starts from an empty cache. KV memory: ``kv_cache_bytes`` exactly
    (``--kv-cache-memory-bytes``), else ``kv_space_gib`` GiB, else the harness's default.
    """
    args = ["--model", str(model), "--kv-cache-dtype", kv_cache_dtype, "--host", "127.0.0.1",
            "--enforce-eager", "--max-num-batched-tokens", str(chunk), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs)]
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    if model_dtype:
        args += ["--dtype", model_dtype]
    if additional_config:
        args += ["--additional-config", json.dumps({"lowbit_kv": additional_config})]
    env = dict(env or {})
    if kv_cache_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        env["VLLM_CPU_KVCACHE_SPACE"] = None  # set, it would override the flag's bytes
    elif kv_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    return Server([*args, *extra_args], env=env, log=log)


#: servers started by this process and not stopped yet
_LIVE: set[Server] = set()


@atexit.register
def stop_all(keep: Server | None = None) -> None:
    """Stop every server this process started, but ``keep``."""
    for s in list(_LIVE):
        if s is not keep:
            s.stop()


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit (so atexit stops our servers, which run in sessions
    of their own), unless the program already handles SIGTERM."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# --------------------------------------------------------------------------- HTTP by port
def request(port: int, method: str, path: str, body: Any = None, headers: Mapping[str, str] | None = None,
            timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    """One request to 127.0.0.1:``port`` (``body`` sent as JSON): status and body."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            c.request(method, path, headers=dict(headers or {}))
        else:
            c.request(method, path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def get_json(port: int, path: str) -> Any:
    status, data = request(port, "GET", path)
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}: {data[:2000]!r}")
    return json.loads(data)


def post(port: int, path: str, body: dict, stream: bool = False) -> Any:
    """The JSON answer, or with ``stream`` the list of server-sent events."""
    status, data = request(port, "POST", path, body)
    if status != 200:
        raise RuntimeError(f"POST {path}: HTTP {status}: {data[:2000]!r}")
    if not stream:
        return json.loads(data)
    lines = (line.strip() for line in data.splitlines())
    return [json.loads(line[5:]) for line in lines if line.startswith(b"data:") and line != b"data: [DONE]"]


def metrics_text(port: int) -> str:
    status, data = request(port, "GET", "/metrics", timeout=60)
    if status != 200:
        raise RuntimeError(f"GET /metrics: HTTP {status}")
    return data.decode(errors="replace")


def metric_value(text: str, name: str, **labels: Any) -> float | None:
    """The first sample of the Prometheus metric ``name`` in a ``/metrics`` text whose
    labels include ``labels`` (None: absent)."""
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            return float(m.group(2))
    return None


def idle_state(port: int, log: str | Path | None = None) -> dict[str, Any]:
    """What must return to idle: vLLM's KV usage and queues, our blocks and staging slots
    (the stats route where the server has it, the backend's log line where it is known)."""
    text = metrics_text(port)
    state: dict[str, Any] = {}
    for key, name in (("kv_cache_usage", "vllm:kv_cache_usage_perc"),
                      ("running", "vllm:num_requests_running"), ("waiting", "vllm:num_requests_waiting")):
        state[key] = metric_value(text, name)
        if state[key] is None:
            raise RuntimeError(f"metric {name} missing from /metrics")
    status, data = request(port, "GET", STATS_ROUTE)
    if status == 200:
        stats = json.loads(data)
        state["blocks_used"] = stats["blocks"]["used"]
        state["staging_in_use"] = (stats["staging"] or {}).get("slots_in_use")
    if log is not None:
        staged = STAGING_LOG.findall(Path(log).read_text(errors="replace"))
        state["staging_in_use_log"] = int(staged[-1]) if staged else None
    return state


def wait_idle(port: int, log: str | Path | None = None, timeout: float = 120) -> tuple[bool, dict, float]:
    """(idle, the last state, seconds waited): idle once every figure of :func:`idle_state` is 0."""
    t0 = time.time()
    while True:
        state = idle_state(port, log)
        if not any(v for v in state.values() if v is not None):
            return True, state, round(time.time() - t0, 1)
        if time.time() - t0 > timeout:
            return False, state, round(time.time() - t0, 1)
        time.sleep(1)


def percentiles(xs: Sequence[float]) -> dict[str, float] | None:
    """Nearest-rank p50, p90, p99 and the mean (None for no data)."""
    if not xs:
        return None
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa: E731
    return dict(p50=round(at(0.5), 4), p90=round(at(0.9), 4), p99=round(at(0.99), 4),
                mean=round(sum(xs) / len(xs), 4))

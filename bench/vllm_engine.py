"""The yardstick's :class:`~bench.quality.Engine` through the real vLLM server path.

    python -m bench.quality --engine vllm --kv-cache-dtype fp8,kivi2,vidkv

Each KV dtype gets one ``python -m serving`` process (our launcher: vLLM's
OpenAI-compatible server with the lowbit-kv plugin), started on first use and
again for each new chunk size (see :meth:`VllmEngine.server_for`)::

    python -m serving --model DIR --kv-cache-dtype X --host 127.0.0.1 --port P
        --enforce-eager --max-num-batched-tokens C --max-model-len L
        --max-num-seqs 4 --no-enable-prefix-caching
        [--additional-config '{"lowbit_kv": {...}}']     # only for scheme overrides

with ``VLLM_CPU_KVCACHE_SPACE`` (GiB) set (default 1 unless already set).
``max_num_batched_tokens = C`` is the chunk: vLLM's chunked prefill then feeds a
long prompt C tokens per step, so every token after the first chunk attends to
the cached (quantized) KV, as the HF engine's chunked prefill does. Prefix
caching is off so that every request starts from an empty cache (a prefix hit
would make a later request read packed pages where the first one attended its
own chunk exactly). Servers of one dtype at a time are alive per process (the
current one and the engine's previous chunk size); an engine restarts its server
if used again after another engine's.

What goes over HTTP (``/v1/completions``, prompts as token-id lists):

* teacher-forced log-probs: ``max_tokens=1`` with vLLM's extra parameter
  ``prompt_logprobs=0``. vLLM 0.32 then returns ``choices[0].prompt_logprobs``,
  one entry per prompt token: ``null`` for the first, then ``{"<token id>":
  {"logprob", "rank", "decoded_token"}}`` holding the prompt token itself (0 =
  no extra top-k entries), i.e. log p(ids[i] | ids[:i]) computed from the
  prefill logits in float32. Entry i+1 is the yardstick's ``lp[i]``.
* greedy: ``temperature=0``, ``max_tokens=n``, ``ignore_eos=true`` (the HF
  engine does not stop at EOS either), ``return_token_ids=true``.
* KV capacity: ``/metrics``, gauge ``vllm:cache_config_info`` labels
  ``kv_cache_size_tokens`` / ``kv_cache_memory_bytes`` / ``num_gpu_blocks``
  (fallback: the start-up log line "KV cache size: N tokens").

Dtypes: ``bfloat16`` (the reference; vLLM's own CPU attention), ``fp8`` (vLLM's
own quantized cache) and every scheme of :mod:`vllm_lowbit_kv.schemes` the
backend agrees to serve. A server that refuses to start raises
:class:`ServerRefused` with the reason from its log.
"""

from __future__ import annotations

import atexit
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.quality import Engine

ROOT = Path(__file__).resolve().parents[1]
#: vLLM's own KV dtypes this engine runs (besides our schemes); bits per element.
#: Other stock dtypes are refused: vLLM 0.32's turboquant_* and int4_per_token_head
#: are silently broken on the CPU build (DESIGN.md).
NATIVE_DTYPES = {"bfloat16": 16.0, "auto": 16.0, "fp8": 8.0}
DEFAULT_KV_SPACE_GIB = 1
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_ENGINE_STARTUP_TIMEOUT", "600"))
REQUEST_TIMEOUT_S = 3600.0


class ServerRefused(RuntimeError):
    """The server exited (or never became ready) at start-up; ``reason`` says why."""

    def __init__(self, kv_cache_dtype: str, reason: str, log: str):
        super().__init__(f"vLLM server for --kv-cache-dtype {kv_cache_dtype} did not start: {reason}")
        self.kv_cache_dtype, self.reason, self.log = kv_cache_dtype, reason, log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refusal_reason(log: str) -> str:
    """The most telling line of a failed start-up log."""
    for pat in (r"(--kv-cache-dtype \S+ cannot serve[^\n]*)", r"(invalid choice:[^\n]*)",
                r"((?:ValueError|TypeError|RuntimeError|ValidationError|AssertionError)[^\n]*)",
                r"(error:[^\n]*)"):
        hits = re.findall(pat, log)
        if hits:
            return hits[-1].strip()
    lines = [ln for ln in log.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "no output"


class VllmServer:
    """One ``python -m serving`` process on 127.0.0.1 and a tiny HTTP client for it."""

    def __init__(self, model_dir: str | Path, kv_cache_dtype: str, *, chunk: int, max_model_len: int,
                 kv_space_gib: int | None = None, additional_config: dict | None = None,
                 max_num_seqs: int = 4, extra_args: Sequence[str] = (), log_path: str | Path | None = None,
                 prefix_caching: bool = False, env: dict[str, str] | None = None,
                 kv_cache_bytes: int | None = None):
        self.model_dir, self.kv_cache_dtype = str(model_dir), kv_cache_dtype
        self.chunk, self.max_model_len = int(chunk), int(max_model_len)
        self.kv_space_gib = kv_space_gib
        self.additional_config = additional_config or None
        self.max_num_seqs, self.extra_args = max_num_seqs, list(extra_args)
        self.log_path = Path(log_path) if log_path else None
        self.prefix_caching, self.extra_env = prefix_caching, dict(env or {})
        #: exact KV budget (vLLM's --kv-cache-memory-bytes) instead of whole GiB
        self.kv_cache_bytes = kv_cache_bytes
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.model_name: str | None = None
        self.startup_s: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "serving", "--model", self.model_dir,
               "--kv-cache-dtype", self.kv_cache_dtype, "--host", "127.0.0.1", "--port", str(port),
               "--enforce-eager", "--max-num-batched-tokens", str(self.chunk),
               "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs)]
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if self.additional_config:
            cmd += ["--additional-config", json.dumps({"lowbit_kv": self.additional_config})]
        if self.kv_cache_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        return cmd + self.extra_args

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.extra_env}
        if self.kv_cache_bytes is not None:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # set, it would override the flag's bytes
        elif self.kv_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_space_gib)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KV_SPACE_GIB))
        # one prefill step of a long chunk can take minutes on a loaded 2-core machine; vLLM's
        # default (300 s) then kills the engine ("RPC call to execute_model timed out")
        env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except FileNotFoundError:
            return ""

    def launch(self) -> "VllmServer":
        """Start the process; :meth:`wait_ready` waits for it (so several can boot at once)."""
        if self.alive:
            return self
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm_{self.kv_cache_dtype}_", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.port = _free_port()
        self._t0 = time.time()
        self.model_name = None
        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen(self.command(self.port), cwd=ROOT, env=self.env(), stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        _LIVE.add(self)
        _exit_on_sigterm()
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "VllmServer":
        """Block until the server answers; :class:`ServerRefused` (server stopped) if it cannot."""
        if self.model_name is not None and self.alive:
            return self
        if self.proc is None:
            raise RuntimeError("launch() first")
        try:
            while "Application startup complete" not in self.log_text():
                if self.proc.poll() is not None:
                    log = self.log_text()
                    raise ServerRefused(self.kv_cache_dtype, _refusal_reason(log), log)
                if time.time() - self._t0 > timeout:
                    log = self.log_text()
                    raise ServerRefused(self.kv_cache_dtype, f"not ready after {timeout:.0f} s", log)
                time.sleep(0.5)
            self.model_name = self.get("/v1/models")["data"][0]["id"]
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.time() - self._t0, 1)
        return self

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "VllmServer":
        return self.launch().wait_ready(timeout)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            if body is None:
                c.request(method, path)
            else:
                c.request(method, path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def get(self, path: str) -> Any:
        status, data = self._request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {data[:2000]!r}")
        return json.loads(data)

    def post(self, path: str, body: dict) -> dict:
        status, data = self._request("POST", path, body)
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status}: {data[:2000]!r}")
        return json.loads(data)

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
        status, data = self._request("GET", "/metrics")
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


def metric_value(text: str, name: str) -> float | None:
    """The first sample of the Prometheus metric ``name`` in a ``/metrics`` text (None: absent)."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def percentiles(xs: Sequence[float]) -> dict[str, float] | None:
    """Nearest-rank p50, p90, p99 and the mean (None for no data)."""
    if not xs:
        return None
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa: E731
    return dict(p50=round(at(0.5), 4), p90=round(at(0.9), 4), p99=round(at(0.99), 4),
                mean=round(sum(xs) / len(xs), 4))


#: servers started by this process (stopped at exit; one alive at a time via VllmEngine)
_LIVE: set[VllmServer] = set()


@atexit.register
def _stop_all() -> None:
    for s in list(_LIVE):
        s.stop()


def _exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit (so atexit stops our servers, which run in their own
    sessions), unless the program already handles SIGTERM."""
    import threading
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def model_geometry(model_dir: str | Path) -> dict[str, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return dict(layers=cfg["num_hidden_layers"], kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                max_positions=cfg.get("max_position_embeddings", 2048))


class VllmEngine(Engine):
    """A vLLM server with ``--kv-cache-dtype kv_cache_dtype``, driven over HTTP.

    Constructor as the yardstick's ``make_engine`` calls it. ``block_tokens`` /
    ``sink_tokens`` / ``skip_layers`` go to the server as
    ``--additional-config '{"lowbit_kv": {...}}'`` (the backend validates them and
    refuses what it cannot serve), and so do ``params`` (codec parameters, e.g. an
    RVQ ``codebook`` file); ``relevance`` must stay ``auto`` (the backend
    computes its own). They are ignored for vLLM's own dtypes, as the HF engine
    ignores them for the bf16 reference.

    ``eviction`` (an :class:`~vllm_lowbit_kv.eviction.EvictionPolicy`): the server
    evicts every request after its prefill (``lowbit_kv`` fields ``eviction``,
    ``retention``, ``eviction_gamma``, ``eviction_sinks``, ``recent_window``); one
    engine per policy (the yardstick makes them). Generation only: vLLM computes
    ``prompt_logprobs`` during the prefill, before the eviction, so there is no
    teacher-forced perplexity after eviction (its rows say ``ppl: null``).
    """

    supports_eviction = True

    def __init__(self, model_dir: str | Path, kv_cache_dtype: str, *, block_tokens: int | None = None,
                 sink_tokens: int | None = None, skip_layers: Sequence[int] = (), relevance: str = "auto",
                 params: dict[str, Any] | None = None, max_model_len: int | None = None,
                 kv_space_gib: int | None = None, extra_args: Sequence[str] = (), eviction: Any = None):
        self.model_dir = str(model_dir)
        self.eviction = eviction
        self.kv_cache_dtype = kv_cache_dtype
        geo = model_geometry(model_dir)
        self.geometry = geo
        self.head_dim = geo["head_dim"]
        self.num_layers = geo["layers"]
        self.skip_layers = tuple(skip_layers)
        self.max_positions = int(max_model_len or min(geo["max_positions"],
                                                      int(os.environ.get("VLLM_ENGINE_MAX_MODEL_LEN", 8192))))
        self.kv_space_gib, self.extra_args = kv_space_gib, list(extra_args)
        if relevance != "auto":
            raise ValueError(f"--engine vllm: --relevance {relevance!r} is not supported (the vLLM "
                             "backend computes relevance itself); use auto")
        self.scheme = None
        self.overrides: dict[str, Any] = {}
        if kv_cache_dtype in NATIVE_DTYPES:
            self._bits = NATIVE_DTYPES[kv_cache_dtype]
        else:
            from vllm_lowbit_kv.schemes import SCHEMES, get_scheme
            if kv_cache_dtype not in SCHEMES and (kv_cache_dtype.startswith(("fp8", "turboquant", "int"))):
                raise ValueError(f"--engine vllm runs vLLM's own KV dtypes {sorted(NATIVE_DTYPES)} only; "
                                 f"{kv_cache_dtype!r} is not measured here (vLLM 0.32's turboquant_* and "
                                 "int4_per_token_head give garbage on the CPU build)")
            scheme = get_scheme(kv_cache_dtype)  # unknown names: ValueError listing the valid ones
            self.overrides = {k: v for k, v in (("block_tokens", block_tokens), ("sink_tokens", sink_tokens))
                              if v is not None}
            if skip_layers:
                self.overrides["skip_layers"] = list(skip_layers)
            self.overrides.update(params or {})
            codec_overrides = {k: v for k, v in self.overrides.items() if k != "skip_layers"}
            self.scheme = scheme.with_params(**codec_overrides) if codec_overrides else scheme
            self._bits = self.scheme.effective_bits(self.head_dim)
            if eviction is not None:
                self.overrides.update(eviction=eviction.name, retention=eviction.retention,
                                      eviction_gamma=eviction.gamma, eviction_sinks=eviction.sink_tokens,
                                      recent_window=eviction.recent_window)
        if eviction is not None and self.eviction_refusal():
            raise ValueError(f"--kv-eviction: {self.eviction_refusal()}")
        self.server: VllmServer | None = None
        self._servers: dict[int, VllmServer] = {}
        self._main_chunk: int | None = None  # the first chunk asked for (the yardstick's --chunk)
        self._last_tokens: int | None = None

    # ------------------------------------------------------------------ server
    def server_for(self, chunk: int) -> VllmServer:
        """The running server for this dtype and ``chunk`` (``max_num_batched_tokens``).

        A chunk is a server setting, so a new chunk means a new server. This engine
        keeps the server of its first chunk (the yardstick's ``--chunk``, to which it
        returns after passkey prompts prefilled in larger chunks) and the one of the
        latest other chunk alive; starting a server stops all others, those of other
        engines included (one dtype at a time: vLLM on
        CPU takes the cores, and the yardstick never goes back to a finished dtype).
        """
        if self.server is not None and self.server.alive and self.server.chunk == chunk:
            return self.server
        cached = self._servers.get(chunk)
        if cached is not None and cached.alive:
            self.server = cached
            return cached
        if self._main_chunk is None:
            self._main_chunk = chunk
        main = self._servers.get(self._main_chunk)
        for s in list(_LIVE):  # keep this engine's main-chunk server only, then start the new one
            if s is not main:
                s.stop()
        self._servers = {c: s for c, s in self._servers.items() if s.alive}
        new = VllmServer(self.model_dir, self.kv_cache_dtype, chunk=chunk,
                         max_model_len=self.max_positions, kv_space_gib=self.kv_space_gib,
                         additional_config=self.overrides, extra_args=self.extra_args)
        new.start()
        self._servers[chunk] = self.server = new
        return new

    def close(self) -> None:
        for s in [*self._servers.values(), self.server]:
            if s is not None:
                s.stop()

    def _check_len(self, n: int) -> None:
        if n > self.max_positions:
            raise ValueError(f"{n} tokens exceed the server's --max-model-len {self.max_positions}")

    # ------------------------------------------------------------------ Engine
    def logprobs_teacher_forced(self, ids, chunk):
        ids = list(ids)
        self._check_len(len(ids))
        lp = self.server_for(chunk).prompt_logprobs(ids)
        self._last_tokens = len(ids)
        return lp

    def greedy(self, ids, n, chunk, reference=None):
        # ``reference`` (early stop) is not used: n is small and a request runs to the end.
        ids = list(ids)
        self._check_len(len(ids) + n)
        out = self.server_for(chunk).greedy(ids, n)
        self._last_tokens = len(ids) + len(out)
        return out

    def eviction_refusal(self) -> str | None:
        if self.scheme is None:
            return (f"vLLM's own attention for --kv-cache-dtype {self.kv_cache_dtype} cannot read "
                    "per-layer kept lengths (eviction needs a lowbit-kv scheme)")
        return None

    def _check_variants(self, policies) -> None:
        if list(policies) != [self.eviction]:
            raise ValueError(f"this engine's server runs eviction={self.eviction!r} only, asked for "
                             f"{policies!r}: make one engine per policy")

    def logprobs_variants(self, ids, chunk, prompt_tokens, policies):
        self._check_variants(policies)
        if self.eviction is None:
            return super().logprobs_variants(ids, chunk, prompt_tokens, policies)
        return [dict(logprobs=None, plan=None, kv_memory=None,
                     note="no teacher-forced PPL after eviction on vLLM (prompt_logprobs come "
                          "from the prefill, before the eviction)")]

    def greedy_variants(self, ids, n, chunk, policies, references=None):
        self._check_variants(policies)
        return [self.greedy(ids, n, chunk)]

    def chat_variants(self, ids, question, n, chunk, policies, stop_ids, tok):
        """The answer through the server's ``/v1/chat/completions`` (the model's chat
        template, greedy, stopping at the model's end of turn), as a user asks it."""
        from bench.factual_prompts import chat_messages
        self._check_variants(policies)
        self._check_len(len(ids) + n)
        server = self.server_for(chunk)
        out = server.post("/v1/chat/completions", dict(model=server.model_name, temperature=0,
                                                       messages=chat_messages(question), max_tokens=int(n)))
        self._last_tokens = (out.get("usage") or {}).get("total_tokens", self._last_tokens)
        return [(out["choices"][0]["message"]["content"] or "").strip()]

    def effective_bits(self) -> float:
        """Bits per element as served: the backend's own start-up figure over all layers
        (sink area and bf16 layers included) once a server has started, else the scheme's."""
        for s in (self.server, *self._servers.values()):
            served = s.served_bits() if s is not None else None
            if served:
                return served["overall"]
        return float(self._bits)

    def bytes_per_token(self) -> float:
        """KV bytes per token over all layers as vLLM's pages store them (blocks only)."""
        g = self.geometry
        return g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * self.effective_bits() / 8

    def kv_memory(self) -> dict[str, Any] | None:
        if self._last_tokens is None:
            return None
        n = self._last_tokens
        g = self.geometry
        bf16_per_tok = g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * 2
        rep: dict[str, Any] = dict(scheme=self.kv_cache_dtype, tokens=n,
                                   total_bytes=round(n * self.bytes_per_token()),
                                   bf16_bytes=n * bf16_per_tok,
                                   compression=16.0 / self.effective_bits(),
                                   scheme_bits=float(self._bits),
                                   note="pages only (the bf16 tail of the last partial group is "
                                        "in a staging area sized at start-up)")
        if self.server is not None and self.server.alive:
            rep["server"] = self.server.cache_info()
            rep["server"]["served_bits"] = self.server.served_bits()
            rep["server"]["startup_s"] = self.server.startup_s
            rep["server"]["kv_space_gib"] = int(self.server.env()["VLLM_CPU_KVCACHE_SPACE"])
        return rep

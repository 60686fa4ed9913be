"""Load-and-fault run against the OpenAI server with a low-bit KV cache (loopback only).

    python -m bench.load_fault --clients 64 --duration 180      # full run: its own vidkv server
    python -m bench.load_fault --port 8000 --clients 16 --duration 30   # a server already running

``--clients`` threads send requests back to back for ``--duration`` seconds
(at most ``--max-requests`` in all); requests still running ``--grace`` seconds
after that are hung up on, so the run is bounded in count and time. Each
client's first request takes the kind of its index (so every kind occurs once
``--clients`` >= the number of kinds), later ones are drawn at random
(``--seed``). The kinds and the answers they may get (:data:`KINDS`):

* ``stream_completion``, ``stream_chat``, ``completion``: prompts of random
  length from the Lee corpus (random offset, so no two share a prefix), a
  random ``max_tokens``; must be 200 and, when streamed, end with ``[DONE]``;
* ``hangup_mid_stream``: a stream read for a few events, then the client closes
  the socket (half the time with a TCP reset); vLLM must abort the request;
* ``hangup_before_response``: the request is sent and the socket closed at once;
* ``oversized_prompt``: a prompt several times ``max_model_len`` tokens: 400;
* ``malformed_json``: a truncated JSON body: 400;
* ``unknown_fields``: a valid request plus fields the API does not define: vLLM
  ignores them (logs them) and answers 200;
* ``bad_values``: ``max_tokens: -1`` / ``temperature: "hot"`` / ``n: 0``: 400;
* ``unknown_model``: 404.

Documented 5xx: none (:data:`DOCUMENTED_5XX` is empty): any 5xx fails the run,
as does any other answer outside a kind's set, a broken stream or a refused
connection. Afterwards the server must be alive (``/health`` 200), idle —
vLLM's ``vllm:kv_cache_usage_perc`` 0, nothing running or waiting, every
staging slot returned (``GET /v1/kv_cache/stats``, and the backend's own log
line when it runs with ``LOWBIT_KV_LOG_STAGING=1`` and its log is known) —
and still answer a completion. Without ``--port`` it starts
``python -m serving --kv-cache-dtype vidkv`` with :data:`SERVER_ARGS` and writes
the summary to ``--json`` (default ``bench/results/load_fault.json``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import portable
from bench.server import measurement_server, percentiles, request, wait_idle

#: kind -> (weight in the random draw, HTTP statuses it may get; None = we hung up first)
KINDS: dict[str, tuple[float, frozenset]] = {
    "stream_completion": (4, frozenset({200})),
    "stream_chat": (3, frozenset({200})),
    "completion": (2, frozenset({200})),
    "hangup_mid_stream": (3, frozenset({200})),
    "hangup_before_response": (1, frozenset({None})),
    "oversized_prompt": (1, frozenset({400})),
    "malformed_json": (1, frozenset({400})),
    "unknown_fields": (1, frozenset({200})),
    "bad_values": (1, frozenset({400})),
    "unknown_model": (1, frozenset({404})),
}
#: 5xx answers that are part of the contract (none)
DOCUMENTED_5XX: dict[int, str] = {}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: the full run's server (python -m serving defaults, a smaller KV cache so preemption happens)
SERVER_ARGS = dict(kv_cache_dtype="vidkv", chunk=256, max_model_len=2048, max_num_seqs=16,
                   num_blocks=48, kv_space_gib=1)
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Outcome:
    kind: str
    status: int | None
    ok: bool
    detail: str = ""
    seconds: float = 0.0
    events: int = 0
    ttft_s: float | None = None


class Client:
    """One load client: its own RNG, plain http.client connections to 127.0.0.1."""

    def __init__(self, port: int, model: str, max_model_len: int, text: str, rng: random.Random,
                 hard_deadline: float):
        self.port, self.model, self.max_model_len = port, model, max_model_len
        self.text, self.rng, self.hard_deadline = text, rng, hard_deadline

    # ------------------------------------------------------------------ building blocks
    def prompt(self) -> str:
        # ~4.5 characters per SmolLM2 token; leave room for the output
        n = self.rng.randint(200, int(self.max_model_len * 2.2))
        start = self.rng.randrange(0, len(self.text) - n)
        return self.text[start:start + n]

    def _send(self, path: str, body: bytes) -> http.client.HTTPConnection:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        c.request("POST", path, body, {"Content-Type": "application/json"})
        return c

    def _exchange(self, kind: str, path: str, body: Any) -> Outcome:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        t0 = time.time()
        c = self._send(path, raw)
        try:
            r = c.getresponse()
            data = r.read()
            ok = r.status in KINDS[kind][1]
            return Outcome(kind, r.status, ok, "" if ok else data[:300].decode(errors="replace"),
                           time.time() - t0)
        finally:
            c.close()

    def _stream(self, kind: str, path: str, body: dict, hang_up_after: int | None = None) -> Outcome:
        t0 = time.time()
        c = self._send(path, json.dumps({**body, "stream": True}).encode())
        events, ttft, done = 0, None, False
        try:
            r = c.getresponse()
            if r.status != 200:
                return Outcome(kind, r.status, False, r.read()[:300].decode(errors="replace"),
                               time.time() - t0)
            for line in r:
                if not line.startswith(b"data:"):
                    continue
                if line.strip() == b"data: [DONE]":
                    done = True
                    break
                events += 1
                if ttft is None:
                    ttft = time.time() - t0
                if hang_up_after is not None and events >= hang_up_after:
                    self._hang_up(c)
                    return Outcome(kind, 200, True, "hung up", time.time() - t0, events, ttft)
                if time.time() > self.hard_deadline:
                    self._hang_up(c)
                    return Outcome(kind, 200, True, "cut at the run's end", time.time() - t0,
                                   events, ttft)
            ok = done and events > 0
            return Outcome(kind, 200, ok, "" if ok else f"stream ended without [DONE] after "
                           f"{events} events", time.time() - t0, events, ttft)
        finally:
            c.close()

    def _hang_up(self, c: http.client.HTTPConnection) -> None:
        if c.sock is not None and self.rng.random() < 0.5:  # TCP reset instead of FIN
            c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()

    # ------------------------------------------------------------------ kinds
    def completion_body(self) -> dict:
        return {"model": self.model, "prompt": self.prompt(), "max_tokens": self.rng.randint(8, 64),
                "temperature": self.rng.choice([0, 0.7])}

    def chat_body(self) -> dict:
        return {"model": self.model, "max_tokens": self.rng.randint(8, 64),
                "messages": [{"role": "user", "content": "Summarise: " + self.prompt()}]}

    def run(self, kind: str) -> Outcome:
        if kind == "stream_completion":
            return self._stream(kind, "/v1/completions", self.completion_body())
        if kind == "stream_chat":
            return self._stream(kind, "/v1/chat/completions", self.chat_body())
        if kind == "completion":
            return self._exchange(kind, "/v1/completions", self.completion_body())
        if kind == "hangup_mid_stream":
            body = {**self.completion_body(), "max_tokens": 200, "ignore_eos": True}
            return self._stream(kind, "/v1/completions", body, hang_up_after=self.rng.randint(1, 8))
        if kind == "hangup_before_response":
            t0 = time.time()
            c = self._send("/v1/completions", json.dumps(self.completion_body()).encode())
            self._hang_up(c)
            return Outcome(kind, None, True, "hung up", time.time() - t0)
        if kind == "oversized_prompt":
            n = self.max_model_len * 8  # characters: several times the context in tokens
            start = self.rng.randrange(0, len(self.text) - n)
            return self._exchange(kind, "/v1/completions", {
                "model": self.model, "prompt": self.text[start:start + n], "max_tokens": 16})
        if kind == "malformed_json":
            good = json.dumps(self.completion_body()).encode()
            return self._exchange(kind, self.rng.choice(["/v1/completions", "/v1/chat/completions"]),
                                  good[:self.rng.randint(1, len(good) - 1)])
        if kind == "unknown_fields":
            return self._exchange(kind, "/v1/completions", {
                **self.completion_body(), "max_tokens": 8, "lowbit_unknown_field": [1, 2],
                "frobnicate": {"x": True}})
        if kind == "bad_values":
            bad = self.rng.choice([{"max_tokens": -1}, {"temperature": "hot"}, {"n": 0}])
            return self._exchange(kind, "/v1/completions", {**self.completion_body(), **bad})
        if kind == "unknown_model":
            return self._exchange(kind, "/v1/completions",
                                  {**self.completion_body(), "model": "no-such-model"})
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")


# --------------------------------------------------------------------------- the run
def run_load(port: int, *, clients: int, duration: float, max_requests: int = 10_000,
             grace: float = 60.0, seed: int = 0, log_path: str | Path | None = None,
             text: str | None = None) -> dict[str, Any]:
    """Drive the server on 127.0.0.1:``port``; return the summary (``passed`` says it all)."""
    if text is None:
        from vllm_lowbit_kv.corpus import default_text
        text = default_text()
    models = json.loads(request(port, "GET", "/v1/models", timeout=30)[1])["data"][0]
    model, max_model_len = models["id"], int(models.get("max_model_len") or 2048)
    t0 = time.time()
    deadline, hard_deadline = t0 + duration, t0 + duration + grace
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    issued = [0]
    kinds, weights = list(KINDS), [w for w, _ in KINDS.values()]

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 100_003 + i)
        cl = Client(port, model, max_model_len, text, rng, hard_deadline)
        first = True
        while time.time() < deadline:
            with lock:
                if issued[0] >= max_requests:
                    return
                issued[0] += 1
            kind = kinds[i % len(kinds)] if first else rng.choices(kinds, weights)[0]
            first = False
            t = time.time()
            try:
                out = cl.run(kind)
            except (OSError, http.client.HTTPException) as e:  # refused, reset by the server, ...
                out = Outcome(kind, None, False, f"{type(e).__name__}: {e}", time.time() - t)
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, hard_deadline + REQUEST_TIMEOUT_S - time.time()))
    load_s = round(time.time() - t0, 1)

    health = request(port, "GET", "/health", timeout=30)[0]
    idle, state, idle_after_s = wait_idle(port, log_path)
    final = None
    try:
        c = Client(port, model, max_model_len, text, random.Random(seed), time.time() + 600)
        final = c.run("completion")
    except (OSError, http.client.HTTPException) as e:
        final = Outcome("completion", None, False, f"{type(e).__name__}: {e}")

    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[str(o.status)] += 1
    five_xx = [o for o in outcomes if o.status is not None and o.status >= 500
               and o.status not in DOCUMENTED_5XX]
    unexpected = [o for o in outcomes if not o.ok]
    streams = [o for o in outcomes if o.kind in ("stream_completion", "stream_chat") and o.ok]
    log_errors = []
    if log_path is not None:
        log = Path(log_path).read_text(errors="replace")
        log_errors = sorted(set(re.findall(r"(EngineDeadError|Traceback \(most recent call last\)|"
                                           r"staging pool exhausted)", log)))
    summary = dict(
        clients=clients, duration_s=duration, grace_s=grace, max_requests=max_requests, seed=seed,
        model=portable.model_name(model), max_model_len=max_model_len, requests=len(outcomes),
        load_s=load_s,
        by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
        kinds_missing=sorted(set(KINDS) - set(by_kind)),
        five_xx=len(five_xx), documented_5xx=DOCUMENTED_5XX,
        unexpected=len(unexpected),
        unexpected_examples=[asdict(o) for o in unexpected[:10]],
        streams_completed=len(streams), stream_events=sum(o.events for o in streams),
        stream_seconds=percentiles([o.seconds for o in streams]),
        stream_ttft_s=percentiles([o.ttft_s for o in streams if o.ttft_s is not None]),
        health_after=health, idle=idle, idle_state=state, idle_after_s=idle_after_s,
        final_completion=asdict(final) if final else None, log_errors=log_errors,
    )
    summary["passed"] = bool(
        not five_xx and not unexpected and health == 200 and idle and final is not None and final.ok
        and not log_errors)
    return summary


def _loopback(host: str) -> str:
    if host not in LOOPBACK:
        raise SystemExit(f"--host must be a loopback address {LOOPBACK}, got {host!r}: this tool "
                         "only loads a local server")
    return host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.load_fault", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=180, help="seconds of new requests")
    p.add_argument("--grace", type=float, default=60, help="seconds before running streams are cut")
    p.add_argument("--max-requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1", type=_loopback)
    p.add_argument("--port", type=int, default=None,
                   help="a server already running on the host (default: start a vidkv server)")
    p.add_argument("--server-log", default=None, help="that server's log (staging and error lines)")
    p.add_argument("--json", default="bench/results/load_fault.json")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    server = None
    server_command = None
    try:
        if args.port is None:
            from vllm_lowbit_kv.model import prepare_model

            a, model = SERVER_ARGS, prepare_model()
            server = measurement_server(model, a["kv_cache_dtype"], chunk=a["chunk"],
                                        max_model_len=a["max_model_len"], max_num_seqs=a["max_num_seqs"],
                                        kv_space_gib=a["kv_space_gib"], prefix_caching=True,
                                        extra_args=["--num-gpu-blocks-override", str(a["num_blocks"])],
                                        env={"LOWBIT_KV_LOG_STAGING": "1"})
            server.start()
            port, log_path = server.port, server.log
            server_command = f"VLLM_CPU_KVCACHE_SPACE={a['kv_space_gib']} LOWBIT_KV_LOG_STAGING=1 " \
                             + portable.command(server.command(), [model])
        else:
            port, log_path = args.port, args.server_log
        print(f"load: {args.clients} clients for {args.duration:.0f} s against 127.0.0.1:{port}",
              file=sys.stderr, flush=True)
        summary = run_load(port, clients=args.clients, duration=args.duration,
                           max_requests=args.max_requests, grace=args.grace, seed=args.seed,
                           log_path=log_path)
        summary["server_alive_after"] = server.alive if server else None
    finally:
        if server is not None:
            server.stop()
    result = dict(command=portable.command(["python", "-m", "bench.load_fault", *argv]),
                  server_command=server_command, **summary)
    print(json.dumps({k: result[k] for k in ("requests", "by_kind", "five_xx", "unexpected", "idle",
                                             "idle_state", "passed")}, indent=1))
    if args.json and args.port is None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not result["passed"]:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()

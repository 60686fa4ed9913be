"""Serving throughput per KV dtype at one KV memory budget, against the model's dtype in the same run.

    python -m bench.throughput             # bfloat16, fp8, vidkv, kivi2, quantile1 (long: hours on 2 cores)
    python -m bench.throughput --quick     # bfloat16 and vidkv, a small workload (development)
    python -m bench.throughput --dtypes vidkv --rates 0.05,inf --requests 12
    python -m bench.throughput --dtypes vidkv,rvq8x256 --rates none --prefill-rounds 3
    python -m bench.throughput --dtype float32 --dtypes vidkv --rates none   # float32 weights

The reference (bfloat16; ``auto`` with ``--dtype float32``) is always measured, first.

One server at a time (``python -m serving --kv-cache-dtype X --enforce-eager
--no-enable-prefix-caching``, :func:`bench.server.measurement_server`), each with
the same KV memory budget, ``--kv-cache-memory-bytes`` (the field
``VLLM_CPU_KVCACHE_SPACE`` fills, in bytes rather than whole GiB: 1 GiB holds
46,592 bfloat16 tokens of SmolLM2, which would take ~20 concurrent long
requests to fill, and 4x that would not run on 2 cores in useful time). The
default budget holds about 1.6 of the workload's requests in bfloat16 and
about 13 in vidkv (which then runs all 12 at once), so bfloat16 is
capacity-bound. The JSON and plot are rewritten after
every dtype (``complete`` says whether all ran).

The workload is fixed by ``--seed``: ``--requests`` prompts of uniformly drawn
length in ``--prompt-tokens`` (token ids of the Lee corpus from random
offsets, sent as token lists), ``--output-tokens`` each (``ignore_eos``,
greedy), streamed over HTTP. For each request rate of ``--rates`` (Poisson
arrivals; ``inf`` = all at once) the same requests run; meanwhile ``/metrics``
is polled every 0.5 s. Per (dtype, rate): output tokens/s (all output tokens
over the first send to the last token), peak and mean ``vllm:num_requests_running``,
peak ``vllm:kv_cache_usage_perc``, preemptions, TTFT and TPOT (time per output
token after the first) percentiles, and each as a ratio to the reference's at the
same rate (``x_ref``); per dtype: KV capacity in tokens (vLLM's, and
``/v1/kv_cache/stats``). The reference is the model's dtype: bfloat16, or ``auto``
(a float32 cache) with ``--dtype float32``, which serves the model in float32 (vLLM's
``--dtype``, every server), as CPUs without AVX-512 BF16 serve it fastest
(:data:`bench.server.REFERENCE_KV_DTYPE`).

Prefill floor. After the rates each server runs the same prompts once more,
all at once, with one output token each (``prefill_only``): how long prefilling
the workload takes on that server. No schedule can finish the full run (at
rate ``inf``) sooner, so the reference's full-run time over a dtype's prefill time is
the highest output tokens/s ratio that dtype could reach against the reference even
if its decode cost nothing (``output_ceiling_x_ref``); the reference's own ceiling
is what any format that prefills as fast as the reference could reach. On a CPU,
where prefill is compute-bound, this ceiling is what limits the output ratio.
A shared machine's speed drifts by more than the differences between formats
over the minutes between two servers, so ``--prefill-rounds N`` measures the
prefill floor N times: round 1 right after each dtype's rates, then rounds 2..N
with every dtype's server started again and all of them up at once, each
round measuring the dtypes one after another (each idle while another runs;
the order rotated per round, so that none always follows the same one): a
round's times are then seconds apart, not minutes. ``prefill_only.seconds``
is the median of ``rounds`` and ``prefill_x_ref`` the median of each round's
ratio to the reference's in the same round. ``--rates none`` measures only the
prefill floor.
JSON (with the command) to ``--json``, a plot to ``--png``. Results written before
``--dtype`` existed name the ratio fields ``x_bf16``, ``capacity_x_bf16``,
``prefill_x_bf16`` and ``output_ceiling_x_bf16``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import machine, portable
from bench.plotting import pyplot, save
from bench.server import (REFERENCE_KV_DTYPE, STATS_ROUTE, Server, ServerRefused, measurement_server,
                          metric_value, metrics_text, percentiles)

DEFAULT_DTYPES = "fp8,vidkv,kivi2,quantile1"  # after the reference
MIB = 2**20
POLL_S = 0.5
QUICK = dict(dtypes="vidkv", requests=6, prompt_tokens="1024,1536", output_tokens=64,
             rates="inf", kv_cache_mib=48, max_model_len=2048)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    quick = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"development run: {quick} (unless given)")
    p.add_argument("--dtypes", default=DEFAULT_DTYPES,
                   help="the reference (bfloat16; auto with --dtype float32) is always included")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="vLLM's --dtype, every server (default: the model's, bfloat16)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--kv-cache-mib", type=float, default=96,
                   help="KV memory budget (MiB), every dtype (96: bfloat16 holds ~1.6 requests)")
    p.add_argument("--requests", type=int, default=12, help="requests per rate")
    p.add_argument("--prompt-tokens", default="1024,4096", help="min,max prompt length (tokens)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rates", default="0.05,inf",
                   help="requests/s, comma-separated; inf = all at once; none: the prefill floor only")
    p.add_argument("--prefill-rounds", type=int, default=1,
                   help="prefill-only rounds; rounds 2.. with every server up at once, measured "
                        "in turn (module doc: prefill floor)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: --requests (no more run at once; a packed scheme's staging, "
                        "sized for this many sequences, is paid from the KV budget)")
    p.add_argument("--max-model-len", type=int, default=4224, help="4096 + 128: what the budget holds")
    p.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench/results/throughput.json")
    p.add_argument("--png", default="bench/results/throughput.png")
    return p


# --------------------------------------------------------------------------- workload
def make_workload(model_dir: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` token-id prompts, lengths uniform in [lo, hi], from random corpus offsets."""
    from transformers import AutoTokenizer

    from vllm_lowbit_kv.corpus import default_text

    ids = AutoTokenizer.from_pretrained(model_dir)(default_text())["input_ids"]
    if len(ids) < hi + 1:
        raise ValueError(f"--prompt-tokens max {hi} exceeds the corpus ({len(ids)} tokens)")
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --------------------------------------------------------------------------- one rate
def _stream_one(port: int, model: str, prompt: list[int], max_tokens: int, t_send: float,
                rec: dict) -> None:
    rec.update(t_send=t_send, t_first=None, t_last=None, tokens=0, error=None)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=7200)
    try:
        c.request("POST", "/v1/completions", json.dumps({
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
            {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            rec["error"] = f"HTTP {r.status}: {r.read()[:300]!r}"
            return
        for line in r:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("choices") and ev["choices"][0].get("text"):
                now = time.time()
                rec["t_first"] = rec["t_first"] or now
                rec["t_last"] = now
            if ev.get("usage"):
                rec["tokens"] = ev["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()


class MetricsPoller(threading.Thread):
    """Polls vLLM's /metrics: running/waiting requests, KV usage, preemptions."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.samples, self.stop_flag = port, [], threading.Event()

    def read(self) -> dict[str, float]:
        text = metrics_text(self.port)
        return {name: metric_value(text, f"vllm:{name}") or 0.0
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                             "num_preemptions_total")}

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.samples.append(self.read())
            except (OSError, http.client.HTTPException):
                pass
            self.stop_flag.wait(POLL_S)


def run_rate(server: Server, prompts: list[list[int]], output_tokens: int, rate: float,
             seed: int) -> dict[str, Any]:
    poller = MetricsPoller(server.port)
    before = poller.read()
    poller.start()
    recs = [dict() for _ in prompts]
    threads = []
    t0 = time.time()
    for i, (prompt, at) in enumerate(zip(prompts, arrival_times(len(prompts), rate, seed))):
        time.sleep(max(0.0, t0 + at - time.time()))
        # daemon: on SIGTERM the interpreter must not wait for streams before atexit stops the server
        th = threading.Thread(target=_stream_one, args=(server.port, server.model_name, prompt,
                                                        output_tokens, time.time(), recs[i]), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    poller.stop_flag.set()
    poller.join()
    after = poller.read()
    errors = [r["error"] for r in recs if r.get("error")]
    done = [r for r in recs if not r.get("error") and r["t_first"]]
    tokens = sum(r["tokens"] for r in done)
    span = max(r["t_last"] for r in done) - min(r["t_send"] for r in recs) if done else None
    running = [s["num_requests_running"] for s in poller.samples] or [0.0]
    return dict(
        rate=rate if not math.isinf(rate) else "inf", requests=len(prompts), completed=len(done),
        errors=errors[:5], output_tokens=tokens, seconds=round(span, 2) if span else None,
        output_tokens_per_s=round(tokens / span, 3) if span else None,
        requests_per_min=round(60 * len(done) / span, 3) if span else None,
        peak_running=max(running), mean_running=round(sum(running) / len(running), 2),
        peak_waiting=max((s["num_requests_waiting"] for s in poller.samples), default=0.0),
        peak_kv_usage=max((s["kv_cache_usage_perc"] for s in poller.samples), default=0.0),
        preemptions=after["num_preemptions_total"] - before["num_preemptions_total"],
        ttft_s=percentiles([r["t_first"] - r["t_send"] for r in done]),
        tpot_s=percentiles([(r["t_last"] - r["t_first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]),
        e2e_s=percentiles([r["t_last"] - r["t_send"] for r in done]),
    )


def prefill_rounds(rows: list[dict], args, prompts, rounds: int, log=print,
                   after_round=lambda n: None) -> None:
    """Rounds 2.. of the prefill floor (module doc): every dtype that served started again,
    all at once, then ``rounds`` rounds of one prefill-only measurement per dtype in turn;
    a dtype whose restart is refused, or a failed measurement, is kept as None.
    ``after_round(n)`` runs after round n (1-based: what the JSON has measured so far)."""
    ok = [r for r in rows if r["status"] == "ok"]
    servers: dict[str, Server] = {}
    try:
        for row in ok:
            server = dtype_server(row["dtype"], args)
            try:
                servers[row["dtype"]] = server.start()
            except ServerRefused as e:
                log(f"{row['dtype']}: prefill rounds not measured: {e.reason}")
        for n in range(rounds):
            for row in ok[n % len(ok):] + ok[:n % len(ok)]:
                server, seconds = servers.get(row["dtype"]), None
                if server is not None:
                    (seconds,) = prefill_floor(server, prompts, args.seed)["rounds"]
                row["prefill_only"]["rounds"].append(seconds)
                log(f"{row['dtype']} prefill only, round {len(row['prefill_only']['rounds'])}: "
                    f"{seconds} s")
            after_round(n + 1)
    finally:
        for server in servers.values():
            server.stop()


# --------------------------------------------------------------------------- all dtypes
RATIO_KEYS = ("output_tokens_per_s", "peak_running", "mean_running", "requests_per_min")
PCT_RATIO_KEYS = ("ttft_s", "tpot_s", "e2e_s")


def add_ratios(rows: list[dict], reference: str) -> None:
    """Each figure over the ``reference`` dtype's at the same rate (same run), and each
    dtype's ceiling on the output ratio (module doc: prefill floor)."""
    ref_row = next((r for r in rows if r["dtype"] == reference and r["status"] == "ok"), None)
    ref = {str(p["rate"]): p for p in ref_row["points"]} if ref_row else {}
    ref_cap = ref_row["capacity_tokens"] if ref_row else None
    ref_all_at_once = ref.get("inf", {}).get("seconds")
    ref_rounds = (ref_row.get("prefill_only") or {}).get("rounds") if ref_row else None
    for r in rows:
        if r["status"] != "ok":
            continue
        r["capacity_x_ref"] = round(r["capacity_tokens"] / ref_cap, 4) if ref_cap else None
        floor = r.get("prefill_only") or {}
        if floor.get("rounds") and ref_rounds:
            done = [s for s in floor["rounds"] if s]
            floor["seconds"] = round(statistics.median(done), 2) if done else None
            paired = [a / b for a, b in zip(floor["rounds"], ref_rounds) if a and b]
            r["prefill_x_ref"] = round(statistics.median(paired), 4) if paired else None
        prefill_s = floor.get("seconds")
        r["output_ceiling_x_ref"] = (round(ref_all_at_once / prefill_s, 4)
                                     if prefill_s and ref_all_at_once else None)
        for p in r["points"]:
            b = ref.get(str(p["rate"]))
            if b is None:
                continue
            ratios = {k: round(p[k] / b[k], 4) for k in RATIO_KEYS if p.get(k) and b.get(k)}
            for k in PCT_RATIO_KEYS:
                if p.get(k) and b.get(k):
                    ratios[f"{k}_p50"] = round(p[k]["p50"] / b[k]["p50"], 4)
                    ratios[f"{k}_p90"] = round(p[k]["p90"] / b[k]["p90"], 4)
            p["x_ref"] = ratios


def codebook_config(model: str, dtype: str) -> dict[str, str] | None:
    """The lowbit_kv fields a scheme with learned codebooks (``rvq*``) needs: the model's
    default codebook file, calibrated on first use (:func:`~vllm_lowbit_kv.calibrate.default_codebook`);
    None for every other dtype."""
    from vllm_lowbit_kv.calibrate import default_codebook

    path = default_codebook(model, dtype, progress=False)
    return None if path is None else {"codebook": str(path)}


def dtype_server(dtype: str, args) -> Server:
    return measurement_server(args.model, dtype, chunk=args.chunk, max_model_len=args.max_model_len,
                              max_num_seqs=args.max_num_seqs, kv_cache_bytes=int(args.kv_cache_mib * MIB),
                              model_dtype=args.dtype, additional_config=codebook_config(args.model, dtype))


def prefill_floor(server: Server, prompts: list[list[int]], seed: int) -> dict[str, Any]:
    """The workload's prompts all at once, one output token each (module doc: prefill
    floor), after one short request (a fresh server's first step pays one-time set-up);
    ``rounds``: the seconds, or None where a request failed."""
    run_rate(server, [prompts[0][:256]], 1, math.inf, seed)
    floor = run_rate(server, prompts, 1, math.inf, seed)
    floor = {k: floor[k] for k in ("completed", "errors", "seconds", "ttft_s")}
    floor["rounds"] = [floor["seconds"] if floor["completed"] == len(prompts) else None]
    return floor


def measure_dtype(dtype: str, args, prompts, rates, log=print) -> dict[str, Any]:
    server = dtype_server(dtype, args)
    # the machine may be shared: its load during the measurement is part of the result
    row: dict[str, Any] = dict(dtype=dtype, status="ok", reason=None,
                               loadavg_start=[round(x, 2) for x in os.getloadavg()])
    try:
        server.start()
    except ServerRefused as e:
        row.update(status="refused", reason=e.reason)
        return row
    try:
        info = server.cache_info()
        stats = server.get(STATS_ROUTE)
        row.update(capacity_tokens=info.get("capacity_tokens"), num_blocks=info.get("num_blocks"),
                   effective_bits=stats["effective_bits"]["overall"],
                   allocated_bits=stats["effective_bits"]["allocated"],
                   kv_cache_bytes=stats["capacity"]["kv_cache_bytes"],
                   attention_impls=server.attention_impls(), startup_s=server.startup_s,
                   points=[])
        avg_len = sum(len(p) for p in prompts) / len(prompts) + args.output_tokens
        row["fits_requests"] = round(row["capacity_tokens"] / avg_len, 2)
        log(f"{dtype}: capacity {row['capacity_tokens']} tokens (~{row['fits_requests']} requests)")
        for rate in rates:
            point = run_rate(server, prompts, args.output_tokens, rate, args.seed)
            row["points"].append(point)
            log(f"{dtype} rate {point['rate']}: {point['output_tokens_per_s']} tok/s, peak running "
                f"{point['peak_running']}, TTFT p50 {point['ttft_s'] and point['ttft_s']['p50']} s, "
                f"TPOT p50 {point['tpot_s'] and point['tpot_s']['p50']} s, errors {len(point['errors'])}")
        floor = row["prefill_only"] = prefill_floor(server, prompts, args.seed)
        log(f"{dtype} prefill only: {floor['seconds']} s for {floor['completed']} requests")
    finally:
        server.stop()
        row["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return row


def plot(rows: list[dict], path: str | Path, title: str, reference: str) -> None:
    plt = pyplot()

    ok = [r for r in rows if r["status"] == "ok"]
    rates = [str(p["rate"]) for p in ok[0]["points"]] if ok else []
    panels = [("output_tokens_per_s", "output tokens/s", None), ("peak_running", "peak running requests", None),
              ("ttft_s", "TTFT p50 (s)", "p50"), ("tpot_s", "TPOT p50 (s)", "p50")]
    others = [r["dtype"] for r in ok if r["dtype"] != reference]
    color = {d: "black" if d == reference else f"C{others.index(d)}" for d in (r["dtype"] for r in ok)}
    if not rates:  # --rates none: the prefill floor alone
        fig, ax = plt.subplots(1, 1, figsize=(7, 4.2))
        prefill_panel(ax, ok, color, reference)
        fig.suptitle(title, fontsize=9)
        save(fig, path)
        return
    fig, axes = plt.subplots(1, 5, figsize=(21, 4.2))
    width = 0.8 / max(1, len(ok))
    for ax, (key, label, sub) in zip(axes, panels):
        for j, r in enumerate(ok):
            ys = [(p[key][sub] if sub else p[key]) if p.get(key) is not None else 0 for p in r["points"]]
            xs = [i + j * width for i in range(len(ys))]
            bars = ax.bar(xs, ys, width, label=r["dtype"], color=color[r["dtype"]])
            for b, p in zip(bars, r["points"]):
                ratio = p.get("x_ref", {}).get(f"{key}_p50" if sub else key)
                if ratio is not None and r["dtype"] != reference:
                    ax.annotate(f"{ratio:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + width * (len(ok) - 1) / 2 for i in range(len(rates))],
                      [f"rate {x}/s" if x != "inf" else "all at once" for x in rates])
        ax.set_title(label, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    prefill_panel(axes[4], ok, color, reference)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def prefill_panel(ax, rows: list[dict], color: dict[str, str], reference: str) -> None:
    """The prefill floor per dtype: a bar (the median with rounds), each round a dot,
    annotated with the ratio to the reference (paired by round) and the output ceiling."""
    floor = [r for r in rows if r.get("prefill_only")]
    bars = ax.bar(range(len(floor)), [r["prefill_only"]["seconds"] or 0 for r in floor],
                  color=[color[r["dtype"]] for r in floor])
    for i, (b, r) in enumerate(zip(bars, floor)):
        rounds = [s for s in r["prefill_only"].get("rounds") or [] if s]
        if len(rounds) > 1:
            ax.plot([i] * len(rounds), rounds, "o", color="grey", markersize=3)
        notes = [f"{r['prefill_x_ref']:.2f}x" if r.get("prefill_x_ref") and r["dtype"] != reference
                 else None,
                 f"ceiling {r['output_ceiling_x_ref']:.2f}x" if r.get("output_ceiling_x_ref") else None]
        if any(notes):
            ax.annotate("\n".join(n for n in notes if n), (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(floor)), [r["dtype"] for r in floor], fontsize=7)
    rounds = max((len(r["prefill_only"].get("rounds") or []) for r in floor), default=0)
    ceilings = any(r.get("output_ceiling_x_ref") for r in floor)
    ax.set_title("prefill only, all at once (s)" + (f": median of {rounds} rounds (dots), x = paired ratio"
                                                    if rounds > 1 else "")
                 + (f"; ceiling = {reference} full run / this" if ceilings else ""), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        for k, v in QUICK.items():
            if f"--{k.replace('_', '-')}" not in given:
                setattr(args, k, v)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.requests
    if args.model is None:
        from vllm_lowbit_kv.model import prepare_model
        args.model = str(prepare_model())
    reference = REFERENCE_KV_DTYPE[args.dtype]
    dtypes = list(dict.fromkeys([reference] + [d.strip() for d in args.dtypes.split(",") if d.strip()]))
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    rates = [] if args.rates == "none" else [float(x) for x in args.rates.split(",")]
    if args.prefill_rounds < 1:
        parser.error(f"--prefill-rounds must be at least 1, got {args.prefill_rounds}")
    if hi + args.output_tokens > args.max_model_len:
        parser.error(f"--max-model-len {args.max_model_len} must hold --prompt-tokens max {hi} + "
                     f"--output-tokens {args.output_tokens}")
    prompts = make_workload(args.model, args.requests, lo, hi, args.seed)
    t0 = time.time()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    probe = measurement_server(args.model, "<dtype>", chunk=args.chunk, max_model_len=args.max_model_len,
                               max_num_seqs=args.max_num_seqs, kv_cache_bytes=int(args.kv_cache_mib * MIB),
                               model_dtype=args.dtype)
    rows: list[dict] = []
    result = dict(
        command=portable.command(["python", "-m", "bench.throughput", *argv], [args.model]),
        server_command="env -u VLLM_CPU_KVCACHE_SPACE "
        + portable.command(probe.command(), [args.model]),
        model=portable.model_name(args.model), model_dtype=args.dtype or "the model's own",
        reference=reference, machine=machine.describe(),
        kv_cache_bytes=int(args.kv_cache_mib * MIB), requests=args.requests,
        prompt_tokens=[lo, hi], prompt_tokens_total=sum(len(p) for p in prompts),
        output_tokens=args.output_tokens, rates=[r if not math.isinf(r) else "inf" for r in rates],
        seed=args.seed, max_num_seqs=args.max_num_seqs, chunk=args.chunk, dtypes=dtypes,
        prefill_rounds=args.prefill_rounds,
        complete=False, elapsed_s=None, rows=rows,
    )
    weights = f", {args.dtype} weights" if args.dtype else ""
    title = (f"{Path(args.model).name}{weights}: KV budget {args.kv_cache_mib:g} MiB,\n"  # fits one panel
             f"{args.requests} requests of {lo}-{hi} prompt + {args.output_tokens} output tokens")

    def write(complete: bool) -> None:  # after every dtype and round: a long run keeps what it measured
        add_ratios(rows, reference)
        result.update(elapsed_s=round(time.time() - t0, 1), complete=complete)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))
        if args.png:
            Path(args.png).parent.mkdir(parents=True, exist_ok=True)
            plot(rows, args.png, title, reference)

    for d in dtypes:
        rows.append(measure_dtype(d, args, prompts, rates, log))
        write(complete=len(rows) == len(dtypes) and args.prefill_rounds == 1)
    if args.prefill_rounds > 1:
        prefill_rounds(rows, args, prompts, args.prefill_rounds - 1, log,
                       after_round=lambda n: write(complete=n == args.prefill_rounds - 1))
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    head = f"{'dtype':10} {'rate':>6} {'capacity':>9} {'x':>5} {'tok/s':>7} {'x':>5} {'peak run':>8} " \
           f"{'x':>5} {'TTFT p50':>8} {'TPOT p50':>8} {'err':>3}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['dtype']:10} refused: {r['reason']}")
            continue
        for p in r["points"]:
            x = p.get("x_ref", {})
            f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
            lines.append(
                f"{r['dtype']:10} {str(p['rate']):>6} {r['capacity_tokens']:>9} "
                f"{f(r.get('capacity_x_ref'), '.2f'):>5} {f(p['output_tokens_per_s'], '.2f'):>7} "
                f"{f(x.get('output_tokens_per_s'), '.2f'):>5} {p['peak_running']:>8.0f} "
                f"{f(x.get('peak_running'), '.2f'):>5} {f(p['ttft_s'] and p['ttft_s']['p50'], '.2f'):>8} "
                f"{f(p['tpot_s'] and p['tpot_s']['p50'], '.3f'):>8} {len(p['errors']):>3}")
    for r in result["rows"]:
        if r.get("prefill_only"):
            rounds = r["prefill_only"].get("rounds") or []
            each = (f" (median of {rounds}, {r.get('prefill_x_ref')}x {result['reference']}'s)"
                    if len(rounds) > 1 else "")
            ceiling = r.get("output_ceiling_x_ref")
            lines.append(f"{r['dtype']:10} prefill only {r['prefill_only']['seconds']} s{each}"
                         + (f": output ceiling {ceiling}x {result['reference']}" if ceiling is not None
                            else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

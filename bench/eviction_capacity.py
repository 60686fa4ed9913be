"""Concurrent requests one fixed KV budget holds, with and without eviction.

    python -m bench.eviction_capacity                  # computed table + the server measurement
    python -m bench.eviction_capacity --no-measure     # computed table only (seconds; printed,
                                                       # written only with --json/--png)

Computed (exact for the vLLM engine, from the real page layout byte sizes):
for each dtype, vLLM's block count at ``--kv-space-gib`` is
``budget // (page_bytes * layers)`` (minus the null block) with ``page_bytes``
the :class:`~vllm_lowbit_kv.paged.PagedLayout` of the scheme (sink area
included; ``bfloat16``: 2 x 2 bytes x heads x head_dim per token). A request of
``P`` prompt and ``G`` generated tokens holds ``ceil((P + G) / bs)`` blocks
without eviction; with eviction at retention r it holds, after its prefill,
the ``kept_blocks`` of its :class:`~vllm_lowbit_kv.eviction.paged.PagedEvictionGeometry`
plus the blocks from its last prompt block on (``ceil((P + G - keep_from) / bs)``),
and ``ceil(P / bs)`` during its prefill. With prefills one at a time, the
number running is the largest n with ``(n - 1) * after + peak <= blocks``.
``bfloat16`` (vLLM's own attention cannot evict; the transformers yardstick can)
is counted at pair granularity: ``r * P + G`` tokens per request.

Measured (``--measure-dtype``): two real servers with ``--num-gpu-blocks-override``
blocks, without and with ``--kv-eviction flashcache --kv-retention r``; ``--requests``
requests of ``--measure-prompt`` tokens and ``--measure-gen`` tokens sent at once;
``/metrics`` is polled for ``vllm:num_requests_running`` (max) and
``vllm:num_preemptions_total``; wall time to the last answer.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench import RESULTS, portable
from bench.plotting import pyplot, save

GIB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.eviction_capacity",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,kivi4,kivi2,vidkv")
    p.add_argument("--retentions", default="0.1,0.2,0.5")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--kv-space-gib", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    p.add_argument("--layer-cap", type=float, default=2.0, help="lowbit_kv eviction_layer_cap")
    p.add_argument("--policy", default="flashcache")
    p.add_argument("--no-measure", action="store_true", help="skip the server measurement")
    p.add_argument("--measure-dtype", default="vidkv")
    p.add_argument("--measure-retention", type=float, default=0.2)
    p.add_argument("--measure-blocks", type=int, default=60, help="--num-gpu-blocks-override")
    p.add_argument("--measure-prompt", type=int, default=2048)
    p.add_argument("--measure-gen", type=int, default=64)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--model", default=None)
    # --no-measure writes only where told: its result would drop the committed measurement
    p.add_argument("--json", default=None, help="default: bench/results/eviction_capacity.json "
                                                "when measuring, none with --no-measure")
    p.add_argument("--png", default=None, help="as --json, .png")
    return p


def _geometry_model(model: str) -> dict:
    from bench.vllm_engine import model_geometry
    return model_geometry(model)


def computed(args, geo_model: dict) -> list[dict]:
    import torch

    from vllm_lowbit_kv.eviction import make_policy
    from vllm_lowbit_kv.eviction.paged import paged_geometry
    from vllm_lowbit_kv.paged import PagedLayout
    from vllm_lowbit_kv.schemes import get_scheme

    L, H, D = geo_model["layers"], geo_model["kv_heads"], geo_model["head_dim"]
    P, G, bs = args.prompt_tokens, args.gen_tokens, args.block_size
    rows = []
    for dtype in args.dtypes:
        if dtype == "bfloat16":
            page, T = bs * H * D * 2 * 2, 1
        else:
            scheme = get_scheme(dtype)
            kc, vc = scheme.codecs(D)
            page, T = PagedLayout(kc, vc, H, bs, scheme.sink_tokens, torch.bfloat16).page_bytes, kc.block_tokens
        blocks = int(args.kv_space_gib * GIB) // (page * L) - 1  # vLLM's null block
        plain = -(-(P + G) // bs)
        row = dict(dtype=dtype, page_bytes_per_layer=page, blocks=blocks,
                   bytes_per_token=page * L / bs, blocks_per_request=plain,
                   concurrent_without=blocks // plain, with_eviction={})
        for r in args.retentions:
            if dtype == "bfloat16":  # the yardstick's pairs, no block granularity
                per = r * P + G
                n = int(blocks * bs // per)
                row["with_eviction"][str(r)] = dict(tokens_per_request=per, concurrent=n,
                                                    note="transformers engine (pairs, no blocks)")
                continue
            pol = make_policy(args.policy, r)
            geo = paged_geometry(P, bs, T, pol, args.layer_cap)
            after = geo.kept_blocks + -(-(P + G - geo.keep_from) // bs)
            peak = -(-P // bs)
            n = 0 if blocks < peak else 1 + (blocks - peak) // after
            row["with_eviction"][str(r)] = dict(kept_blocks=geo.kept_blocks, blocks_after=after,
                                                blocks_during_prefill=peak, freed=len(geo.freed_blocks),
                                                concurrent=n)
        rows.append(row)
    return rows


def _poll(srv, stop: threading.Event, seen: dict) -> None:
    from bench.server import metric_value, metrics_text

    while not stop.is_set():
        try:
            running = metric_value(metrics_text(srv.port), "vllm:num_requests_running")
            if running is not None:
                seen["max_running"] = max(seen.get("max_running", 0), int(running))
        except OSError:
            pass
        stop.wait(0.25)


def measure(args, model: str, eviction: dict | None) -> dict:
    from transformers import AutoTokenizer

    from bench.quality import passkey_prompt
    from bench.server import measurement_server, metric_value, metrics_text

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [passkey_prompt(tok, args.measure_prompt, 0.5, 10000 + i) for i in range(args.requests)]
    srv = measurement_server(model, args.measure_dtype, chunk=512,
                             max_model_len=args.measure_prompt + args.measure_gen + 128, max_num_seqs=16,
                             additional_config=eviction,
                             extra_args=["--num-gpu-blocks-override", str(args.measure_blocks)])
    seen: dict = {}
    with srv:
        stop = threading.Event()
        poller = threading.Thread(target=_poll, args=(srv, stop, seen))
        poller.start()
        t0 = time.time()
        outs = [None] * len(prompts)

        def one(i):
            outs[i] = srv.greedy(prompts[i], args.measure_gen)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        stop.set()
        poller.join()
        preemptions = metric_value(metrics_text(srv.port), "vllm:num_preemptions_total")
        freed = [int(x) for x in re.findall(r"freed (\d+) blocks", srv.log_text())]
    return dict(eviction=eviction, blocks=args.measure_blocks, requests=len(prompts),
                prompt_tokens=[len(p) for p in prompts], gen_tokens=args.measure_gen,
                max_running=seen.get("max_running"), preemptions=preemptions,
                wall_s=round(wall, 1), answers_complete=all(o and len(o) == args.measure_gen for o in outs),
                freed_blocks_per_request=freed, server_command=portable.command(srv.command(), [model]))


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    rows, rets = result["computed"], result["retentions"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    w = 0.8 / (len(rets) + 1)
    for j, r in enumerate(rows):
        ax.bar(j, r["concurrent_without"], w, color="gray", label="no eviction" if j == 0 else None)
        for i, ret in enumerate(rets):
            v = r["with_eviction"][str(ret)]["concurrent"]
            ax.bar(j + (i + 1) * w, v, w, color=f"C{i}", label=f"flashcache r={ret}" if j == 0 else None)
            ax.annotate(str(v), (j + (i + 1) * w, v), ha="center", va="bottom", fontsize=7)
        ax.annotate(str(r["concurrent_without"]), (j, r["concurrent_without"]), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rows))],
                  [f"{r['dtype']}\n{r['bytes_per_token']:.0f} B/token" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("concurrent requests in the KV budget")
    ax.set_title(f"{result['kv_space_gib']} GiB KV, requests of {result['prompt_tokens']} + "
                 f"{result['gen_tokens']} tokens, blocks of {result['block_size']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    save(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.retentions = [float(x) for x in args.retentions.split(",") if x.strip()]
    if args.model is None:
        from vllm_lowbit_kv.model import prepare_model
        args.model = str(prepare_model())
    result = dict(command=portable.command(["python", "-m", "bench.eviction_capacity", *argv],
                                                   [args.model]),
                  model=portable.model_name(args.model),
                  kv_space_gib=args.kv_space_gib, prompt_tokens=args.prompt_tokens,
                  gen_tokens=args.gen_tokens, block_size=args.block_size, layer_cap=args.layer_cap,
                  policy=args.policy, retentions=args.retentions,
                  computed=computed(args, _geometry_model(args.model)), measured=None)
    for r in result["computed"]:
        ev = "  ".join(f"r={k}: {v['concurrent']}" for k, v in r["with_eviction"].items())
        print(f"{r['dtype']:10s} {r['bytes_per_token']:8.0f} B/token  {r['blocks']:6d} blocks  "
              f"no eviction: {r['concurrent_without']}  {ev}")
    if not args.no_measure:
        ev = {"eviction": args.policy, "retention": args.measure_retention}
        result["measured"] = [measure(args, args.model, None), measure(args, args.model, ev)]
        for m in result["measured"]:
            print(f"measured {args.measure_dtype} eviction={m['eviction']}: max running "
                  f"{m['max_running']} of {m['requests']}, preemptions {m['preemptions']}, "
                  f"{m['wall_s']} s")
    if not args.no_measure:
        args.json = args.json or str(RESULTS / "eviction_capacity.json")
        args.png = args.png or str(RESULTS / "eviction_capacity.png")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        plot(result, args.png)
    return result


if __name__ == "__main__":
    main()

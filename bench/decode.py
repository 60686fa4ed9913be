"""Server decode throughput at equal batch: a packed KV scheme against bf16, same run.

    python -m bench.decode                                   # bfloat16 vs vidkv, batch 16
    python -m bench.decode --kv-cache-dtype bfloat16,vidkv,kivi2 --batch 16 \\
        --prompt-tokens 1536 --output-tokens 128 --rounds 2
    python -m bench.decode --dtype float32 --kv-cache-dtype auto,vidkv   # float32 weights

Each KV dtype gets the real server (``python -m serving``, started through
:func:`bench.server.measurement_server`: vLLM's OpenAI server with the plugin,
``--enforce-eager``, prefix caching off, ``--max-num-seqs`` = the batch).
``batch`` requests with distinct prompts of ``prompt_tokens`` tokens (cut from
the Lee corpus) are sent at once, streaming, each generating exactly
``output_tokens`` tokens (greedy, ``ignore_eos``). Every streamed token is
time-stamped on arrival; the decode window is the span in which *all*
requests are decoding (from the last first token to the first last token),
and decode throughput = tokens received in that window / its length, i.e.
tokens per second of steps that each decode the whole batch. Rounds
alternate the dtypes (bf16, scheme, bf16, scheme, ...) so a change in the
machine's load hits both; the ratio is that of the medians. The JSON records
the command, the machine, its load average, and every round; a PNG plots them.
Results: ``bench/results/decode_cpu.{json,png}``.

``--ceiling-prompt-tokens N`` also measures, each round after the others, the reference
with N-token prompts (same batch and output tokens): a step that attends to almost no
context, so its decode rate is the model's work alone. Its median over the reference's
at ``--prompt-tokens`` (``ceiling.x_ref``) is about the most any KV format can gain at
this batch and model, attention at no cost (the model's other work is the same for
every format).

``--dtype float32`` serves the model in float32 (vLLM's ``--dtype``, every server), as
CPUs without AVX-512 BF16 serve it fastest (torch has no fast bf16 matrix multiply
there); the reference is then ``auto``, a float32 cache (the plugin refuses a float32
model over a 16-bit cache).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from bench import RESULTS, machine, portable
from bench.plotting import pyplot, save
from bench.server import Server, measurement_server
from bench.vllm_engine import model_geometry


def prompts(model_dir: str, batch: int, n: int) -> list[list[int]]:
    """``batch`` distinct token-id prompts of ``n`` tokens from the evaluation corpus."""
    from transformers import AutoTokenizer

    from vllm_lowbit_kv.corpus import default_text

    ids = AutoTokenizer.from_pretrained(model_dir)(default_text()).input_ids
    if len(ids) < batch * n:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than {batch} x {n}")
    return [ids[i * n:(i + 1) * n] for i in range(batch)]


def stream_times(server: Server, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every generated token of one streamed completion."""
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    times: list[float] = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    finally:
        conn.close()
    if len(times) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} streamed tokens, got {len(times)}")
    return times


def one_round(server: Server, batch_prompts: list[list[int]], output_tokens: int) -> dict:
    results: list[list[float] | BaseException] = [None] * len(batch_prompts)  # type: ignore

    def run(i: int) -> None:
        try:
            results[i] = stream_times(server, batch_prompts[i], output_tokens)
        except BaseException as e:  # reported below
            results[i] = e

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch_prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]!r}")
    start = max(ts[0] for ts in results)  # every request has its first token
    end = min(ts[-1] for ts in results)  # no request has finished
    if end <= start:
        raise RuntimeError("no window in which every request decodes (raise --output-tokens)")
    in_window = sum(sum(1 for t in ts if start < t <= end) for ts in results)
    return dict(decode_tokens_per_s=in_window / (end - start), window_s=end - start,
                window_tokens=in_window, wall_s=max(ts[-1] for ts in results) - t0,
                first_token_s=start - t0)


def summarize(rounds: list[dict], dtypes: list[str]) -> dict:
    """Per dtype the median decode rate over its rounds (the ceiling rows apart), the ratios
    to the first dtype's, and the ceiling's median and ratio where it was measured."""
    def median(d: str, ceiling: bool = False) -> float:
        return statistics.median(x["decode_tokens_per_s"] for x in rounds
                                 if x["kv_cache_dtype"] == d and x.get("ceiling", False) == ceiling)
    med = {d: median(d) for d in dtypes}
    out = dict(median_decode_tokens_per_s=med,
               ratio_to_reference={d: med[d] / med[dtypes[0]] for d in dtypes})
    short = [x for x in rounds if x.get("ceiling")]
    if short:
        top = median(dtypes[0], ceiling=True)
        out["ceiling"] = dict(prompt_tokens=short[0]["prompt_tokens"],
                              median_decode_tokens_per_s=top, x_ref=top / med[dtypes[0]])
    return out


def measure(args) -> dict:
    model_dir = args.model
    geo = model_geometry(model_dir)
    batch_prompts = prompts(model_dir, args.batch, args.prompt_tokens)
    max_len = args.prompt_tokens + args.output_tokens + 16
    # (dtype, prompts, ceiling): the dtypes at --prompt-tokens, then the reference's ceiling
    runs = [(d, batch_prompts, False) for d in args.dtypes]
    if args.ceiling_prompt_tokens:
        runs.append((args.dtypes[0], [p[:args.ceiling_prompt_tokens] for p in batch_prompts], True))
    rounds = []
    for r in range(args.rounds):
        for dtype, these, ceiling in runs:
            name = f"{dtype}_ceiling" if ceiling else dtype
            log = args.log_dir / f"decode_{name}_{r}.log" if args.log_dir else None
            server = measurement_server(model_dir, dtype, chunk=args.chunk, max_model_len=max_len,
                                        kv_space_gib=args.kv_space_gib, max_num_seqs=args.batch,
                                        model_dtype=args.dtype, log=log)
            with server:
                load = os.getloadavg()[0]
                res = one_round(server, these, args.output_tokens)
            res.update(kv_cache_dtype=dtype, prompt_tokens=len(these[0]), round=r,
                       load_avg_1min=load, startup_s=server.startup_s)
            if ceiling:
                res["ceiling"] = True
            rounds.append(res)
            print(f"round {r} {name:14s}: {res['decode_tokens_per_s']:7.1f} tokens/s decode "
                  f"({res['window_tokens']} tokens in {res['window_s']:.1f} s, load {load:.1f})",
                  flush=True)
    return dict(
        command=portable.command([sys.executable, "-m", "bench.decode", *sys.argv[1:]], [model_dir]),
        machine=machine.describe(),
        model=portable.model_name(model_dir), model_dtype=args.dtype or "the model's own",
        geometry=geo, batch=args.batch,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, chunk=args.chunk, kv_space_gib=args.kv_space_gib,
        attention_impl=os.environ.get("LOWBIT_KV_ATTENTION_IMPL", "auto"),
        rounds=rounds, **summarize(rounds, args.dtypes), reference=args.dtypes[0])


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    dtypes = list(result["median_decode_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, d in enumerate(dtypes):
        vals = [x["decode_tokens_per_s"] for x in result["rounds"]
                if x["kv_cache_dtype"] == d and not x.get("ceiling")]
        ax.bar(i, result["median_decode_tokens_per_s"][d], color=f"C{i}", alpha=0.6)
        ax.plot([i] * len(vals), vals, "ko", ms=4)
        ax.text(i, result["median_decode_tokens_per_s"][d],
                f"x{result['ratio_to_reference'][d]:.2f}", ha="center", va="bottom")
    if "ceiling" in result:  # the reference at short prompts: attention at about no cost
        c = result["ceiling"]
        ax.axhline(c["median_decode_tokens_per_s"], color="gray", ls="--", lw=0.8,
                   label=f"{dtypes[0]} at {c['prompt_tokens']}-token prompts "
                         f"(x{c['x_ref']:.2f}: attention at about no cost)")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xticks(range(len(dtypes)), dtypes)
    ax.set_ylabel("decode tokens/s (whole batch decoding)")
    dtype = result.get("model_dtype", "the model's own")  # older results lack it
    weights = "" if dtype == "the model's own" else f", {dtype} weights"
    ax.set_title(f"vLLM CPU server{weights}, batch {result['batch']}, {result['prompt_tokens']}-token "
                 f"prompts, {result['output_tokens']} output tokens\n{result['machine']['cpu']}, "
                 f"{result['machine']['cores']} cores (dots: rounds)", fontsize=8)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    from vllm_lowbit_kv.model import prepare_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--kv-cache-dtype", dest="dtypes", default="bfloat16,vidkv",
                   help="comma-separated; the first is the reference of the ratios")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="vLLM's --dtype, every server (default: the model's, bfloat16)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    p.add_argument("--kv-space-gib", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ceiling-prompt-tokens", type=int, default=0,
                   help="also measure the reference with prompts this short each round (0: off)")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the server logs here")
    p.add_argument("--out", type=Path, default=RESULTS / "decode_cpu.json")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    if args.dtype == "float32" and args.dtypes[0] != "auto":
        p.error(f"--kv-cache-dtype: with --dtype float32 the reference (the first) must be auto "
                f"(a float32 cache; a float32 model over a 16-bit cache is refused), not "
                f"{args.dtypes[0]!r}")
    if not 0 <= args.ceiling_prompt_tokens < args.prompt_tokens:
        p.error(f"--ceiling-prompt-tokens: from 0 (off) to below --prompt-tokens "
                f"({args.prompt_tokens}), not {args.ceiling_prompt_tokens}")
    args.model = args.model or str(prepare_model(progress=False))
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(dict(median=result["median_decode_tokens_per_s"],
                          ratio=result["ratio_to_reference"], ceiling=result.get("ceiling")),
                     indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

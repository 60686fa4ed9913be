"""vLLM's own benchmark client against each KV dtype, the model's own first, in the same run.

    python -m bench.serve_client                     # bfloat16 and vidkv
    python -m bench.serve_client --kv-cache-dtype bfloat16,vidkv,kivi2 --prompts 8 \\
        --input-tokens 1024 --output-tokens 64 \\
        --json bench/results/serve_client.json --png bench/results/serve_client.png

Speed as a vLLM user measures it: one server per dtype (``python -m serving``, started
through :func:`bench.server.measurement_server`: ``--enforce-eager``, prefix caching
off, ``--max-num-seqs`` = ``--prompts``), then ``vllm bench serve --dataset-name random``
(this package's ``vllm`` console script, vLLM's own client) with a fixed seed, so
every server gets the same prompts, all sent at once. Per dtype: vLLM's result
(output tokens/s; TTFT, TPOT and inter-token latency, ITL: means or medians and 99th
percentiles; duration) and each as a ratio to the reference's
(``x_ref``: bfloat16, or ``auto`` with ``--dtype float32``, below), and the
tokens its KV cache holds in ``--kv-space-gib`` (``kv_capacity_tokens``, vLLM's figure):
prompts that do not fit at once wait for a running one to finish, so with long prompts
in a small budget the run measures what the capacity buys, with a large one the
kernels. The JSON records the command, the machine and the client command; a PNG plots
the ratios.

``--dtype float32`` serves the model in float32 (vLLM's ``--dtype``, every server).
On CPUs without AVX-512 BF16 torch has no fast bf16 matrix multiply, so there a
bfloat16 model's linear layers take most of every run, whatever the KV dtype; float32
ones run at the CPU's float rate. The reference is then ``auto`` (float32 KV): vLLM's CPU
attention answers garbage for a float32 model over a 16-bit cache, and the plugin
refuses that combination at start-up.

``--rounds N`` measures every dtype N times, in turn (the reference, then the others,
then the reference again, ...): a 2-core machine's speed drifts by 10-20% between
minutes, so one run of each says little; each row records its ``round`` and its ratios
are to the reference's row of the same round, and ``summary`` gives per dtype the median
ratio over the rounds with its smallest and largest.

Two launcher settings can be compared in the same run, each dtype once per value:

* ``--preload on,off``: with the launcher's LD_PRELOAD (tcmalloc, Intel OpenMP:
  ``LOWBIT_KV_PRELOAD=1``) and without (``LOWBIT_KV_PRELOAD=0``); each row records the
  launcher's start-up line;
* ``--reserved-cpus launcher,1``: the CPUs vLLM keeps away from its worker, as the
  launcher leaves them (``launcher``: none on a machine of two CPUs or fewer) or N
  (``VLLM_CPU_NUM_OF_RESERVED_CPU=N``; 1 is vLLM's own default for one worker on x86);
  each row records the worker's CPUs from vLLM's log (``worker_cpus``).

A row's ratios are to the reference's with the same settings, and ``x_<setting>_<value>``
(``x_preload_off``, ``x_reserved_cpus_1``) compares a row with the launcher's own value
to the same dtype's row with the other value, of the same round. The defaults, ``on``
and ``launcher``, are the launcher's own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS, machine, portable
from bench.plotting import pyplot, save
from bench.server import REFERENCE_KV_DTYPE, measurement_server

#: vLLM's result fields kept per dtype, and whether higher is better: throughput, the
#: latencies' means and medians, and their 99th percentiles (vLLM's default
#: ``--metric-percentiles``): a step that stalls the decoding requests (another prompt's
#: prefill chunk, many groups encoded at once) shows in p99 inter-token latency (ITL)
METRICS = {"output_throughput": True, "mean_ttft_ms": False, "median_ttft_ms": False,
           "p99_ttft_ms": False, "mean_tpot_ms": False, "median_tpot_ms": False,
           "p99_tpot_ms": False, "median_itl_ms": False, "p99_itl_ms": False, "duration": False}


def client_command(port: int, model: str, served_name: str, args, result_dir: str) -> list[str]:
    """``vllm bench serve`` with random prompts of ``--input-tokens``, all at once."""
    return [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
            "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--served-model-name", served_name, "--dataset-name", "random",
            "--random-input-len", str(args.input_tokens), "--random-output-len",
            str(args.output_tokens), "--num-prompts", str(args.prompts), "--seed", str(args.seed),
            "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", result_dir]


#: launcher setting -> its launcher value first, then the values it can be compared with
SETTINGS = {"preload": ("on", "off"), "reserved_cpus": ("launcher", "N")}
PRELOAD_ENV = {"on": "1", "off": "0"}
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
PRELOAD_LINE = re.compile(r"^lowbit-kv: LD_PRELOAD.*$", re.M)
WORKER_CPUS = re.compile(r"local_rank=0, core ids=(\[[\d, ]*\])")


def setting_values(name: str, text: str) -> list[str]:
    """``--preload on,off`` / ``--reserved-cpus launcher,1``: the values, checked."""
    values = list(dict.fromkeys(text.split(",")))
    launcher, other = SETTINGS[name]
    ok = [launcher, other] if other != "N" else [launcher]
    if not values or any(v not in ok and not (other == "N" and v.isdigit()) for v in values):
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag}: {launcher}, {other} or {launcher},{other}, not {text!r}")
    return values


def server_env(setting: dict) -> dict[str, str | None]:
    """The server's environment for one combination of settings (None: unset)."""
    reserved = setting.get("reserved_cpus", "launcher")
    return {"LOWBIT_KV_PRELOAD": PRELOAD_ENV[setting.get("preload", "on")],
            "LOWBIT_KV_PRELOADED": None, RESERVED_ENV: None if reserved == "launcher" else reserved}


def measure(model: str, dtype: str, args, setting: dict) -> dict:
    server = measurement_server(model, dtype, chunk=args.chunk, max_model_len=args.max_model_len,
                                max_num_seqs=args.prompts, kv_space_gib=args.kv_space_gib,
                                model_dtype=args.dtype, env=server_env(setting))
    with server.start() as s, tempfile.TemporaryDirectory() as d:
        run = subprocess.run(client_command(s.port, model, s.model_name, args, d),
                             capture_output=True, text=True, timeout=3600)
        if run.returncode:
            raise RuntimeError(f"vllm bench serve failed for {dtype}:\n{run.stdout[-3000:]}"
                               f"\n{run.stderr[-3000:]}")
        result = json.loads(next(Path(d).glob("*.json")).read_text())
        impls = s.attention_impls()
        capacity = s.cache_info().get("capacity_tokens")
        log = s.log.read_text()
    line, cpus = PRELOAD_LINE.findall(log), WORKER_CPUS.findall(log)
    ld_preload = portable.portable(line[0]) if line else None  # a repo path as the repo's
    return dict(dtype=dtype, **setting, ld_preload=ld_preload,
                worker_cpus=json.loads(cpus[-1]) if cpus else None, attention_impls=impls,
                kv_capacity_tokens=capacity, completed=result["completed"],
                **{m: result[m] for m in METRICS})


def _same(r: dict, row: dict, keys) -> bool:
    return all(r.get(k) == row.get(k) for k in keys)


def add_ratios(rows: list[dict]) -> None:
    """``x_ref``: to the first row of the same round with the same settings (the reference's);
    ``x_<setting>_<value>`` (``x_preload_off``, ``x_reserved_cpus_1``): a row with the
    launcher's value of that setting to the same dtype's row with the other value, the
    same round and the same other settings."""
    for row in rows:
        ref = next(r for r in rows if _same(r, row, ["round", *SETTINGS]))
        row["x_ref"] = {m: round(row[m] / ref[m], 4) for m in METRICS if ref[m]}
        for name, (launcher, _) in SETTINGS.items():
            if row.get(name, launcher) != launcher:
                continue
            others = ["dtype", "round", *(k for k in SETTINGS if k != name)]
            for r in rows:
                if r.get(name, launcher) != launcher and _same(r, row, others):
                    row[f"x_{name}_{r[name]}"] = {m: round(row[m] / r[m], 4) for m in METRICS if r[m]}


def summarize(rows: list[dict]) -> list[dict]:
    """Per dtype and settings, in the rows' order: its rounds and, per metric, the median of
    its ratios to the reference's (``x_ref``) with the smallest and largest."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["dtype"], *(row.get(k) for k in SETTINGS)), []).append(row)
    return [dict(dtype=key[0], **{k: v for k, v in zip(SETTINGS, key[1:]) if v is not None},
                 rounds=len(mine), **{
        k: {m: round(f([r["x_ref"][m] for r in mine]), 4) for m in mine[0]["x_ref"]}
        for k, f in (("x_ref_median", statistics.median), ("x_ref_min", min),
                     ("x_ref_max", max))}) for key, mine in groups.items()]


def label(row: dict, rows: list[dict]) -> str:
    """The dtype, and each setting the rows vary and this row has off the launcher's value."""
    notes = []
    for name, (launcher, _) in SETTINGS.items():
        value = row.get(name, launcher)
        if len({r.get(name, launcher) for r in rows}) > 1 and value != launcher:
            notes.append("no preload" if name == "preload"
                         else f"{value} CPU{'' if value == '1' else 's'} reserved")
    return row["dtype"] + "".join(f" ({n})" for n in notes)


def plot(summary: list[dict], path: Path, title: str) -> None:
    """Per dtype the median ratio to the reference's, the bar's whisker spanning the rounds."""
    plt = pyplot()
    shown = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.4))
    for ax, m in zip(axes, shown):
        mid = [s["x_ref_median"][m] for s in summary]
        spread = [[x - s["x_ref_min"][m] for x, s in zip(mid, summary)],
                  [s["x_ref_max"][m] - x for x, s in zip(mid, summary)]]
        ax.bar([label(s, summary) for s in summary], mid, yerr=spread, capsize=4,
               color="tab:blue")
        ax.tick_params(axis="x", labelsize=6, rotation=20)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{m} / {summary[0]['dtype']}'s ({'higher' if METRICS[m] else 'lower'} "
                     "is better)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.serve_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtype", default="vidkv",
                   help="measured after the reference (bfloat16; auto with --dtype float32)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="vLLM's --dtype for every server (default: the model's own)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--prompts", type=int, default=8, help="requests, all sent at once")
    p.add_argument("--input-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-space-gib", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every dtype this many times, in turn (ratios per round, medians)")
    p.add_argument("--preload", default="on", help="on, off or on,off: each dtype with the launcher's "
                   "LD_PRELOAD (tcmalloc, Intel OpenMP), without (LOWBIT_KV_PRELOAD=0), or both")
    p.add_argument("--reserved-cpus", default="launcher",
                   help="launcher, N or launcher,N: the CPUs vLLM keeps from its worker as the "
                   "launcher leaves them, N (VLLM_CPU_NUM_OF_RESERVED_CPU), or both")
    p.add_argument("--json", default=str(RESULTS / "serve_client.json"))
    p.add_argument("--png", default=str(RESULTS / "serve_client.png"))
    args = p.parse_args(argv)
    if args.model is None:
        from vllm_lowbit_kv.model import prepare_model
        args.model = str(prepare_model())
    dtypes = list(dict.fromkeys([REFERENCE_KV_DTYPE[args.dtype]] + args.kv_cache_dtype.split(",")))
    try:
        values = {name: setting_values(name, getattr(args, name)) for name in SETTINGS}
    except ValueError as e:
        p.error(str(e))
    settings = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, not {args.rounds}")
    t0 = time.time()
    rows = []
    for round_ in range(args.rounds):
        for dtype in dtypes:
            for setting in settings:
                rows.append(dict(measure(args.model, dtype, args, setting), round=round_))
                print(f"round {round_}, {label(rows[-1], settings)}: "
                      f"{rows[-1]['output_throughput']:.2f} output tok/s, median TTFT "
                      f"{rows[-1]['median_ttft_ms']:.0f} ms, KV cache of "
                      f"{rows[-1]['kv_capacity_tokens']} tokens", file=sys.stderr, flush=True)
    add_ratios(rows)
    summary = summarize(rows)
    result = dict(
        command=portable.command(["python", "-m", "bench.serve_client", *argv], [args.model]),
        client_command=portable.command(
            client_command(0, args.model, "SmolLM2-135M-Instruct", args, "RESULT_DIR"),
            [args.model]).replace("--port 0", "--port PORT"),
        model=portable.model_name(args.model), model_dtype=args.dtype or "the model's own",
        reference=dtypes[0], machine=machine.describe(), rows=rows,
        summary=summary, elapsed_s=round(time.time() - t0, 1))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
    weights = f", {args.dtype} weights" if args.dtype else ""
    plot(summary, Path(args.png), f"vllm bench serve: {args.prompts} random prompts of "
                                  f"{args.input_tokens} tokens, {args.output_tokens} output "
                                  f"tokens, all at once, {args.kv_space_gib} GiB of KV"
                                  f"{rounds}{weights} ({result['machine']['cpu']})")
    for r in rows:
        print(f"round {r['round']}, {label(r, rows):>22}: output tok/s "
              f"x{r['x_ref']['output_throughput']:.2f}, median TTFT "
              f"x{r['x_ref']['median_ttft_ms']:.2f}, median TPOT x{r['x_ref']['median_tpot_ms']:.2f}"
              f", p99 ITL x{r['x_ref']['p99_itl_ms']:.2f}"
              + "".join(f", {m} x{r[k][m]:.2f} of {k[2:]}'s" for k in r if k.startswith("x_")
                        and k != "x_ref" for m in ("output_throughput", "median_tpot_ms")))
    for s in summary:
        lo, mid, hi = (s[k]["output_throughput"] for k in ("x_ref_min", "x_ref_median", "x_ref_max"))
        print(f"{label(s, summary):>22}: output tok/s x{mid:.2f} of {dtypes[0]}'s (median of {s['rounds']}"
              f" rounds; {lo:.2f}-{hi:.2f})")
    return result


if __name__ == "__main__":
    main()

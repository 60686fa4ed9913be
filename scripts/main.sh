#!/usr/bin/env bash
# Set up (idempotent) and start the main job: vLLM's OpenAI-compatible server on
# the embedded SmolLM2 (served as SmolLM2-135M-Instruct) with the paged KV cache
# stored by the vidkv scheme, on 127.0.0.1:8000. The defaults (loopback only,
# 2 GiB of KV cache, vidkv, eager mode, 32 sequences) are python -m serving's own
# (serving/__main__.py); arguments go to it, so to vLLM, and override them, e.g.
# `bash scripts/main.sh --port 9000 --kv-cache-dtype kivi2`,
# `bash scripts/main.sh --lowbit-config my.json` or `--host 0.0.0.0` to serve the
# network. Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m serving "$@"

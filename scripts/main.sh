#!/usr/bin/env bash
# Set up (idempotent) and start the main job: vLLM's OpenAI-compatible server on
# the embedded SmolLM2 with the paged KV cache stored by the vidkv scheme.
# Extra arguments go to `python -m serving` (so to vLLM): they override the
# defaults below, e.g. `bash scripts/main.sh --port 9000 --kv-cache-dtype kivi2`
# or `bash scripts/main.sh --lowbit-config my.json`. Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# CPU defaults: 2 GiB of KV cache (vLLM's CPU build reads this variable), eager
# mode (skips ~60 s of torch.compile warm-up), the model's full 8K context, and
# 32 concurrent sequences (each running sequence gets bf16 staging slots for its
# residual window and partial last group, paid from the KV budget).
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
exec .venv/bin/python -m serving --kv-cache-dtype vidkv --host 127.0.0.1 --port 8000 \
    --enforce-eager --max-model-len 8192 --max-num-seqs 32 "$@"

#!/usr/bin/env bash
# The GPU checks in one command, for a machine with CUDA (no vLLM needed):
#   1. every test marked `gpu` (kernels against the CPU reference, the paged forward on
#      CUDA against the CPU, SmolLM2 through the paged path on CUDA);
#   2. SmolLM2 through the paged path with each GPU implementation, recorded in
#      bench/results/gpu_forward.json with the device's name.
# The model folder comes from MODEL (or vllm_lowbit_kv.model.prepare_model()).
# --dry-run: print the commands, then run step 2 on the CPU for 512 tokens (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
TESTS=("$PY" -m pytest -q -m gpu tests/)
FORWARD=("$PY" -m bench.paged_forward --device cuda --attention-impl cuda,triton,torch
         "${MODEL_ARGS[@]}" --json bench/results/gpu_forward.json)
if [ "${1:-}" = "--dry-run" ]; then
    echo "would run: ${TESTS[*]}"
    echo "would run: ${FORWARD[*]}"
    exec "$PY" -m bench.paged_forward --device cpu --tokens 512 "${MODEL_ARGS[@]}"
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA device (use --dry-run on the CPU)')"
"${TESTS[@]}"
"${FORWARD[@]}"

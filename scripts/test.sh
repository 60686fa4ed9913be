#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; arguments go to pytest:
#   bash scripts/test.sh -m "not slow"    # the fast subset: no vLLM server starts
#   bash scripts/test.sh -n 0 -s tests/test_kivi.py   # one process (pdb, -s)
# The tests run in LOWBIT_KV_TEST_WORKERS processes (default: 2, at most the CPUs; pytest-xdist),
# whole modules at a time, the modules of the session's shared server as one (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cpus=$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')
workers=${LOWBIT_KV_TEST_WORKERS:-$(( cpus < 2 ? cpus : 2 ))}
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadscope --no-loadscope-reorder "$@"

#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; arguments go to pytest:
#   bash scripts/test.sh -m "not slow"    # the fast subset: no vLLM server starts
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the quality yardstick on the
# embedded model. Extra arguments go to `python -m bench.quality`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- --kv-cache-dtype vidkv,kivi2 --passkey-lengths 1024,2048
fi
exec .venv/bin/python -m bench.quality "$@"

#!/usr/bin/env bash
# README command two: install from scratch, then run the whole test suite (CPU; GPU tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"

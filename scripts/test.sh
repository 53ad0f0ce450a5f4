#!/usr/bin/env bash
# README command two (what .ci/run runs): install, then run the whole test suite (CPU; GPU tests skip).
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast tier (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m pytest -q -p no:cacheprovider --durations=15 tests "$@"

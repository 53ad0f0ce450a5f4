#!/usr/bin/env bash
# README command two (what .ci/run runs): install, then run the whole test suite (CPU; GPU tests skip).
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast tier (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
# Two pytest workers (pytest-xdist, each test file whole on one worker): a torchrun test leaves about half of two
# cores idle (rendezvous, process start-up and exit), so two at a time end the suite sooner. TEST_WORKERS=N sets
# the number, TEST_WORKERS=0 runs everything in this one process.
WORKERS=${TEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
"$PY" -m pytest -q -p no:cacheprovider --durations=40 ${XDIST[@]+"${XDIST[@]}"} tests "$@"

#!/usr/bin/env bash
# Install llamapipe and its test extra. A CPU torch build is pinned only when torch is absent, so a
# machine that already has (a CUDA) torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi
"$PY" -m pip install -e ".[test]"

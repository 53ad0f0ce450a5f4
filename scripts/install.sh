#!/usr/bin/env bash
# Install llamapipe (editable) with its test extra, and torch first when it is missing.
#
# torch from PyPI is the CUDA build on Linux (a 527 MB wheel plus several GB of CUDA libraries), so a
# missing torch is taken from PyTorch's CPU wheel index unless TORCH_INDEX_URL says otherwise:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 bash scripts/install.sh   # a CUDA build
#   TORCH_INDEX_URL=pypi bash scripts/install.sh                                     # whatever pip's index serves
# When the CPU index cannot be reached within a few seconds (a machine that reaches only a package
# mirror), torch==2.13.0 comes from pip's configured index instead. An installed torch 2.5 or newer,
# CPU or CUDA, is kept. The last line says which build is in use.
#
# A second run is quick: when this Python already has llamapipe installed editable from this checkout with the
# same pyproject.toml (a stamp in its site-packages records that), nothing is reinstalled. FORCE_INSTALL=1
# reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP_DIR=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
STAMP="$STAMP_DIR/llamapipe-install.stamp"
WANT="$(pwd) $("$PY" -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")"

report() {
  "$PY" - <<'PY'
import torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
gpus = torch.cuda.device_count() if torch.version.cuda else 0
print(f"install: torch {torch.__version__} ({build}; {gpus} GPU(s) visible)")
PY
}

if [ "${FORCE_INSTALL:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
   && "$PY" -c "import llamapipe, torch, pytest" 2>/dev/null; then
  echo "install: up to date (llamapipe installed from $(pwd), pyproject.toml unchanged; FORCE_INSTALL=1 reinstalls)"
  report
  exit 0
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}

reachable() {  # a quick probe, so an unreachable index costs seconds, not pip's retries
  "$PY" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)
PY
}

has_torch() {
  "$PY" -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 5))" 2>/dev/null
}

if ! has_torch; then
  if [ "$TORCH_INDEX_URL" != pypi ] && reachable "$TORCH_INDEX_URL"; then
    echo "install: $TORCH_SPEC from $TORCH_INDEX_URL"
    "$PY" -m pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
  else
    [ "$TORCH_INDEX_URL" = pypi ] || echo "install: $TORCH_INDEX_URL not reachable; $TORCH_SPEC from pip's configured index"
    "$PY" -m pip install "$TORCH_SPEC"
  fi
fi
"$PY" -m pip install -q -e ".[test]"
echo "$WANT" > "$STAMP"
"$PY" - <<'PY'
from importlib.metadata import version
names = ("pytest", "transformers", "datasets", "tokenizers", "sentencepiece", "numpy", "safetensors", "matplotlib")
print("install: " + ", ".join(f"{n} {version(n)}" for n in names))
PY
report

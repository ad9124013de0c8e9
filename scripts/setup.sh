#!/usr/bin/env bash
# Install tierio (editable) with the given extras, using a CPU build of torch.
# Usage: scripts/setup.sh [EXTRAS]     e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
if ! "$PY" -c "import torch" 2>/dev/null; then
    # Pin the CPU wheel explicitly so the resolver never reaches for a CUDA build.
    "$PY" -m pip install -q "torch==2.13.0"
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"$PY" -m pip install -q -e "$spec"

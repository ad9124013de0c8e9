#!/usr/bin/env bash
# Set up (package + test extras) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec "${PYTHON:-python3}" -m pytest -q "$@"

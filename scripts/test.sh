#!/usr/bin/env bash
# Set up (package + test extras) and run the whole test suite. Extra arguments go to pytest.
# Two workers (TIERIO_TEST_WORKERS; 0 runs in this process): many tests wait on child processes,
# servers and disks, so two at a time keep both cores busy.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec "${PYTHON:-python3}" -m pytest -q -n "${TIERIO_TEST_WORKERS:-2}" "$@"

#!/usr/bin/env bash
# Set up tierio and run its demo: train, checkpoint asynchronously to three tiers, lose the
# local disk, restore from the next tier, resume bit-exact. Extra arguments go to `tierio demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec tierio demo "$@"

#!/usr/bin/env bash
# Benchmarks of two commits in interleaved rounds, on this machine, in one run: did a change slow
# anything down? Each round runs every benchmark once from each commit, the order alternating, so
# both sides meet the same mix of the disk's states (its speed changes within minutes).
#
# Usage: scripts/compare-commits.sh BASE [ROUNDS] [OUT]     e.g. scripts/compare-commits.sh b9cc987 2
#   BASE    the commit to compare the working tree against
#   ROUNDS  rounds (default 2)
#   OUT     where the JSON of every run goes (default: a new temporary directory); ROUND0=1 numbers
#           the rounds 11, 12, ... so a second call adds rounds to the same OUT
# Then: python3 scripts/compare-summary.py OUT     (a table of the ratios, base against this tree)
#
# The benchmarks: `tierio bench ckpt`, `bench weights` and `bench kv` at sizes that take a few
# minutes each (override with BENCH_CKPT, BENCH_WEIGHTS, BENCH_KV; BENCHES="ckpt kv" runs only those).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/compare-commits.sh BASE [ROUNDS] [OUT]}
rounds=${2:-2}
out=${3:-$(mktemp -d -t tierio-compare-XXXX)}
PY=${PYTHON:-python3}
mkdir -p "$out"
tree=$(mktemp -d -t tierio-base-XXXX)
git worktree add -q --detach "$tree" "$base"
trap 'git worktree remove --force "$tree"' EXIT

declare -A args=(
  [ckpt]=${BENCH_CKPT:---no-integrations --size 512MiB --repeat 3}
  [weights]=${BENCH_WEIGHTS:---size 512MiB --repeat 3}
  [kv]=${BENCH_KV:---dram-size 512MiB --nvme-size 512MiB --no-model}
)
sides=("base:$tree/src" "head:$PWD/src")
for ((r = 1; r <= rounds; r++)); do
  for bench in ${BENCHES:-ckpt weights kv}; do
    order=("${sides[@]}")
    (( (r + ${#bench}) % 2 )) && order=("${sides[1]}" "${sides[0]}")
    for side in "${order[@]}"; do
      name=${side%%:*} src=${side#*:}
      echo "round $r: bench $bench ($name)" >&2
      # shellcheck disable=SC2086 # the arguments are words
      PYTHONPATH="$src" "$PY" -m tierio bench "$bench" ${args[$bench]} --json > "$out/$bench.$name.${ROUND0:-0}$r.json"
    done
  done
done
echo "$out"

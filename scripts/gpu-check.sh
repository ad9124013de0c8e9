#!/usr/bin/env bash
# What "verified on a GPU" means for tierio. On a machine with CUDA (no network needed), in at most
# 8 minutes: install tierio from this tree and the wheels brought along; run every GPU-marked test
# (each GPU path checked byte for byte against the CPU path's); measure the GPU paths (JSON into
# $OUT); run the framework checks that need a GPU; print one summary table. Exit status: the number
# of failed checks (0: all passed or skipped with a reason).
#
#   OUT=/some/dir scripts/gpu-check.sh      (default OUT: ./gpu-check-out; logs and gpu-bench.json go there)
#
# The wheels: gpu-wheels/ (git-ignored, about 26 MiB; carried along with the tree), filled on a
# machine that reaches PyPI by the command at the top of scripts/gpu-wheels.txt. Without the folder
# whatever is installed is used, and GDS is reported as not run.
# shellcheck disable=SC2317  # the functions run through check (bash -c), which shellcheck cannot follow
set -uo pipefail
OUT="$(realpath -m "${OUT:-$(dirname "$0")/../gpu-check-out}")"
cd "$(dirname "$0")/.." || exit 1
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$PWD/gpu-wheels}"
BUDGET="${GPU_CHECK_SECONDS:-480}"  # every check's time limit is cut to what is left of this
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
# On the tree's disk, not /tmp (often tmpfs): the weight loads read a real filesystem, cold.
WORK="$(mktemp -d "${GPU_CHECK_DIR:-$PWD}/.gpu-check-XXXX")"
trap 'rm -rf "$WORK"' EXIT
END=$((SECONDS + BUDGET))
ROWS="$WORK/rows"
fails=0

row() { printf '%-4s  %-44s %s\n' "$1" "$2" "$3" >>"$ROWS"; }

check() {  # check NAME SECONDS COMMAND...: PASS on status 0, SKIP on 77, FAIL otherwise; the row shows the last line
  # COMMAND may be a function of this script: every function and setting below is exported for it.
  local name="$1" limit="$2" left=$((END - SECONDS)) log="$OUT/$1.log" rc
  shift 2
  if [ "$left" -lt 15 ]; then row FAIL "$name" "not started: the ${BUDGET}s budget is spent"; fails=$((fails + 1)); return; fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "== $name (at most ${limit}s)"
  timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" >"$log" 2>&1; rc=$?
  case "$rc" in
    0) row PASS "$name" "$(tail -n 1 "$log")" ;;
    77) row SKIP "$name" "$(tail -n 1 "$log")" ;;
    124 | 137) row FAIL "$name" "timed out after ${limit}s ($log)"; fails=$((fails + 1)) ;;
    *) row FAIL "$name" "status $rc ($log)"; tail -n 20 "$log" | sed 's/^/    /'; fails=$((fails + 1)) ;;
  esac
}

# -- the machine and the installs ------------------------------------------------------------------
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "FAIL cuda: torch.cuda.is_available() is False: nothing on this machine to verify"; exit 1; }
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch; print(torch.cuda.device_count(), "x", torch.cuda.get_device_name(0), "torch", torch.__version__, "CUDA", torch.version.cuda)' | tee "$OUT/machine.txt"
df -T "$WORK" >"$OUT/disk.txt"
CUDA_MAJOR="$("$PY" -c 'import torch; print(torch.version.cuda.split(".")[0])')"
export PY WHEELS WORK CUDA_MAJOR

export PIP_BREAK_SYSTEM_PACKAGES=1  # a lent machine's Python may be the system's; it is wiped after the run
offline() { "$PY" -m pip install --no-index --find-links "$WHEELS" --disable-pip-version-check "$@"; }
install_tierio() {  # editable, no dependencies; the build backend from the folder (or the installed one)
  if [ -d "$WHEELS" ]; then offline --no-deps -e .; else "$PY" -m pip install --no-build-isolation --no-deps -e .; fi
}
install_wheels() {  # what tierio and the tests import; pip takes from the folder only what is missing
  [ -d "$WHEELS" ] || { echo "no $WHEELS folder: using what is installed"; return 77; }
  offline boto3 pytest pytest-timeout
}
install_kvikio() {  # the CUDA 12 or 13 build, matching torch; CuPy and cuFile are the machine's own
  [ -d "$WHEELS" ] || { echo "no $WHEELS folder: GDS is not run"; return 77; }
  offline --no-deps "kvikio-cu$CUDA_MAJOR" "libkvikio-cu$CUDA_MAJOR" rapids-logger cuda-pathfinder \
    || { echo "kvikio-cu$CUDA_MAJOR did not install: GDS is not run"; return 77; }
}
gds_mode() {  # SKIP (with kvikio's own error) when GDS cannot run; else say which mode will run
  "$PY" -c '
import sys
from tierio.io import gds
try:
    import kvikio  # noqa: F401 - the error says why GDS cannot run
except Exception as exc:
    msg = " ".join(str(exc).split())[:200]
    print(f"kvikio does not import ({msg}): GDS is not run"); sys.exit(77)
print("GDS", "in compatibility mode (POSIX reads, no GPUDirect)" if gds.compat_mode() else "with GPUDirect")
sys.exit(0 if gds.available() else 77)'
}
export -f offline install_tierio install_wheels install_kvikio gds_mode
check install-tierio 120 install_tierio
check install-wheels 120 install_wheels
check install-kvikio 60 install_kvikio
check gds-mode 60 gds_mode

# -- the GPU-marked tests: every accelerator path against the CPU path's bytes ---------------------
check pytest-gpu 180 "$PY" -m pytest -q -rA -m gpu -p no:cacheprovider --timeout=150 tests/test_gpu_paths.py tests/test_gpu_nccl.py
grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' "$OUT/pytest-gpu.log" 2>/dev/null | sed 's/^/      /' >>"$ROWS"

# -- the benchmarks ---------------------------------------------------------------------------------
check bench-gpu 200 "$PY" -m tierio.bench.gpu --out "$OUT" --dir "$WORK"

# -- framework runs on the GPU (scripts/gpu_frameworks.py) -----------------------------------------
port() { "$PY" -c 'from tierio.storage.seaweed import free_port; print(free_port())'; }
run1() { "$PY" -m torch.distributed.run --nproc_per_node 1 --master_addr 127.0.0.1 --master_port "$(port)" "$@"; }
frameworks() { run1 scripts/gpu_frameworks.py "$@"; }
needs() {  # SKIP a check whose framework is not installed (torchrun would turn a child's 77 into 1)
  local m; for m in "$@"; do "$PY" -c "import $m" 2>/dev/null || { echo "$m is not installed: not run"; return 77; }; done
}
hf_fsdp2() { needs transformers accelerate && frameworks hf-fsdp2 "$WORK/hf" save && frameworks hf-fsdp2 "$WORK/hf" resume; }
hf_deepspeed() { needs deepspeed transformers accelerate && frameworks hf-deepspeed "$WORK/ds"; }
lightning_mp() {  # the CPU test's job (tests/training_jobs.py) over NCCL on the GPU: saved, resumed, compared
  local tiers="[\"$WORK/pl/t0\"]"
  needs lightning || return
  TIERIO_JOB_ACCELERATOR=gpu run1 tests/training_jobs.py lightning-fsdp "$WORK/pl" --tiers "$tiers" --length 2 \
    && TIERIO_JOB_ACCELERATOR=gpu run1 tests/training_jobs.py lightning-fsdp "$WORK/pl" --tiers "$tiers" --length 3 --resume \
    && "$PY" scripts/gpu_frameworks.py pl-compare "$WORK/pl"
}
lightning_fsdp1() { needs lightning && frameworks pl-fsdp1 "$WORK/pl1"; }
export -f port run1 frameworks needs hf_fsdp2 hf_deepspeed lightning_mp lightning_fsdp1
check hf-trainer-fsdp2-save-resume 90 hf_fsdp2
check hf-trainer-deepspeed-refused 60 hf_deepspeed
check lightning-model-parallel-save-resume 90 lightning_mp
check lightning-fsdp1-full-through-plugin 60 lightning_fsdp1

# -- one summary table ------------------------------------------------------------------------------
echo
echo "gpu-check: $(cat "$OUT/machine.txt"), work on $(df --output=fstype "$WORK" | tail -n 1), ${SECONDS}s"
cat "$ROWS"
[ -f "$OUT/gpu-bench.json" ] && "$PY" -m tierio.bench.gpu --table "$OUT/gpu-bench.json" | sed 's/^/      /'
cp "$ROWS" "$OUT/summary.txt"
echo "gpu-check: $fails failed (logs and gpu-bench.json in $OUT)"
exit "$fails"

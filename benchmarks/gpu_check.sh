#!/usr/bin/env bash
# Everything a GPU machine should run, in one go, inside 10 minutes on one H100/H200:
#   1. what the machine is (nvidia-smi, zengine-report: torch, CUDA, kernels),
#   2. the CUDA suite (tests/cuda: NCCL at W=1, and the W=2 cases where the machine allows),
#   3. the main job (examples/train_gpt.py) on --num_gpus 1 for 50 steps,
#   4. benchmarks/bench_gpu.py at a size that fits the time left (BENCH_ARGS overrides it).
#
#     bash benchmarks/gpu_check.sh            # logs under runs/gpu_check/ (or $OUT when set)
#
# Each part runs under its own time limit and a failing part does not stop the next; the exit
# status is non-zero when any part failed. Missing Python packages (pydantic, hjson on an image
# that has torch only) can travel as wheels in .whl/: they are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
failed=()

part() {  # part NAME LIMIT_S COMMAND...: run one part with its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name: rc=$rc, $((SECONDS - start)) s"
  [ "$rc" = 0 ] || failed+=("$name")
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -m zengine.ops.report; } \
  > "$OUT/machine.log" 2>&1
head -n 40 "$OUT/machine.log"
part cuda_tests "${TEST_LIMIT:-300}" python3 -m pytest tests/cuda -q -rfEs -p no:cacheprovider
part main_job "${JOB_LIMIT:-120}" python3 -m zengine.launcher.runner --num_gpus 1 examples/train_gpt.py \
  --deepspeed_config configs/zero2.json --steps 50 --print_every 10
if [ -f benchmarks/bench_gpu.py ]; then
  # shellcheck disable=SC2086
  part bench_gpu "${BENCH_LIMIT:-240}" python3 benchmarks/bench_gpu.py --out "$OUT" ${BENCH_ARGS:---steps 10 --warmup 3}
fi
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "ALL PASSED"

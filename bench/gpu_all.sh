#!/usr/bin/env bash
# Every GPU check in one go (make test-gpu): the GPU tests, then the four GPU benches, each with its
# own time limit inside one overall budget, so one that hangs does not starve the rest. Each step's
# whole output goes to $LOGS/<step>.log; a table of the steps is printed last. Exit status: 0 when
# every step passed, 1 when one failed, 2 when there is no CUDA GPU here.
#
#   PY=.venv/bin/python BUDGET_S=900 LOGS=.gpuherd/gpu-logs [ONLY="tests memory"] bench/gpu_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-900}
LOGS=${LOGS:-.gpuherd/gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA GPU here: the GPU tests and benches need one (they skip in make test)"
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv \
  | tee "$LOGS/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", torch.cuda.nccl.version())' \
  | tee -a "$LOGS/gpu.txt"

start=$(date +%s)
summary=()
failed=0

# step NAME LIMIT_S COMMAND...: runs COMMAND with at most LIMIT_S (less if the budget has less left).
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then
    summary+=("$(printf '%-16s %-8s %6s' "$name" "skipped" "-")")
    return
  fi
  local left=$((BUDGET_S - ($(date +%s) - start)))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    summary+=("$(printf '%-16s %-8s %6s' "$name" "not run" "-")")
    failed=1
    return
  fi
  local t0 rc
  t0=$(date +%s)
  echo "== $name (at most ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  tail -n 60 "$LOGS/$name.log"
  local verdict=passed
  if ((rc == 124 || rc == 137)); then verdict="timeout"; elif ((rc != 0)); then verdict="rc=$rc"; fi
  [[ $verdict == passed ]] || failed=1
  summary+=("$(printf '%-16s %-8s %5ss' "$name" "$verdict" "$(($(date +%s) - t0))")")
}

step tests 240 "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/gpu
step smoke 180 "$PY" bench/gpu_smoke.py --steps 200
step memory 180 "$PY" bench/bench_memory.py --repeats 5
step profile 180 "$PY" bench/bench_profile.py --device cuda
step elastic 240 "$PY" bench/bench_elastic.py --device cuda --backend "${ELASTIC_BACKEND:-gloo}" --repeats "${ELASTIC_REPEATS:-2}" --wait-s 60

echo
printf '%-16s %-8s %6s\n' step verdict time
printf '%s\n' "${summary[@]}"
exit $failed

#!/usr/bin/env bash
# Offline check of fa2 on a GPU box without network: install local wheels, build fa2, run the tests and the
# benchmark, and keep every log.
#
#   bash bench/gpu_check.sh WHEELDIR LOGDIR
#
# WHEELDIR holds the build-time wheels the box lacks (nvidia-cutlass==4.2.0.0); the box's own torch,
# scikit-build-core, pybind11, pytest and triton are used. Environment:
#   FA2_HEAD_DIMS / FA2_DTYPES / FA2_CUDA_ARCHS   trim the build (see README)
#   PYTEST_ARGS   extra pytest arguments (default: -q -x)
#   BENCH_ARGS    arguments for bench/bench.py (default: its full sweep); BENCH=0 skips the benchmark
set -uo pipefail
wheels=${1:?usage: gpu_check.sh WHEELDIR LOGDIR}
logs=${2:?usage: gpu_check.sh WHEELDIR LOGDIR}
mkdir -p "$logs"
summary="$logs/summary.txt"
: > "$summary"
status=0
step() {  # step NAME LOGFILE COMMAND...: run, time, record, keep going
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" > "$logs/$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$summary"
  tail -n 5 "$logs/$log"
  [ $rc -eq 0 ] || status=1
  return $rc
}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
step wheels wheels.log python3 -m pip install --no-index --no-deps "$wheels"/*.whl
step build build.log python3 -m pip install -v --no-index --no-build-isolation --no-deps . || { cat "$summary"; exit 1; }
step info info.log python3 -c "import torch, fa2; print(torch.cuda.get_device_name(), fa2.build_info())"
cat "$logs/info.log"
# shellcheck disable=SC2086
step tests tests.log python3 -m pytest ${PYTEST_ARGS:--q -x} tests
if [ "${BENCH:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  step bench bench.log python3 bench/bench.py ${BENCH_ARGS:-} --out "$logs/bench.jsonl"
fi
cat "$summary"
exit $status

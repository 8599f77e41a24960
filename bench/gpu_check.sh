#!/usr/bin/env bash
# Offline check of fa2 on a GPU box without network: install the carried wheels, build and install fa2,
# print build_info, run the tests, run the benchmark; keep every log and the time of every step.
#
#   bash bench/gpu_check.sh WHEELDIR LOGDIR
#
# WHEELDIR holds the build-time wheels the box lacks (nvidia-cutlass==4.2.0.0); the box's own torch,
# scikit-build-core, pybind11, cmake, ninja, pytest and triton are used (--no-build-isolation).
# LOGDIR receives env.log, wheels.log, build.log, info.log, tests.log, bench.log, bench.jsonl and
# summary.txt (one line per step: exit code and seconds). Environment:
#   FA2_HEAD_DIMS / FA2_DTYPES / FA2_CUDA_ARCHS / FA2_PTXAS_VERBOSE   trim or instrument the build (README)
#   CMAKE_BUILD_PARALLEL_LEVEL   compile jobs (default: nproc)
#   PYTEST_ARGS   pytest arguments (default: -q)       TESTS=0 skips the tests
#   BENCH_ARGS    bench/bench.py arguments (default: its full sweep)   BENCH=0 skips the benchmark
#   PYTHON        interpreter (default: python3)
# Exit status: 0 if every step that ran passed. A failed build skips the steps that need it (they would
# otherwise test a previously installed fa2); a failed test run still lets the benchmark run.
set -uo pipefail

wheels=${1:?usage: gpu_check.sh WHEELDIR LOGDIR}
logs=${2:?usage: gpu_check.sh WHEELDIR LOGDIR}
mkdir -p "$logs" && logs=$(cd "$logs" && pwd)
wheels=$(cd "$wheels" && pwd) || { echo "gpu_check: no wheel dir $1" >&2; exit 2; }
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
summary=$logs/summary.txt
: > "$summary"
status=0
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

note() { echo "$*" | tee -a "$summary"; }

# step NAME LOG QUIET COMMAND...: run COMMAND with output into LOGDIR/LOG (and the console unless QUIET=1;
# then its first errors and tail on failure), record exit code and seconds. Returns the command's exit code.
step() {
  local name=$1 log=$logs/$2 quiet=$3 t0=$SECONDS rc
  shift 3
  echo "=== $name: $*" | tee "$log"
  if [ "$quiet" = 1 ]; then
    "$@" >> "$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then  # the first errors (a compile error may lie far above the tail), then the tail
      grep -n -m 20 -E "error|Error|FAILED" "$log"
      echo "--- last lines of $log:"
      tail -n 30 "$log"
    fi
  else
    "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  fi
  note "$(printf '%-7s rc=%-3s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$log")"
  [ $rc -eq 0 ] || status=1
  return $rc
}

environment() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  command -v nvcc && nvcc --version | tail -n 2
  cmake --version | head -n 1
  "$py" - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "scikit-build-core", "pybind11", "nvidia-cutlass", "pytest", "ninja", "cmake"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (not installed)")
EOF
  env | grep -E '^(FA2_|CMAKE_BUILD_PARALLEL_LEVEL|CUDAARCHS|CUDACXX)' | sort
  git rev-parse --short HEAD 2>/dev/null && git status --short | head -n 20
  return 0  # a description of the machine, never a failure
}

note "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd); logs in $logs"
step env env.log 0 environment
shopt -s nullglob
whl=("$wheels"/*.whl)
if [ ${#whl[@]} -gt 0 ]; then
  step wheels wheels.log 0 "$py" -m pip install --no-index --no-deps "${whl[@]}"
else
  note "wheels: none in $wheels (expected nvidia-cutlass==4.2.0.0)"
fi

if step build build.log 1 "$py" -m pip install -v --no-index --no-build-isolation --no-deps .; then
  grep -E "fa2 [0-9.]+: head dims|CUTLASS headers from" "$logs/build.log" | tee -a "$summary"
  step info info.log 0 "$py" -c "import torch, fa2; print(fa2.build_info()); print(torch.cuda.get_device_name())"
  if [ "${TESTS:-1}" != 0 ]; then
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
    step tests tests.log 0 "$py" -m pytest ${PYTEST_ARGS:--q} tests
  fi
  if [ "${BENCH:-1}" != 0 ]; then
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    step bench bench.log 0 "$py" bench/bench.py ${BENCH_ARGS:-} --out "$logs/bench.jsonl"
    if [ -s "$logs/bench.jsonl" ] && "$py" -c "import matplotlib" 2>/dev/null; then
      step plot plot.log 0 "$py" bench/plot.py "$logs/bench.jsonl" -o "$logs/bench.png"
    fi
  fi
else
  note "build failed: info, tests and bench skipped (see the tail above and $logs/build.log)"
fi

echo "=== summary ($summary)"
cat "$summary"
exit $status

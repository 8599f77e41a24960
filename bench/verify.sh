#!/usr/bin/env bash
# One device call that lands a kernel change: build, test, sanitize and measure the working tree, all under a
# deadline so the call ends inside the device's 10-minute limit. Needs the nvidia-cutlass wheel in .whl/.
#
#   run(command="bash bench/verify.sh full", carry=[".whl"])    # ~9 min on the H100 box
#   run(command="AB_FLAGS=-DSOME_KNOB=1 bash bench/verify.sh ab-bwd", carry=[".whl"])
#
# full: FA2_CUDA_ARCHS=90 install (all head dims and dtypes), the GPU test suite, compute-sanitizer memcheck
#       and racecheck, then bench/bench.py --hdims 64,128 with its plot, then as time allows --hdims 96,256
#       and the batch-1 inference shapes (32 heads, d128, 1k-8k).
# ab-bwd: backward A/B (bench/ab.py, 64/128 bf16, bwd) of the tree as it is ("base") against a variant: the tree
#       with the patch AB_PATCH applied and/or built with CMAKE_CUDA_FLAGS=AB_FLAGS ("variant"). v9's
#       run (results/h100-2026-11-23-v9-ab3-bwd.txt) compared three builds this way.
# FA2_CUDA_FLAGS is passed to the full build; BENCH_ARGS replaces its first bench.py's arguments;
# VERIFY_SECONDS (default 570) is the deadline. Everything lands in $OUT/verify-<mode>.tgz, re-packed after each
# step, so a call that runs out of time still returns what it finished (the device returns at most 8 files).
set -uo pipefail
mode=${1:?usage: verify.sh full|ab-bwd}
case $mode in full|ab-bwd) ;; *) echo "verify.sh: unknown mode '$mode'"; exit 2 ;; esac
cd "$(dirname "$0")/.."
deadline=$((SECONDS + ${VERIFY_SECONDS:-570}))
out=$OUT/verify-$mode && mkdir -p "$out"
pack() { (cd "$OUT" && tar czf "verify-$mode.tgz.tmp" "verify-$mode" && mv "verify-$mode.tgz.tmp" "verify-$mode.tgz"); }
# left CAP: seconds a step may take, at most CAP and what is left before the deadline (0: skip it)
left() { local l=$((deadline - SECONDS - 10)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -gt 20 ] && echo "$l" || echo 0; }
timed() {  # NAME CAP LOG COMMAND...
  local name=$1 cap; cap=$(left "$2"); local log=$out/$3; shift 3
  if [ "$cap" = 0 ]; then echo "$name: skipped (no time left)"; return; fi
  local t0=$SECONDS; timeout "$cap" "$@" > "$log" 2>&1; echo "$name: rc $? in $((SECONDS - t0)) s"; pack
}
python3 -m pip install -q --no-index --no-deps .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1

if [ "$mode" = full ]; then
  t0=$SECONDS
  FA2_CUDA_ARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index --no-build-isolation \
    --no-deps -Ccmake.define.FA2_PTXAS_VERBOSE=ON -Ccmake.define.CMAKE_CUDA_FLAGS="${FA2_CUDA_FLAGS:-}" . \
    > "$out/build.log" 2>&1 || { echo "build failed"; grep -m 20 -E "error" "$out/build.log"; pack; exit 1; }
  echo "build: $((SECONDS - t0)) s"
  timed tests 240 tests.log python3 -m pytest -q -p no:cacheprovider tests; tail -2 "$out/tests.log"
  timed memcheck 90 memcheck.log compute-sanitizer --tool memcheck python3 bench/sanitize.py
  timed racecheck 90 racecheck.log compute-sanitizer --tool racecheck python3 bench/sanitize.py --quick
  tail -qn 1 "$out/memcheck.log" "$out/racecheck.log"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  timed bench-64-128 200 bench.txt python3 bench/bench.py ${BENCH_ARGS:---hdims 64,128} --out "$out/bench.jsonl"
  python3 bench/plot.py "$out/bench.jsonl" > "$out/plot.log" 2>&1
  timed bench-96-256 200 bench-96-256.txt python3 bench/bench.py --hdims 96,256 --seqlens 512,2048,8192 \
    --out "$out/bench-96-256.jsonl"
  timed bench-b1h32 100 bench-b1h32.txt python3 bench/bench.py --hdims 128 --batch 1 --nheads 32 \
    --seqlens 1024,2048,4096,8192 --out "$out/bench-b1h32.jsonl"
else
  build() {  # name "flags" [source dir]
    cmake -S "${3:-.}" -B "build/$1" -G Ninja -DFA2_HEAD_DIMS=64,128 -DFA2_DTYPES=bf16 -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DFA2_PTXAS_VERBOSE=ON "-DCMAKE_CUDA_FLAGS=$2" > "$out/cfg-$1.log" 2>&1 &&
      cmake --build "build/$1" -j 6 > "$out/build-$1.log" 2>&1
    echo "build $1: rc $?"
  }
  t0=$SECONDS
  src=.
  if [ -n "${AB_PATCH:-}" ]; then
    src=build/src-variant && rm -rf "$src" && mkdir -p "$src" && cp -r CMakeLists.txt pyproject.toml csrc python "$src"/
    (cd "$src" && patch -p1 < "$OLDPWD/$AB_PATCH") > "$out/patch.log" 2>&1 || { echo "patch failed"; cat "$out/patch.log"; exit 2; }
  fi
  build base "" & build variant "${AB_FLAGS:-}" "$src" & wait
  echo "builds: $((SECONDS - t0)) s"
  for f in "$out"/build-*.log; do echo "== $f"; grep -E "Compiling entry|registers|spill stores" "$f"; done > "$out/ptxas.txt"
  timed ab-bwd 420 ab-bwd.txt python3 bench/ab.py --builds base=build/base,variant=build/variant \
    --hdims 64,128 --dtype bf16 --modes bwd --rounds 2 --seqlens 1024,4096,16384
fi
pack
ls -la "$OUT"

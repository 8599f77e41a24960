#!/usr/bin/env bash
# One device call that measures, or tests, bench/experiments/v9-fwd.patch (bench/NOTES.md v9), on a copy of
# the repo (the device's copy: the patch is applied there, not here). Needs the nvidia-cutlass wheel in .whl/.
#
#   run(command="bash bench/experiments/v9-verify.sh ab-fwd", carry=[".whl"])  # ~7 min
#   run(command="bash bench/experiments/v9-verify.sh ab-bwd", carry=[".whl"])  # ~6 min
#   run(command="bash bench/experiments/v9-verify.sh full",   carry=[".whl"])  # ~7 min
#   run(command="bash bench/experiments/v9-verify.sh sweep",  carry=[".whl"])  # ~4 min
#
# ab-fwd: forward-only builds (64/128 bf16, sm90) of the tree before the patch ("base"), the patch as it is
#       ("v9": one K/V stage, lazy rescale, causal head groups), with two K/V stages ("v9s2"), with the
#       pipelined d64 loop ("v9pipe") and with contiguous warp rows that skip causal blocks above them
#       ("v9skip"). bench/ab.py times each against SDPA-flash after kernel_check's quick fp64 grid; then one
#       ncu --set full of the v9 forward next to FA2's (d64 and d128, 4k).
# ab-bwd: backward builds before the patch ("bbase"), with it ("bv9": the dQ slab stores addressed from four
#       base pointers, which cuts d128's spill from 112 to 60 B), and with causal head groups on top ("bgrp"),
#       timed the same way.
# full: the patched tree installed with FA2_CUDA_ARCHS=90 (all head dims, both dtypes), the GPU test suite,
#       compute-sanitizer memcheck and racecheck, and bench/bench.py --hdims 64,128 with its plot.
# sweep: the rest of the performance issue's shapes on the patched tree (head dims 96 and 256 only, so the
#       build is short): bench.py --hdims 96,256, and the batch-1 inference shapes (32 heads, d128, 1k-8k).
# FA2_CUDA_FLAGS (e.g. -DFA2_FWD_STAGES=2) is passed to the full and sweep builds, to test a non-default choice.
# Everything lands in $OUT/v9-<mode>.tgz (the device returns at most 8 files per call).
set -uo pipefail
mode=${1:?usage: v9-verify.sh ab-fwd|ab-bwd|full|sweep}
case $mode in ab-fwd|ab-bwd|full|sweep) ;; *) echo "v9-verify.sh: unknown mode '$mode'"; exit 2 ;; esac
cd "$(dirname "$0")/../.."
out=$OUT/v9-$mode && mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
rm -f csrc/fa2/schedule.h  # the one file the patch creates, in case an earlier call left it on the machine
rm -rf build/src-base && mkdir -p build/src-base && cp -r CMakeLists.txt pyproject.toml csrc python build/src-base/
git apply bench/experiments/v9-fwd.patch 2>"$out/apply.err" || patch -p1 < bench/experiments/v9-fwd.patch \
  || { echo "patch does not apply"; cat "$out/apply.err"; exit 2; }

build() {  # name src kinds "flags"
  cmake -S "$2" -B "build/$1" -G Ninja -DFA2_HEAD_DIMS=64,128 -DFA2_DTYPES=bf16 -DFA2_KINDS="$3" \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DFA2_PTXAS_VERBOSE=ON "-DCMAKE_CUDA_FLAGS=$4" > "$out/cfg-$1.log" 2>&1 &&
    cmake --build "build/$1" -j 3 > "$out/build-$1.log" 2>&1
  echo "build $1: rc $?"
}

if [ "$mode" = ab-fwd ]; then
  t0=$SECONDS
  build base build/src-base fwd "" & build v9 . fwd "" & build v9s2 . fwd "-DFA2_FWD_STAGES=2" &
  build v9pipe . fwd "-DFA2_FWD_STAGES=2 -DFA2_FWD_PIPE=1" & build v9skip . fwd "-DFA2_FWD_WARP_SKIP=1" & wait
  echo "builds: $((SECONDS - t0)) s"
  for f in "$out"/build-*.log; do echo "== $f"; grep -E "Compiling entry|registers|spill stores" "$f"; done > "$out/ptxas.txt"
  timeout 300 python3 bench/ab.py --builds base=build/base,v9=build/v9,v9s2=build/v9s2,v9pipe=build/v9pipe,v9skip=build/v9skip \
    --hdims 64,128 --dtype bf16 --modes fwd --rounds 2 --seqlens 1024,4096,16384 > "$out/ab-fwd.txt" 2>&1
  echo "ab fwd: rc $?"
  timeout 120 ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:fwd_kernel|flash_fwd" \
    --set full --import-source yes -o "$out/fwd" python3 bench/ncu_vs_flash.py --mode fwd --build build/v9 \
    --hdims 64,128 --seqlen 4096 > "$out/ncu.log" 2>&1
  echo "ncu: rc $?"
  ncu --import "$out/fwd.ncu-rep" --page details > "$out/ncu-fwd-details.txt" 2>&1
  ncu --import "$out/fwd.ncu-rep" --page source --csv --print-source sass > "$out/ncu-fwd-sass.csv" 2>&1
  rm -f "$out/fwd.ncu-rep"
elif [ "$mode" = ab-bwd ]; then
  t0=$SECONDS
  build bbase build/src-base fwd,bwd "" & build bv9 . fwd,bwd "" & build bgrp . fwd,bwd "-DFA2_BWD_HEAD_GROUP=1" &
  wait
  echo "builds: $((SECONDS - t0)) s"
  for f in "$out"/build-*.log; do echo "== $f"; grep -E "Compiling entry|registers|spill stores" "$f"; done > "$out/ptxas.txt"
  timeout 330 python3 bench/ab.py --builds bbase=build/bbase,bv9=build/bv9,bgrp=build/bgrp --hdims 64,128 \
    --dtype bf16 --modes bwd --rounds 2 --seqlens 1024,4096,16384 > "$out/ab-bwd.txt" 2>&1
  echo "ab bwd: rc $?"
elif [ "$mode" = sweep ]; then
  t0=$SECONDS
  FA2_CUDA_ARCHS=90 FA2_HEAD_DIMS=96,128,256 CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index \
    --no-build-isolation --no-deps -Ccmake.define.CMAKE_CUDA_FLAGS="${FA2_CUDA_FLAGS:-}" . > "$out/build.log" 2>&1 \
    || { echo "build failed"; tail -30 "$out/build.log"; }
  echo "build: $((SECONDS - t0)) s"
  timeout 240 python3 bench/bench.py --hdims 96,256 --out "$out/bench-96-256.jsonl" > "$out/bench-96-256.txt" 2>&1
  echo "bench 96,256: rc $?"
  timeout 150 python3 bench/bench.py --hdims 128 --batch 1 --nheads 32 --seqlens 1024,2048,4096,8192 \
    --out "$out/bench-b1h32.jsonl" > "$out/bench-b1h32.txt" 2>&1
  echo "bench b1h32: rc $?"
else  # full
  t0=$SECONDS
  FA2_CUDA_ARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index --no-build-isolation \
    --no-deps -Ccmake.define.CMAKE_CUDA_FLAGS="${FA2_CUDA_FLAGS:-}" . > "$out/build.log" 2>&1 \
    || { echo "build failed"; tail -30 "$out/build.log"; }
  echo "build: $((SECONDS - t0)) s"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests > "$out/tests.log" 2>&1; echo "tests: rc $?"; tail -3 "$out/tests.log"
  timeout 60 compute-sanitizer --tool memcheck python3 bench/sanitize.py > "$out/memcheck.log" 2>&1; echo "memcheck: rc $?"
  timeout 60 compute-sanitizer --tool racecheck python3 bench/sanitize.py --quick > "$out/racecheck.log" 2>&1; echo "racecheck: rc $?"
  tail -2 "$out/memcheck.log" "$out/racecheck.log"
  timeout 200 python3 bench/bench.py --hdims 64,128 --out "$out/bench.jsonl" > "$out/bench.txt" 2>&1; echo "bench: rc $?"
  python3 bench/plot.py "$out/bench.jsonl" > "$out/plot.log" 2>&1
fi
(cd "$OUT" && tar czf "v9-$mode.tgz" "v9-$mode" && rm -rf "v9-$mode")
ls -la "$OUT"

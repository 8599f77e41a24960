#!/usr/bin/env bash
# One device call that lands a kernel change: build, test, sanitize and measure the working tree, all under a
# deadline so the call ends inside the device's 10-minute limit. Needs the nvidia-cutlass wheel in .whl/.
#
#   run(command="bash bench/verify.sh full", carry=[".whl"])    # ~9 min on the H100 box
#   run(command="AB_FLAGS=-DSOME_KNOB=1 bash bench/verify.sh ab", carry=[".whl"])
#
# full: the landing run. Builds what users build (all head dims and dtypes) for VERIFY_ARCHS (default "80;90", the
#       default build; "80" runs the sm80 code on an H100 through the driver's PTX JIT, warmed first by
#       bench/jit_warm.py), or takes the module carried in VERIFY_PREBUILT (a folder holding _C*.so, e.g. one that a
#       previous call left in $OUT), then the GPU test suite with FA2_REQUIRE_GPU=1 (a skip is a failure),
#       compute-sanitizer memcheck and racecheck, then bench/bench.py --hdims 64,128 with its plot, then as time
#       allows --hdims 96,256 and the batch-1 inference shapes (32 heads, d128, 1k-8k). VERIFY_STEPS (default
#       "tests sanitize bench") picks the steps; "host" (bench/host_overhead.py) and "train" (examples/train_gpt.py
#       --attn all, eager and compiled) are there to be named. A module it built is also left in $OUT (split in 15 MB parts).
# ab (or ab-bwd): A/B (bench/ab.py) of the tree as it is ("base") against a variant: the tree with the patch
#       AB_PATCH applied and/or built with CMAKE_CUDA_FLAGS=AB_FLAGS ("variant"; AB_FLAGS2 adds "variant2").
#       AB_HDIMS (64,128), AB_KINDS (fwd,bwd; fwd only halves the build,
#       bwd alone builds fwd too), AB_MODES (bwd), AB_SEQLENS (1024,4096,16384) and AB_DTYPE (bf16)
#       choose what is built and timed. NOTES v9 and v10 were measured this way.
# ncu: a trimmed build (NCU_HDIMS, default 64,128; NCU_KINDS, default fwd,bwd; bf16, sm90), then for each NCU_RUNS
#       entry MODE:HDIMS:SEQLEN (default bwd:64,128:4096) one fa2 and one SDPA-flash call under ncu
#       (bench/ncu_vs_flash.py, non-causal) with the sections and stall metrics the NOTES compare;
#       NCU_SOURCE="MODE:HDIM:SEQLEN ..." adds for each a --set full report and its per-SASS-instruction page as CSV
#       (stall samples by reason, shared-memory wavefronts and conflicts), for bench/ncu_source.py; NCU_RUNS=" "
#       skips the summary runs.
# FA2_CUDA_FLAGS is passed to the full build; BENCH_ARGS replaces its first bench.py's arguments;
# VERIFY_SECONDS (default 570) is the deadline. Everything lands in $OUT/verify-<mode>.tgz, re-packed after each
# step, so a call that runs out of time still returns what it finished (the device returns at most 8 files).
set -uo pipefail
mode=${1:?usage: verify.sh full|ab|ncu}
case $mode in full|ab|ncu) ;; ab-bwd) mode=ab ;; *) echo "verify.sh: unknown mode '$mode'"; exit 2 ;; esac
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
  export CUDA_CACHE_MAXSIZE=4294967296  # the PTX JIT's cache: every kernel of an sm80-only build must fit
  steps=" ${VERIFY_STEPS:-tests sanitize bench} "
  if [ -n "${VERIFY_PREBUILT:-}" ]; then
    pkg=/tmp/fa2-prebuilt && rm -rf "$pkg" && mkdir -p "$pkg" && cp -r python/fa2 "$pkg"/ &&
      cat "$VERIFY_PREBUILT"/_C*.so* > "$pkg/fa2/$(ls "$VERIFY_PREBUILT" | grep -m1 -o '^_C[^ ]*\.so')" || exit 1
    export PYTHONPATH=$pkg
    echo "prebuilt module from $VERIFY_PREBUILT"
  else
    t0=$SECONDS
    FA2_CUDA_ARCHS=${VERIFY_ARCHS:-80;90} CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index \
      --no-build-isolation --no-deps -Ccmake.define.FA2_PTXAS_VERBOSE=ON \
      -Ccmake.define.CMAKE_CUDA_FLAGS="${FA2_CUDA_FLAGS:-}" . \
      > "$out/build.log" 2>&1 || { echo "build failed"; grep -m 20 -E "error" "$out/build.log"; pack; exit 1; }
    echo "build (archs ${VERIFY_ARCHS:-80;90}): $((SECONDS - t0)) s"
    so=$(cd /tmp && python3 -c "import fa2._C as m; print(m.__file__)")
    (cd "$OUT" && split -b 15000000 -d "$so" "$(basename "$so")." && ls -la "$OUT")
  fi
  python3 -c "import fa2, torch; print(fa2.build_info(), torch.cuda.get_device_name())" | tee "$out/build_info.txt"
  jit=$(python3 -c "import fa2, torch; major, minor = torch.cuda.get_device_capability()
print(int(not any(a // 10 == major and a <= 10 * major + minor for a in fa2.build_info()['archs'])))")
  if [ "$jit" = 1 ]; then timed jit-warm 240 jit.log python3 bench/jit_warm.py --jobs 16; tail -1 "$out/jit.log"; fi
  if [[ $steps == *" tests "* ]]; then
    timed tests 300 tests.log env FA2_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider tests
    tail -2 "$out/tests.log"
  fi
  if [[ $steps == *" sanitize "* ]]; then
    timed memcheck 150 memcheck.log compute-sanitizer --tool memcheck python3 bench/sanitize.py
    timed racecheck 150 racecheck.log compute-sanitizer --tool racecheck python3 bench/sanitize.py --quick
    tail -qn 1 "$out/memcheck.log" "$out/racecheck.log"
  fi
  if [[ $steps == *" host "* ]]; then  # host time per eager call, side by side with SDPA-flash
    timed host 150 host.txt python3 bench/host_overhead.py --out "$out/host.jsonl"
  fi
  if [[ $steps == *" train "* ]]; then  # the example's tokens/s, eager and compiled
    timed train-eager 200 train-eager.txt python3 examples/train_gpt.py --attn all --steps 200 --out "$out/train-eager"
    timed train-compiled 260 train-compiled.txt python3 examples/train_gpt.py --attn all --compile --steps 200 \
      --out "$out/train-compiled"
  fi
  if [[ $steps == *" bench "* ]]; then
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    timed bench-64-128 200 bench.txt python3 bench/bench.py ${BENCH_ARGS:---hdims 64,128} --out "$out/bench.jsonl"
    python3 bench/plot.py "$out/bench.jsonl" > "$out/plot.log" 2>&1
    timed bench-96-256 200 bench-96-256.txt python3 bench/bench.py --hdims 96,256 --seqlens 512,2048,8192 \
      --out "$out/bench-96-256.jsonl"
    timed bench-b1h32 100 bench-b1h32.txt python3 bench/bench.py --hdims 128 --batch 1 --nheads 32 \
      --seqlens 1024,2048,4096,8192 --out "$out/bench-b1h32.jsonl"
  fi
elif [ "$mode" = ncu ]; then
  t0=$SECONDS
  cmake -S . -B build/ncu -G Ninja -DFA2_HEAD_DIMS="${NCU_HDIMS:-64,128}" -DFA2_KINDS="${NCU_KINDS:-fwd,bwd}" \
    -DFA2_DTYPES=bf16 -DCMAKE_CUDA_ARCHITECTURES=90 \
    > "$out/cfg.log" 2>&1 && cmake --build build/ncu -j 16 > "$out/build.log" 2>&1 || { echo "build failed"; pack; exit 1; }
  echo "build: $((SECONDS - t0)) s"
  metrics=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
  metrics+=,lts__t_sectors_op_red.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  metrics+=,smsp__inst_executed.sum,smsp__inst_executed_op_ldsm.sum
  # shared-memory pipe busy = wavefronts / (SMs * cycles): one wavefront per cycle per SM at most
  metrics+=,sm__cycles_elapsed.avg,l1tex__data_pipe_lsu_wavefronts.sum
  for r in barrier long_scoreboard math_pipe_throttle mio_throttle short_scoreboard wait lg_throttle no_instruction \
           not_selected selected dispatch_stall branch_resolving; do
    metrics+=,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  regex() { [ "$1" = fwd ] && echo "regex:fwd_kernel" || echo "regex:bwd_kernel|dq_dk_dv"; }
  for run in ${NCU_RUNS:-bwd:64,128:4096}; do
    IFS=: read -r m h n <<< "$run"
    timed "ncu $run" 200 "ncu-$m-${h//,/-}-$n.txt" ncu --clock-control none --kernel-name-base demangled \
      --kernel-name "$(regex "$m")" --section SpeedOfLight --section WarpStateStats --section LaunchStats \
      --section Occupancy --metrics "$metrics" python3 bench/ncu_vs_flash.py --build build/ncu --mode "$m" \
      --hdims "$h" --seqlen "$n"
  done
  for src in ${NCU_SOURCE:-}; do
    IFS=: read -r m h n <<< "$src"
    tag=$m-$h-$n
    timed "ncu source $src" 200 "ncu-source-$tag.log" ncu --clock-control none --kernel-name-base demangled \
      --kernel-name "$(regex "$m")" --set full --import-source yes -f -o "$out/source-$tag" python3 bench/ncu_vs_flash.py \
      --build build/ncu --mode "$m" --hdims "$h" --seqlen "$n"
    ncu --import "$out/source-$tag.ncu-rep" --page source --csv --print-source sass 2> "$out/source-csv-$tag.log" |
      gzip > "$out/source-$tag.csv.gz"
    rm -f "$out/source-$tag.ncu-rep"; pack
  done
else
  build() {  # name "flags" [source dir]
    cmake -S "${3:-.}" -B "build/$1" -G Ninja -DFA2_HEAD_DIMS="$hdims" -DFA2_DTYPES="$dtype" -DFA2_KINDS="$kinds" \
      -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DFA2_PTXAS_VERBOSE=ON "-DCMAKE_CUDA_FLAGS=$2" > "$out/cfg-$1.log" 2>&1 &&
      cmake --build "build/$1" -j 6 > "$out/build-$1.log" 2>&1
    echo "build $1: rc $?"
  }
  hdims=${AB_HDIMS:-64,128} dtype=${AB_DTYPE:-bf16} kinds=${AB_KINDS:-fwd,bwd}
  case $kinds in *fwd*) ;; *) kinds=fwd,$kinds ;; esac  # a backward's check and timing need the forward's lse
  t0=$SECONDS
  src=.
  if [ -n "${AB_PATCH:-}" ]; then
    src=build/src-variant && rm -rf "$src" && mkdir -p "$src" && cp -r CMakeLists.txt pyproject.toml csrc python "$src"/
    (cd "$src" && patch -p1 < "$OLDPWD/$AB_PATCH") > "$out/patch.log" 2>&1 || { echo "patch failed"; cat "$out/patch.log"; exit 2; }
  fi
  build base "" & build variant "${AB_FLAGS:-}" "$src" &
  [ -n "${AB_FLAGS2:-}" ] && build variant2 "$AB_FLAGS2" "$src" &
  wait
  echo "builds: $((SECONDS - t0)) s"
  for f in "$out"/build-*.log; do echo "== $f"; grep -E "Compiling entry|registers|spill stores" "$f"; done > "$out/ptxas.txt"
  builds=base=build/base,variant=build/variant${AB_FLAGS2:+,variant2=build/variant2}
  timed ab 420 ab.txt python3 bench/ab.py --builds "$builds" \
    --hdims "$hdims" --dtype "$dtype" --modes "${AB_MODES:-bwd}" --rounds 2 --seqlens "${AB_SEQLENS:-1024,4096,16384}"
fi
pack
ls -la "$OUT"

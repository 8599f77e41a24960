#!/usr/bin/env bash
# The GPU landing script: run from a checkout on a machine with an NVIDIA GPU, it builds, tests, sanitizes and
# measures the working tree in one go, under a deadline (VERIFY_SECONDS) so that it ends inside a fixed time budget.
# Needs the CUDA toolkit, torch, and the nvidia-cutlass wheel in .whl/ (or VERIFY_WHEELS) unless CUTLASS is otherwise
# at hand (FA2_CUTLASS_DIR or an installed nvidia-cutlass). docs/performance.md and docs/profiling.md say what each
# measurement means.
#
#   bash bench/verify.sh full                                              # the landing run
#   VERIFY_PREBUILT=.prebuilt/new bash bench/verify.sh full                # test and measure a module built earlier
#   VERIFY_AB_BASE=.prebuilt/base VERIFY_ARCHS=90 VERIFY_STEPS=ab bash bench/verify.sh full
#                                                                          # the tree's module against the last landing's
#   AB_FLAGS=-DSOME_KNOB=1 bash bench/verify.sh ab                         # a compile-flag variant against the tree
#
# full: the landing run. Builds what users build (all head dims and dtypes) for VERIFY_ARCHS (default "80;90", the
#       default build; "80" runs the sm80 code on an H100 through the driver's PTX JIT, warmed first by
#       bench/jit_warm.py), with CMAKE_CUDA_FLAGS=FA2_CUDA_FLAGS, or takes the module in VERIFY_PREBUILT (a folder
#       holding _C*.so or the _C*.so.NN parts an earlier run left in $OUT). A module it built is left in $OUT, split
#       in 15 MB parts (keep them as a later run's VERIFY_PREBUILT or VERIFY_AB_BASE). Then the steps named in
#       VERIFY_STEPS (default "tests sanitize bench"), in this order:
#         tests     the GPU test suite with FA2_REQUIRE_GPU=1 (a skip is a failure), once per kernel family the GPU
#                   runs (FA2_FAMILY=sm80, then sm90 on an sm90 GPU with the Hopper family built; VERIFY_FAMILIES
#                   names others)
#         sanitize  compute-sanitizer memcheck and racecheck over bench/sanitize.py
#         ab        same-run A/B (bench.py ab) of this run's module ("new") against the module in VERIFY_AB_BASE
#                   ("base"): d64/96/128/256 bf16, seqlens 1k/4k/16k, causal and not, fwd and bwd, each build
#                   checked first with the tests' reference and rule; VERIFY_AB_ARGS replaces those options
#         bench     bench.py sweep --hdims 64,128 --plot (BENCH_ARGS replaces its options), then as time allows
#                   --hdims 96,256 --seqlens 512,2048,8192 and bench.py inference (batch 1, 32 heads, d128, 1k-8k)
#         host      bench.py host --rounds 9 (host µs per eager call, side by side with SDPA-flash)
#         train     examples/train_gpt.py --attn all, eager and compiled, 200 steps each
#         varlen    bench.py varlen
#         decode    bench.py decode (1 query against 1k-32k of KV cache, batch 1/8/64, GQA 32/8, d128)
#       "none" runs no step (a build only). VERIFY_SASS_BASE=<dump.json.gz> (bench/sass.py dump of an earlier module)
#       first compares this module's SASS per kernel with it: identical, identical but for parameter offsets, or not.
# ab:   A/B (bench.py ab) of trimmed standalone builds (AB_HDIMS, default 64,128; AB_DTYPE bf16; AB_KINDS fwd,bwd,
#       fwd only halves the build, bwd alone builds fwd too; sm90): the tree as it is ("base") against the tree with
#       the patch AB_PATCH applied and/or CMAKE_CUDA_FLAGS=AB_FLAGS ("variant"; AB_FLAGS2 adds "variant2"). With
#       AB_BASE=<module folder> that module is the base and only the tree is built ("new"). AB_MODES (bwd),
#       AB_SEQLENS (1024,4096,16384) choose what is timed.
# ncu:  a trimmed build (NCU_HDIMS, default 64,128; NCU_KINDS, default fwd,bwd; bf16, sm90), then for each NCU_RUNS
#       entry MODE:HDIMS:SEQLEN (default bwd:64,128:4096) one fa2 and one SDPA-flash call under ncu
#       (bench/prof.py vs-flash, non-causal) with the sections and stall metrics docs/performance.md compares;
#       NCU_SOURCE="MODE:HDIM:SEQLEN ..." adds for each a --set full report's per-SASS-instruction page as CSV and its
#       summary by bench/prof.py source; NCU_RUNS=" " skips the summary runs.
# Output: OUT (default ./verify-out) receives verify-<mode>.tgz, re-packed after each step, so a run cut short by its
# deadline (VERIFY_SECONDS, default 570) or from outside still leaves what it finished; summary.txt in it has one line
# per step (exit code, seconds) and env.txt the machine. The files that docs cite go to bench/results/ by hand.
set -uo pipefail
mode=${1:?usage: verify.sh full|ab|ncu}
case $mode in full|ab|ncu) ;; ab-bwd) mode=ab ;; *) echo "verify.sh: unknown mode '$mode'"; exit 2 ;; esac
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$repo/verify-out}
deadline=$((SECONDS + ${VERIFY_SECONDS:-570}))
out=$OUT/verify-$mode && mkdir -p "$out"
: > "$out/summary.txt"
status=0
pack() { (cd "$OUT" && tar czf "verify-$mode.tgz.tmp" "verify-$mode" && mv "verify-$mode.tgz.tmp" "verify-$mode.tgz"); }
note() { echo "$*" | tee -a "$out/summary.txt"; }
# left CAP: seconds a step may take, at most CAP and what is left before the deadline (0: skip it)
left() { local l=$((deadline - SECONDS - 10)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -gt 20 ] && echo "$l" || echo 0; }
timed() {  # NAME CAP LOG COMMAND...
  local name=$1 cap rc; cap=$(left "$2"); local log=$out/$3; shift 3
  if [ "$cap" = 0 ]; then note "$name: skipped (no time left)"; return; fi
  local t0=$SECONDS; timeout "$cap" "$@" > "$log" 2>&1; rc=$?
  note "$name: rc $rc in $((SECONDS - t0)) s"; [ "$rc" = 0 ] || status=1; pack
}
# assemble DIR DEST: the module of a folder (whole _C*.so, or _C*.so.NN parts joined) into the package folder DEST
assemble() {
  local name; name=$(ls "$1" | grep -m1 -o '^_C[^ ]*\.so') || { echo "no _C*.so in $1"; return 1; }
  if [ -f "$1/$name" ]; then cp "$1/$name" "$2/$name"; else cat "$1/$name".[0-9]* > "$2/$name"; fi
}
# ab_run NAME CAP BUILDS ARGS...: bench.py ab over name=dir builds, into ab*.txt / ab*.jsonl
ab_run() {
  local name=$1 cap=$2 builds=$3; shift 3
  timed "$name" "$cap" "$name.txt" python3 bench/bench.py ab --builds "$builds" --out "$out/$name.jsonl" "$@"
  tail -n 4 "$out/$name.txt"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  command -v nvcc > /dev/null && nvcc --version | tail -n 2
  python3 - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "scikit-build-core", "nvidia-cutlass", "pytest", "ninja", "cmake", "matplotlib"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (not installed)")
EOF
  env | grep -E '^(FA2_|VERIFY_|AB_|NCU_|BENCH_ARGS|CUDAARCHS)' | sort
  git rev-parse --short HEAD 2>/dev/null && git status --short 2>/dev/null | head -n 30
} > "$out/env.txt" 2>&1
shopt -s nullglob
wheels=("${VERIFY_WHEELS:-.whl}"/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps "${wheels[@]}"
else
  note "wheels: none in ${VERIFY_WHEELS:-.whl} (the build then needs FA2_CUTLASS_DIR or an installed nvidia-cutlass)"
fi
shopt -u nullglob

if [ "$mode" = full ]; then
  export CUDA_CACHE_MAXSIZE=4294967296  # the PTX JIT's cache: every kernel of an sm80-only build must fit
  steps=" ${VERIFY_STEPS:-tests sanitize bench} "
  if [ -n "${VERIFY_PREBUILT:-}" ]; then
    pkg=/tmp/fa2-prebuilt && rm -rf "$pkg" && mkdir -p "$pkg" && cp -r python/fa2 "$pkg"/ &&
      rm -f "$pkg"/fa2/_C*.so && assemble "$VERIFY_PREBUILT" "$pkg/fa2" || { note "prebuilt: no module"; exit 1; }
    export PYTHONPATH=$pkg
    newmod=$pkg/fa2
    note "prebuilt module from $VERIFY_PREBUILT"
  else
    t0=$SECONDS
    FA2_CUDA_ARCHS=${VERIFY_ARCHS:-80;90} CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index \
      --no-build-isolation --no-deps -Ccmake.define.FA2_PTXAS_VERBOSE=ON \
      -Ccmake.define.CMAKE_CUDA_FLAGS="${FA2_CUDA_FLAGS:-}" . \
      > "$out/build.log" 2>&1 || { note "build failed"; grep -m 20 -E "error" "$out/build.log"; pack; exit 1; }
    note "build (archs ${VERIFY_ARCHS:-80;90}): $((SECONDS - t0)) s"
    so=$(cd /tmp && python3 -c "import fa2._C as m; print(m.__file__)")
    newmod=$(dirname "$so")
    (cd "$OUT" && split -b 15000000 -d "$so" "$(basename "$so")." && ls -la "$OUT")
  fi
  python3 -c "import fa2, torch; print(fa2.build_info(), torch.cuda.get_device_name())" | tee "$out/build_info.txt"
  jit=$(python3 -c "import fa2, torch; major, minor = torch.cuda.get_device_capability()
print(int(not any(a // 10 == major and a <= 10 * major + minor for a in fa2.build_info()['archs'])))")
  if [ "$jit" = 1 ]; then timed jit-warm 240 jit.log python3 bench/jit_warm.py --jobs 16; tail -1 "$out/jit.log"; fi
  if [ -n "${VERIFY_SASS_BASE:-}" ]; then  # this module's SASS per kernel against a dump of the base's (bench/sass.py)
    newso=$(ls "$newmod"/_C*.so | head -n 1)
    timed sass-dump 120 sass-dump.log python3 bench/sass.py dump "$newso" "$out/sass-new.json.gz"
    timed sass-compare 60 sass.txt python3 bench/sass.py compare "$VERIFY_SASS_BASE" "$out/sass-new.json.gz"
    head -n 40 "$out/sass.txt"
  fi
  if [[ $steps == *" tests "* ]]; then  # the suite once per kernel family this GPU runs, that family forced on
    families=${VERIFY_FAMILIES:-$(python3 -c "import fa2, torch
print(' '.join(f for f in fa2.build_info()['families'] if f == 'sm80' or torch.cuda.get_device_capability() == (9, 0)))")}
    for family in $families; do
      timed "tests-$family" 300 "tests-$family.log" env FA2_REQUIRE_GPU=1 FA2_FAMILY="$family" python3 -m pytest -q \
        -p no:cacheprovider tests
      tail -2 "$out/tests-$family.log"
    done
  fi
  if [[ $steps == *" sanitize "* ]]; then
    timed memcheck 150 memcheck.log compute-sanitizer --tool memcheck python3 bench/sanitize.py
    timed racecheck 150 racecheck.log compute-sanitizer --tool racecheck python3 bench/sanitize.py --quick
    tail -qn 1 "$out/memcheck.log" "$out/racecheck.log"
  fi
  if [[ $steps == *" ab "* ]]; then  # this run's module against the base module (VERIFY_AB_BASE), in one run
    if [ -z "${VERIFY_AB_BASE:-}" ]; then
      note "ab: skipped (VERIFY_AB_BASE names no module folder)"; status=1
    else
      # shellcheck disable=SC2086  # VERIFY_AB_ARGS is a list of words
      ab_run ab 360 "base=$VERIFY_AB_BASE,new=$newmod" \
        ${VERIFY_AB_ARGS:---hdims 64,96,128,256 --dtype bf16 --modes fwd,bwd --seqlens 1024,4096,16384 --rounds 2}
    fi
  fi
  if [[ $steps == *" bench "* ]]; then
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    timed bench-64-128 220 bench.txt python3 bench/bench.py sweep ${BENCH_ARGS:---hdims 64,128} --plot \
      --out "$out/bench.jsonl"
    timed bench-96-256 200 bench-96-256.txt python3 bench/bench.py sweep --hdims 96,256 --seqlens 512,2048,8192 \
      --out "$out/bench-96-256.jsonl"
    timed bench-b1h32 100 bench-b1h32.txt python3 bench/bench.py inference --out "$out/bench-b1h32.jsonl"
  fi
  if [[ $steps == *" host "* ]]; then  # host time per eager call, side by side with SDPA-flash
    timed host 150 host.txt python3 bench/bench.py host --rounds 9 --out "$out/host.jsonl"
  fi
  if [[ $steps == *" train "* ]]; then  # the example's tokens/s, eager and compiled
    timed train-eager 200 train-eager.txt python3 examples/train_gpt.py --attn all --steps 200 --out "$out/train-eager"
    timed train-compiled 260 train-compiled.txt python3 examples/train_gpt.py --attn all --compile --steps 200 \
      --out "$out/train-compiled"
  fi
  if [[ $steps == *" varlen "* ]]; then
    timed varlen 100 varlen.txt python3 bench/bench.py varlen --out "$out/varlen.jsonl"
  fi
  if [[ $steps == *" decode "* ]]; then
    timed decode 150 decode.txt python3 bench/bench.py decode --out "$out/decode.jsonl"
  fi
elif [ "$mode" = ncu ]; then
  t0=$SECONDS
  cmake -S . -B build/ncu -G Ninja -DFA2_HEAD_DIMS="${NCU_HDIMS:-64,128}" -DFA2_KINDS="${NCU_KINDS:-fwd,bwd}" \
    -DFA2_DTYPES=bf16 -DCMAKE_CUDA_ARCHITECTURES=90 \
    > "$out/cfg.log" 2>&1 && cmake --build build/ncu -j 16 > "$out/build.log" 2>&1 || { note "build failed"; pack; exit 1; }
  note "build: $((SECONDS - t0)) s"
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
      --section Occupancy --metrics "$metrics" python3 bench/prof.py vs-flash --build build/ncu --mode "$m" \
      --hdims "$h" --seqlen "$n"
  done
  for src in ${NCU_SOURCE:-}; do
    IFS=: read -r m h n <<< "$src"
    tag=$m-$h-$n
    timed "ncu source $src" 200 "ncu-source-$tag.log" ncu --clock-control none --kernel-name-base demangled \
      --kernel-name "$(regex "$m")" --set full --import-source yes -f -o "$out/source-$tag" python3 bench/prof.py \
      vs-flash --build build/ncu --mode "$m" --hdims "$h" --seqlen "$n"
    ncu --import "$out/source-$tag.ncu-rep" --page source --csv --print-source sass 2> "$out/source-csv-$tag.log" |
      gzip > "$out/source-$tag.csv.gz"
    rm -f "$out/source-$tag.ncu-rep"
    python3 bench/prof.py source "$out/source-$tag.csv.gz" > "$out/source-$tag.txt" 2>&1
    [ "$m" = fwd ] && python3 bench/prof.py source --groups "$out/source-$tag.csv.gz" >> "$out/source-$tag.txt" 2>&1
    pack
  done
else
  build() {  # name "flags" [source dir]
    cmake -S "${3:-.}" -B "build/$1" -G Ninja -DFA2_HEAD_DIMS="$hdims" -DFA2_DTYPES="$dtype" -DFA2_KINDS="$kinds" \
      -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DFA2_PTXAS_VERBOSE=ON "-DCMAKE_CUDA_FLAGS=$2" > "$out/cfg-$1.log" 2>&1 &&
      cmake --build "build/$1" -j "${jobs:-6}" > "$out/build-$1.log" 2>&1
    echo "build $1: rc $?" | tee -a "$out/summary.txt"
  }
  hdims=${AB_HDIMS:-64,128} dtype=${AB_DTYPE:-bf16} kinds=${AB_KINDS:-fwd,bwd}
  case $kinds in *fwd*) ;; *) kinds=fwd,$kinds ;; esac  # a backward's check and timing need the forward's lse
  t0=$SECONDS
  src=.
  if [ -n "${AB_PATCH:-}" ]; then
    src=build/src-variant && rm -rf "$src" && mkdir -p "$src" && cp -r CMakeLists.txt pyproject.toml csrc python "$src"/
    (cd "$src" && patch -p1 < "$OLDPWD/$AB_PATCH") > "$out/patch.log" 2>&1 || { note "patch failed"; cat "$out/patch.log"; exit 2; }
  fi
  if [ -n "${AB_BASE:-}" ]; then  # the module in AB_BASE is the base; the tree as it is, built here, is "new"
    jobs=16 build new "${AB_FLAGS:-}" "$src"
    builds=base=$AB_BASE,new=build/new
  else
    build base "" & build variant "${AB_FLAGS:-}" "$src" &
    [ -n "${AB_FLAGS2:-}" ] && build variant2 "$AB_FLAGS2" "$src" &
    wait
    builds=base=build/base,variant=build/variant${AB_FLAGS2:+,variant2=build/variant2}
  fi
  note "builds: $((SECONDS - t0)) s"
  for f in "$out"/build-*.log; do echo "== $f"; grep -E "Compiling entry|registers|spill stores" "$f"; done > "$out/ptxas.txt"
  ab_run ab 420 "$builds" --hdims "$hdims" --dtype "$dtype" --modes "${AB_MODES:-bwd}" --rounds 2 \
    --seqlens "${AB_SEQLENS:-1024,4096,16384}"
fi
pack
ls -la "$OUT"
exit $status

"""Prove that every kernel translation unit of a build compiles for every arch it targets, in a fraction of the
build's time: each (TU, arch) pair goes through nvcc's device front end only (parsing, template instantiation,
static_asserts, `#if __CUDA_ARCH__` branches), without optimisation, PTX assembly or the host pass.

    python csrc/instantiations/check_compile.py                     # the default build: every head dim, dtype, kind, arch
    python csrc/instantiations/check_compile.py --archs 80,90,120 --jobs 8
    python csrc/instantiations/check_compile.py --only bwd_hdim96   # TUs whose name contains a string

The commands are the ones CMake writes for the real build (same flags, defines and include paths, read from
compile_commands.json after a configure-only run), with the arch list replaced by one virtual arch and code
generation switched off (`-Xcicc --no_code_gen`). With that switch cicc exits 1 even on success, so a pair passes
when nvcc exits 0 or 1 *and* prints no error; before checking anything, a planted static_assert failure must be
reported as a failure, or the check itself is broken and says so.
On the 2-core CI machine each pair takes 20-45 s (the forward / backward TUs), about 17 minutes for the default
build's 64 pairs; the full build compiles the same pairs to SASS in roughly three times that.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARCH_FLAG = re.compile(r"^(--generate-code=|-gencode|--gpu-architecture|-arch)")
PLANTED = "template <int N> __device__ void f() { static_assert(N == 1, \"planted\"); }\n" \
          "__global__ void k() { f<2>(); }\n"


def configure(build_dir: pathlib.Path, archs) -> list:
    """compile_commands.json entries of the kernel TUs, from a configure-only CMake run."""
    cmd = ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
           f"-DPython_EXECUTABLE={sys.executable}"]  # this Python's torch (headers) and nvidia-cutlass
    if archs:
        cmd.append("-DCMAKE_CUDA_ARCHITECTURES=" + ";".join(archs))
    for var in ("FA2_HEAD_DIMS", "FA2_DTYPES", "FA2_KINDS"):  # empty: CMakeLists.txt's default (everything)
        cmd.append(f"-D{var}=" + os.environ.get(var, ""))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    entries = json.loads((build_dir / "compile_commands.json").read_text())
    return [e for e in entries if e["file"].endswith(".cu")]


def front_end_command(command: str, arch: str, out: str) -> list:
    """The TU's build command with its archs, object output and dependency flags replaced: front end for one arch."""
    words, kept, skip = shlex.split(command), [], 0
    for i, w in enumerate(words):
        if skip:
            skip -= 1
            continue
        if w in ("-o", "-MF", "-MT", "-gencode", "-arch", "--gpu-architecture"):
            skip = 1
            continue
        if ARCH_FLAG.match(w) or w in ("-c", "-MD") or w.startswith("--threads") or w.startswith("-lineinfo"):
            continue
        kept.append(w)
    return [*kept, f"-arch=compute_{arch}", "-ptx", "-Xcicc", "--no_code_gen", "-o", out]


def archs_of(command: str) -> list:
    return sorted(set(re.findall(r"arch=compute_(\d+[af]?)", command)), key=lambda a: int(re.match(r"\d+", a)[0]))


def run(cmd, cwd) -> tuple:
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    ok = p.returncode in (0, 1) and not re.search(r"\berror\b", text)
    return ok, time.monotonic() - t0, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Every TU of axes.json is present and generated from it (CMake then fails on none it selects).
    if subprocess.run([sys.executable, str(ROOT / "csrc" / "instantiations" / "generate.py"), "--check"]).returncode:
        print("check_compile: the instantiations are not axes.json's; run `python csrc/instantiations/generate.py`")
        return 1
    ap.add_argument("--archs", default="", help="comma-separated archs (default: the build's default, 80,90)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="pairs compiled at once (default: cores)")
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "check-compile"))
    ap.add_argument("--only", default="", help="check only TUs whose file name contains this string")
    args = ap.parse_args()
    build_dir = pathlib.Path(args.build_dir)
    entries = configure(build_dir, [a for a in args.archs.replace(";", ",").split(",") if a])
    entries = [e for e in entries if args.only in pathlib.Path(e["file"]).name]
    if not entries:
        print("check_compile: no kernel TUs selected")
        return 1
    archs = sorted({a for e in entries for a in archs_of(e["command"])})
    tmp = tempfile.mkdtemp(prefix="fa2-check-")

    # The check must be able to fail: a planted error, through the same command, must be reported.
    planted = pathlib.Path(tmp, "planted.cu")
    planted.write_text(PLANTED)
    ok, _, text = run(front_end_command(entries[0]["command"].replace(entries[0]["file"], str(planted)), archs[0],
                                        os.devnull), entries[0]["directory"])
    if ok or "planted" not in text:
        print("check_compile: a planted static_assert failure was not reported; the check is broken:\n" + text)
        return 2

    pairs = [(e, a) for e in entries for a in archs_of(e["command"])]  # a family's TUs have their own archs
    print(f"check_compile: {len(entries)} TUs x archs {','.join(archs)} = {len(pairs)} front-end compiles, "
          f"{args.jobs} at a time", flush=True)
    t0, failed = time.monotonic(), []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run, front_end_command(e["command"], a, os.devnull), e["directory"]): (e, a)
                   for e, a in pairs}
        for fut in concurrent.futures.as_completed(futures):
            e, a = futures[fut]
            ok, secs, text = fut.result()
            name = pathlib.Path(e["file"]).name
            print(f"  {'ok  ' if ok else 'FAIL'} sm{a:<4} {name:<24} {secs:5.0f} s", flush=True)
            if not ok:
                failed.append((name, a, text))
    for name, a, text in failed:
        print(f"\n==== {name} for sm{a}:\n{text.strip()}")
    print(f"check_compile: {len(pairs) - len(failed)} of {len(pairs)} passed in {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fill the CUDA driver's JIT cache for a build without machine code for this GPU (an sm80-only build on an H100:
every kernel runs as compute_80 PTX that the driver compiles at its first launch, one kernel at a time). One
process per (head dim, dtype), all at once, each launching every kernel of its translation unit once: the plain,
A100 and 99 KB configurations (csrc/sm80/config.h), short and long sequences, both dQ paths. Later processes (the
tests) then load the compiled kernels from the cache. Set CUDA_CACHE_MAXSIZE (e.g. 4294967296) so they all fit.

    CUDA_CACHE_MAXSIZE=4294967296 python bench/jit_warm.py [--jobs 16]
"""
import argparse
import concurrent.futures
import subprocess
import sys
import time


def warm(head_dim: int, dtype_name: str) -> None:
    import torch

    import fa2
    import fa2._C

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    for smem_limit in (0, 163 * 1024, 99 * 1024):  # the device's, an A100's, a consumer GPU's (test-only override)
        fa2._C.set_test_overrides(smem_limit=smem_limit)
        for seqlen in (128, 1100, 2100):  # d256's forward tile changes at 1024 (2048 causal)
            q, k, v = (torch.randn(1, seqlen, 2, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            out, lse = fa2.fwd(q, k, v, causal=seqlen > 2048)
            if seqlen == 128 and head_dim in fa2.build_info()["bwd_head_dims"]:
                for deterministic in (False, True):
                    fa2.bwd(torch.randn_like(out), q, k, v, out, lse, deterministic=deterministic)
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "HEAD_DIM,DTYPE": the worker
    args = ap.parse_args()
    if args.one:
        d, t = args.one.split(",")
        warm(int(d), t)
        return 0
    import fa2

    info = fa2.build_info()
    pairs = [(d, t) for d in info["fwd_head_dims"] for t in info["dtypes"]]
    t0 = time.monotonic()

    def run(pair):
        start = time.monotonic()
        p = subprocess.run([sys.executable, __file__, "--one", f"{pair[0]},{pair[1]}"], capture_output=True, text=True)
        return pair, p.returncode, time.monotonic() - start, p.stderr[-2000:]

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for (d, t), rc, secs, err in pool.map(run, pairs):
            print(f"  d{d} {t}: rc {rc} in {secs:.0f} s" + (f"\n{err}" if rc else ""), flush=True)
            failed += rc != 0
    print(f"jit_warm: {len(pairs)} translation units in {time.monotonic() - t0:.0f} s, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one attention configuration a few times, for Nsight Compute. fa2's kernels are fa2::fwd_kernel<...>,
fa2::bwd_preprocess_kernel, fa2::bwd_kernel<...>, fa2::bwd_dq_kernel<...> (deterministic=True) and
fa2::bwd_convert_dq_kernel. Warm-up calls run first, outside any NVTX range; each profiled call sits in an
NVTX range named "profile", so ncu can select exactly those:

    ncu --clock-control none --nvtx --nvtx-include "profile/" \\
        --kernel-name-base demangled --kernel-name regex:fa2:: --set full -o fa2_bwd_d128 \\
        python bench/ncu_profile.py --mode bwd --hdim 128 --seqlen 4096

(`--kernel-name-base demangled`: the regex then sees the namespace and template arguments.) Add
`--launch-count 1` to stop after the first kernel; `--import-source yes` to embed the source that -lineinfo
points at. Text instead of a report: replace `--set full -o NAME` by `--section SpeedOfLight
--section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats
--section SourceCounters`. Without ncu it prints the mean time per call (CUDA events), a sanity check only;
bench/bench.py is where timings come from.
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["fwd", "bwd", "fwdbwd"], default="fwd",
                    help="fwd: fa2.fwd; bwd: fa2.bwd on a saved forward; fwdbwd: fa2.attention + autograd")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=None, help="default 16384 // seqlen (16k tokens)")
    ap.add_argument("--nheads", type=int, default=None, help="default 2048 // hdim (hidden 2048)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="bwd: the deterministic dQ path")
    ap.add_argument("--warmup", type=int, default=2, help="calls before the profiled ones (not in a range)")
    ap.add_argument("--iters", type=int, default=3, help="profiled calls, each in an NVTX range 'profile'")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_profile.py: needs a CUDA GPU")

    import fa2
    b, h = a.batch or max(1, 16384 // a.seqlen), a.nheads or max(1, 2048 // a.hdim)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    q, k, v = (torch.randn(b, a.seqlen, h, a.hdim, device="cuda", dtype=dtype, requires_grad=a.mode == "fwdbwd")
               for _ in range(3))
    with torch.no_grad():
        out, lse = fa2.fwd(q, k, v, causal=a.causal)
    dout = torch.randn_like(out)

    def call():
        if a.mode == "fwd":
            fa2.fwd(q, k, v, causal=a.causal, out=out)
        elif a.mode == "bwd":
            fa2.bwd(dout, q, k, v, out, lse, causal=a.causal, deterministic=a.deterministic)
        else:
            torch.autograd.grad(fa2.attention(q, k, v, causal=a.causal), (q, k, v), dout)

    for _ in range(a.warmup):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.iters):
        with torch.cuda.nvtx.range("profile"):
            call()
    end.record()
    torch.cuda.synchronize()
    print(f"{a.mode} {a.dtype} hdim {a.hdim} seqlen {a.seqlen} batch {b} nheads {h} causal {a.causal}: "
          f"{start.elapsed_time(end) / max(1, a.iters):.3f} ms per call (mean of {a.iters})")


if __name__ == "__main__":
    main()

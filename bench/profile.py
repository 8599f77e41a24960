"""Run one attention configuration a few times, for Nsight Compute. Kernel names read fa2::fwd_kernel<...>,
fa2::bwd_kernel<...>, fa2::bwd_dq_kernel<...>, fa2::bwd_preprocess_kernel, fa2::bwd_convert_dq_kernel.

    ncu --clock-control none --kernel-name regex:fa2:: --launch-skip 2 --launch-count 1 --set full \\
        -o fa2_bwd python bench/profile.py --mode bwd --hdim 128 --seqlen 4096

Text instead of a report: replace `--set full -o NAME` by `--section SpeedOfLight --section WarpStateStats
--section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis`. With FA2_NVTX=1 every call sits
in an NVTX range (fa2.fwd / fa2.bwd), so `--nvtx --nvtx-include fa2.bwd/` also selects them.
"""
import argparse

import torch

import fa2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=None, help="default 16384 // seqlen")
    ap.add_argument("--nheads", type=int, default=None, help="default 2048 // hdim")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    b, h = a.batch or max(1, 16384 // a.seqlen), a.nheads or 2048 // a.hdim
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(b, a.seqlen, h, a.hdim, device="cuda", dtype=dtype) for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=a.causal)
    dout = torch.randn_like(out)
    for _ in range(a.iters):
        with torch.cuda.nvtx.range(f"profile.{a.mode}"):
            if a.mode == "fwd":
                fa2.fwd(q, k, v, causal=a.causal, out=out)
            else:
                fa2.bwd(dout, q, k, v, out, lse, causal=a.causal, deterministic=a.deterministic)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

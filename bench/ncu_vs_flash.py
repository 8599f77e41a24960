"""One fa2 backward and one SDPA-flash backward per head dim (or, with --mode fwd, one forward each), for
Nsight Compute to put side by side:

    ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:bwd_kernel|dq_dk_dv" \\
        --section SpeedOfLight --section WarpStateStats --section LaunchStats \\
        --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed.sum \\
        python bench/ncu_vs_flash.py [--build build/dev] [--hdims 64,128]

No NVTX filter: the autograd backward runs on another thread, outside a range pushed here, so every call
is profiled (one of each, no warm-up; ncu replays each kernel anyway). --build uses a standalone CMake
build dir's _C instead of the installed fa2. bench/results/h100-2026-11-23-v7-ncu-bwd-vs-flash.txt is
one such report.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=None, help="standalone CMake build dir holding _C*.so")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--mode", choices=("fwd", "bwd"), default="bwd",
                    help="fwd: run the forwards only (filter: regex:fwd_kernel|flash_fwd)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernel_check as kc
    kc.C = kc.load(a.build)
    for d in map(int, a.hdims.split(",")):
        b, n, h = max(1, 16384 // a.seqlen), a.seqlen, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        o, lse = kc.call_fwd(q, k, v, a.causal, d ** -0.5)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal)
        if a.mode == "fwd":
            continue
        kc.call_bwd(do, q, k, v, o, lse, a.causal, d ** -0.5)
        torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

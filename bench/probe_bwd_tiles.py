"""The d128 full-attention backward on its two Hopper tiles, side by side with SDPA-cuDNN, one process (session 37):
the plan's 80-row tile (a padded call) against the 64-row persistent tile (the same tokens packed: varlen runs it),
bf16, 16k tokens, hidden 2048; d64 (one tile both ways) as the control. Prints the kernels each call ran.

    python3 bench/probe_bwd_tiles.py [build dir]
"""
import sys

import torch
from torch.nn.attention import SDPBackend

import common

fa2 = common.load(sys.argv[1] if len(sys.argv) > 1 else None)


def kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = set()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tile = "<" + e.name.split("BwdTraits<")[1].split(">")[0] + ">" if "BwdTraits<" in e.name else ""
            names.add(e.name.split("<")[0] + tile)
    return sorted(names)


for d in (128, 64):
    for n in (1024, 2048, 4096, 8192, 16384):
        b, h = 16384 // n, 2048 // d
        q, k, v, do, out, lse, (qt, kt, vt), o = common.paired_inputs(fa2, b, n, h, d, torch.bfloat16, False,
                                                                      SDPBackend.CUDNN_ATTENTION)
        cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * n
        qp, kp, vp, dop = (t.reshape(b * n, h, d) for t in (q, k, v, do))
        outp, lsep = fa2.fwd_varlen(qp, kp, vp, cu, cu, n, n)
        calls = {
            "dense": lambda: fa2.bwd(do, q, k, v, out, lse),
            "packed": lambda: fa2.bwd_varlen(dop, qp, kp, vp, outp, lsep, cu, cu, n, n),
            "cudnn": lambda: torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2), retain_graph=True),
        }
        ms = {name: min(common.time_ms(fn) for _ in range(3)) for name, fn in calls.items()}
        flops = 2.5 * 4 * b * h * n * n * d
        cells = "  ".join(f"{name} {t * 1e3:.1f} us {flops / t / 1e9:.0f} TF" for name, t in ms.items())
        print(f"d{d} n={n}: {cells}  dense/packed time {ms['dense'] / ms['packed']:.3f}", flush=True)
        if n == 1024:
            print("   kernels", {name: kernels(calls[name]) for name in ("dense", "packed")})

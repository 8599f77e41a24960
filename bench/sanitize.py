"""A few odd shapes through every kernel, small enough for compute-sanitizer:

    compute-sanitizer --tool memcheck python bench/sanitize.py
    compute-sanitizer --tool racecheck python bench/sanitize.py --quick
"""
import sys

import torch

import fa2

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal)
    (1, 77, 133, 4, 2, 40, True),
    (2, 130, 61, 2, 1, 64, True),
    (1, 1, 257, 2, 2, 128, False),
    (1, 200, 200, 2, 2, 256, True),
    (1, 65, 129, 2, 2, 96, False),
]
quick = "--quick" in sys.argv
for b, sq, sk, h, hk, d, causal in CASES[:2] if quick else CASES:
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
        out, lse = fa2.fwd(q, k, v, causal=causal)
        dout = torch.randn_like(out)
        for det in (False, True):
            grads = fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
print("sanitize cases done")

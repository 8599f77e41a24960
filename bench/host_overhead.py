"""Host (CPU) time per call of each layer of fa2's Python stack, on a shape small enough that the GPU is
never the bottleneck: wall time per call of back-to-back calls, then a cProfile of attention fwd+bwd.

    python bench/host_overhead.py

Layers: _C.fwd with prepared arguments (pybind11 + the launch), fa2.fwd (checks, allocation), the fa2::fwd
custom op, fa2.attention, and the same for the backward.
"""
import cProfile
import pstats
import time

import torch

import fa2
from fa2 import interface


def per_call_us(fn, n=300):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=True)
    dout = torch.randn_like(out)
    calls = []
    real = interface._C
    interface._C = type("Spy", (), {"fwd": lambda self, **kw: calls.append(kw) or real.fwd(**kw)})()
    fa2.fwd(q, k, v, causal=True)
    interface._C = real
    prepared = calls[0]

    def fwdbwd():
        torch.autograd.grad(fa2.attention(q, k, v, causal=True), (q, k, v), dout)

    rows = [
        ("_C.fwd (prepared arguments)", lambda: real.fwd(**prepared)),
        ("fa2.fwd", lambda: fa2.fwd(q, k, v, causal=True)),
        ("torch.ops.fa2.fwd", lambda: torch.ops.fa2.fwd(q, k, v, None, True, False)),
        ("fa2.attention (no grad)", lambda: fa2.attention(q.detach(), k.detach(), v.detach(), causal=True)),
        ("fa2.bwd", lambda: fa2.bwd(dout, q, k, v, out, lse, causal=True)),
        ("torch.ops.fa2.bwd", lambda: torch.ops.fa2.bwd(dout, q, k, v, out, lse, None, True, False)),
        ("fa2.attention fwd+bwd (autograd)", fwdbwd),
    ]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, q {tuple(q.shape)}")
    for name, fn in rows:
        print(f"  {per_call_us(fn):8.1f}  {name}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fwdbwd()
    prof.disable()
    torch.cuda.synchronize()
    print("\n# cProfile, 200 x attention fwd+bwd, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

"""Host (CPU) time per eager call, fa2 side by side with SDPA-flash (torch's FlashAttention-2 backend), at shapes
where the GPU is never the bottleneck: wall time per call of back-to-back calls (the GPU keeps up, so this is the
host's time), forward alone (no grad), backward alone (autograd.grad on a kept graph) and forward+backward through
autograd, each the best of --rounds (5) rounds in which the implementations take turns. "sdpa_fa2" is
F.scaled_dot_product_attention with fa2 activated behind it (fa2.sdpa). Then the time per call of each layer of
fa2's own stack, and a cProfile of its forward+backward.

    python bench/host_overhead.py [--out results.jsonl]

Each side takes its native layout: fa2 (batch, seqlen, nheads, head_dim), SDPA (batch, nheads, seqlen, head_dim).
"""
import argparse
import cProfile
import datetime
import json
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2

SHAPES = [  # (batch, seqlen, nheads, head_dim, causal): small training / inference calls where host time dominates
    (1, 512, 8, 64, True), (1, 1024, 32, 128, True), (4, 256, 12, 64, True)]


def per_call_us(fn, n=300):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def kernel_us(fn, n=100):
    """GPU time per call of fn's kernels alone: fn captured once in a CUDA graph, the graph replayed n times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def side_by_side(b, s, h, d, causal, rounds=5):
    """{(impl, mode): us per call} for one shape: the best of `rounds` rounds, the impls interleaved in each."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qt, kt, vt = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout, doutt = torch.randn_like(q), torch.randn_like(qt)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    fa = lambda q, k, v: fa2.attention(q, k, v, causal=causal)  # noqa: E731
    times = {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # entered once: no host time inside the timed calls
        for _ in range(rounds):
            for impl, attend, inputs, grad_out in (("fa2", fa, (q, k, v), dout), ("sdpa_flash", sdpa, (qt, kt, vt), doutt),
                                                   ("sdpa_fa2", sdpa, (qt, kt, vt), doutt)):
                if impl == "sdpa_fa2":
                    fa2.sdpa.activate()
                detached = [t.detach() for t in inputs]
                kept = attend(*inputs)
                for mode, fn in (("fwd", lambda: attend(*detached)),
                                 ("bwd", lambda: torch.autograd.grad(kept, inputs, grad_out, retain_graph=True)),
                                 ("fwdbwd", lambda: torch.autograd.grad(attend(*inputs), inputs, grad_out))):
                    t = per_call_us(fn)
                    times[impl, mode] = min(times.get((impl, mode), t), t)
                fa2.sdpa.restore()
    # What the GPU alone needs for fa2's calls: a wall time near it is no longer host-bound.
    out, lse = fa2.fwd(q.detach(), k.detach(), v.detach(), causal=causal)
    times["fa2", "fwd_kernel"] = kernel_us(lambda: fa2.fwd(q.detach(), k.detach(), v.detach(), causal=causal))
    times["fa2", "bwd_kernel"] = kernel_us(lambda: fa2.bwd(dout, q.detach(), k.detach(), v.detach(), out, lse,
                                                           causal=causal))
    return times


def layers():
    """Time per call of each layer of fa2's stack, on the smallest shape."""
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=True)
    dout = torch.randn_like(out)

    def fwdbwd():
        torch.autograd.grad(fa2.attention(q, k, v, causal=True), (q, k, v), dout)

    rows = [
        ("torch.empty_like (one allocation, for scale)", lambda: torch.empty_like(q)),
        ("torch.ops.fa2.fwd.default (the C++ op, through autograd's key)",
         lambda: torch.ops.fa2.fwd.default(q.detach(), k.detach(), v.detach(), None, True, False)),
        ("fa2.fwd", lambda: fa2.fwd(q, k, v, causal=True)),
        ("fa2.attention (no grad)", lambda: fa2.attention(q.detach(), k.detach(), v.detach(), causal=True)),
        ("fa2.bwd", lambda: fa2.bwd(dout, q, k, v, out, lse, causal=True)),
        ("torch.ops.fa2.bwd.default", lambda: torch.ops.fa2.bwd.default(dout, q, k, v, out, lse, None, True, False)),
        ("fa2.attention fwd+bwd (autograd)", fwdbwd),
    ]
    print(f"\n# fa2's layers, host us per call, q {tuple(q.shape)}")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="append one JSON object per measurement")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per shape; each time is the best over them")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}; host us per eager call (bf16), fa2 / sdpa_flash")
    print(f"{'shape':>28} {'mode':>7} {'fa2':>9} {'sdpa_flash':>11} {'ratio':>6} {'sdpa_fa2':>9} {'fa2 GPU':>8}")
    rows = []
    for b, s, h, d, causal in SHAPES:
        times = side_by_side(b, s, h, d, causal, args.rounds)
        for mode in ("fwd", "bwd", "fwdbwd"):
            ours, theirs = times["fa2", mode], times["sdpa_flash", mode]
            kernel = {"fwd": times["fa2", "fwd_kernel"], "bwd": times["fa2", "bwd_kernel"],
                      "fwdbwd": times["fa2", "fwd_kernel"] + times["fa2", "bwd_kernel"]}[mode]
            print(f"{f'b{b} s{s} h{h} d{d} causal={causal}':>28} {mode:>7} {ours:9.1f} {theirs:11.1f} "
                  f"{ours / theirs:6.2f} {times['sdpa_fa2', mode]:9.1f} {kernel:8.1f}")
            for impl in ("fa2", "sdpa_flash", "sdpa_fa2"):
                rows.append({"impl": impl, "mode": f"host_{mode}", "dtype": "bf16", "hdim": d, "causal": causal,
                             "seqlen": s, "batch": b, "nheads": h, "ms": times[impl, mode] / 1e3, "tflops": None,
                             "us_per_call": times[impl, mode],
                             "device": device, "date": str(datetime.date.today())})
        for mode in ("fwd_kernel", "bwd_kernel"):
            rows.append({"impl": "fa2", "mode": mode, "dtype": "bf16", "hdim": d, "causal": causal, "seqlen": s,
                         "batch": b, "nheads": h, "ms": times["fa2", mode] / 1e3, "tflops": None,
                         "us_per_call": times["fa2", mode], "device": device, "date": str(datetime.date.today())})
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    layers()


if __name__ == "__main__":
    main()

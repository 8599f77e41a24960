"""Where a training step's time goes: examples/train_gpt.py's model, a few steps under torch.profiler for
each attention, GPU time per kernel (top rows) and host vs device time per step.

    python bench/step_profile.py --compile                  # the example's shape: 16 x 1024, 6 x 64 heads
    python bench/step_profile.py --batch 4 --seqlen 4096

Also times fa2.attention alone on the step's shape: forward and forward+backward through autograd, as
GPU time (CUDA-graph replay, no Python in the way) and as eager wall time per call (Python included).
"""
import argparse
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import host_overhead  # noqa: E402  (bench/, this script's folder, leads sys.path)
import train_gpt  # noqa: E402


def per_call_us(fn, n=50):
    """(GPU us per call from CUDA-graph replays, eager wall us per call)."""
    return host_overhead.kernel_us(fn, n), host_overhead.per_call_us(fn, n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    import fa2

    dim, nheads, layers, vocab = 384, 6, 6, 110
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; GPT {layers}x{dim} ({nheads} heads of "
          f"{dim // nheads}), batch {args.batch} x {args.seqlen}, bf16 autocast, compile={args.compile}")
    x = torch.randint(0, vocab, (args.batch, args.seqlen), device="cuda")
    for attention in ("fa2", "sdpa"):
        torch.manual_seed(0)
        model = train_gpt.GPT(vocab, dim=dim, nheads=nheads, layers=layers, seqlen=args.seqlen,
                              attention=attention).cuda()
        run = torch.compile(model, fullgraph=True) if args.compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            host = (time.perf_counter() - t0) / args.steps * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.steps * 1e3
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        gpu = sum(e.self_device_time_total for e in events) / args.steps / 1e3
        print(f"\n## {attention}: {wall:.2f} ms/step wall, {host:.2f} ms/step host (until the last launch), "
              f"{gpu:.2f} ms/step of kernels")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.rows]:
            print(f"  {e.self_device_time_total / args.steps / 1e3:7.3f} ms  {e.count // args.steps:4d}x  "
                  f"{e.key[:110]}")

    q, k, v = (torch.randn(args.batch, args.seqlen, nheads, dim // nheads, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    print(f"\n## attention alone, {tuple(q.shape)} causal: GPU (graph replay) / eager wall, us per call")
    for name, fn in (("fa2", lambda q, k, v: fa2.attention(q, k, v, causal=True)),
                     ("sdpa", lambda q, k, v: train_gpt.sdpa_attention(q, k, v))):
        def fwd():
            with torch.no_grad():
                fn(q, k, v)

        def fwdbwd():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
        for mode, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
            g, w = per_call_us(f)
            print(f"  {name:5} {mode:8} {g:8.1f} / {w:8.1f}")


if __name__ == "__main__":
    main()

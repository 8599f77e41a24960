"""Time one forward shape several times, each time on freshly allocated inputs, fa2 next to SDPA-flash: for shapes
whose ratio moves between runs with the same kernels (bench/NOTES.md v12: d64 non-causal 16k at batch 1).

    python bench/repeat_shape.py --build build/base --hdim 64 --seqlen 16384 --batch 1 --nheads 32 --repeats 8

--build: a standalone CMake build dir (its _C), as bench/ab.py uses; without it, the installed fa2._C.
--pad-mb: before each repeat, allocate (and keep) this many MB more, so the next inputs land at other addresses.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build")
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--pad-mb", type=int, default=37)
    args = ap.parse_args()
    if args.build:
        sys.path.insert(0, os.path.abspath(args.build))
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernel_check as kc
    kc.C = kc.load(args.build)
    b, n, h, d = args.batch, args.seqlen, args.nheads, args.hdim
    flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
    keep = []
    print(f"# {torch.cuda.get_device_name()}: fwd {args.dtype} b{b} h{h} n{n} d{d} causal={args.causal}, "
          f"TFLOP/s per repeat (fresh inputs each), do_bench median")
    print(f"{'rep':>3} {'fa2':>7} {'flash':>7} {'fa2/flash':>9} {'q address':>14}")
    for rep in range(args.repeats):
        keep.append(torch.empty(args.pad_mb * rep + 1, 1 << 20, dtype=torch.uint8, device="cuda"))
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=kc.DT[args.dtype]) for _ in range(3))
        into = (torch.empty_like(q), torch.empty(b, h, n, device="cuda", dtype=torch.float32))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
        ours = lambda: kc.call_fwd(q, k, v, args.causal, d ** -0.5, into=into)  # noqa: E731
        t_ours, t_flash = (tt.do_bench(fn, warmup=25, rep=100, return_mode="median") for fn in (ours, flash))
        print(f"{rep:>3} {flops / t_ours / 1e9:7.1f} {flops / t_flash / 1e9:7.1f} {t_flash / t_ours:9.3f} "
              f"{q.data_ptr():#14x}", flush=True)


if __name__ == "__main__":
    main()

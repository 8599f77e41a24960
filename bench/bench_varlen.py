"""Packed variable-length batches: fa2.attention_varlen against padding every sequence to the longest one
(fa2.attention and SDPA-flash on the padded batch), on the same tokens, in one run.

    python bench/bench_varlen.py                       # 16k tokens of lengths uniform in [64, 2048]
    python bench/bench_varlen.py --min 1 --max 128 --tokens 65536

TFLOP/s count only the real tokens' work (FA2 formula per sequence: 4 * H * len^2 * d, halved for causal;
fwdbwd 3.5x), so padding shows up as lost throughput. Timing as in bench.py (triton do_bench, median).
"""
import argparse
import json

import torch

from bench import attention_fn  # the padded implementations, exactly as bench.py times them


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--min", type=int, default=64)
    ap.add_argument("--max", type=int, default=2048)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--nheads", type=int, default=16)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()
    import triton.testing

    import fa2
    torch.manual_seed(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(torch.randint(args.min, args.max + 1, ())))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest, h, d = sum(lengths), max(lengths), args.nheads, args.hdim
    print(f"# {torch.cuda.get_device_name()}: {len(lengths)} sequences, {total} tokens, longest {longest}, "
          f"padded batch {len(lengths)}x{longest} ({len(lengths) * longest / total:.2f}x the tokens), h{h} d{d}")
    packed = [torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    padded = [torch.zeros(len(lengths), longest, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for p, t in zip(padded, packed):
        for i, n in enumerate(lengths):
            p[i, :n] = t[cu[i]:cu[i] + n].detach()
        p.requires_grad_()
    for causal in (False, True):
        flops = sum(4 * h * n * n * d for n in lengths) / (2 if causal else 1)
        runs = {
            "fa2_varlen": (lambda q, k, v: fa2.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal),
                           packed),
            "fa2_padded": (attention_fn("fa2", causal), padded),
            "sdpa_flash_padded": (attention_fn("sdpa_flash", causal), padded),
        }
        for mode, mult in (("fwd", 1.0), ("fwdbwd", 3.5)):
            cells = []
            for name, (fn, (q, k, v)) in runs.items():
                if mode == "fwd":
                    def step():
                        with torch.no_grad():
                            fn(q, k, v)
                else:
                    dout = torch.randn_like(q)

                    def step():
                        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
                ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                tflops = flops * mult / ms / 1e9
                cells.append(f"{name} {ms:7.3f} ms {tflops:6.1f} TFLOP/s")
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(dict(impl=name, mode=mode, causal=causal, ms=ms, tflops=tflops,
                                                sequences=len(lengths), tokens=total, longest=longest, nheads=h,
                                                hdim=d, min=args.min, max=args.max)) + "\n")
            print(f"causal={causal!s:5} {mode:6} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

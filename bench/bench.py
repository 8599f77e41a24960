"""Side-by-side attention benchmark: fa2 against torch SDPA's FLASH_ATTENTION (FlashAttention-2's own
kernels) and CUDNN_ATTENTION backends, same inputs, in one run.

    python bench/bench.py                                   # the default sweep (FA2-paper shapes)
    python bench/bench.py --hdims 128 --modes fwd --seqlens 4096,16384
    python bench/bench.py --batch 1 --nheads 32 --seqlens 1024,4096,8192   # inference shapes

Timing: triton.testing.do_bench (CUDA events, L2 flushed before every rep), median of 100 ms after 25 ms
of warm-up. FLOPs: FlashAttention-2's formula, fwd 4*B*H*N^2*d (halved for causal), bwd 2.5x, fwd+bwd 3.5x.
bwd and fwd+bwd run through autograd for every implementation. Each row of the results file is one
(impl, dtype, hdim, causal, seqlen, mode) JSON object; an implementation that fails records ms = null.
"""
import argparse
import datetime
import json
import pathlib
import re

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def attention_fn(impl, causal):
    """(b, s, h, d) tensors in, (b, s, h, d) out, for every implementation."""
    if impl == "fa2":
        return lambda q, k, v: fa2.attention(q, k, v, causal=causal)
    backend = SDPA[impl]

    def sdpa(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return sdpa


def time_one(impl, mode, q, k, v, dout, causal):
    import triton.testing as tt
    fn = attention_fn(impl, causal)
    if mode == "fwd":
        with torch.no_grad():
            return tt.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
    if mode == "bwd":
        out = fn(q, k, v)
        return tt.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup=25, rep=100,
                           return_mode="median")
    return tt.do_bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), warmup=25, rep=100,
                       return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--modes", default="fwd,bwd,fwdbwd")
    ap.add_argument("--impls", default="fa2,sdpa_flash,sdpa_cudnn")
    ap.add_argument("--tokens", type=int, default=16384, help="batch * seqlen when --batch is not given")
    ap.add_argument("--hidden", type=int, default=2048, help="nheads * hdim when --nheads is not given")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--nheads", type=int, default=None)
    ap.add_argument("--out", default=None, help="results .jsonl (default bench/results/<gpu>-<date>.jsonl)")
    args = ap.parse_args()

    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out_path = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / f"{slug}-{date[:10]}.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    impls = args.impls.split(",")
    print(f"# {device}, torch {torch.__version__}, fa2 {fa2.build_info()}")
    print(f"# results -> {out_path}")
    header = f"{'dtype':5} {'hdim':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5} {'mode':>6} " + \
        " ".join(f"{i:>10}" for i in impls) + f" {'fa2/flash':>9} {'maxdiff':>8}"
    print(header)
    with out_path.open("a") as f:
        for dt in args.dtypes.split(","):
            for d in map(int, args.hdims.split(",")):
                for causal in (c.strip().lower() == "true" for c in args.causal.split(",")):
                    for n in map(int, args.seqlens.split(",")):
                        b = args.batch or max(1, args.tokens // n)
                        h = args.nheads or args.hidden // d
                        mk = lambda: torch.randn(b, n, h, d, device="cuda", dtype=DTYPES[dt], requires_grad=True)
                        q, k, v = mk(), mk(), mk()
                        dout = torch.randn(b, n, h, d, device="cuda", dtype=DTYPES[dt])
                        with torch.no_grad():  # a guard, not a test: fa2 and SDPA-flash should agree
                            diff = (attention_fn("fa2", causal)(q, k, v).float()
                                    - attention_fn("sdpa_flash", causal)(q, k, v).float()).abs().max().item()
                        flops = 4 * b * h * n * n * d / (2 if causal else 1)
                        for mode in args.modes.split(","):
                            tflops = {}
                            for impl in impls:
                                try:
                                    ms = time_one(impl, mode, q, k, v, dout, causal)
                                except Exception as e:  # an impl without this shape: record, don't crash
                                    print(f"#   {impl} {mode} failed: {type(e).__name__}: {str(e)[:120]}")
                                    ms = None
                                tf = None if ms is None else flops * MODE_FLOPS[mode] / ms / 1e9
                                tflops[impl] = tf
                                f.write(json.dumps(dict(impl=impl, mode=mode, dtype=dt, hdim=d, causal=causal, seqlen=n,
                                                        batch=b, nheads=h, ms=ms, tflops=tf, device=device,
                                                        date=date)) + "\n")
                            ratio = (tflops.get("fa2") or 0) / tflops["sdpa_flash"] if tflops.get("sdpa_flash") else float("nan")
                            cells = " ".join(f"{tflops[i]:10.1f}" if tflops[i] else f"{'-':>10}" for i in impls)
                            print(f"{dt:5} {d:>4} {str(causal):>6} {n:>6} {b:>5} {h:>5} {mode:>6} {cells} {ratio:9.2f} {diff:8.1e}",
                                  flush=True)
                        f.flush()
                        del q, k, v, dout
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

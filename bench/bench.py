"""Side-by-side attention benchmark: fa2 against torch SDPA's FLASH_ATTENTION (FlashAttention-2's own
kernels) and CUDNN_ATTENTION backends, on the same inputs, in one run.

    python bench/bench.py                                   # the default sweep (FA2-paper shapes)
    python bench/bench.py --hdims 128 --modes fwd --seqlens 4096,16384
    python bench/bench.py --batch 1 --nheads 32 --seqlens 1024,4096,8192   # inference shapes

Shapes: batch * seqlen = 16384 tokens and nheads * hdim = 2048 unless --batch / --nheads say otherwise.
fa2 gets (batch, seqlen, nheads, hdim) tensors; SDPA gets q.transpose(1, 2) views of the same tensors,
as a FlashAttention user's code would pass them.
Timing: triton.testing.do_bench (CUDA events, L2 flushed before every rep), median over 100 ms after 25 ms
of warm-up. FLOPs: FlashAttention-2's formula, fwd 4*B*H*N^2*d (halved for causal), bwd 2.5x, fwd+bwd 3.5x.
bwd and fwdbwd go through autograd for every implementation (bwd: torch.autograd.grad of a kept output).
Before timing, each configuration checks fa2's forward against sdpa_flash (max |diff|, printed; a guard,
not a test). An implementation that raises is recorded with ms = tflops = null.
Results: one JSON object per (impl, dtype, hdim, causal, seqlen, mode), appended to
bench/results/<gpu>-<date>.jsonl (or --out); bench/plot.py draws them.
"""
import argparse
import datetime
import json
import math
import pathlib
import re

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("fwd", "bwd", "fwdbwd")
MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
IMPLS = ("fa2", "sdpa_flash", "sdpa_cudnn")


def attention_fn(impl, causal):
    """(batch, seqlen, nheads, hdim) q, k, v in, the same layout out, for every implementation."""
    if impl == "fa2":
        import fa2
        return lambda q, k, v: fa2.attention(q, k, v, causal=causal)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]

    def sdpa(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return sdpa


def time_ms(impl, mode, q, k, v, dout, causal):
    """Median milliseconds of one call of `mode` for `impl`."""
    import triton.testing

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    fn = attention_fn(impl, causal)
    if mode == "fwd":
        with torch.no_grad():
            return bench(lambda: fn(q, k, v))
    if mode == "bwd":
        out = fn(q, k, v)
        return bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    return bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))


def max_diff(q, k, v, causal):
    """max |fa2 - sdpa_flash| of the forward output; nan where either raises."""
    try:
        with torch.no_grad():
            a = attention_fn("fa2", causal)(q, k, v)
            b = attention_fn("sdpa_flash", causal)(q, k, v)
            return (a.float() - b.float()).abs().max().item()
    except Exception:  # the timing loop reports the failure itself
        return math.nan


def csv(s, cast=str, allowed=None, name=""):
    items = [cast(x.strip()) for x in s.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise SystemExit(f"bench.py: {name} {bad} not in {list(allowed)}")
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="false,true", help="comma list of false, true")
    ap.add_argument("--modes", default="fwd,bwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    ap.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen unless --batch")
    ap.add_argument("--hidden", type=int, default=2048, help="nheads = hidden // hdim unless --nheads")
    ap.add_argument("--batch", type=int, default=None, help="fixed batch (e.g. 1 for inference shapes)")
    ap.add_argument("--nheads", type=int, default=None, help="fixed number of heads (e.g. 32)")
    ap.add_argument("--out", default=None,
                    help="results .jsonl, appended to (default bench/results/<gpu>-<date>.jsonl)")
    args = ap.parse_args()
    dtypes = csv(args.dtypes, allowed=DTYPES, name="--dtypes")
    hdims = csv(args.hdims, int)
    seqlens = csv(args.seqlens, int)
    causals = [c == "true" for c in csv(args.causal.lower(), allowed=("false", "true"), name="--causal")]
    modes = csv(args.modes, allowed=MODES, name="--modes")
    impls = csv(args.impls, allowed=IMPLS, name="--impls")
    if not torch.cuda.is_available():
        raise SystemExit("bench.py: needs a CUDA GPU (torch.cuda.is_available() is False)")

    import fa2
    device = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    out_path = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / f"{slug}-{date[:10]}.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {device}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, fa2 {fa2.build_info()}")
    print(f"# TFLOP/s (FA2 formula); results appended to {out_path}")
    print(f"{'dtype':5} {'hdim':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5} {'mode':>6} "
          + " ".join(f"{i:>10}" for i in impls) + f" {'fa2/flash':>9} {'maxdiff':>8}", flush=True)

    with out_path.open("a") as f:
        for dt in dtypes:
            for d in hdims:
                for causal in causals:
                    for n in seqlens:
                        b = args.batch or max(1, args.tokens // n)
                        h = args.nheads or max(1, args.hidden // d)
                        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=DTYPES[dt], requires_grad=True)
                                   for _ in range(3))
                        dout = torch.randn(b, n, h, d, device="cuda", dtype=DTYPES[dt])
                        diff = max_diff(q, k, v, causal)
                        flops = 4 * b * h * n * n * d / (2 if causal else 1)
                        for mode in modes:
                            tflops = {}
                            for impl in impls:
                                try:
                                    ms = time_ms(impl, mode, q, k, v, dout, causal)
                                except Exception as e:  # e.g. a head dim this build or backend lacks
                                    print(f"#   {impl} {mode} failed: {type(e).__name__}: {str(e)[:160]}")
                                    ms = None
                                tflops[impl] = None if ms is None else flops * MODE_FLOPS[mode] / ms / 1e9
                                f.write(json.dumps(dict(impl=impl, mode=mode, dtype=dt, hdim=d, causal=causal,
                                                        seqlen=n, batch=b, nheads=h, ms=ms, tflops=tflops[impl],
                                                        device=device, date=date)) + "\n")
                            fa, fl = tflops.get("fa2"), tflops.get("sdpa_flash")
                            ratio = fa / fl if fa and fl else math.nan
                            cells = " ".join(f"{tflops[i]:10.1f}" if tflops[i] else f"{'-':>10}" for i in impls)
                            print(f"{dt:5} {d:>4} {str(causal):>6} {n:>6} {b:>5} {h:>5} {mode:>6} {cells} "
                                  f"{ratio:9.2f} {diff:8.1e}", flush=True)
                            f.flush()
                        del q, k, v, dout
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

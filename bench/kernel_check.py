"""Kernel iteration loop for the GPU box: call fa2's low-level fwd/bwd, check fwd and bwd against
an fp64 reference with FlashAttention's rule, then time fwd/bwd side by side with SDPA's FLASH backend.

    python bench/kernel_check.py [--quick] [--hdims 64,128] [--dtypes bf16]

Prints one line per check and a small timing table; exits non-zero on any failed check.
"""
import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(build_dir=None):
    """fa2, with the _C module of a standalone CMake build dir if given (bench/ab.py: one build per process): the
    package's Python files from this checkout next to that build's module, in a temporary folder."""
    if build_dir is not None:
        pkg = os.path.join(tempfile.mkdtemp(prefix="fa2-build-"), "fa2")
        shutil.copytree(os.path.join(REPO, "python", "fa2"), pkg, ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
        for name in os.listdir(build_dir):
            if name.startswith("_C") and name.endswith(".so"):
                os.symlink(os.path.abspath(os.path.join(build_dir, name)), os.path.join(pkg, name))
        sys.path.insert(0, os.path.dirname(pkg))
    import fa2
    if build_dir is not None:
        assert fa2.ops._C.__file__.startswith(os.path.dirname(os.path.dirname(pkg))), fa2.ops._C.__file__
    return fa2


C = None  # fa2 (load()); bench/ab.py and friends load a build dir's first
DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


def call_fwd(q, k, v, causal, scale, into=None):
    """into=(out, lse) reuses out (timing loops); otherwise a fresh one, poisoned with NaN."""
    out = torch.full_like(q, float("nan")) if into is None else into[0]
    return C.fwd(q, k, v, softmax_scale=scale, causal=causal, out=out)


def bwd_buffers(q, k):
    """dq, dk, dv (poisoned with NaN) for call_bwd."""
    return torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(k, float("nan"))


def call_bwd(dout, q, k, v, out, lse, causal, scale, deterministic=False, into=None):
    """into=bwd_buffers(q, k) reuses those buffers (timing loops); otherwise fresh ones."""
    dq, dk, dv = bwd_buffers(q, k) if into is None else into
    return C.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, deterministic=deterministic, dq=dq, dk=dk,
                 dv=dv)


def ref_attention(q, k, v, causal, scale, dtype):
    """Plain attention in `dtype` (fp64 reference, or the inputs' low precision)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = (q @ k.transpose(-1, -2)).float().to(dtype) * scale if dtype != torch.float64 else (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s.float() if dtype != torch.float64 else s, dim=-1).nan_to_num(0.0).to(dtype)
    o = (p @ v).transpose(1, 2)
    return o, lse


def check(name, ours, ref64, reflow, atol):
    ours = ours.double()
    ref64 = ref64.double()
    if torch.isnan(ours).any():
        print(f"FAIL {name}: NaN in output ({int(torch.isnan(ours).sum())} elements)")
        return False
    err = (ours - ref64).abs().max().item()
    base = (reflow.double() - ref64).abs().max().item()
    ok = err <= 2 * base + atol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: err {err:.2e}  torch-lowprec err {base:.2e}")
    return ok


def correctness(hdims, dtypes, quick, bwd=True):
    ok = True
    torch.manual_seed(0)
    shapes = [(1, 1, 1), (2, 113, 203), (2, 128, 128), (1, 1000, 1000), (1, 2048, 1023), (1, 1023, 2048)]
    if quick:
        shapes = shapes[:4]
    for dt in dtypes:
        for d in hdims:
            for (b, sq, sk) in shapes:
                for causal in (False, True):
                    for h, hk in ((4, 4), (8, 2)):
                        q = torch.randn(b, sq, h, d, device="cuda", dtype=DT[dt])
                        k = torch.randn(b, sk, hk, d, device="cuda", dtype=DT[dt])
                        v = torch.randn(b, sk, hk, d, device="cuda", dtype=DT[dt])
                        scale = d ** -0.5
                        o, lse = call_fwd(q, k, v, causal, scale)
                        torch.cuda.synchronize()
                        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
                        o64, lse64 = ref_attention(qd, kd, vd, causal, scale, torch.float64)
                        olow, _ = ref_attention(q, k, v, causal, scale, DT[dt])
                        tag = f"{dt} d{d} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal}"
                        ok &= check("fwd O   " + tag, o, o64, olow, 1e-3)
                        fin = torch.isfinite(lse64)
                        lse_err = (lse.double()[fin] - lse64.detach()[fin]).abs().max().item() if fin.any() else 0.0
                        lse_ok = lse_err < 1e-2 and bool((lse[~fin] == float("-inf")).all()) and not torch.isnan(lse).any()
                        print(f"{'ok  ' if lse_ok else 'FAIL'} fwd LSE {tag}: err {lse_err:.2e}")
                        ok &= lse_ok
                        if not bwd:
                            continue
                        dout = torch.randn_like(q)
                        dq, dk, dv = call_bwd(dout, q, k, v, o, lse, causal, scale)
                        torch.cuda.synchronize()
                        g64 = torch.autograd.grad(o64, (qd, kd, vd), dout.double())
                        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
                        olow2, _ = ref_attention(ql, kl, vl, causal, scale, DT[dt])
                        glow = torch.autograd.grad(olow2, (ql, kl, vl), dout)
                        for nm, ours, r64, rl in zip(("dQ", "dK", "dV"), (dq, dk, dv), g64, glow):
                            ok &= check(f"bwd {nm}  " + tag, ours, r64, rl, 1e-3)
                        if not quick and causal and h == hk:
                            dq2, _, _ = call_bwd(dout, q, k, v, o, lse, causal, scale, deterministic=True)
                            dq3, _, _ = call_bwd(dout, q, k, v, o, lse, causal, scale, deterministic=True)
                            same = torch.equal(dq2, dq3)
                            ok &= check("bwd dQ(det) " + tag, dq2, g64[0], glow[0], 1e-3) and same
                            print(f"{'ok  ' if same else 'FAIL'} deterministic dQ bit-identical {tag}")
    return ok


def timing(hdims, dtypes):
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(f"\n{'dtype':5} {'d':>4} {'causal':>6} {'N':>6} {'mode':>4} {'fa2':>7} {'flash':>7} {'cudnn':>7} {'fa2/flash':>9}")
    for dt in dtypes:
        for d in hdims:
            h = 2048 // d
            for causal in (False, True):
                for n in (1024, 4096, 16384):
                    b = 16384 // n
                    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=DT[dt]) for _ in range(3))
                    do = torch.randn_like(q)
                    scale = d ** -0.5
                    fl = 4 * b * h * n * n * d / (2 if causal else 1)
                    o, lse = call_fwd(q, k, v, causal, scale)
                    res = {}
                    res["fa2", "fwd"] = tt.do_bench(lambda: call_fwd(q, k, v, causal, scale), warmup=25, rep=100, return_mode="median")
                    res["fa2", "bwd"] = tt.do_bench(lambda: call_bwd(do, q, k, v, o, lse, causal, scale), warmup=25, rep=100, return_mode="median")
                    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        with sdpa_kernel([be]):
                            res[name, "fwd"] = tt.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), warmup=25, rep=100, return_mode="median")
                            ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                            dot = do.transpose(1, 2)
                            res[name, "bwd"] = tt.do_bench(lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True), warmup=25, rep=100, return_mode="median")
                    for mode, mult in (("fwd", 1.0), ("bwd", 2.5)):
                        tf = {k2: fl * mult / res[k2, mode] / 1e9 for k2 in ("fa2", "flash", "cudnn")}
                        print(f"{dt:5} {d:>4} {str(causal):>6} {n:>6} {mode:>4} {tf['fa2']:7.1f} {tf['flash']:7.1f} {tf['cudnn']:7.1f} {tf['fa2']/tf['flash']:9.2f}", flush=True)
                    del q, k, v, do, o, lse, qt, kt, vt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdims", default=None)
    ap.add_argument("--dtypes", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--timing-hdims", default="64,128")
    args = ap.parse_args()
    global C
    C = load()
    info = C.build_info()
    print(torch.cuda.get_device_name(), info)
    hdims = [int(x) for x in args.hdims.split(",")] if args.hdims else info["fwd_head_dims"]
    dtypes = args.dtypes.split(",") if args.dtypes else info["dtypes"]
    ok = correctness(hdims, dtypes, args.quick)
    print("CORRECTNESS", "PASS" if ok else "FAIL", flush=True)
    if not args.no_timing:
        timing([int(x) for x in args.timing_hdims.split(",")], dtypes[-1:])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

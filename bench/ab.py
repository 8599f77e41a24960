"""A/B of kernel builds: several standalone CMake build dirs (each with its own _C module), each checked
for correctness (kernel_check's quick grid) and timed against SDPA-flash, then one table.

    python bench/ab.py --builds base=build/base,quads=build/quads --hdims 64,128 --dtype bf16 --modes bwd

Build dirs come from e.g.
    cmake -S . -B build/quads -G Ninja -DFA2_HEAD_DIMS=64,128 -DFA2_DTYPES=bf16 \
          -DCMAKE_CUDA_ARCHITECTURES=90 "-DCMAKE_CUDA_FLAGS=-DSOME_KNOB=1" && cmake --build build/quads

Each build runs in its own process, and the builds take turns for --rounds rounds (the best of the
rounds' medians is kept), so that drift hits every variant alike. (Loading several builds into one
process does not work: every build's calls bound to the first build's kernels, even with RTLD_DEEPBIND.)
SDPA-flash is timed in every process; the ratio is taken against the flash time of the same process.
A build without one of --hdims is skipped for that head dim. Exits non-zero if any build fails a
correctness check.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import MODE_FLOPS  # noqa: E402  (bench/bench.py: FA2's FLOP multipliers per mode)


def worker(args):
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernel_check as kc
    kc.C = kc.load(args.worker)  # this build's module, even where an installed fa2 is importable
    # A forward-only A/B may use forward-only builds (FA2_KINDS=fwd).
    have = set(kc.C.build_info()["fwd_head_dims" if args.modes == "fwd" else "bwd_head_dims"])
    hdims = [d for d in map(int, args.hdims.split(",")) if d in have]
    out = {"ok": True, "times": {}}
    if args.check:
        fwd_only = args.modes == "fwd"
        out["ok"] = bool(kc.correctness(hdims, [args.dtype], quick=True, bwd=not fwd_only))
        # The kernel this build launches, by name (tile shapes are in the name).
        q, k, v = (torch.randn(1, 256, 2, hdims[0], device="cuda", dtype=kc.DT[args.dtype]) for _ in range(3))
        o, lse = kc.call_fwd(q, k, v, False, 1.0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            if fwd_only:
                kc.call_fwd(q, k, v, False, 1.0)
            else:
                kc.call_bwd(torch.randn_like(q), q, k, v, o, lse, False, 1.0)
            torch.cuda.synchronize()
        out["kernels"] = sorted({e.name for e in prof.events() if "bwd_kernel" in e.name or "fwd_kernel" in e.name})
    dt = kc.DT[args.dtype]
    for d in hdims:
        h = 2048 // d
        for causal in [c == "true" for c in args.causal.split(",")]:
            for n in map(int, args.seqlens.split(",")):
                b = 16384 // n
                torch.manual_seed(n + d)
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(3))
                do = torch.randn_like(q)
                scale = d ** -0.5
                o, lse = kc.call_fwd(q, k, v, causal, scale)
                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                for mode in args.modes.split(","):
                    if mode == "fwd":
                        def flash():
                            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        into = (torch.empty_like(o), torch.empty_like(lse))
                        ours = lambda: kc.call_fwd(q, k, v, causal, scale, into=into)  # noqa: E731
                    else:
                        def flash():
                            torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
                        into = kc.bwd_buffers(q, k)
                        ours = lambda: kc.call_bwd(do, q, k, v, o, lse, causal, scale, into=into)  # noqa: E731
                    key = f"{d},{causal},{n},{mode}"
                    out["times"][key] = [tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
                                         for fn in (flash, ours)]
    print("AB-RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--builds", required=True, help="name=dir,name=dir,...")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--modes", default="bwd", help="fwd,bwd")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--causal", default="false,true", help="comma list of false, true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="append one JSON object per measurement (each build and its process's SDPA-flash)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    builds = dict(item.split("=") for item in args.builds.split(","))
    ok = True
    best = {}  # (name, key) -> [flash ms, ours ms], best of rounds
    for rnd in range(args.rounds):
        for name, bdir in builds.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--builds", args.builds, "--worker", bdir,
                   "--hdims", args.hdims, "--dtype", args.dtype, "--modes", args.modes, "--seqlens", args.seqlens,
                   "--causal", args.causal]
            if rnd == 0:
                cmd.append("--check")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AB-RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"## {name}: worker failed (rc {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                ok = False
                continue
            res = json.loads(lines[-1][len("AB-RESULT "):])
            if rnd == 0:
                fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
                print(f"## {name} ({bdir}): correctness {'PASS' if res['ok'] else 'FAIL'}; launches {res['kernels']}")
                for ln in fails[:10]:
                    print("   " + ln)
                ok &= res["ok"]
            for key, (tf, to) in res["times"].items():
                prev = best.get((name, key))
                best[name, key] = [min(tf, prev[0]), min(to, prev[1])] if prev else [tf, to]
            print(f"## round {rnd}: {name} done", flush=True)

    names = list(builds)
    keys = sorted({key for (_, key) in best}, key=lambda s: (s.split(",")[3], int(s.split(",")[0]),
                                                            s.split(",")[1], int(s.split(",")[2])))
    print(f"\n{'dtype':5} {'d':>4} {'causal':>6} {'N':>6} {'mode':>4} "
          + " ".join(f"{nm:>20}" for nm in names) + "   (fa2 TFLOP/s, x = / flash of the same process)")
    for key in keys:
        d, causal, n, mode = key.split(",")
        d, n = int(d), int(n)
        fl = 4 * (16384 // n) * (2048 // d) * n * n * d / (2 if causal == "True" else 1) * MODE_FLOPS[mode]
        cols = []
        for nm in names:
            if (nm, key) not in best:
                cols.append("-".rjust(20))
                continue
            tf, to = best[nm, key]
            cols.append(f"{fl / to / 1e9:6.1f} {tf / to:.3f}x ({fl / tf / 1e9:5.1f})".rjust(20))
        print(f"{args.dtype:5} {d:>4} {causal:>6} {n:>6} {mode:>4} " + " ".join(cols), flush=True)
    if args.out:
        import torch

        common = {"dtype": args.dtype, "device": torch.cuda.get_device_name(), "date": str(datetime.date.today())}
        with open(args.out, "a") as f:
            for (nm, key), (tf, to) in sorted(best.items()):
                d, causal, n, mode = key.split(",")
                d, n = int(d), int(n)
                fl = 4 * (16384 // n) * (2048 // d) * n * n * d / (2 if causal == "True" else 1) * MODE_FLOPS[mode]
                shape = {"mode": mode, "hdim": d, "causal": causal == "True", "seqlen": n, "batch": 16384 // n,
                         "nheads": 2048 // d}
                for impl, ms in ((f"fa2:{nm}", to), (f"sdpa_flash:{nm}-process", tf)):
                    f.write(json.dumps({"impl": impl, **shape, **common, "ms": ms, "tflops": fl / ms / 1e9}) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

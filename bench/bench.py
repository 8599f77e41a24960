"""fa2's benchmarks, one tool. Every mode times fa2 side by side with torch SDPA's FLASH_ATTENTION backend
(FlashAttention-2's own kernels) and, where it applies, CUDNN_ATTENTION, on the same inputs in one run; prints a
table and appends one JSON object per measurement to a .jsonl file (keys impl, mode, dtype, hdim, causal, seqlen,
batch, nheads, ms, tflops, device, date, bench, plus the mode's own).

    python bench/bench.py sweep                     # FA2-paper shapes: 16k tokens, hidden 2048; fwd, bwd, fwd+bwd
    python bench/bench.py inference                 # batch 1, 32 heads, d128, 1k-8k
    python bench/bench.py varlen                    # packed batches against padding
    python bench/bench.py host                      # host µs per eager call at host-bound shapes
    python bench/bench.py decode                    # 1-4 queries against a KV cache of 1k-32k, GQA 32/8, d128
    python bench/bench.py features                  # window, softcap, sinks against plain and causal attention
    python bench/bench.py ab --builds base=DIR,new=DIR   # builds of fa2._C timed side by side, after the tests' check
    python bench/bench.py repeat                    # one shape on freshly placed inputs, several times
    python bench/bench.py plot FILE.jsonl           # TFLOP/s against seqlen, a panel per (hdim, causal, mode)

TFLOP/s use FlashAttention-2's formula: fwd 4*B*H*Nq*Nk*d (halved for causal), bwd 2.5x, fwd+bwd 3.5x. Timing is
triton.testing.do_bench (CUDA events, L2 flushed before every rep, median of 100 ms after 25 ms of warm-up) except
in host (wall time of back-to-back calls, CUDA-graph replay for the kernels alone). Correctness is the test suite's:
fa2.reference.attention_ref with fa2.testing's rule, run as a gate on small shapes before timing (--no-check
skips it). `MODE --dry-run` lists what would be measured without a GPU. docs/performance.md has the method and the
results.
"""
import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SDPA_IMPLS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
SWEEP_IMPLS = ("fa2", "fa2_sm80", "fa2_sm90", "sdpa_flash", "sdpa_cudnn")  # fa2_<family>: that family forced


def sdpa_backend(impl):
    from torch.nn.attention import SDPBackend
    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}[impl]


def attention_fn(impl, causal, fa2=None, dropout_p=0.0):
    """(batch, seqlen, nheads, hdim) q, k, v in, the same layout out, for every implementation. SDPA gets
    q.transpose(1, 2) views of the same tensors, as a FlashAttention user's code would pass them."""
    if impl == "fa2" or impl.startswith("fa2_"):  # fa2_<family>: the family is forced around the step (forced_step)
        fa2 = fa2 or common.load()
        return lambda q, k, v: fa2.attention(q, k, v, causal=causal, dropout_p=dropout_p)
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    backend = sdpa_backend(impl)

    def sdpa(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, dropout_p=dropout_p,
                                                  enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)
    return sdpa


def forced_step(impl, step):
    """`step` with fa2_<family>'s family forced (the test override) for all of it: the forward and the autograd
    backward, which plans its own launch when it runs."""
    if not impl.startswith("fa2_"):
        return step
    fa2 = common.load()

    def forced():
        fa2._C.set_test_overrides(family=impl[len("fa2_"):])
        try:
            return step()
        finally:
            fa2._C.set_test_overrides()
    return forced


def step_fn(fn, mode, q, k, v, dout):
    """The timed call of `mode`: fwd without grad; bwd = torch.autograd.grad of a kept output; fwdbwd both."""
    import torch
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return fn(q, k, v)
        return fwd
    if mode == "bwd":
        out = fn(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def gate(fa2, hdims, dtypes, bwd, args):
    """The tests' reference check on small shapes for what is about to be timed; True if it passed or was skipped."""
    if args.no_check:
        return True
    info = fa2.build_info()
    ok = True
    for dt in dtypes:
        if dt not in info["dtypes"]:
            continue
        fwd_dims = [d for d in hdims if any(x >= d for x in info["fwd_head_dims"])]
        bwd_dims = [d for d in fwd_dims if any(x >= d for x in info["bwd_head_dims"])] if bwd else []
        ok &= common.reference_check(fa2, bwd_dims, dt, bwd=True) if bwd_dims else True
        rest = [d for d in fwd_dims if d not in bwd_dims]
        ok &= common.reference_check(fa2, rest, dt, bwd=False) if rest else True
    return ok


# ------------------------------------------------------------------------------------------- sweep, inference
def sweep_shapes(args):
    """[(dtype, hdim, causal, seqlen, batch, nheads)] in the order they are measured."""
    out = []
    for dt in common.csv_list(args.dtypes, allowed=common.DTYPE_NAMES, name="--dtypes"):
        for d in common.csv_list(args.hdims, int):
            for causal in common.bools(args.causal):
                for n in common.csv_list(args.seqlens, int):
                    out.append((dt, d, causal, n, args.batch or max(1, args.tokens // n),
                                args.nheads or max(1, args.hidden // d)))
    return out


def run_sweep(args):
    import torch
    shapes = sweep_shapes(args)
    modes = common.csv_list(args.modes, allowed=common.MODE_FLOPS, name="--modes")
    impls = common.csv_list(args.impls, allowed=SWEEP_IMPLS + SDPA_IMPLS, name="--impls")
    if args.dry_run:
        print(f"# {args.mode}: {len(shapes)} shapes x modes {modes} x impls {impls}")
        for dt, d, causal, n, b, h in shapes:
            print(f"{dt} hdim {d} causal {causal} seqlen {n} batch {b} nheads {h}")
        return 0
    common.require_gpu(f"bench.py {args.mode}")
    fa2 = common.load(args.build)
    device, date = common.device_name(), common.now()
    out = args.out or common.default_out(device, date, "" if args.mode == "sweep" else f"-{args.mode}")
    rows = common.Rows(out, args.mode, device, date)
    print(common.header(f"bench.py {args.mode}", fa2))
    ok = True
    if "fa2" in impls:
        ok = gate(fa2, sorted({s[1] for s in shapes}), sorted({s[0] for s in shapes}),
                  any(m != "fwd" for m in modes), args)
    print(f"# TFLOP/s (FA2 formula); maxdiff = max |fa2 - sdpa_flash| of the forward, printed, not judged; "
          f"rows appended to {out}")
    print(f"{'dtype':5} {'hdim':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5} {'mode':>6} "
          + " ".join(f"{i:>10}" for i in impls) + f" {'fa2/flash':>9} {'maxdiff':>8}", flush=True)
    for dt, d, causal, n, b, h in shapes:
        if h % args.group:
            raise SystemExit(f"bench.py: --group {args.group} must divide the {h} heads of hdim {d}")
        q, k, v = (torch.randn(b, n, h // (1 if i == 0 else args.group), d, device="cuda", dtype=common.dtype(dt),
                               requires_grad=True) for i in range(3))
        dout = torch.randn(b, n, h, d, device="cuda", dtype=common.dtype(dt))
        diff = math.nan
        if "fa2" in impls:
            try:
                with torch.no_grad():
                    a = attention_fn("fa2", causal, fa2)(q, k, v)
                    diff = (a.float() - attention_fn("sdpa_flash", causal)(q, k, v).float()).abs().max().item()
            except Exception:  # the timing loop reports the failure itself
                pass
        for mode in modes:
            tflops = {}
            for impl in impls:
                try:
                    ms = common.time_ms(forced_step(impl, step_fn(attention_fn(impl, causal, fa2), mode, q, k, v, dout)))
                except Exception as e:  # e.g. a head dim this build or backend lacks
                    print(f"#   {impl} {mode} failed: {type(e).__name__}: {str(e)[:160]}")
                    ms = None
                tflops[impl] = None if ms is None else common.flops(b, h, n, n, d, causal, mode) / ms / 1e9
                rows.write(impl=impl, mode=mode, dtype=dt, hdim=d, causal=causal, seqlen=n, batch=b, nheads=h,
                           nheads_kv=h // args.group, ms=ms, tflops=tflops[impl])
            fa, fl = tflops.get("fa2"), tflops.get("sdpa_flash")
            ratio = fa / fl if fa and fl else math.nan
            cells = " ".join(f"{tflops[i]:10.1f}" if tflops[i] else f"{'-':>10}" for i in impls)
            print(f"{dt:5} {d:>4} {str(causal):>6} {n:>6} {b:>5} {h:>5} {mode:>6} {cells} {ratio:9.2f} {diff:8.1e}",
                  flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    rows.close()
    if args.plot:
        for dt in sorted({s[0] for s in shapes}):
            try:
                plot_file(out, dt)
            except (Exception, SystemExit) as e:  # no matplotlib, or no rows of dt: the rows are written, `plot` can follow later
                print(f"# plot {dt}: {type(e).__name__}: {e}")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------------ varlen
def varlen_lengths(args):
    import torch
    gen = torch.Generator().manual_seed(args.seed)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(torch.randint(args.min, args.max + 1, (), generator=gen)))
    if args.equal:  # as many sequences of the mean length: the dense batch's tiles, through the varlen call
        lengths = [round(sum(lengths) / len(lengths))] * len(lengths)
    return lengths


def run_varlen(args):
    import torch
    lengths = varlen_lengths(args)
    total, longest, h, d = sum(lengths), max(lengths), args.nheads, args.hdim
    max_seqlen = longest * args.max_factor  # the grid's query blocks per sequence (the empty ones past each end)
    desc = (f"{len(lengths)} sequences, {total} tokens, longest {longest}, padded batch {len(lengths)}x{longest} "
            f"({len(lengths) * longest / total:.2f}x the tokens), max_seqlen {max_seqlen}, h{h} d{d} {args.dtype}")
    if args.dry_run:
        print(f"# varlen: {desc}\n# lengths {lengths}")
        return 0
    common.require_gpu("bench.py varlen")
    fa2 = common.load(args.build)
    device, date = common.device_name(), common.now()
    rows = common.Rows(args.out or common.default_out(device, date, "-varlen"), "varlen", device, date)
    print(common.header("bench.py varlen", fa2) + f"\n# {desc}")
    ok = gate(fa2, [d], [args.dtype], True, args)
    dt = common.dtype(args.dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = [torch.randn(total, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]
    padded = [torch.zeros(len(lengths), longest, h, d, device="cuda", dtype=dt) for _ in range(3)]
    for p, t in zip(padded, packed):
        for i, n in enumerate(lengths):
            p[i, :n] = t[cu[i]:cu[i] + n].detach()
        p.requires_grad_()
    # The per-FLOP reference (issue #35): a padded batch of as many sequences of the mean length (the same tokens, no
    # padding), its TFLOP/s counted on its own work.
    mean = max(1, round(total / len(lengths)))
    dense = [torch.randn(len(lengths), mean, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]

    def varlen_fn(causal):
        return lambda q, k, v: fa2.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal)

    print("# TFLOP/s count the real tokens' work only (FA2 formula per sequence), so padding shows as lost throughput;")
    print(f"# fa2_dense: {len(lengths)}x{mean} (the same tokens, equal lengths), counted on its own work")
    modes = common.csv_list(args.modes, allowed=("fwd", "fwdbwd"), name="--modes")
    for causal in (False, True):
        work = sum(common.flops(1, h, n, n, d, causal) for n in lengths)
        runs = {
            "fa2_varlen": (varlen_fn(causal), packed, work),
            "fa2_varlen_sm80": (varlen_fn(causal), packed, work),  # the mma.sync family, forward and backward
            "fa2_dense": (attention_fn("fa2", causal, fa2), dense,
                          common.flops(len(lengths), h, mean, mean, d, causal)),
            "fa2_padded": (attention_fn("fa2", causal, fa2), padded, work),
            "sdpa_flash_padded": (attention_fn("sdpa_flash", causal), padded, work),
        }
        for mode in modes:
            cells, rate = [], {}
            for name, (fn, (q, k, v), flops) in runs.items():
                step = step_fn(fn, mode, q, k, v, torch.randn_like(q))
                ms = common.time_ms(forced_step("fa2_sm80", step) if name.endswith("_sm80") else step)
                tflops = rate[name] = flops * common.MODE_FLOPS[mode] / ms / 1e9
                cells.append(f"{name} {ms:7.3f} ms {tflops:6.1f} TFLOP/s")
                rows.write(impl=name, mode=mode, dtype=args.dtype, hdim=d, causal=causal, seqlen=longest,
                           batch=len(lengths), nheads=h, ms=ms, tflops=tflops, tokens=total, min=args.min,
                           max=args.max, equal=args.equal, max_seqlen=max_seqlen)
            cells.append(f"varlen/dense {rate['fa2_varlen'] / rate['fa2_dense']:.2f}")
            print(f"causal={causal!s:5} {mode:6} | " + " | ".join(cells), flush=True)
    rows.close()
    return 0 if ok else 1


# -------------------------------------------------------------------------------------------------------- host
HOST_SHAPES = [  # (batch, seqlen, nheads, head_dim, causal): small training / inference calls where host time rules
    (1, 512, 8, 64, True), (1, 1024, 32, 128, True), (4, 256, 12, 64, True)]


def host_side_by_side(fa2, b, s, h, d, causal, rounds):
    """{(impl, mode): µs per call} for one shape, the best of `rounds` rounds in which the impls take turns."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qt, kt, vt = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout, doutt = torch.randn_like(q), torch.randn_like(qt)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    fa = lambda q, k, v: fa2.attention(q, k, v, causal=causal)  # noqa: E731
    times = {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # entered once: no host time inside the timed calls
        for _ in range(rounds):
            for impl, attend, inputs, grad_out in (("fa2", fa, (q, k, v), dout),
                                                   ("sdpa_flash", sdpa, (qt, kt, vt), doutt),
                                                   ("sdpa_fa2", sdpa, (qt, kt, vt), doutt)):
                if impl == "sdpa_fa2":
                    fa2.sdpa.activate()
                detached = [t.detach() for t in inputs]
                kept = attend(*inputs)
                for mode, fn in (("fwd", lambda: attend(*detached)),
                                 ("bwd", lambda: torch.autograd.grad(kept, inputs, grad_out, retain_graph=True)),
                                 ("fwdbwd", lambda: torch.autograd.grad(attend(*inputs), inputs, grad_out))):
                    t = common.per_call_us(fn)
                    times[impl, mode] = min(times.get((impl, mode), t), t)
                fa2.sdpa.restore()
    # What the GPU alone needs for fa2's calls: a wall time near it is no longer host-bound.
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = fa2.fwd(qd, kd, vd, causal=causal)
    times["fa2", "fwd_kernel"] = common.kernel_us(lambda: fa2.fwd(qd, kd, vd, causal=causal))
    times["fa2", "bwd_kernel"] = common.kernel_us(lambda: fa2.bwd(dout, qd, kd, vd, out, lse, causal=causal))
    return times


def host_layers(fa2):
    """µs per call of each layer of fa2's stack on the smallest shape, then a cProfile of fwd+bwd."""
    import cProfile
    import pstats

    import torch
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=True)
    dout = torch.randn_like(out)

    def fwdbwd():
        torch.autograd.grad(fa2.attention(q, k, v, causal=True), (q, k, v), dout)

    layers = [
        ("torch.empty_like (one allocation, for scale)", lambda: torch.empty_like(q)),
        ("torch.ops.fa2.fwd.default (the C++ op, through autograd's key)",
         lambda: torch.ops.fa2.fwd.default(q.detach(), k.detach(), v.detach(), None, True, False)),
        ("fa2.fwd", lambda: fa2.fwd(q, k, v, causal=True)),
        ("fa2.attention (no grad)", lambda: fa2.attention(q.detach(), k.detach(), v.detach(), causal=True)),
        ("fa2.bwd", lambda: fa2.bwd(dout, q, k, v, out, lse, causal=True)),
        ("torch.ops.fa2.bwd.default", lambda: torch.ops.fa2.bwd.default(dout, q, k, v, out, lse, None, True, False)),
        ("fa2.attention fwd+bwd (autograd)", fwdbwd),
    ]
    print(f"\n# fa2's layers, host µs per call, q {tuple(q.shape)}")
    for name, fn in layers:
        try:
            print(f"  {common.per_call_us(fn):8.1f}  {name}")
        except Exception as e:  # an op signature this build lacks: the rest still runs
            print(f"  {'-':>8}  {name}: {type(e).__name__}: {str(e)[:120]}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fwdbwd()
    prof.disable()
    torch.cuda.synchronize()
    print("\n# cProfile, 200 x attention fwd+bwd, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def run_host(args):
    if args.dry_run:
        for b, s, h, d, causal in HOST_SHAPES:
            print(f"b{b} s{s} h{h} d{d} causal={causal}: fa2, sdpa_flash, sdpa_fa2 x fwd, bwd, fwdbwd; "
                  f"{args.rounds} rounds")
        return 0
    common.require_gpu("bench.py host")
    fa2 = common.load(args.build)
    device, date = common.device_name(), common.now()
    rows = common.Rows(args.out, "host", device, date)  # no default file: host times are per machine and noisy
    print(common.header("bench.py host", fa2) + "; host µs per eager call (bf16), fa2 / sdpa_flash")
    print(f"{'shape':>28} {'mode':>7} {'fa2':>9} {'sdpa_flash':>11} {'ratio':>6} {'sdpa_fa2':>9} {'fa2 GPU':>8}")
    for b, s, h, d, causal in HOST_SHAPES:
        times = host_side_by_side(fa2, b, s, h, d, causal, args.rounds)
        shape = dict(dtype="bf16", hdim=d, causal=causal, seqlen=s, batch=b, nheads=h, tflops=None)
        for mode in ("fwd", "bwd", "fwdbwd"):
            ours, theirs = times["fa2", mode], times["sdpa_flash", mode]
            kernel = {"fwd": times["fa2", "fwd_kernel"], "bwd": times["fa2", "bwd_kernel"],
                      "fwdbwd": times["fa2", "fwd_kernel"] + times["fa2", "bwd_kernel"]}[mode]
            print(f"{f'b{b} s{s} h{h} d{d} causal={causal}':>28} {mode:>7} {ours:9.1f} {theirs:11.1f} "
                  f"{ours / theirs:6.2f} {times['sdpa_fa2', mode]:9.1f} {kernel:8.1f}", flush=True)
            for impl in ("fa2", "sdpa_flash", "sdpa_fa2"):
                rows.write(impl=impl, mode=f"host_{mode}", ms=times[impl, mode] / 1e3, us_per_call=times[impl, mode],
                           **shape)
        for mode in ("fwd_kernel", "bwd_kernel"):
            rows.write(impl="fa2", mode=mode, ms=times["fa2", mode] / 1e3, us_per_call=times["fa2", mode], **shape)
    rows.close()
    if not args.no_layers:
        host_layers(fa2)
    return 0


# ---------------------------------------------------------------------------------------------------- features
# name: (causal, fa2.attention options; "sink" = a random (nheads,) sink, "sink_grad" = a learnable one (its gradient
# computed in the backward), "alibi" = ALiBi's geometric (nheads,) slopes). "none" and "causal" are the baselines each feature is compared with (same causality), and the rows
# SDPA-flash is timed at, as at the dropout rows (FlashAttention-2's own dropout).
FEATURES = {
    "none": (False, {}), "causal": (True, {}),
    "softcap": (False, dict(softcap=30.0)), "softcap_causal": (True, dict(softcap=30.0)),
    "softcap50": (False, dict(softcap=50.0)),
    "sink": (False, "sink"), "sink_causal": (True, "sink"), "sink_grad_causal": (True, "sink_grad"),
    "alibi": (False, "alibi"), "alibi_causal": (True, "alibi"),
    "window128": (True, dict(window_size=(127, 0))), "window1k": (True, dict(window_size=(1023, 0))),
    "window4k": (True, dict(window_size=(4095, 0))),
    "dropout": (False, dict(dropout_p=0.1)), "dropout_causal": (True, dict(dropout_p=0.1)),
    "deterministic": (False, dict(deterministic=True)), "deterministic_causal": (True, dict(deterministic=True)),
}


def visible_scores(n, causal, options):
    """Scores per (batch, head) that a feature's attention computes: n*n, causal n*n/2 (FA2's count), a causal window
    of w + 1 keys per row sum_i min(i + 1, w + 1) (only the visible ones: the band's TFLOP/s)."""
    if isinstance(options, dict) and "window_size" in options:
        w = options["window_size"][0]
        return sum(min(i + 1, w + 1) for i in range(n))
    return n * n / (2 if causal else 1)


def run_features(args):
    import torch
    names = common.csv_list(args.features, allowed=FEATURES, name="--features")
    modes = common.csv_list(args.modes, allowed=("fwd", "bwd", "fwdbwd"), name="--modes")
    hdims, seqlens = common.csv_list(args.hdims, int), common.csv_list(args.seqlens, int)
    if args.dry_run:
        for d in hdims:
            for n in seqlens:
                print(f"{args.dtype} d{d} seqlen {n} batch {max(1, args.tokens // n)} heads {args.hidden // d}: "
                      f"{', '.join(names)} x {modes}")
        return 0
    common.require_gpu("bench.py features")
    fa2 = common.load(args.build)
    if args.family:  # every fa2 call of the run, the gate's too, on that family where it serves the call
        fa2._C.set_test_overrides(family=args.family)
    device, date = common.device_name(), common.now()
    rows = common.Rows(args.out or common.default_out(device, date, "-features"), "features", device, date)
    print(common.header("bench.py features", fa2))
    ok = gate(fa2, hdims, [args.dtype], "bwd" in modes or "fwdbwd" in modes, args)
    dt = common.dtype(args.dtype)
    print(f"{'hdim':>4} {'seqlen':>6} {'feature':>15} {'mode':>6} {'fa2 ms':>8} {'TFLOP/s':>8} {'/ base':>7} "
          f"{'sdpa_flash ms':>13}", flush=True)
    for d in hdims:
        for n in seqlens:
            b, h = max(1, args.tokens // n), max(1, args.hidden // d)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            calls = {}  # (impl, name, mode) -> the timed call
            for name in names:
                causal, options = FEATURES[name]
                kw = (dict(sink=torch.randn(h, device="cuda", requires_grad=options == "sink_grad"))
                      if options in ("sink", "sink_grad") else
                      dict(alibi_slopes=2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda") / h)) if options == "alibi"
                      else dict(options))
                fn = lambda q, k, v, causal=causal, kw=kw: fa2.attention(q, k, v, causal=causal, **kw)  # noqa: E731
                for mode in modes:
                    calls["fa2", name, mode] = step_fn(fn, mode, q, k, v, dout)
                    if name in ("none", "causal") or "dropout_p" in kw:
                        flash = attention_fn("sdpa_flash", causal, dropout_p=kw.get("dropout_p", 0.0))
                        calls["sdpa_flash", name, mode] = step_fn(flash, mode, q, k, v, dout)
            # Interleaved rounds, the best of each: a feature and its baseline are timed seconds apart, not a
            # sweep apart, so clock drift does not pass for a feature's cost.
            best = {}
            for _ in range(args.rounds):
                for key, call in calls.items():
                    best[key] = min(best.get(key, math.inf), common.time_ms(call))
            for name in names:
                causal, options = FEATURES[name]
                for mode in modes:
                    ms = best["fa2", name, mode]
                    work = 4 * b * h * d * visible_scores(n, causal, options) * common.MODE_FLOPS[mode]
                    base = best.get(("fa2", "causal" if causal else "none", mode), math.nan)
                    flash = best.get(("sdpa_flash", name, mode))
                    if flash is not None:
                        rows.write(impl="sdpa_flash", mode=mode, dtype=args.dtype, hdim=d, causal=causal, seqlen=n,
                                   batch=b, nheads=h, ms=flash, tflops=work / flash / 1e9, feature=name)
                    rows.write(impl="fa2", mode=mode, dtype=args.dtype, hdim=d, causal=causal, seqlen=n, batch=b,
                               nheads=h, ms=ms, tflops=work / ms / 1e9, feature=name, time_vs_base=ms / base,
                               rounds=args.rounds, family=args.family or "plan",
                               options={options: True} if isinstance(options, str) else options)
                    print(f"{d:>4} {n:>6} {name:>15} {mode:>6} {ms:8.3f} {work / ms / 1e9:8.1f} {ms / base:7.3f} "
                          f"{'' if flash is None else f'{flash:13.3f}'}", flush=True)
            del q, k, v, dout, calls
            torch.cuda.empty_cache()
    rows.close()
    if args.family:
        fa2._C.set_test_overrides()
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------------ decode
def decode_shapes(args):
    """[(batch, seqlen_q, seqlen_k)]"""
    return [(b, sq, sk) for b in common.csv_list(args.batches, int) for sq in common.csv_list(args.seqlens_q, int)
            for sk in common.csv_list(args.seqlens_k, int)]


def decode_fn(impl, fa2, q, k, v):
    """(call, kv_expanded): one decode step of `impl`. SDPA gets enable_gqa=True; a backend that refuses it gets
    K/V expanded to q's heads once, outside the timing (kv_expanded=True: it then reads nheads/nheads_k x the bytes)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    if impl == "fa2":
        out = torch.empty_like(q)
        return (lambda: fa2.fwd(q, k, v, out=out)), False
    if impl in KVCACHE_IMPLS:
        return kvcache_fn(impl, fa2, q, k, v), False
    backend = sdpa_backend(impl)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def call():
        with sdpa_kernel([backend]), torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    try:
        call()
        return call, False
    except RuntimeError:
        if not gqa:
            raise
    group = q.shape[2] // k.shape[2]
    kt, vt = (t.repeat_interleave(group, dim=1) for t in (kt, vt))
    gqa = False
    call()
    return call, True


# fa2.attention_with_kvcache over the same keys: the cache as one entry per sequence, as 256-row pages in shuffled
# order, as 256-row pages in order (the unpaged cache's own memory, so its time over fa2_kvcache is the page code's
# cost alone), or with the step's seqlen_q rows appended first (its last rows, rewritten in place on every call), plain
# or with a rotary embedding of the whole head (q and the new keys rotated in the append's launch).
KVCACHE_IMPLS = ("fa2_kvcache", "fa2_paged", "fa2_paged_in_order", "fa2_append", "fa2_rotary")


def kvcache_fn(impl, fa2, q, k, v):
    import torch
    b, sk = k.shape[:2]
    lens = torch.full((b,), sk, device="cuda", dtype=torch.int32)
    if impl == "fa2_kvcache":
        return lambda: fa2.attention_with_kvcache(q, k, v, cache_seqlens=lens)
    if impl in ("fa2_append", "fa2_rotary"):
        sq = q.shape[1]
        new_k, new_v = k[:, sk - sq:].clone(), v[:, sk - sq:].clone()
        held = lens - sq
        if impl == "fa2_append":
            return lambda: fa2.attention_with_kvcache(q, k, v, new_k, new_v, cache_seqlens=held)
        angle = torch.rand(sk, q.shape[-1] // 2, device="cuda") * 6.283
        cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)
        return lambda: fa2.attention_with_kvcache(q, k, v, new_k, new_v, cache_seqlens=held, rotary_cos=cos,
                                                  rotary_sin=sin)
    page = 256
    pages = -(-sk // page)
    if impl == "fa2_paged_in_order":
        if sk % page:
            raise SystemExit(f"fa2_paged_in_order needs seqlen_k a multiple of {page} (got {sk})")
        table = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
        k_pages, v_pages = (t.view(b * pages, page, *t.shape[2:]) for t in (k, v))
        return lambda: fa2.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)
    table = torch.randperm(b * pages, device="cuda").view(b, pages).int()
    k_pages, v_pages = (torch.zeros(b * pages, page, *t.shape[2:], device="cuda", dtype=t.dtype) for t in (k, v))
    rows = torch.arange(sk, device="cuda")
    for i in range(b):
        k_pages[table[i].long()[rows // page], rows % page] = k[i]
        v_pages[table[i].long()[rows // page], rows % page] = v[i]
    return lambda: fa2.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)


def run_decode(args):
    import torch
    shapes = decode_shapes(args)
    impls = common.csv_list(args.impls, allowed=("fa2",) + KVCACHE_IMPLS + SDPA_IMPLS, name="--impls")
    h, hk, d = args.nheads, args.nheads_k, args.hdim
    if args.dry_run:
        print(f"# decode: h{h}/{hk} d{d} {args.dtype}, non-causal (the queries see the whole cache), impls {impls}")
        for b, sq, sk in shapes:
            print(f"batch {b} seqlen_q {sq} seqlen_k {sk}: KV cache {2 * b * sk * hk * d * 2 / 2**20:.0f} MiB")
        return 0
    common.require_gpu("bench.py decode")
    fa2 = common.load(args.build)
    device, date = common.device_name(), common.now()
    rows = common.Rows(args.out or common.default_out(device, date, "-decode"), "decode", device, date)
    print(common.header("bench.py decode", fa2))
    ok = gate(fa2, [d], [args.dtype], False, args) if "fa2" in impls else True
    dt = common.dtype(args.dtype)
    size = dt.itemsize if hasattr(dt, "itemsize") else 2
    print(f"# decode, h{h}/{hk} d{d} {args.dtype}: µs per call (do_bench median) and GB/s of the bytes a step must "
          f"move (q, K, V cache, out; * = K/V expanded to {h} heads for a backend without GQA)")
    rotary_ratio = "fa2_rotary" in impls and "fa2_append" in impls
    print(f"{'batch':>5} {'sq':>3} {'seqlen_k':>8} " + " ".join(f"{i + ' us':>16} {'GB/s':>6}" for i in impls)
          + f" {'fa2/flash':>9}" + (f" {'rotary/append':>13}" if rotary_ratio else ""), flush=True)
    for b, sq, sk in shapes:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
        moved = size * (2 * b * sq * h * d + 2 * b * sk * hk * d)
        cells, us, timed = [], {}, {}
        for impl in impls:
            timers = {}
            try:
                fn, expanded = decode_fn(impl, fa2, q, k, v)
                ms = common.time_ms(fn)
                if args.timers:
                    timers = dict(us_host=common.per_call_us(fn), us_graph=common.kernel_us(fn))
            except Exception as e:
                print(f"#   {impl} b{b} sq{sq} sk{sk} failed: {type(e).__name__}: {str(e)[:160]}")
                ms, expanded = None, False
            us[impl] = None if ms is None else ms * 1e3
            gbps = None if ms is None else moved / ms / 1e6
            tflops = None if ms is None else common.flops(b, h, sq, sk, d, False) / ms / 1e9
            rows.write(impl=impl, mode="decode", dtype=args.dtype, hdim=d, causal=False, seqlen=sq, seqlen_k=sk,
                       batch=b, nheads=h, nheads_k=hk, ms=ms, us=us[impl], tflops=tflops, gbps=gbps,
                       kv_expanded=expanded, **timers)
            timed[impl] = timers
            cells.append(f"{us[impl]:15.1f}{'*' if expanded else ' '} {gbps:6.0f}" if ms else f"{'-':>16} {'-':>6}")
            torch.cuda.empty_cache()
        ratio = us["sdpa_flash"] / us["fa2"] if us.get("fa2") and us.get("sdpa_flash") else math.nan
        rotary = (f" {us['fa2_rotary'] / us['fa2_append']:13.3f}" if us.get("fa2_rotary") and us.get("fa2_append")
                  else f" {'-':>13}") if rotary_ratio else ""
        print(f"{b:>5} {sq:>3} {sk:>8} " + " ".join(cells) + f" {ratio:9.2f}" + rotary, flush=True)
        for impl, t in timed.items():
            if t:
                print(f"#   {impl}: host {t['us_host']:.1f} us a call (back to back), kernels {t['us_graph']:.1f} us "
                      f"(graph replay)", flush=True)
        if rotary_ratio and timed.get("fa2_rotary") and timed.get("fa2_append"):
            r, a = timed["fa2_rotary"], timed["fa2_append"]
            print(f"#   rotary / append: host {r['us_host'] / a['us_host']:.3f}, kernels "
                  f"{r['us_graph'] / a['us_graph']:.3f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    rows.close()
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------- ab
def ab_points(args):
    """[(hdim, causal, seqlen)]: 16k tokens, hidden 2048, as the sweep."""
    return [(d, causal, n) for d in common.csv_list(args.hdims, int) for causal in common.bools(args.causal)
            for n in common.csv_list(args.seqlens, int)]


def ab_worker(args):
    """One build in this process: the tests' check (first round), then each point's fa2 and SDPA-flash medians."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fa2 = common.load(args.worker)
    modes = common.csv_list(args.modes, allowed=("fwd", "bwd"), name="--modes")
    info = fa2.build_info()
    # A forward-only A/B may use forward-only builds (FA2_KINDS=fwd).
    have = set(info["fwd_head_dims" if modes == ["fwd"] else "bwd_head_dims"])
    points = [p for p in ab_points(args) if p[0] in have]
    result = {"ok": True, "times": {}, "build_info": info}
    if args.check:
        hdims = sorted({p[0] for p in points})
        result["ok"] = bool(common.reference_check(fa2, hdims, args.dtype, bwd=modes != ["fwd"])) if hdims else True
        if hdims:  # the kernels this build launches, by name (tile shapes are in the name)
            q, k, v = (torch.randn(1, 256, 2, hdims[0], device="cuda", dtype=common.dtype(args.dtype))
                       for _ in range(3))
            o, lse = fa2.fwd(q, k, v)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                if modes == ["fwd"]:
                    fa2.fwd(q, k, v)
                else:
                    fa2.bwd(torch.randn_like(q), q, k, v, o, lse)
                torch.cuda.synchronize()
            result["kernels"] = sorted({e.name for e in prof.events() if "_kernel" in e.name and "fa2" in e.name})
    dt = common.dtype(args.dtype)
    for d, causal, n in points:
        torch.manual_seed(n + d)
        q, k, v, do, o, lse, (qt, kt, vt), ot = common.paired_inputs(fa2, 16384 // n, n, 2048 // d, d, dt, causal,
                                                                      SDPBackend.FLASH_ATTENTION)
        for mode in modes:
            if mode == "fwd":
                def flash():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                into = torch.empty_like(o)
                ours = lambda: fa2.fwd(q, k, v, causal=causal, out=into)  # noqa: E731
            else:
                def flash():
                    torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
                dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
                ours = lambda: fa2.bwd(do, q, k, v, o, lse, causal=causal, dq=dq, dk=dk, dv=dv)  # noqa: E731
            result["times"][f"{d},{causal},{n},{mode}"] = [common.time_ms(fn) for fn in (flash, ours)]
        del q, k, v, do, o, lse, qt, kt, vt, ot
        torch.cuda.empty_cache()
    print("AB-RESULT " + json.dumps(result), flush=True)
    return 0


def run_ab(args):
    if args.worker:
        return ab_worker(args)
    builds = dict(item.split("=", 1) for item in args.builds.split(","))
    modes = common.csv_list(args.modes, allowed=("fwd", "bwd"), name="--modes")
    points = ab_points(args)
    if args.dry_run:
        print(f"# ab: builds {builds}, {args.dtype}, modes {modes}, {args.rounds} rounds; 16k tokens, hidden 2048")
        for name, path in builds.items():
            print(f"# {name}: {path}: {common.module_files(path) or 'NO MODULE FOUND'}")
        for d, causal, n in points:
            print(f"hdim {d} causal {causal} seqlen {n} batch {16384 // n} nheads {2048 // d}")
        return 0
    ok = True
    best = {}  # (name, key) -> [flash ms, ours ms], best of rounds
    for rnd in range(args.rounds):
        for name, bdir in builds.items():
            cmd = [sys.executable, os.path.abspath(__file__), "ab", "--builds", args.builds, "--worker", bdir,
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
                print(f"## {name} ({bdir}): {res['build_info']}\n   tests' reference check "
                      f"{'PASS' if res['ok'] else 'FAIL'}; launches {res.get('kernels')}")
                for ln in [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")][:10]:
                    print("   " + ln)
                ok &= res["ok"]
            for key, (tf, to) in res["times"].items():
                prev = best.get((name, key))
                best[name, key] = [min(tf, prev[0]), min(to, prev[1])] if prev else [tf, to]
            print(f"## round {rnd}: {name} done", flush=True)

    names = list(builds)
    keys = sorted({key for (_, key) in best}, key=lambda s: (s.split(",")[3], int(s.split(",")[0]),
                                                            s.split(",")[1], int(s.split(",")[2])))
    base = names[0]
    print(f"\n{'dtype':5} {'d':>4} {'causal':>6} {'N':>6} {'mode':>4} " + " ".join(f"{nm:>20}" for nm in names)
          + "".join(f" {nm + '/' + base:>12}" for nm in names[1:])
          + "   (fa2 TFLOP/s, x = / flash of the same process (flash TFLOP/s); then time ratio base / build: "
            "> 1 = the build is faster)")
    ratios = collections.defaultdict(list)
    device, date = None, common.now()
    rows = None
    if args.out:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown"
        rows = common.Rows(args.out, "ab", device, date)
    for key in keys:
        d, causal, n, mode = key.split(",")
        d, n, causal = int(d), int(n), causal == "True"
        b, h = 16384 // n, 2048 // d
        fl = common.flops(b, h, n, n, d, causal, mode)
        cols, extra = [], []
        for nm in names:
            if (nm, key) not in best:
                cols.append("-".rjust(20))
                continue
            tf, to = best[nm, key]
            cols.append(f"{fl / to / 1e9:6.1f} {tf / to:.3f}x ({fl / tf / 1e9:5.1f})".rjust(20))
            if rows:
                shape = dict(mode=mode, dtype=args.dtype, hdim=d, causal=causal, seqlen=n, batch=b, nheads=h)
                rows.write(impl=f"fa2:{nm}", ms=to, tflops=fl / to / 1e9, **shape)
                rows.write(impl=f"sdpa_flash:{nm}-process", ms=tf, tflops=fl / tf / 1e9, **shape)
        for nm in names[1:]:
            if (nm, key) in best and (base, key) in best:
                r = best[base, key][1] / best[nm, key][1]
                ratios[nm, mode].append(r)
                extra.append(f"{r:12.3f}")
            else:
                extra.append(f"{'-':>12}")
        print(f"{args.dtype:5} {d:>4} {str(causal):>6} {n:>6} {mode:>4} " + " ".join(cols) + " ".join(extra),
              flush=True)
    for (nm, mode), rs in sorted(ratios.items()):
        print(f"# {nm} vs {base}, {mode}: time ratio {base}/{nm} min {min(rs):.3f} median {statistics.median(rs):.3f} "
              f"max {max(rs):.3f} over {len(rs)} points")
    if rows:
        rows.close()
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------------ repeat
def run_repeat(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, n, h, d = args.batch, args.seqlen, args.nheads, args.hdim
    if args.dry_run:
        print(f"# repeat: fwd {args.dtype} b{b} h{h} n{n} d{d} causal={args.causal}, {args.repeats} repeats, "
              f"+{args.pad_mb} MB of padding allocations per repeat")
        return 0
    common.require_gpu("bench.py repeat")
    fa2 = common.load(args.build)
    device, date = common.device_name(), common.now()
    rows = common.Rows(args.out, "repeat", device, date)
    fl = common.flops(b, h, n, n, d, args.causal)
    keep = []
    print(common.header("bench.py repeat", fa2) + f"\n# fwd {args.dtype} b{b} h{h} n{n} d{d} causal={args.causal}, "
          "TFLOP/s per repeat (fresh inputs each, at other addresses), do_bench median")
    print(f"{'rep':>3} {'fa2':>7} {'flash':>7} {'fa2/flash':>9} {'q address':>14}")
    for rep in range(args.repeats):
        keep.append(torch.empty(args.pad_mb * rep + 1, 1 << 20, dtype=torch.uint8, device="cuda"))
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=common.dtype(args.dtype)) for _ in range(3))
        into = torch.empty_like(q)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
        ours = lambda: fa2.fwd(q, k, v, causal=args.causal, out=into)  # noqa: E731
        t_ours, t_flash = common.time_ms(ours), common.time_ms(flash)
        print(f"{rep:>3} {fl / t_ours / 1e9:7.1f} {fl / t_flash / 1e9:7.1f} {t_flash / t_ours:9.3f} "
              f"{q.data_ptr():#14x}", flush=True)
        shape = dict(mode="fwd", dtype=args.dtype, hdim=d, causal=args.causal, seqlen=n, batch=b, nheads=h,
                     repeat=rep, q_address=q.data_ptr())
        rows.write(impl="fa2", ms=t_ours, tflops=fl / t_ours / 1e9, **shape)
        rows.write(impl="sdpa_flash", ms=t_flash, tflops=fl / t_flash / 1e9, **shape)
    rows.close()
    return 0


# -------------------------------------------------------------------------------------------------------- plot
PAPER = "16k tokens, hidden 2048"
PLOT_ORDER = {"fa2": 0, "sdpa_flash": 1, "sdpa_cudnn": 2}


def family(r):
    if r["batch"] * r["seqlen"] == 16384 and r["nheads"] * r["hdim"] == 2048:
        return PAPER
    return f"batch {r['batch']}, {r['nheads']} heads"


def plot_panels(rows, dtype, shapes=None):
    """(family, {(hdim, causal, mode): {impl: {seqlen: TFLOP/s or None}}}) of a sweep's rows; the last row of a point
    wins where a file holds several runs."""
    rows = [r for r in rows if r.get("dtype") == dtype and r.get("mode") in common.MODE_FLOPS
            and r.get("bench", "sweep") in ("sweep", "inference")]
    families = collections.Counter(family(r) for r in rows)
    if not families:
        raise SystemExit(f"plot: no {dtype} sweep rows")
    shapes = shapes or (PAPER if PAPER in families else families.most_common(1)[0][0])
    if shapes not in families:
        raise SystemExit(f"plot: no rows for shapes '{shapes}'; the file has {sorted(families)}")
    panels = collections.defaultdict(lambda: collections.defaultdict(dict))
    for r in rows:
        if family(r) == shapes:
            panels[(r["hdim"], r["causal"], r["mode"])][r["impl"]][r["seqlen"]] = r["tflops"]
    return shapes, panels, [r for r in rows if family(r) == shapes]


def plot_file(path, dtype="bf16", shapes=None, output=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes, panels, rows = plot_panels(common.read_rows(path), dtype, shapes)
    keys = sorted(panels, key=lambda p: ({"fwd": 0, "bwd": 1, "fwdbwd": 2}.get(p[2], 3), p[0], p[1]))
    cols = min(4, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        d, causal, mode = key
        for impl, pts in sorted(panels[key].items(), key=lambda kv: (PLOT_ORDER.get(kv[0], 9), kv[0])):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] if pts[x] is not None else math.nan for x in xs], marker="o", label=impl,
                    linewidth=2.2 if impl == "fa2" else 1.2)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for pts in panels[key].values() for x in pts})
        ax.set_xticks(ticks, [f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in ticks])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode}, hdim {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    devices = sorted({r["device"] for r in rows})
    dates = sorted({r["date"][:10] for r in rows})
    fig.suptitle(f"{', '.join(devices)} ({', '.join(dates)}): {dtype}, {shapes}; FA2 FLOP formula")
    fig.tight_layout()
    out = output or str(os.path.splitext(str(path))[0]) + f"-{dtype}.png"
    fig.savefig(out, dpi=110)
    print(out)
    return out


def run_plot(args):
    if args.dry_run:
        shapes, panels, _ = plot_panels(common.read_rows(args.results), args.dtype, args.shapes)
        print(f"# {shapes}: {len(panels)} panels")
        for (d, causal, mode), impls in sorted(panels.items()):
            print(f"{mode} hdim {d} causal {causal}: " + ", ".join(f"{i} {len(p)} seqlens" for i, p in impls.items()))
        return 0
    plot_file(args.results, args.dtype, args.shapes, args.output)
    return 0


# -------------------------------------------------------------------------------------------------- arguments
def parser():
    ap = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True, metavar="MODE")

    def mode(name, help_line, doc=""):
        p = sub.add_parser(name, help=help_line, description=help_line + ("\n\n" + doc if doc else ""),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--dry-run", action="store_true", help="list what would be measured and exit (no GPU)")
        if name not in ("plot", "ab"):
            p.add_argument("--build", default=None,
                           help="time the fa2._C of this folder (CMake build dir, installed fa2/, or _C*.so.NN parts) "
                                "instead of the installed one")
        return p

    def shape_args(p, hdims, seqlens, batch, nheads, impls=",".join(SWEEP_IMPLS)):
        p.add_argument("--dtypes", default="bf16,fp16", help="comma list of bf16, fp16")
        p.add_argument("--hdims", default=hdims)
        p.add_argument("--seqlens", default=seqlens)
        p.add_argument("--causal", default="false,true", help="comma list of false, true")
        p.add_argument("--modes", default="fwd,bwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd (all via autograd)")
        p.add_argument("--impls", default=impls, help="comma list of fa2, " + ", ".join(SDPA_IMPLS))
        p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen unless --batch")
        p.add_argument("--hidden", type=int, default=2048, help="nheads = hidden // hdim unless --nheads")
        p.add_argument("--batch", type=int, default=batch, help="fixed batch")
        p.add_argument("--nheads", type=int, default=nheads, help="fixed number of heads")
        p.add_argument("--group", type=int, default=1,
                       help="query heads per K/V head (GQA; 1 = MHA); TFLOP/s count the query heads' work, as for MHA")
        p.add_argument("--out", default=None, help="results .jsonl, appended to (default bench/results/<gpu>-<date>"
                                                   f"{'' if batch is None else '-inference'}.jsonl)")
        p.add_argument("--plot", action="store_true", help="then draw <out>-<dtype>.png per dtype (matplotlib)")
        p.add_argument("--no-check", action="store_true", help="skip the tests' reference check before timing")

    p = mode("sweep", "fa2 vs SDPA flash vs SDPA cuDNN, fwd/bwd/fwd+bwd, causal and not, per head dim and seqlen.",
             "Shapes: batch * seqlen = --tokens (16384), nheads * hdim = --hidden (2048), the FA2 paper's.")
    shape_args(p, "64,128,256", "512,1024,2048,4096,8192,16384", None, None)
    p.set_defaults(run=run_sweep)

    p = mode("inference", "The sweep at inference shapes: batch 1, 32 heads, d128, seqlens 1k-8k (every option of "
                          "sweep applies).")
    shape_args(p, "128", "1024,2048,4096,8192", 1, 32)
    p.set_defaults(run=run_sweep)

    p = mode("varlen", "Packed variable-length batch (fa2.attention_varlen) against padding it to the longest "
                       "sequence (fa2 and SDPA-flash), on the same tokens.",
             "TFLOP/s count only the real tokens' work, so padding shows up as lost throughput.")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--min", type=int, default=64, help="shortest sequence")
    p.add_argument("--max", type=int, default=2048, help="longest sequence (lengths uniform in [min, max])")
    p.add_argument("--equal", action="store_true",
                   help="every sequence of the mean length: fa2_varlen then runs fa2_dense's tiles through the varlen "
                        "call, so varlen/dense is the call's own cost")
    p.add_argument("--max-factor", type=int, default=1,
                   help="pass max_seqlen = this x the longest (more grid tiles past each sequence's end)")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=common.DTYPE_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd (comma-separated)")
    p.add_argument("--out", default=None, help="results .jsonl (default bench/results/<gpu>-<date>-varlen.jsonl)")
    p.add_argument("--no-check", action="store_true", help="skip the tests' reference check before timing")
    p.set_defaults(run=run_varlen)

    p = mode("host", "Host µs per eager call, fa2 vs SDPA-flash vs sdpa_fa2 (fa2 behind F.scaled_dot_product_"
                     "attention), at shapes where the GPU is never the bottleneck.",
             "Wall time per call of back-to-back calls, fwd (no grad), bwd (autograd.grad on a kept graph) and "
             "fwd+bwd, each the best of --rounds rounds in which the implementations take turns; fa2's kernels alone "
             "by CUDA-graph replay (kernel_us). Then the time of each layer of fa2's stack and a cProfile.")
    p.add_argument("--rounds", type=int, default=5, help="rounds per shape; each time is the best over them")
    p.add_argument("--out", default=None, help="append one JSON object per measurement here")
    p.add_argument("--no-layers", action="store_true", help="skip the per-layer times and the cProfile")
    p.set_defaults(run=run_host)

    p = mode("decode", "Decode: a few queries (--seqlens-q, default 1) against a KV cache of --seqlens-k, per batch; "
                       "fa2.fwd vs SDPA flash vs cuDNN, GQA 32/8 heads, d128.",
             "Non-causal: every query sees the whole cache (with 1-4 queries a bottom-right causal mask hides at most "
             "3 keys, and SDPA's is_causal is top-left, which would be wrong here). Rows: mode 'decode', seqlen = "
             "seqlen_q, seqlen_k = the cache length, us, gbps = bytes of q, K, V, out over the time.")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--seqlens-q", default="1", help="queries per step, e.g. 1,2,4")
    p.add_argument("--seqlens-k", default="1024,4096,16384,32768")
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-k", type=int, default=8)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=common.DTYPE_NAMES)
    p.add_argument("--impls", default="fa2,sdpa_flash,sdpa_cudnn",
                   help="comma list of fa2, " + ", ".join(KVCACHE_IMPLS + SDPA_IMPLS) + " (fa2_kvcache: "
                        "fa2.attention_with_kvcache on the same cache; fa2_paged: the cache in shuffled 256-row pages; "
                        "fa2_paged_in_order: in order, the same memory as fa2_kvcache; fa2_append: appending the "
                        "step's rows first; fa2_rotary: the same with a rotary embedding, q and the new keys rotated "
                        "in the append)")
    p.add_argument("--timers", action="store_true",
                   help="also each call's host wall time (back-to-back calls) and its kernels' GPU time alone (CUDA-graph "
                        "replay), beside do_bench's: a decode step is host-bound at small batches, and served from a "
                        "captured graph")
    p.add_argument("--out", default=None, help="results .jsonl (default bench/results/<gpu>-<date>-decode.jsonl)")
    p.add_argument("--no-check", action="store_true", help="skip the tests' reference check before timing")
    p.set_defaults(run=run_decode)

    p = mode("features", "Sliding window, softcap, sinks, ALiBi and dropout in fa2.attention against plain and causal "
                         "attention at the same shapes (SDPA-flash timed at the baselines and with dropout), fwd and "
                         "bwd, in interleaved rounds.",
             "Rows carry 'feature' and time_vs_base = time / the same-causality baseline's. TFLOP/s count only the\n"
             "scores a feature computes: a window's are the visible band's (compare with causal's at the same seqlen).")
    p.add_argument("--features", default=",".join(FEATURES), help="comma list of " + ", ".join(FEATURES))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each call's best is kept")
    p.add_argument("--hdims", default="64,128")
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--modes", default="fwd,bwd", help="comma list of fwd, bwd, fwdbwd")
    p.add_argument("--dtype", default="bf16", choices=common.DTYPE_NAMES)
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="nheads = hidden // hdim")
    p.add_argument("--out", default=None, help="results .jsonl (default bench/results/<gpu>-<date>-features.jsonl)")
    p.add_argument("--family", default=None, choices=("sm80", "sm90"),
                   help="force fa2's forward family (the test override) where it serves the call, e.g. sm90 to time "
                        "the Hopper forward's dropout against its plain forward (default: the launch plan's)")
    p.add_argument("--no-check", action="store_true", help="skip the tests' reference check before timing")
    p.set_defaults(run=run_features)

    p = mode("ab", "A/B of builds of fa2._C: each build in its own process, checked with the tests' reference and "
                   "rule, then timed (fa2.fwd / fa2.bwd into given buffers) next to SDPA-flash; builds take turns.",
             "--builds name=DIR,... : a standalone CMake build dir, an installed fa2/ folder, or a folder of the\n"
             "_C*.so.NN parts that bench/verify.sh leaves in $OUT (e.g. the last landing's module). The first build is\n"
             "the base: a last column per other build gives time(base) / time(build). Two builds cannot share one\n"
             "process (fa2's ops register once per process), so each round runs one process per build, in turn, and\n"
             "the best of the rounds' medians is kept; SDPA-flash is timed in every process and each ratio to it is\n"
             "taken within the process. Shapes: 16k tokens, hidden 2048. Exits non-zero if a build fails the check.\n"
             "One build alone is the kernel iteration loop: check + timing against FA2.")
    p.add_argument("--builds", required=True, help="name=dir,name=dir,... (the first is the base)")
    p.add_argument("--hdims", default="64,96,128,256")
    p.add_argument("--dtype", default="bf16", choices=common.DTYPE_NAMES)
    p.add_argument("--modes", default="fwd,bwd", help="comma list of fwd, bwd")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--causal", default="false,true", help="comma list of false, true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", help="append one JSON object per measurement (each build and its process's SDPA-flash)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run_ab)

    p = mode("repeat", "One forward shape timed --repeats times on freshly allocated inputs, shifted in memory each "
                       "time, fa2 next to SDPA-flash: for a ratio that moves between runs of the same kernels.")
    p.add_argument("--hdim", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=common.DTYPE_NAMES)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--pad-mb", type=int, default=37, help="MB more allocated (and kept) before each repeat")
    p.add_argument("--out", default=None, help="append one JSON object per measurement here")
    p.set_defaults(run=run_repeat)

    p = mode("plot", "Plot a sweep/inference .jsonl: TFLOP/s against seqlen, a panel per (hdim, causal, mode), a line "
                     "per impl (matplotlib; no GPU).",
             "Rows are grouped into shape families: '16k tokens, hidden 2048' (the sweep) or 'batch B, H heads'\n"
             "(inference); one family per figure. Where a file holds several runs of a point, the last one wins.")
    p.add_argument("results", help="a bench.py sweep .jsonl file")
    p.add_argument("--dtype", default="bf16", choices=common.DTYPE_NAMES)
    p.add_argument("--shapes", default=None, help=f"shape family to plot (default: '{PAPER}' if present)")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: <results>-<dtype>.png)")
    p.set_defaults(run=run_plot)
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Context parallelism at long sequence (#38, item 4): examples/train_gpt_cp.py's GPT trained on one sequence sharded
over the n GPUs of this torchrun launch, fa2 against SDPA's default backend under the same engine (PyTorch's
context_parallel ring), side by side in one run:

    torchrun --nproc-per-node 2 bench/context_parallel.py --out bench/results/h100x2-<date>-context-parallel.jsonl

  kernels  one profiled training step per impl: the attention kernels that ran (fa2's, or SDPA's choice)
  cp       --steps training steps (the first --warmup-steps untimed) at seqlen = chunk x n, each GPU holding `chunk`
           tokens, for every chunk of --chunks, impl of --impls and rotate method of --rotates: ms per step (the
           slowest rank's) and tokens/s per GPU
  overlap  after each cp measurement, one more step profiled (rank 0): the ms of NCCL kernels, the share of them
           that ran while a computing kernel ran (communication hidden), the attention kernels' ms, the GPU's busy ms
  single   one GPU without context parallelism, at seqlen = chunk (the same tokens per GPU: the weak-scaling
           reference) and at the whole seqlen where it fits (the strong-scaling reference); the ranks share these runs
  scaling  per chunk and impl: cp tokens/s per GPU over single's at the same chunk, and over single's at the whole
           sequence; and fa2 / sdpa
  loss     --loss-steps steps at --loss-seqlen, sharded and unsharded from the same seed and batches: both curves and
           their largest difference

One JSON line per measurement (impl, mode, dtype, seqlen, batch, nheads, hdim, ms, tokens_per_s, ngpus, device, date,
and the mode's own keys), written by rank 0 as it goes, and a table at the end. What the numbers should look like
(docs/context-parallel.md#the-benchmark): at the same chunk a GPU of the sharded run does n times the causal
attention work of the single GPU (the sequence is n times longer), so the weak-scaling ratio falls as attention's
share of the step grows; the strong-scaling ratio is the engine's overhead (communication not hidden under the
attention, the merge, the float32 gradient sums) and should rise with the chunk.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import common  # noqa: E402
import train_gpt  # noqa: E402
import train_gpt_cp  # noqa: E402

ATTENTION_KERNELS = re.compile(r"fa2::|flash|fmha|cudnn|sdpa|attention", re.IGNORECASE)
OPS = re.compile(r"(aten|fa2|c10d|_c10d_functional)::")  # the ops (host events) that launched kernels, not kernels


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def config(args, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def union(intervals):
    """The disjoint union of (start, end) intervals, sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def covered(a, b) -> float:
    """The length of the intersection of two disjoint unions."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def overlap(kernels) -> dict:
    """From (name, start_us, end_us) of one step's GPU kernels: ms of communication (NCCL kernels), of it the ms that
    ran while a computing kernel ran too (hidden under the computation), the attention kernels' ms, and the ms the
    GPU was busy with anything."""
    comm = union((s, e) for n, s, e in kernels if "nccl" in n.lower())
    compute = union((s, e) for n, s, e in kernels if "nccl" not in n.lower())
    attention = union((s, e) for n, s, e in kernels if ATTENTION_KERNELS.search(n) and "nccl" not in n.lower())
    length = lambda u: sum(e - s for s, e in u) / 1e3  # noqa: E731
    comm_ms, hidden_ms = length(comm), covered(comm, compute) / 1e3
    return {"comm_ms": comm_ms, "comm_hidden_ms": hidden_ms, "attention_ms": length(attention),
            "busy_ms": length(union(comm + compute)), "comm_hidden": hidden_ms / comm_ms if comm_ms else None}


def attention_kernels(args, mesh, data, vocab) -> dict:
    """{"kernels": {kernel name: launches per step} of the attention kernels, "others": {kernel name: ms} of the ten
    costliest of the rest (not NCCL's), **overlap(...)} of one profiled cp training step (after one unprofiled one)."""
    from torch.profiler import ProfilerActivity, profile

    with train_gpt.sdpa_backends(train_gpt_cp.BACKENDS[args.attn]), \
            train_gpt_cp.sharded(mesh, args.seqlen, args.rotate, args.device) as positions:
        trainer = train_gpt_cp.Trainer(args, vocab, mesh)
        batches = train_gpt.batches(data, args.batch, args.seqlen, args.seed)
        trainer.step(*next(batches), positions)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.step(*next(batches), positions)
            torch.cuda.synchronize()
    del trainer
    free_memory()
    names = {e.key[:160]: e.count for e in prof.key_averages()
             if e.self_device_time_total > 0 and ATTENTION_KERNELS.search(e.key) and not OPS.match(e.key)}
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not OPS.match(e.name)]
    others = collections.Counter()
    for name, start, end in kernels:
        if not ATTENTION_KERNELS.search(name) and "nccl" not in name.lower():
            others[name[:100]] += (end - start) / 1e3
    return {"kernels": names, "others": {n: round(ms, 2) for n, ms in others.most_common(10)}, **overlap(kernels)}


class Run:
    """The rows, the budget and the ranks' agreement on both."""

    def __init__(self, args, mesh):
        self.args, self.mesh = args, mesh
        self.rank, self.n = dist.get_rank(), mesh.size()
        self.start = time.perf_counter()
        self.device = torch.cuda.get_device_name()
        self.rows = common.Rows(args.out if self.rank == 0 else None, "context_parallel", self.device,
                                common.now())
        self.written = []
        self.hdim = args.dim // args.nheads

    def in_budget(self) -> bool:
        """Rank 0's clock decides for all (every rank must run the same collectives)."""
        left = torch.tensor([float(time.perf_counter() - self.start < self.args.budget_s)], device="cuda")
        dist.broadcast(left, 0)
        return bool(left.item())

    def write(self, **row):
        row = {"dtype": "bf16", "hdim": self.hdim, "causal": True, "batch": self.args.batch,
               "nheads": self.args.nheads, "layers": self.args.layers, "dim": self.args.dim, "tflops": None,
               "ms": None, **row}
        if self.rank == 0:
            self.written.append(self.rows.write(**row))


def measure_cp(run, data, vocab):
    a = run.args
    for chunk in a.chunks:
        seqlen = chunk * run.n
        for rotate in a.rotates:
            for impl in a.impls:
                if not run.in_budget():
                    return
                cfg = config(a, attn=impl, seqlen=seqlen, rotate=rotate, steps=a.steps, warmup_steps=a.warmup_steps,
                             log_every=0)
                try:
                    r = train_gpt_cp.train(cfg, run.mesh, data, vocab)
                    error = None
                except Exception as e:  # the same failure on every rank (an unsupported backend): recorded
                    r, error = None, f"{type(e).__name__}: {str(e)[:300]}"
                free_memory()
                run.write(impl=impl, mode="cp", seqlen=seqlen, chunk=chunk, rotate=rotate, ngpus=run.n,
                          ms=r and r["ms_per_step"], tokens_per_s=r and r["tokens_per_s_per_gpu"], error=error)
                if r is not None and a.overlap:  # one more step, profiled: how much of the ring's traffic hides
                    stats = attention_kernels(cfg, run.mesh, data, vocab)
                    stats.pop("kernels")
                    run.write(impl=impl, mode="overlap", seqlen=seqlen, chunk=chunk, rotate=rotate, ngpus=run.n,
                              **stats)


def measure_single(run, data, vocab):
    """The single-GPU runs, shared round-robin by the ranks (each on its own GPU, at the same time), gathered."""
    a = run.args
    todo = [(impl, kind, chunk) for chunk in a.chunks for impl in a.impls for kind in ("single_chunk", "single_total")]
    mine = []
    for impl, kind, chunk in todo[run.rank::run.n]:
        seqlen = chunk if kind == "single_chunk" else chunk * run.n
        cfg = config(a, attn=impl, seqlen=seqlen, steps=a.steps, warmup_steps=a.warmup_steps, log_every=0)
        try:
            r, error = train_gpt_cp.train(cfg, None, data, vocab), None
        except torch.cuda.OutOfMemoryError:
            r, error = None, "out of memory"
        free_memory()
        mine.append(dict(impl=impl, mode=kind, seqlen=seqlen, chunk=chunk, ngpus=1, ms=r and r["ms_per_step"],
                         tokens_per_s=r and r["tokens_per_s_per_gpu"], error=error, rank=run.rank))
    everyone = [None] * run.n
    dist.all_gather_object(everyone, mine)
    for rows in everyone:
        for row in rows:
            run.write(**row)


def measure_loss(run, data, vocab):
    """Sharded (all ranks) and unsharded (one rank per impl) curves from the same seed; rank 0 compares them."""
    a = run.args
    curves = {}
    for impl in a.impls:
        cfg = config(a, attn=impl, seqlen=a.loss_seqlen, steps=a.loss_steps, warmup_steps=0, log_every=0)
        curves[impl] = train_gpt_cp.train(cfg, run.mesh, data, vocab)["loss"]
        free_memory()
    mine = {}
    for i, impl in enumerate(a.impls):
        if i % run.n == run.rank:
            cfg = config(a, attn=impl, seqlen=a.loss_seqlen, steps=a.loss_steps, warmup_steps=0, log_every=0)
            mine[impl] = train_gpt_cp.train(cfg, None, data, vocab)["loss"]
            free_memory()
    everyone = [None] * run.n
    dist.all_gather_object(everyone, mine)
    single = {k: v for d in everyone for k, v in d.items()}
    for impl in a.impls:
        diff = max(abs(x - y) for x, y in zip(curves[impl], single[impl]))
        run.write(impl=impl, mode="loss", seqlen=a.loss_seqlen, ngpus=run.n, steps=a.loss_steps, seed=a.seed,
                  loss_sharded=curves[impl], loss_unsharded=single[impl], max_abs_diff=diff)


def summarize(run):
    """Scaling rows and the table (rank 0)."""
    rows = run.written
    single = {(r["impl"], r["mode"], r["chunk"]): r["tokens_per_s"] for r in rows if r["mode"].startswith("single")}
    cp = [r for r in rows if r["mode"] == "cp"]
    best = {(r["impl"], r["chunk"], r["rotate"]): r["tokens_per_s"] for r in cp}
    for r in cp:
        if r["tokens_per_s"] is None:
            continue
        weak, strong = single.get((r["impl"], "single_chunk", r["chunk"])), single.get((r["impl"], "single_total", r["chunk"]))
        sdpa = best.get(("sdpa", r["chunk"], r["rotate"]))
        run.write(impl=r["impl"], mode="scaling", seqlen=r["seqlen"], chunk=r["chunk"], rotate=r["rotate"], ngpus=run.n,
                  tokens_per_s=r["tokens_per_s"], vs_single_chunk=weak and r["tokens_per_s"] / weak,
                  vs_single_total=strong and r["tokens_per_s"] / strong,
                  vs_sdpa=sdpa and r["tokens_per_s"] / sdpa)
    print(f"\n# {run.device} x {run.n}, torch {torch.__version__}; GPT {run.args.layers}x{run.args.dim} "
          f"({run.args.nheads} heads of {run.hdim}), batch {run.args.batch}, bf16 autocast, causal; tokens/s per GPU")
    print(f"{'impl':10} {'rotate':9} {'chunk':>7} {'seqlen':>8} {'ms/step':>9} {'tok/s/GPU':>10} {'/1GPU@chunk':>11} "
          f"{'/1GPU@seqlen':>12} {'/sdpa':>6}")
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in run.written:
        if r["mode"] == "scaling":
            print(f"{r['impl']:10} {r['rotate']:9} {r['chunk']:7d} {r['seqlen']:8d} "
                  f"{fmt(next(c['ms'] for c in cp if (c['impl'], c['chunk'], c['rotate']) == (r['impl'], r['chunk'], r['rotate'])), '9.1f')} "
                  f"{fmt(r['tokens_per_s'], '10,.0f')} {fmt(r['vs_single_chunk'], '11.2f')} "
                  f"{fmt(r['vs_single_total'], '12.2f')} {fmt(r['vs_sdpa'], '6.2f')}")
    for r in rows:
        if r["mode"].startswith("single") or (r["mode"] == "cp" and r.get("error")):
            print(f"{r['impl']:10} {r['mode']:12} seqlen {r['seqlen']:7d}: {fmt(r['ms'], '.1f')} ms/step, "
                  f"{fmt(r['tokens_per_s'], ',.0f')} tokens/s{'  ' + r['error'] if r.get('error') else ''}")
        if r["mode"] == "loss":
            print(f"{r['impl']:10} loss over {r['steps']} steps at {r['seqlen']}: sharded {r['loss_sharded'][-1]:.4f}, "
                  f"unsharded {r['loss_unsharded'][-1]:.4f}, max |difference| {r['max_abs_diff']:.4f}")
        if r["mode"] == "overlap":
            print(f"{r['impl']:10} {r['rotate']:9} chunk {r['chunk']:6d}: communication {r['comm_ms']:.1f} ms, "
                  f"{fmt(r['comm_hidden'] and 100 * r['comm_hidden'], '.0f')}% of it under computation; attention "
                  f"kernels {r['attention_ms']:.1f} ms; GPU busy {r['busy_ms']:.1f} ms (rank 0, one profiled step)")
            if r.get("others"):
                print(f"{'':10} the costliest other kernels, ms: " + "; ".join(f"{n[:70]} {ms:.1f}"
                                                                       for n, ms in r["others"].items()))
        if r["mode"] == "kernels":
            print(f"{r['impl']:10} attention kernels per step: " + "; ".join(f"{c}x {n[:90]}" for n, c in r["kernels"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    train_gpt_cp.model_arguments(p)
    p.add_argument("--chunks", type=lambda s: common.csv_list(s, int, name="--chunks"), default=[16384, 32768, 65536],
                   help="tokens per GPU of the sharded runs (seqlen = chunk x ngpus)")
    p.add_argument("--impls", type=lambda s: common.csv_list(s, str, list(train_gpt_cp.BACKENDS), "--impls"),
                   default=["fa2", "sdpa"])
    p.add_argument("--rotates", type=lambda s: common.csv_list(s, str, ["allgather", "alltoall"], "--rotates"),
                   default=["allgather", "alltoall"])
    p.add_argument("--steps", type=int, default=5, help="training steps per measurement")
    p.add_argument("--warmup-steps", type=int, default=2, help="of which untimed")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="skip the profiled step after each cp measurement (communication hidden under computation)")
    p.add_argument("--loss-seqlen", type=int, default=16384)
    p.add_argument("--loss-steps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=75.0,
                   help="start no further cp measurement after this many seconds (singles and losses still run)")
    p.add_argument("--out", default=None, help="JSON-lines file (rank 0 appends); default: none, the table only")
    args = p.parse_args(argv)
    if args.device != "cuda":
        p.error("--device: the benchmark runs on GPUs")
    args.attn, args.rotate, args.log_every = args.impls[0], args.rotates[0], 0  # each measurement sets its own
    common.require_gpu("bench/context_parallel.py")
    mesh = train_gpt_cp.init(unsharded=False)
    run = Run(args, mesh)
    data, vocab = train_gpt_cp.load_data(args.data)
    if run.rank == 0:
        print(common.header("context_parallel", train_gpt.fa2) + f", {run.n} GPUs", flush=True)

    for impl in args.impls:  # also warms each impl's path up
        profiled = attention_kernels(config(args, attn=impl, seqlen=args.chunks[0] * run.n, rotate=args.rotates[0]),
                                     mesh, data, vocab)
        run.write(impl=impl, mode="kernels", seqlen=args.chunks[0] * run.n, ngpus=run.n, kernels=profiled["kernels"])
    measure_cp(run, data, vocab)
    measure_single(run, data, vocab)
    measure_loss(run, data, vocab)
    if run.rank == 0:
        summarize(run)
        print(f"\n{time.perf_counter() - run.start:.0f} s" + (f"; rows in {args.out}" if args.out else ""), flush=True)
    run.rows.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fa2 under PyTorch's context parallelism through SDPA (#38, item 2): `torch.distributed.tensor.experimental.
context_parallel` shards a causal sequence over 2 or more GPUs in its load-balanced layout (2n chunks, rank r holding
chunks r and 2n-1-r), F.scaled_dot_product_attention then runs PyTorch's ring, which calls SDPA's flash op once per
ring step, forward and backward, and fa2.sdpa.activate() routes those calls to fa2's kernels. For both rotate
methods (all-gather, all-to-all), eager and torch.compile, every rank holds its shard of out, dq, dk and dv to
unsharded attention's fp64 reference with FlashAttention's 2x rule, and torch.profiler shows fa2's forward and
backward kernels running (at least once per ring step) and none of torch's own attention kernels.

The eager cases run in one torchrun launch of this file over every GPU of the host (at least 2, at most 8), the
compiled ones in a launch over 2 GPUs (on more, the engine's compiled causal ring is not supported by PyTorch: its
own test skips it, and on 4 H200s the compiled all-to-all case gave NaN and hung with torch's own flash kernels as
with fa2's; docs/context-parallel.md). The test makes the launches (NCCL):

    torchrun --nproc-per-node 2 tests/test_context_parallel_sdpa.py --out DIR [--cases a,b]   # DIR/rank{r}.json
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2
from fa2.testing import assert_close_to_ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling helpers, also under torchrun
from test_context_parallel import _reference  # noqa: E402

WORLD = 2  # the GPUs the test needs; the eager cases' launch takes every GPU of the host (up to 8)
BATCH, SEQLEN, NHEADS, HEAD_DIM = 2, 4096, 8, 64
DTYPE = torch.bfloat16
CASES = {f"{rotate}_{mode}": (rotate, mode == "compiled")
         for rotate in ("allgather", "alltoall") for mode in ("eager", "compiled")}
# fa2's kernels as the profiler names them (demangled): the mma.sync forward fa2::fwd_kernel<...>, the Hopper
# forward fa2::sm90::fwd_kernel<...>, the backward's main loop fa2::bwd_kernel<...> or fa2::sm90::bwd_kernel<...>.
FA2_FWD, FA2_BWD = re.compile(r"\bfa2::(sm90::)?fwd_kernel\b"), re.compile(r"\bfa2::(sm90::)?bwd_kernel\b")
# torch's own attention kernels: FlashAttention-2's (pytorch_flash::flash_fwd_kernel...), the memory-efficient
# ones (fmha_cutlassF...), cuDNN's (cudnn_generated_..._sdpa...).
TORCH_ATTENTION = re.compile(r"pytorch_flash|flash_fwd|flash_bwd|fmha|cudnn|sdpa", re.IGNORECASE)


def head_tail_positions(rank, world, seqlen):
    """The positions PyTorch's load-balanced sharding gives rank `rank`: chunks rank and 2*world-1-rank of 2*world."""
    chunk = seqlen // (2 * world)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * world - 1 - rank)])


def causal_sdpa(q, k, v):
    # F.scaled_dot_product_attention is looked up at call time: inside context_parallel it is PyTorch's patched one.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kernel_counts(prof):
    """{kernel name: launches} of the GPU kernels the profiler saw."""
    return {e.key: e.count for e in prof.key_averages() if e.self_device_time_total > 0}


def run_case(name, mesh):
    """One case on this rank; returns the attention kernels it launched. Raises AssertionError on a mismatch, after
    every collective (the other rank never waits for this one)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.profiler import ProfilerActivity, profile

    rotate, compiled = CASES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    set_rotate_method(rotate)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same sequence on every rank
    q, k, v, dout = (torch.randn(BATCH, SEQLEN, NHEADS, HEAD_DIM, generator=gen).to("cuda", DTYPE) for _ in range(4))
    positions = torch.arange(SEQLEN, device="cuda")
    attend = causal_sdpa
    if compiled:
        torch._dynamo.reset()  # the rotate method is read while tracing: a graph of the previous case must not serve
        attend = torch.compile(causal_sdpa, fullgraph=True)
    # The one buffer context_parallel shards is the positions: the rank's tokens are q, k, v at those positions,
    # (batch, seqlen, nheads, head_dim) as a model makes them, handed to SDPA as its heads-first views.
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}), \
            sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        leaves = [t[:, positions].requires_grad_() for t in (q, k, v)]
        local_dout = dout[:, positions]

        def forward_backward():
            out = attend(*(t.transpose(1, 2) for t in leaves)).transpose(1, 2)
            return [out.detach()] + list(torch.autograd.grad(out, leaves, local_dout))

        forward_backward()  # compiles the compiled case's forward and backward graphs
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            results = forward_backward()
            torch.cuda.synchronize()
    kernels = {n: c for n, c in kernel_counts(prof).items() if FA2_FWD.search(n) or FA2_BWD.search(n)
               or TORCH_ATTENTION.search(n)}

    rows = positions.cpu()
    assert torch.equal(rows, head_tail_positions(rank, world, SEQLEN)), f"{name} rank {rank}: not PyTorch's load-" \
        f"balanced layout (positions {rows[:4].tolist()}...): this test is about that one"
    out64, _, grads64 = _reference(q, k, v, None, dout, dict(causal=True), True)
    out_low, _, grads_low = _reference(q, k, v, None, dout, dict(causal=True), False)
    scale = max(g.abs().max().item() for g in grads64)  # dq, dk, dv come from the same P, dP and dS (test_bwd.py)
    for what, got, ref64, ref_low in zip(("out", "dq", "dk", "dv"), results, [out64, *grads64], [out_low, *grads_low]):
        assert_close_to_ref(got, ref64[:, rows], ref_low[:, rows], name=f"{name} rank {rank} {what}",
                            scale=None if what == "out" else scale)
    fwd = sum(c for n, c in kernels.items() if FA2_FWD.search(n))
    bwd = sum(c for n, c in kernels.items() if FA2_BWD.search(n))
    theirs = {n: c for n, c in kernels.items() if TORCH_ATTENTION.search(n)}
    assert fwd >= world and bwd >= world and not theirs, \
        f"{name} rank {rank}: fa2 forward kernels {fwd}, backward {bwd} (each ring step runs one of each: >= " \
        f"{world}), torch's attention kernels {theirs} (none)"
    return kernels


def main(out_dir, cases):
    """One rank under torchrun: the cases in order, {case: {"outcome": "ok" or the failure, "kernels": ...}}."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    fa2.sdpa.activate()
    results = {}
    for name in cases:
        start = time.perf_counter()
        try:
            results[name] = {"outcome": "ok", "kernels": run_case(name, mesh)}
        except Exception:
            results[name] = {"outcome": traceback.format_exc(), "kernels": {}}
        print(f"rank {rank} {name} ({time.perf_counter() - start:.0f} s): {results[name]['outcome'][:2000]}",
              flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["outcome"] == "ok" for r in results.values()) else 1


# ------------------------------------------------------------------------------------------------ CPU
# The same engine on gloo, with aten's flash op served on the CPU by fa2.sdpa's own adapters (the functions
# fa2.sdpa.activate() registers for CUDA), fa2's kernels replaced by the reference kernels in float64: the calls
# PyTorch's ring makes (keywords, chunk views, the saved lse and its slices) reach the adapters, the adapters hand the
# kernels what fa2's checks accept, and the sharded result is unsharded attention's to rounding.
CPU_SEQLEN, CPU_HEAD_DIM = 96, 16


def _reference_call(kernels):
    """fa2.ops.call with fwd_out and bwd_out computed by the reference kernels, after the checks fa2's C++ makes on
    what the adapters pass (rows of 16-byte chunks, a contiguous lse)."""
    from fa2 import ops

    def call(op, *args):
        if op is ops.FWD_OUT:
            q, k, v, _, _, _, _, scale, causal, out = args
            tensors = dict(q=q, k=k, v=v, out=out)
            lse = None
        else:
            dout, q, k, v, out, lse, _, _, _, _, scale, causal, _, dq, dk, dv = args
            tensors = dict(q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
            assert lse.is_contiguous(), f"lse strides {lse.stride()}: fa2's backward refuses them"
        for name, t in tensors.items():
            assert t.stride(-1) == 1 and all(st % 8 == 0 for sz, st in zip(t.shape[:-1], t.stride()[:-1]) if sz > 1), \
                f"{name} strides {t.stride()}: fa2's kernels refuse them"
        if op is ops.FWD_OUT:
            return kernels.fwd(q, k, v, softmax_scale=scale, causal=causal, out=out)[1]
        return kernels.bwd(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, dq=dq, dk=dk, dv=dv)
    return call


def cpu_worker(rank, world, port, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    from fa2.integrations import sdpa
    from test_context_parallel import ReferenceKernels
    from test_context_parallel_ring import same_on_every_rank

    # One thread a rank: with 8 threads on a loaded machine, some 4-rank all-gather runs differed from the unsharded
    # result by up to 4.4e-10, where runs on one thread agree to 3e-15; cause not found (docs/log.md, session 38).
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    kernels = ReferenceKernels()
    sdpa.ops.call = _reference_call(kernels)
    lib = torch.library.Library("aten", "IMPL", "CPU")
    lib.impl("_scaled_dot_product_flash_attention", sdpa._sdpa_fwd, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", sdpa._sdpa_bwd, "CPU")
    _cp_options.convert_to_f32 = False  # merged and summed in float64: exact to rounding
    outcomes = {}
    for rotate in ("allgather", "alltoall"):
        try:
            set_rotate_method(rotate)
            gen = torch.Generator().manual_seed(zlib.crc32(rotate.encode()))
            q, k, v, dout = (torch.randn(2, CPU_SEQLEN, 4, CPU_HEAD_DIM, generator=gen, dtype=torch.float64)
                             for _ in range(4))
            same_on_every_rank(dist.group.WORLD, rotate, rank, k=k, v=v)
            positions = torch.arange(CPU_SEQLEN)
            with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
                leaves = [t[:, positions].requires_grad_() for t in (q, k, v)]
                shards = [DTensor.from_local(t.transpose(1, 2), mesh, [Shard(2)], run_check=False) for t in leaves]
                kernels.calls = 0
                out = torch.ops.aten._scaled_dot_product_flash_attention(*shards, is_causal=True)[0]
                out = out.to_local().transpose(1, 2)
                grads = torch.autograd.grad(out, leaves, dout[:, positions])
            assert torch.equal(positions, head_tail_positions(rank, world, CPU_SEQLEN)), positions
            assert kernels.calls == 2 * world, f"{kernels.calls} launches, expected a forward and a backward per step"
            out64, _, grads64 = _reference(q, k, v, None, dout, dict(causal=True), True)
            for name, got, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], [out64, *grads64]):
                torch.testing.assert_close(got, ref[:, positions], rtol=1e-10, atol=1e-10,
                                           msg=lambda m: f"{rotate} rank {rank} {name}: {m}")
            outcomes[rotate] = "ok"
        except Exception:
            outcomes[rotate] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcomes, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_the_engines_calls_reach_fa2s_sdpa_adapters_and_match_unsharded(world, tmp_path):
    """CPU, gloo: PyTorch's ring through aten's flash op and fa2.sdpa's adapters (reference kernels, float64) is
    unsharded causal attention, forward and backward, for both rotate methods; one forward and one backward launch
    per ring step."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(cpu_worker, args=(world, port, str(tmp_path)), nprocs=world)
    for rank in range(world):
        outcomes = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for rotate, outcome in outcomes.items():
            assert outcome == "ok", f"{rotate} rank {rank}:\n{outcome}"


# ------------------------------------------------------------------------------------------------ GPU
_LAUNCH = {}


def launches(gpus):
    """{world size: the cases its launch runs}: eager on every GPU (up to 8), compiled on 2 (PyTorch's limit)."""
    world = min(gpus, 8)
    compiled = [name for name, (_, c) in CASES.items() if c]
    eager = [name for name in CASES if name not in compiled]
    return {world: list(CASES)} if world == WORLD else {world: eager, WORLD: compiled}


@pytest.fixture
def torchrun_results(tmp_path_factory):
    """The results per rank of the launch that runs `case` (process start, NCCL and compilation cost seconds each,
    so each launch runs once for the module)."""
    def results(case):
        plan = launches(torch.cuda.device_count())
        world = next(w for w, cases in plan.items() if case in cases)
        if world not in _LAUNCH:
            out = tmp_path_factory.mktemp(f"cp_sdpa{world}")
            env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   os.path.abspath(__file__), "--out", str(out),
                   "--cases", ",".join(plan[world])]
            try:  # a hung collective ends at the process group's 120 s timeout; this reports how far it got
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
            except subprocess.TimeoutExpired as e:
                text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
                run = subprocess.CompletedProcess(cmd, "timeout after 480 s", text(e.stdout), text(e.stderr))
            ranks = []
            for rank in range(world):
                path = out / f"rank{rank}.json"
                ranks.append(json.loads(path.read_text()) if path.exists() else None)
            _LAUNCH[world] = run, ranks
        return _LAUNCH[world]
    return results


@pytest.mark.gpu
@pytest.mark.gpus(WORLD)
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_sdpa_runs_fa2_and_meets_the_rule(case, require_kernel, torchrun_results):
    require_kernel("fwd", HEAD_DIM, DTYPE)
    require_kernel("bwd", HEAD_DIM, DTYPE)
    run, ranks = torchrun_results(case)
    for rank, result in enumerate(ranks):
        assert result is not None, f"rank {rank} wrote no results (torchrun exit {run.returncode}):\n" \
                                   f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
        assert result[case]["outcome"] == "ok", f"rank {rank}:\n{result[case]['outcome']}"


if __name__ == "__main__":  # torchrun --nproc-per-node N tests/test_context_parallel_sdpa.py --out DIR
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".", help="directory for rank{r}.json")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    sys.exit(main(args.out, args.cases.split(",")))

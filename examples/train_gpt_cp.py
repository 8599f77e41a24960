"""Train examples/train_gpt.py's GPT on long sequences sharded over the GPUs of one host (context parallelism), fa2
computing the attention under PyTorch's engine; or the same run unsharded on one GPU, for the loss comparison.

    torchrun --nproc-per-node 2 examples/train_gpt_cp.py --seqlen 65536 --steps 50 --out runs/cp2
    python examples/train_gpt_cp.py --unsharded --seqlen 65536 --steps 50 --out runs/cp1

Every step draws one batch of whole sequences, the same on every rank (one seeded generator), and each rank trains
on the tokens PyTorch's `context_parallel` gives it: with causal attention, its load-balanced layout (the sequence in
2n chunks, rank r holding chunks r and 2n-1-r). The one buffer handed to `context_parallel` is the positions
0..seqlen-1, sharded once when the context is entered; each batch is then indexed by them, and the model embeds
those global positions. Inside the context, F.scaled_dot_product_attention runs PyTorch's ring (K/V all-gathered or
passed around, --rotate), which calls SDPA's flash op once per ring step, forward and backward; `--attn fa2` pins
SDPA's FLASH backend with `fa2.sdpa.activate()` behind it, so fa2's kernels compute every step. `--attn sdpa` leaves
SDPA's own choice (cuDNN on an H100) under the same engine, `--attn sdpa_flash` FlashAttention-2's own kernels.

Each rank's loss is the mean over its tokens, and the shards are equal, so averaging the gradients over the ranks
gives the unsharded run's gradient: every rank keeps the same weights, and the sharded and unsharded loss curves
agree up to bf16 noise (the ring's merge and sums round differently). Writes <out>/train_gpt_cp.json (losses,
ms/step, tokens/s per GPU)."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt  # noqa: E402  the model, the data and the SDPA backend switch

# fa2: FLASH backend, fa2 behind it; sdpa: SDPA's own choice; sdpa_flash: FLASH backend, FlashAttention-2's kernels.
BACKENDS = {"fa2": "sdpa_fa2", "sdpa": "sdpa", "sdpa_flash": "sdpa_flash"}


def init(unsharded: bool):
    """The CP mesh (all ranks of this torchrun launch, one GPU each), or None for an unsharded run on one GPU."""
    if unsharded:
        return None
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun (torchrun --nproc-per-node N examples/train_gpt_cp.py ...), "
                         "or pass --unsharded for one GPU")
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    return init_device_mesh("cuda", (dist.get_world_size(),))


@contextlib.contextmanager
def sharded(mesh, seqlen: int, rotate: str = "allgather", device: str = "cuda"):
    """Yields this rank's positions of a seqlen-token sequence. With a mesh, inside the block SDPA runs PyTorch's ring
    over it (the context is entered once, so torch.compile sees one patched SDPA for the whole run)."""
    positions = torch.arange(seqlen, device=device)
    if mesh is None:
        yield positions
        return
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
        yield positions


class Trainer:
    """One model and its optimizer; step() trains on one batch of whole sequences, at this rank's positions."""

    def __init__(self, args, vocab: int, mesh):
        torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run
        self.model = train_gpt.GPT(vocab, dim=args.dim, nheads=args.nheads, layers=args.layers, seqlen=args.seqlen,
                                   attention="sdpa").to(args.device)
        self.run = torch.compile(self.model, fullgraph=True) if args.compile else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda i: train_gpt.lr_factor(i, args.steps))
        self.group = None if mesh is None else mesh.get_group()
        self.autocast = torch.autocast(args.device, dtype=torch.bfloat16)

    def step(self, x, y, positions) -> torch.Tensor:
        """The loss of the whole batch (averaged over the ranks), detached; no host sync."""
        with self.autocast:
            loss = self.run(x[:, positions], y[:, positions], positions)
        loss.backward()
        loss = loss.detach()
        if self.group is not None:  # one all-reduce of every gradient and the loss, averaged over the ranks
            grads = [p.grad for p in self.model.parameters()]
            flat = torch.cat([g.flatten() for g in grads] + [loss.view(1)])
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads] + [1])):
                g.copy_(part.view_as(g))
            loss = flat[-1]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss


def load_data(data_path=None, device="cuda"):
    """The training text on the device (train_gpt.py's split) and the vocabulary size."""
    data, vocab = train_gpt.encode(train_gpt.load_text(data_path), device)
    return data[:int(0.9 * len(data))], vocab


def elapsed_max(seconds: float, mesh) -> float:
    """The slowest rank's time (every rank waits for it at the next collective)."""
    if mesh is None:
        return seconds
    t = torch.tensor([seconds], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return t.item()


def train(args, mesh, train_data, vocab: int) -> dict:
    """args.steps steps; losses of all, time of those after args.warmup_steps (the slowest rank's)."""
    if len(train_data) <= args.seqlen + 1:
        raise SystemExit(f"--seqlen {args.seqlen} needs a text longer than {len(train_data)} training characters "
                         f"(--data)")
    ngpus = 1 if mesh is None else mesh.size()
    with train_gpt.sdpa_backends(BACKENDS[args.attn]), \
            sharded(mesh, args.seqlen, args.rotate, args.device) as positions:
        trainer = Trainer(args, vocab, mesh)
        data = train_gpt.batches(train_data, args.batch, args.seqlen, args.seed)
        losses, start = [], None
        for i in range(args.steps):
            if i == args.warmup_steps:
                train_gpt.sync(args.device)
                start = time.perf_counter()
            losses.append(trainer.step(*next(data), positions))
            if args.log_every and (i + 1) % args.log_every == 0 and (mesh is None or dist.get_rank() == 0):
                print(f"step {i + 1}: loss {losses[-1].item():.4f}", flush=True)
        train_gpt.sync(args.device)
        seconds = elapsed_max(time.perf_counter() - start, mesh)
    timed = args.steps - args.warmup_steps
    ms = seconds / timed * 1e3
    return {"loss": torch.stack(losses).tolist(), "ms_per_step": ms, "timed_steps": timed, "ngpus": ngpus,
            "tokens_per_s_per_gpu": args.batch * args.seqlen / (ms / 1e3) / ngpus}


def model_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """train_gpt.py's model and optimizer options, one long sequence per step (bench/context_parallel.py takes them
    too)."""
    return train_gpt.model_arguments(p, batch=1, device_help="cpu: an unsharded smoke test with --attn sdpa")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", choices=list(BACKENDS), default="fa2")
    p.add_argument("--unsharded", action="store_true", help="one GPU, no context parallelism (the loss reference)")
    p.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather",
                   help="how PyTorch's ring moves K/V between the ranks")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the timing")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seqlen", type=int, default=65536, help="tokens per sequence (all ranks together)")
    p.add_argument("--out", default="runs/train_gpt_cp", help="directory for train_gpt_cp.json")
    return model_arguments(p)


def main(argv=None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if not 0 <= args.warmup_steps < args.steps:
        p.error("--warmup-steps must be in [0, --steps)")
    mesh = init(args.unsharded)
    ngpus = 1 if mesh is None else mesh.size()
    if mesh is not None and args.seqlen % (2 * ngpus):
        p.error(f"--seqlen must be a multiple of 2 x {ngpus} GPUs for PyTorch's load-balanced sharding")
    train_data, vocab = load_data(args.data, args.device)
    result = train(args, mesh, train_data, vocab)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    record = {"args": vars(args), "device": device, "torch": torch.__version__, "vocab": vocab,
              **result}
    if mesh is None or dist.get_rank() == 0:
        print(f"{args.attn} on {ngpus} GPU(s), {args.batch} x {args.seqlen} tokens: {result['ms_per_step']:.1f} ms/step, "
              f"{result['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, final loss {result['loss'][-1]:.4f}")
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_gpt_cp.json").write_text(json.dumps(record, indent=1))
        print(f"wrote {out / 'train_gpt_cp.json'}")
    if mesh is not None:
        dist.destroy_process_group()
    return record


if __name__ == "__main__":
    main()

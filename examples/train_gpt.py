"""Train a small character-level GPT twice, with fa2 and with torch's SDPA, and compare loss and speed.

    python examples/train_gpt.py --attn both --compile --out runs/train_gpt

The model is nanoGPT's "shakespeare-char" size (6 layers, 384 wide, 6 heads of 64) at context 1024. The
text is this repository's own docs and source (ours, BSD-3-Clause), read at start-up; --data FILE trains
on any other text file. Every run starts from the same weights and sees the same batches under bf16
autocast, so the loss curves should lie on top of each other. tokens/s counts the steps after
--warmup-steps (those include compilation). Writes <out>/train_gpt.json (loss curves, validation loss, tokens/s) and
<out>/train_gpt.png (the curves and their difference)."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fa2

REPO = pathlib.Path(__file__).resolve().parents[1]


def fa2_attention(q, k, v):
    return fa2.attention(q, k, v, causal=True)


def sdpa_attention(q, k, v):  # SDPA wants (batch, nheads, seqlen, head_dim)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


# sdpa lets torch pick its backend (cuDNN on an H100); sdpa_flash pins FlashAttention-2's own kernels; sdpa_fa2 pins
# the flash backend with fa2 activated behind it (fa2.sdpa): unchanged model code running fa2's kernels.
ATTENTION = {"fa2": fa2_attention, "sdpa": sdpa_attention, "sdpa_flash": sdpa_attention, "sdpa_fa2": sdpa_attention}
RUNS = {"both": ["fa2", "sdpa"], "all": ["fa2", "sdpa", "sdpa_flash", "sdpa_fa2"]}


@contextlib.contextmanager
def sdpa_backends(attention: str):
    """For sdpa_flash and sdpa_fa2, SDPA's other backends are switched off while the model is built, compiled and
    trained: set globally rather than with sdpa_kernel() inside the model, so torch.compile traces the same choice.
    For sdpa_fa2, fa2 is activated behind the flash backend meanwhile."""
    if attention not in ("sdpa_flash", "sdpa_fa2"):
        yield
        return
    flags = ("cudnn_sdp", "mem_efficient_sdp", "math_sdp")
    before = [getattr(torch.backends.cuda, f"{f}_enabled")() for f in flags]
    for f in flags:
        getattr(torch.backends.cuda, f"enable_{f}")(False)
    if attention == "sdpa_fa2":
        fa2.sdpa.activate()
    try:
        yield
    finally:
        fa2.sdpa.restore()
        for f, on in zip(flags, before):
            getattr(torch.backends.cuda, f"enable_{f}")(on)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ model
class Block(nn.Module):
    def __init__(self, dim: int, nheads: int, attention):
        super().__init__()
        self.nheads, self.attention = nheads, attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        # q, k, v stay strided slices of one qkv tensor, (batch, seqlen, nheads, head_dim): no copies for fa2.
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.nheads, dim // self.nheads).unbind(2)
        x = x + self.proj(self.attention(q, k, v).reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, *, dim=384, nheads=6, layers=6, seqlen=1024, attention="fa2"):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seqlen, dim)
        self.blocks = nn.ModuleList(Block(dim, nheads, ATTENTION[attention]) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets, positions=None):
        """Mean next-character cross-entropy of idx (batch, seqlen) against targets. positions: each token's place
        in the sequence, 0..seqlen-1 by default; a context-parallel rank passes those of its shard
        (examples/train_gpt_cp.py)."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------------ data
def load_text(path: str | None) -> str:
    if path:
        return pathlib.Path(path).read_text(encoding="utf-8")
    files = [REPO / "README.md"] + sorted(f for folder in ("bench", "csrc", "examples", "python", "tests")
                                          for suffix in ("*.md", "*.py", "*.h", "*.cpp")
                                          for f in (REPO / folder).rglob(suffix))
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def encode(text: str, device) -> tuple[torch.Tensor, int]:
    """The text as character ids on the device, and the vocabulary size."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long, device=device), len(chars)


def batches(data: torch.Tensor, batch: int, seqlen: int, seed: int):
    """Random windows of seqlen + 1 characters, in an order fixed by the seed (the same for every run). The
    text lives on the device, so a batch is one gather there: no host-to-device copy, no sync per step."""
    gen = torch.Generator(data.device).manual_seed(seed)
    offsets = torch.arange(seqlen + 1, device=data.device)
    while True:
        starts = torch.randint(len(data) - seqlen - 1, (batch, 1), generator=gen, device=data.device)
        window = data[starts + offsets]
        yield window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------------ train
def lr_factor(i: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine decay to lr / 10."""
    warmup = max(1, steps // 10)
    if i < warmup:
        return (i + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warmup) / max(1, steps - warmup)))


def train(attention: str, args, train_data, val_data, vocab: int) -> dict:
    torch.manual_seed(args.seed)  # the same initial weights for every attention
    model = GPT(vocab, dim=args.dim, nheads=args.nheads, layers=args.layers, seqlen=args.seqlen,
                attention=attention).to(args.device)
    step = torch.compile(model, fullgraph=True) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, args.steps))
    autocast = torch.autocast(args.device, dtype=torch.bfloat16)
    data = batches(train_data, args.batch, args.seqlen, args.seed)
    losses, start, wall_start = [], None, time.perf_counter()
    from tqdm import tqdm  # here, not at the top: tests/test_train.py imports this model without tqdm

    bar = tqdm(range(args.steps), desc=attention)
    for i in bar:
        if i == args.warmup_steps:  # from here on: steady state, compilation done
            sync(args.device)
            start = time.perf_counter()
        x, y = next(data)
        with autocast:
            loss = step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.detach())  # no .item() per step: it would wait for the GPU
        if (i + 1) % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    sync(args.device)
    seconds = time.perf_counter() - start
    tokens_per_s = (args.steps - args.warmup_steps) * args.batch * args.seqlen / seconds
    with torch.no_grad(), autocast:  # eager: a compiled no-grad graph would only cost another compilation
        val = batches(val_data, args.batch, args.seqlen, args.seed + 1)
        val_loss = sum(model(*next(val)).item() for _ in range(args.val_batches)) / args.val_batches
    return {"loss": torch.stack(losses).tolist(), "val_loss": val_loss, "tokens_per_s": tokens_per_s,
            "timed_steps": args.steps - args.warmup_steps, "timed_seconds": seconds,
            "wall_seconds": time.perf_counter() - wall_start}  # with compilation and validation


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 1))
    styles = ({"lw": 2.5, "alpha": 0.6}, {"lw": 1}, {"lw": 1, "ls": "--"})  # the curves overlap
    for (name, r), style in zip(results.items(), styles):
        top.plot(r["loss"], label=f"{name}: {r['tokens_per_s'] / 1e3:,.0f}k tokens/s, val loss {r['val_loss']:.3f}",
                 **style)
    top.set(ylabel="train loss (nats/char)", title="char-level GPT, bf16: fa2 vs SDPA")
    top.legend()
    if {"fa2", "sdpa"} <= results.keys():
        bottom.plot([a - b for a, b in zip(results["fa2"]["loss"], results["sdpa"]["loss"])], lw=1, color="gray")
        bottom.axhline(0, color="black", lw=0.5)
    bottom.set(xlabel="step", ylabel="fa2 − sdpa")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def model_arguments(p: argparse.ArgumentParser, *, batch: int, device_help: str) -> argparse.ArgumentParser:
    """The model's and the optimizer's options (examples/train_gpt_cp.py and bench/context_parallel.py take them
    too)."""
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True)")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--nheads", type=int, default=6)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a UTF-8 text file (default: this repository's docs and source)")
    p.add_argument("--device", default="cuda", help=device_help)
    return p


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", choices=[*ATTENTION, *RUNS], default="both",
                   help="both: fa2 and sdpa; all: fa2, sdpa, sdpa_flash and sdpa_fa2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=20, help="first steps left out of tokens/s (compilation)")
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--val-batches", type=int, default=10)
    p.add_argument("--out", default="runs/train_gpt", help="directory for train_gpt.json and train_gpt.png")
    model_arguments(p, batch=16, device_help="fa2 needs cuda; sdpa also runs on cpu (a smoke test)")
    args = p.parse_args(argv)
    if not 0 <= args.warmup_steps < args.steps:
        p.error("--warmup-steps must be in [0, --steps)")

    text = load_text(args.data)
    data, vocab = encode(text, args.device)
    split = int(0.9 * len(data))  # the last tenth for validation
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{len(text):,} characters, vocabulary {vocab}; {args.steps} steps of {args.batch} x {args.seqlen} "
          f"tokens on {device}")

    results = {}
    for attention in RUNS.get(args.attn, [args.attn]):
        with sdpa_backends(attention):
            results[attention] = r = train(attention, args, data[:split], data[split:], vocab)
        print(f"{attention}: {r['tokens_per_s']:,.0f} tokens/s, final train loss {r['loss'][-1]:.4f}, "
              f"val loss {r['val_loss']:.4f}")
    for other in results.keys() - {"fa2"} if "fa2" in results else ():
        print(f"fa2 / {other} tokens/s: {results['fa2']['tokens_per_s'] / results[other]['tokens_per_s']:.2f}x")

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "device": device, "torch": torch.__version__, "characters": len(text),
              "vocab": vocab, "results": results}
    (out / "train_gpt.json").write_text(json.dumps(record, indent=1))
    plot(results, out / "train_gpt.png")
    print(f"wrote {out / 'train_gpt.json'} and {out / 'train_gpt.png'}")
    return record


if __name__ == "__main__":
    main()

"""End to end (GPU): a tiny causal transformer trained for 50 steps with fa2.attention follows the loss
curve of the same model trained with torch's scaled_dot_product_attention from the same initialisation."""
import importlib.util
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

# The model is examples/train_gpt.py's: its pre-norm Block and its two attention functions.
_spec = importlib.util.spec_from_file_location(
    "train_gpt", pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py")
train_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_gpt)
Block, fa2_attention, sdpa_attention = train_gpt.Block, train_gpt.fa2_attention, train_gpt.sdpa_attention


def train(attention, *, steps=50, vocab=512, dim=256, nheads=4, layers=2, seqlen=256, batch=8, device="cuda"):
    """Losses of `steps` AdamW steps under bf16 autocast, from a fixed initialisation and fixed data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, dim), *[Block(dim, nheads, attention) for _ in range(layers)],
                          nn.LayerNorm(dim), nn.Linear(dim, vocab)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A learnable synthetic language: each token is the previous one plus 0, 1 or 2 (mod vocab).
    gen = torch.Generator().manual_seed(1)
    data = (torch.randint(0, 3, (steps, batch, seqlen + 1), generator=gen).cumsum(-1) % vocab).to(device)
    losses = []
    for x in data:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_loss_curve_matches_sdpa(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    ours, theirs = train(fa2_attention), train(sdpa_attention)
    for name, losses in (("fa2", ours), ("sdpa", theirs)):
        assert losses[-1] < 0.5 * losses[0], f"{name} did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
    gap = max(abs(a - b) for a, b in zip(ours, theirs))
    assert gap < 0.05 * theirs[0], f"loss curves differ by up to {gap:.3f} (initial loss {theirs[0]:.3f})"
    assert abs(ours[-1] - theirs[-1]) < 0.03 * theirs[-1], f"final losses {ours[-1]:.4f} vs {theirs[-1]:.4f}"

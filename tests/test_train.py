"""A tiny transformer trained for 50 steps with fa2.attention follows the same loss curve as with SDPA."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fa2

pytestmark = pytest.mark.gpu


class Block(nn.Module):
    def __init__(self, dim, heads, use_fa2):
        super().__init__()
        self.heads, self.use_fa2 = heads, use_fa2
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        if self.use_fa2:
            a = fa2.attention(q, k, v, causal=True)
        else:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


def train(use_fa2, steps=50, vocab=512, dim=256, heads=4, seq=256, batch=8):
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, dim)
    blocks = nn.Sequential(*[Block(dim, heads, use_fa2) for _ in range(2)])
    head = nn.Linear(dim, vocab)
    model = nn.ModuleList([emb, blocks, head]).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # A learnable synthetic language: each token is the previous one plus a small random step.
    steps_tok = torch.randint(0, 3, (steps, batch, seq + 1), device="cuda", generator=gen)
    data = torch.cumsum(steps_tok, dim=-1) % vocab
    losses = []
    for i in range(steps):
        x, y = data[i, :, :-1], data[i, :, 1:]
        logits = head(blocks(emb(x)))
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_loss_curve_matches_sdpa():
    ours, theirs = train(True), train(False)
    assert ours[-1] < 0.5 * ours[0] and theirs[-1] < 0.5 * theirs[0], (ours[-1], theirs[-1])
    gap = max(abs(a - b) for a, b in zip(ours, theirs))
    assert gap < 0.05 * ours[0], f"loss curves differ by {gap:.3f} (initial loss {ours[0]:.3f})"
    assert abs(ours[-1] - theirs[-1]) < 0.05 * theirs[-1] + 0.02

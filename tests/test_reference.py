"""The tiled FlashAttention-2 algorithms in fa2.reference equal plain attention (CPU, fp64)."""
import pytest
import torch

from fa2.reference import attention_ref, flash_bwd_tiled, flash_fwd_tiled

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (2, 1, 1, 2, 2, 16),
    (2, 17, 17, 2, 2, 16),
    (1, 128, 128, 4, 4, 32),
    (1, 1000, 1000, 1, 1, 16),
    (2, 113, 203, 4, 2, 16),
    (2, 203, 113, 4, 1, 16),
    (1, 1, 17, 2, 2, 8),
    (1, 17, 1, 2, 2, 8),
]
BLOCKS = [(64, 64), (32, 48), (16, 128)]


def _inputs(b, sq, sk, h, hk, d):
    return (torch.randn(b, sq, h, d, dtype=torch.float64), torch.randn(b, sk, hk, d, dtype=torch.float64),
            torch.randn(b, sk, hk, d, dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("blocks", BLOCKS)
def test_tiled_forward_matches_naive(case, causal, blocks):
    q, k, v = _inputs(*case)
    out, lse = attention_ref(q, k, v, causal=causal)
    out_t, lse_t = flash_fwd_tiled(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1])
    assert not torch.isnan(out_t).any() and not torch.isnan(lse_t).any()
    torch.testing.assert_close(out_t, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_t, lse, rtol=0, atol=1e-12)  # equal -inf pattern included


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_tiled_backward_matches_autograd(case, causal):
    q, k, v = (t.requires_grad_() for t in _inputs(*case))
    out, lse = attention_ref(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    got = flash_bwd_tiled(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal=causal,
                          block_m=32, block_n=48)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10, msg=name)


def test_rows_without_keys_are_zero_with_neg_inf_lse():
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    q, k, v = (t.requires_grad_() for t in _inputs(1, 40, 10, 2, 2, 8))
    for fn in (attention_ref, flash_fwd_tiled):
        out, lse = fn(q, k, v, causal=True)
        assert torch.equal(out[:, :30], torch.zeros_like(out[:, :30]))
        assert torch.isneginf(lse[:, :, :30]).all() and torch.isfinite(lse[:, :, 30:]).all()
    out, lse = attention_ref(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    tiled = flash_bwd_tiled(torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                            causal=True)
    assert all(torch.isfinite(g).all() for g in tiled)


def test_gradcheck_tiny():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 5, 7, 2, 1, 8))
    assert torch.autograd.gradcheck(lambda a, b, c: attention_ref(a, b, c, causal=True)[0], (q, k, v))

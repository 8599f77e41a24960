"""The executable specification (CPU, fp64): the tiled FlashAttention-2 algorithms equal plain attention,
for any block size, causal or not, GQA/MQA, equal and unequal sequence lengths."""
import pytest
import torch

from fa2.reference import attention_ref, flash_bwd_tiled, flash_fwd_tiled
from tolerance import assert_close_to_ref, assert_lse_close

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim): big seqlens get few heads
    (2, 1, 1, 2, 2, 16),
    (2, 17, 17, 4, 1, 16),  # MQA
    (1, 128, 128, 4, 4, 32),
    (1, 1000, 1000, 1, 1, 16),
    (2, 113, 203, 8, 2, 16),  # GQA 4:1
    (1, 203, 113, 4, 1, 16),  # MQA, seqlen_q > seqlen_k: causal leaves the first 90 rows without keys
    (1, 1, 17, 2, 2, 8),
    (1, 17, 1, 4, 1, 8),
]
CASE_IDS = ["b{}_{}x{}_h{}kv{}_d{}".format(*c) for c in CASES]
BLOCKS = [(64, 64), (32, 48), (16, 128), (128, 16)]  # (block_m, block_n), some not dividing the seqlens


def _inputs(b, sq, sk, h, hk, d, dtype=torch.float64):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"blocks{b[0]}x{b[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tiled_forward_equals_attention(case, causal, blocks):
    q, k, v = _inputs(*case)
    out, lse = attention_ref(q, k, v, causal=causal)
    out_t, lse_t = flash_fwd_tiled(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1])
    torch.testing.assert_close(out_t, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_t, lse, rtol=0, atol=1e-12)  # the -inf pattern must match too


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rise", [12.0, -12.0, 3000.0, -3000.0])
def test_lazy_rescale_is_the_same_softmax(rise, causal):
    """Scores that climb (rise > 0) or fall along the keys, so the running max moves in most key blocks: by
    ~|rise| / 16 per 64 keys. With |rise| = 12 it stays inside the 2^8 the lazy rescale lets pass for several
    blocks; with 3000 it moves past that in every block. Same inputs as test_fwd.py's kernel test."""
    torch.manual_seed(int(rise))
    b, n, h, d = 1, 1024, 2, 16
    u = torch.randn(d, dtype=torch.float64)
    u /= u.norm()
    ramp = torch.linspace(0.0, 1.0, n, dtype=torch.float64)[None, :, None, None]
    q = u + 0.05 * torch.randn(b, n, h, d, dtype=torch.float64)
    k = rise * ramp * u + torch.randn(b, n, h, d, dtype=torch.float64)
    v = torch.randn(b, n, h, d, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=1.0)
    eager = flash_fwd_tiled(q, k, v, causal=causal, softmax_scale=1.0)
    lazy = flash_fwd_tiled(q, k, v, causal=causal, softmax_scale=1.0, rescale_threshold=8.0)
    for got in (eager, lazy):
        torch.testing.assert_close(got[0], out, rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1], lse, rtol=1e-14, atol=1e-12)
    if rise == 12.0:
        # Visited first to last, only slowly climbing scores leave m stale for some blocks (falling ones never
        # move it, steep ones move it every block): there the lazy run must round differently from the eager
        # one, or it did not take the stale path. (The kernel visits last to first: its stale case is -12.)
        assert not torch.equal(lazy[0], eager[0])


@pytest.mark.parametrize("blocks", BLOCKS[:2], ids=lambda b: f"blocks{b[0]}x{b[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tiled_backward_equals_autograd(case, causal, blocks):
    q, k, v = (t.requires_grad_() for t in _inputs(*case))
    out, lse = attention_ref(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    got = flash_bwd_tiled(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal=causal,
                          block_m=blocks[0], block_n=blocks[1])
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10, msg=name)


def test_causal_is_aligned_bottom_right():
    # Query i sees keys 0 .. i + seqlen_k - seqlen_q: with 3 queries and 5 keys, row i sees i + 3 keys.
    q, k, v = _inputs(1, 3, 5, 2, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    for i in range(3):
        row_out, row_lse = attention_ref(q[:, i:i + 1], k[:, :i + 3], v[:, :i + 3])
        torch.testing.assert_close(out[:, i:i + 1], row_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[:, :, i:i + 1], row_lse, rtol=0, atol=1e-12)


def test_rows_without_keys_give_zero_and_neg_inf():
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k = 30 rows see no key.
    q, k, v = (t.requires_grad_() for t in _inputs(1, 40, 10, 2, 1, 8))
    results = {"attention_ref": attention_ref(q, k, v, causal=True),
               "tiled, one Q block": flash_fwd_tiled(q, k, v, causal=True),
               "tiled, Q blocks without keys": flash_fwd_tiled(q, k, v, causal=True, block_m=16, block_n=16)}
    for name, (out, lse) in results.items():
        assert torch.equal(out[:, :30], torch.zeros_like(out[:, :30])), name
        assert torch.isneginf(lse[:, :, :30]).all() and torch.isfinite(lse[:, :, 30:]).all(), name
    out, lse = attention_ref(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    tiled = flash_bwd_tiled(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal=True,
                            block_m=16, block_n=16)
    for name, g, t in zip(("dq", "dk", "dv"), grads, tiled):
        assert torch.isfinite(g).all() and torch.isfinite(t).all(), name
        torch.testing.assert_close(t, g, rtol=0, atol=1e-10, msg=name)
    assert torch.equal(tiled[0][:, :30], torch.zeros_like(tiled[0][:, :30]))  # dq of rows without keys


def _ref_grads(q, k, v, dout, *, upcast):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(attention_ref(q, k, v, causal=True, upcast=upcast)[0], (q, k, v), dout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tiled_in_low_precision_meets_the_tolerance_rule(dtype):
    # What the kernels must achieve, checked on the spec itself: fp32 accumulation with P (and dS) rounded
    # to the input dtype is at least as accurate as plain attention computed in that dtype.
    q, k, v = _inputs(1, 128, 203, 8, 1, 64, dtype=dtype)
    # fp64 inputs and leaves for the fp64 reference: from low-precision ones its output and gradients would come
    # back rounded to that precision.
    ref64, lse64 = attention_ref(q.double(), k.double(), v.double(), causal=True)
    ref_low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    out, lse = flash_fwd_tiled(q, k, v, causal=True)
    assert_close_to_ref(out, ref64, ref_low, name=f"tiled out {dtype}")
    assert_lse_close(lse, lse64, attention_ref(q, k, v, causal=True, dtype=torch.float32)[1], name=f"tiled lse {dtype}")

    dout = torch.randn_like(out)
    grads = flash_bwd_tiled(dout, q, k, v, out, lse, causal=True)
    ref64_grads = _ref_grads(q.double(), k.double(), v.double(), dout.double(), upcast=True)
    for name, g, r64, rl in zip(("dq", "dk", "dv"), grads, ref64_grads, _ref_grads(q, k, v, dout, upcast=False)):
        assert_close_to_ref(g, r64, rl, name=f"tiled {name} {dtype}")

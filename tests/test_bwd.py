"""fa2.bwd and fa2.attention gradients against the fp64 reference (GPU)."""
import pytest
import torch

import fa2
from fa2.reference import attention_ref
from tolerance import assert_close_to_ref

pytestmark = pytest.mark.gpu

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (1, 1, 1, 2, 2, 64),
    (2, 113, 203, 4, 4, 64),
    (2, 203, 113, 8, 1, 128),
    (1, 1000, 1000, 4, 4, 128),
    (1, 2048, 1023, 16, 2, 64),
    (1, 1023, 2048, 4, 4, 96),
    (2, 257, 257, 4, 2, 40),
    (1, 512, 700, 2, 2, 160),
    (1, 384, 384, 2, 1, 256),
    (1, 300, 300, 2, 2, 32),
    (1, 300, 500, 2, 2, 192),
    (1, 500, 300, 2, 2, 224),
]


def _compiled(d, dtype):
    info = fa2.build_info()
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return name in info["dtypes"] and any(h >= d for h in info["bwd_head_dims"])


def _grads(q, k, v, dout, causal, upcast):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q, k, v, causal=causal, upcast=upcast)
    return torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_{}x{}_h{}/{}_d{}".format(*c))
def test_attention_grads_match_reference(case, dtype, causal):
    b, sq, sk, h, hk, d = case
    if not _compiled(d, dtype):
        pytest.skip("not in this build")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    out = fa2.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref64 = _grads(q, k, v, dout, causal, upcast=True)
    ref_low = _grads(q, k, v, dout, causal, upcast=False)
    for name, g, r64, rl in zip(("dq", "dk", "dv"), got, ref64, ref_low):
        assert_close_to_ref(g, r64, rl, name=f"{name} {case} causal={causal}", atol=1e-3)


def test_requires_grad_subset_and_noncontiguous_dout():
    q = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = fa2.attention(q, k, v, causal=True)
    dout = torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # non-contiguous
    dq, dv = torch.autograd.grad(out, (q, v), dout)
    rq, _, rv = _grads(q, k, v, dout, True, upcast=True)
    lq, _, lv = _grads(q, k, v, dout, True, upcast=False)
    assert_close_to_ref(dq, rq, lq, name="dq", atol=1e-3)
    assert_close_to_ref(dv, rv, lv, name="dv", atol=1e-3)
    # A broadcast (stride-0) dout, as from out.sum().backward().
    q2 = q.detach().clone().requires_grad_()
    fa2.attention(q2, k, v).sum().backward()
    assert torch.isfinite(q2.grad).all()


def test_deterministic_dq_is_bit_identical():
    q, k, v = (torch.randn(2, 1500, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=True)
    dout = torch.randn_like(out)
    first = fa2.bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    second = fa2.bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ref64 = _grads(q, k, v, dout, True, upcast=True)
    ref_low = _grads(q, k, v, dout, True, upcast=False)
    assert_close_to_ref(first[0], ref64[0], ref_low[0], name="deterministic dq", atol=1e-3)


def test_bwd_empty_inputs():
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    q, k, v = mk(1, 5, 2, 64), mk(1, 0, 2, 64), mk(1, 0, 2, 64)
    out, lse = fa2.fwd(q, k, v)
    dq, dk, dv = fa2.bwd(torch.randn_like(out), q, k, v, out, lse)
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape

"""fa2.fwd against the fp64 reference with FlashAttention's tolerance rule (GPU)."""
import pytest
import torch

import fa2
from fa2.reference import attention_ref
from tolerance import assert_close_to_ref, assert_lse_close, poison

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
SEQLENS = [(1, 1), (113, 203), (128, 128), (1000, 1000), (2048, 1023), (1023, 2048), (4096, 4096)]
HEADS = [(1, 4, 4), (2, 8, 1), (2, 8, 8), (1, 16, 2)]  # (batch, nheads, nheads_k): MHA, MQA, GQA 8:1


def _compiled(d, dtype):
    info = fa2.build_info()
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return name in info["dtypes"] and any(h >= d for h in info["fwd_head_dims"])


def run_and_check(q, k, v, causal, tag, scale=None):
    out = poison(torch.empty_like(q))
    out, lse = fa2.fwd(q, k, v, causal=causal, softmax_scale=scale, out=out)
    ref64, lse64 = attention_ref(q, k, v, causal=causal, softmax_scale=scale)
    ref_low, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    assert_close_to_ref(out, ref64, ref_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, name=f"lse {tag}")
    return out, lse


def _grid():
    for d in HEAD_DIMS:
        seqlens = SEQLENS if d in (64, 128) else [(1, 1), (113, 203), (1023, 2048), (2048, 1023)]
        for sq, sk in seqlens:
            heads = HEADS if sq * sk <= 2048 * 2048 else HEADS[:2]
            for b, h, hk in heads:
                yield d, sq, sk, b, h, hk


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d,sq,sk,b,h,hk", list(_grid()))
def test_matches_reference(d, sq, sk, b, h, hk, dtype, causal):
    if not _compiled(d, dtype):
        pytest.skip(f"head_dim {d} / {dtype} not in this build")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    run_and_check(q, k, v, causal, f"d{d} {sq}x{sk} b{b} h{h}/{hk} causal={causal} {dtype}")


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs(causal):
    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16)  # packed (b, s, 3, h, d)
    q, k, v = qkv.unbind(2)
    run_and_check(q, k, v, causal, "packed qkv")
    # (b, h, s, d) storage viewed as (b, s, h, d): strides (h*s*d, d, s*d, 1)
    q2, k2, v2 = (torch.randn(2, 4, 257, 64, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    run_and_check(q2, k2, v2, causal, "transposed layout")


def test_large_logits_stay_finite():
    q = torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16) * 40
    k = torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16) * 40
    v = torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = run_and_check(q, k, v, False, "scores ~1e4", scale=1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert lse.abs().max() > 1e3  # the scores really were large


def test_deterministic():
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o1, l1 = fa2.fwd(q, k, v, causal=True)
    o2, l2 = fa2.fwd(q, k, v, causal=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_rows_without_keys():
    q = torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 100, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = run_and_check(q, k, v, True, "seqlen_q > seqlen_k causal")
    assert torch.equal(out[:, :200], torch.zeros_like(out[:, :200]))
    assert torch.isneginf(lse[:, :, :200]).all()


def test_empty_inputs():
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    out, lse = fa2.fwd(mk(0, 8, 2, 64), mk(0, 8, 2, 64), mk(0, 8, 2, 64))
    assert out.shape == (0, 8, 2, 64) and lse.shape == (0, 2, 8)
    out, lse = fa2.fwd(mk(1, 0, 2, 64), mk(1, 8, 2, 64), mk(1, 8, 2, 64))
    assert out.shape == (1, 0, 2, 64)
    out, lse = fa2.fwd(mk(1, 5, 2, 64), mk(1, 0, 2, 64), mk(1, 0, 2, 64))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()

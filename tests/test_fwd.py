"""fa2.fwd against the fp64 reference with FlashAttention's tolerance rule (GPU): our error may be at most
twice that of plain PyTorch attention in the same low precision. Every output buffer is poisoned with NaN
first, so an element the kernel skipped cannot pass."""
import pytest
import torch

import fa2
from fa2.reference import attention_ref
from tolerance import assert_close_to_ref, assert_lse_close, assert_written, poison

pytestmark = pytest.mark.gpu

HEAD_DIMS = [32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
SEQLENS_ALL = [(1, 1), (113, 203), (128, 128), (1000, 1000), (2048, 1023), (1023, 2048), (4096, 4096)]
SEQLENS_SOME = [(1, 1), (113, 203), (2048, 1023)]  # head dims other than 64 and 128


def _heads(seqlen_q, seqlen_k):
    """(batch, nheads, nheads_k): MHA, MQA and GQA 8:1; fewer heads as the sequences grow."""
    if seqlen_q * seqlen_k <= 256 * 256:
        return [(2, 4, 4), (2, 8, 1), (1, 16, 2)]
    if seqlen_q * seqlen_k <= 2048 * 2048:
        return [(1, 4, 4), (1, 16, 2)]
    return [(1, 4, 4)]


GRID = [(d, sq, sk, b, h, hk) for d in HEAD_DIMS for sq, sk in (SEQLENS_ALL if d in (64, 128) else SEQLENS_SOME)
        for b, h, hk in _heads(sq, sk)]


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def check_fwd(q, k, v, *, causal, tag, softmax_scale=None, out=None):
    """Run fa2.fwd into a poisoned buffer and hold out and lse to the tolerance rule."""
    out = poison(torch.empty_like(q) if out is None else out)
    result, lse = fa2.fwd(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out)
    assert result is out
    assert_written(out, name=f"out {tag}")
    # fp64 inputs, so the reference output is not rounded back to q's dtype.
    ref64, lse64 = attention_ref(q.double(), k.double(), v.double(), causal=causal, softmax_scale=softmax_scale)
    ref_low, _ = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=False)
    assert_close_to_ref(out, ref64, ref_low, name=f"out {tag}")
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_lse_close(lse, lse64, name=f"lse {tag}")
    return out, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d,sq,sk,b,h,hk", GRID, ids=["d{}_{}x{}_b{}_h{}kv{}".format(*g) for g in GRID])
def test_matches_reference(d, sq, sk, b, h, hk, dtype, causal, require_kernel):
    require_kernel("fwd", d, dtype)
    q, k, v = randn(b, sq, h, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype)
    check_fwd(q, k, v, causal=causal, tag=f"d{d} {sq}x{sk} b{b} h{h}:{hk} causal={causal} {dtype}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs_and_out(causal, require_kernel):
    require_kernel("fwd", 64, torch.bfloat16)
    # Slices of a packed (batch, seqlen, 3, nheads, head_dim) qkv tensor.
    q, k, v = randn(2, 300, 3, 4, 64).unbind(2)
    check_fwd(q, k, v, causal=causal, tag="packed qkv")
    # (batch, nheads, seqlen, head_dim) storage seen as (batch, seqlen, nheads, head_dim), out likewise.
    q, k, v = (randn(2, 4, 257, 64).transpose(1, 2) for _ in range(3))
    check_fwd(q, k, v, causal=causal, tag="heads-first layout", out=torch.empty_like(q))
    assert q.stride() == (4 * 257 * 64, 64, 257 * 64, 1)


def test_large_logits_stay_finite(require_kernel):
    require_kernel("fwd", 64, torch.bfloat16)
    # Scores of order 1e4: exp overflows unless the running max is subtracted first.
    q, k, v = randn(1, 512, 2, 64) * 40, randn(1, 512, 2, 64) * 40, randn(1, 512, 2, 64)
    out, lse = check_fwd(q, k, v, causal=False, softmax_scale=1.0, tag="scores ~1e4")
    assert lse.abs().max() > 1e3 and torch.isfinite(lse).all()


def test_rows_without_keys_are_zero_with_neg_inf_lse(require_kernel):
    require_kernel("fwd", 64, torch.float16)
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    q, k, v = randn(1, 300, 2, 64, dtype=torch.float16), randn(1, 100, 2, 64, dtype=torch.float16), \
        randn(1, 100, 2, 64, dtype=torch.float16)
    out, lse = check_fwd(q, k, v, causal=True, tag="seqlen_q > seqlen_k causal")
    assert torch.equal(out[:, :200], torch.zeros_like(out[:, :200]))
    assert torch.isneginf(lse[:, :, :200]).all() and torch.isfinite(lse[:, :, 200:]).all()


def test_is_deterministic(require_kernel):
    require_kernel("fwd", 128, torch.bfloat16)
    q, k, v = (randn(2, 1000, 8, 128) for _ in range(3))
    first, second = fa2.fwd(q, k, v, causal=True), fa2.fwd(q, k, v, causal=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_empty_inputs_launch_nothing(require_kernel):
    require_kernel("fwd", 64, torch.bfloat16)
    out, lse = fa2.fwd(randn(0, 8, 2, 64), randn(0, 8, 2, 64), randn(0, 8, 2, 64))
    assert out.shape == (0, 8, 2, 64) and lse.shape == (0, 2, 8)
    out, lse = fa2.fwd(randn(1, 0, 2, 64), randn(1, 8, 2, 64), randn(1, 8, 2, 64))
    assert out.shape == (1, 0, 2, 64) and lse.shape == (1, 2, 0)
    out, lse = fa2.fwd(randn(1, 5, 2, 64), randn(1, 0, 2, 64), randn(1, 0, 2, 64))  # no keys at all
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all() and lse.shape == (1, 2, 5)


def test_runs_on_the_current_stream_inside_a_cuda_graph(require_kernel):
    # Capture fails if the launch used another stream or synchronised with the host.
    require_kernel("fwd", 64, torch.bfloat16)
    q, k, v = (randn(2, 200, 4, 64) for _ in range(3))
    expected, expected_lse = fa2.fwd(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fa2.fwd(q, k, v, causal=True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fa2.fwd(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)

"""Packed variable-length batches: fa2.fwd_varlen / fa2.bwd_varlen (and fa2.attention_varlen) against the
fp64 reference run sequence by sequence (GPU), and the validation of cu_seqlens (CPU)."""
import pytest
import torch

import fa2
from fa2.reference import attention_ref
from fa2.testing import assert_close_to_ref, assert_lse_close, assert_written, poison

gpu = pytest.mark.gpu


def pack(lengths, nheads, head_dim, dtype, device="cuda"):
    """Random (total, nheads, head_dim) tokens and the int32 cu_seqlens of `lengths`."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return torch.randn(int(cu[-1]), nheads, head_dim, device=device, dtype=dtype), cu


def per_sequence_ref(q, k, v, cu_q, cu_k, causal, dout, upcast):
    """Reference out, lse (nheads, total_q) and gradients, one sequence at a time, packed like ours."""
    # fp64 leaves for the fp64 reference: gradients of bf16 leaves would be rounded to bf16 on the way out.
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    outs, lses, grads = [], [], [[], [], []]
    for b in range(cu_q.numel() - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (cast(t[s][None]).detach().clone().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        out, lse = attention_ref(qs, ks, vs, causal=causal, upcast=upcast)
        g = torch.autograd.grad(out, (qs, ks, vs), cast(dout[sq][None]), allow_unused=True)
        outs.append(out[0].detach())
        lses.append(lse[0].detach())
        for acc, gi, t in zip(grads, g, (qs, ks, vs)):
            acc.append((torch.zeros_like(t) if gi is None else gi)[0])
    return torch.cat(outs), torch.cat(lses, dim=1), [torch.cat(g) for g in grads]


def per_sequence_lse32(q, k, v, cu_q, cu_k, causal):
    """lse (nheads, total_q) of attention computed in float32, one sequence at a time: the error the kernels' float32
    lse is held to."""
    lses = []
    for b in range(cu_q.numel() - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        lses.append(attention_ref(q[sq][None], k[sk][None], v[sk][None], causal=causal, dtype=torch.float32)[1][0])
    return torch.cat(lses, dim=1)


def check(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, causal, *, max_extra=0, deterministic=False):
    q, cu_q = pack(lengths_q, nheads, head_dim, dtype)
    k, cu_k = pack(lengths_k, nheads_k, head_dim, dtype)
    v = torch.randn_like(k)
    max_q, max_k = max(lengths_q) + max_extra, max(lengths_k) + max_extra
    out, lse = poison(torch.empty_like(q)), None
    out, lse = fa2.fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, out=out)
    dout = torch.randn_like(q)
    dq, dk, dv = (poison(torch.empty_like(t)) for t in (q, k, v))
    fa2.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, dq=dq, dk=dk, dv=dv,
                   deterministic=deterministic)
    tag = f"q{lengths_q[:8]} k{lengths_k[:8]} h{nheads}/{nheads_k} d{head_dim} {dtype} causal={causal}"
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_written(t, name=f"{name} {tag}")
    out64, lse64, g64 = per_sequence_ref(q, k, v, cu_q, cu_k, causal, dout, upcast=True)
    out_low, _, g_low = per_sequence_ref(q, k, v, cu_q, cu_k, causal, dout, upcast=False)
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, per_sequence_lse32(q, k, v, cu_q, cu_k, causal), name=f"lse {tag}")
    for name, g, r64, rl in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g_low):
        assert_close_to_ref(g, r64, rl, name=f"{name} {tag}")
    return dq, dk, dv


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_self_attention_with_empty_and_single_token_sequences(head_dim, dtype, causal, require_kernel):
    require_kernel("bwd", head_dim, dtype)
    lengths = [0, 1, 5, 128, 300, 0, 77, 1]
    check(lengths, lengths, 4, 4, head_dim, dtype, causal)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads_k", [2, 1], ids=["gqa", "mqa"])
def test_cross_lengths_and_gqa(nheads_k, causal, require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    # seqlen_q != seqlen_k per sequence, including queries without keys and keys without queries.
    check([3, 200, 0, 64, 129, 17], [70, 150, 9, 0, 257, 1], 8, nheads_k, 64, torch.bfloat16, causal)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_thousand_short_sequences(causal, require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    lengths = torch.randint(0, 40, (1000,)).tolist()
    check(lengths, lengths, 4, 2, 64, torch.bfloat16, causal)


@gpu
def test_max_seqlen_may_exceed_the_longest_sequence(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    check([33, 100], [50, 64], 2, 2, 64, torch.bfloat16, True, max_extra=200)


@gpu
def test_deterministic_varlen_bwd_is_bit_identical(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    lengths = [130, 7, 256, 0, 65]
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # the same inputs twice: check() draws them from the global generator
        runs.append(check(lengths, lengths, 4, 2, 64, torch.bfloat16, True, deterministic=True))
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@gpu
def test_varlen_matches_padded_batch(require_kernel, launch_overrides):
    """Equal lengths packed give exactly what the padded kernels give for the same batch (of one family: the
    mma.sync one, which runs both)."""
    require_kernel("fwd", 64, torch.bfloat16)
    launch_overrides(family="sm80")
    q4, k4, v4 = (torch.randn(3, 100, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")
    out4, lse4 = fa2.fwd(q4, k4, v4, causal=True)
    out, lse = fa2.fwd_varlen(q4.flatten(0, 1), k4.flatten(0, 1), v4.flatten(0, 1), cu, cu, 100, 100, causal=True)
    assert torch.equal(out, out4.flatten(0, 1))
    assert torch.equal(lse, lse4.transpose(0, 1).flatten(1))


@gpu
def test_attention_varlen_autograd(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    if not hasattr(fa2, "attention_varlen"):
        pytest.fail("fa2.attention_varlen is missing")
    lengths = [12, 0, 99, 1]
    q, cu = pack(lengths, 4, 64, torch.bfloat16)
    k = torch.randn(q.shape[0], 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for t in (q, k, v):
        t.requires_grad_()
    out = fa2.attention_varlen(q, k, v, cu, cu, 99, 99, causal=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    out64, _, g64 = per_sequence_ref(q, k, v, cu, cu, True, dout, upcast=True)
    out_low, _, g_low = per_sequence_ref(q, k, v, cu, cu, True, dout, upcast=False)
    assert_close_to_ref(out, out64, out_low, name="attention_varlen out")
    for name, g, r64, rl in zip(("dq", "dk", "dv"), got, g64, g_low):
        assert_close_to_ref(g, r64, rl, name=f"attention_varlen {name}")


@gpu
def test_gpu_cu_seqlens_values_are_read_once_per_tensor(require_kernel, monkeypatch):
    """The varlen ops never wait for cu_seqlens on the GPU (a wait per call left the GPU idle for the host's launch
    path); the Python layer reads a pair's values once, and again after an in-place write bumps a version."""
    require_kernel("fwd", 64, torch.bfloat16)
    reads, read = [], fa2.ops.CHECK_VARLEN
    monkeypatch.setattr(fa2.ops, "CHECK_VARLEN", lambda *args: (reads.append(args[2:4]), read(*args))[1])
    q, cu_q = pack([40, 200, 9], 2, 64, torch.bfloat16)
    k, cu_k = pack([64, 130, 300], 2, 64, torch.bfloat16)
    v = torch.randn_like(k)
    for causal in (False, True):
        fa2.attention_varlen(q, k, v, cu_q, cu_k, 200, 300, causal=causal)
    fa2.fwd_varlen(q, k, v, cu_q, cu_k, 200, 300)
    assert len(reads) == 1 and reads[0][0] is cu_q and reads[0][1] is cu_k
    with pytest.raises(ValueError, match=r"max_seqlen_k \(299\) is shorter than the longest sequence \(300\)"):
        fa2.attention_varlen(q, k, v, cu_q, cu_k, 200, 299)  # checked against other limits: read again
    cu_k[2] = 500  # in place: the version moves, the values are read again
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0 and never decrease"):
        fa2.attention_varlen(q, k, v, cu_q, cu_k, 200, 300)
    with pytest.raises(ValueError, match="cu_seqlens_q\\[-1\\] must equal the number of tokens"):
        fa2.fwd_varlen(q[:-1], k, v, cu_q, cu_k.clone(), 200, 300)
    assert len(reads) == 4


@gpu
def test_gpu_cu_seqlens_checks_in_inference_mode_and_by_type(require_kernel):
    """Inference tensors have no version counter: their values are read once per pair as well. An int64 cu_seqlens on
    the GPU is a TypeError, as on the CPU."""
    require_kernel("fwd", 64, torch.bfloat16)
    with torch.inference_mode():
        q, cu = pack([40, 200], 2, 64, torch.bfloat16)
        fa2.attention_varlen(q, q, q, cu, cu, 200, 200)
        fa2.attention_varlen(q, q, q, cu, cu, 200, 200, causal=True)
        bad = cu.clone()
        bad[1] = 300
        with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and never decrease"):
            fa2.attention_varlen(q, q, q, bad, cu, 200, 200)
    q, cu = pack([40, 200], 2, 64, torch.bfloat16)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        fa2.attention_varlen(q, q, q, cu.long(), cu, 200, 200)


# ----------------------------------------------------------------------------------------- validation (CPU)
def _inputs():
    q = torch.randn(10, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, k.clone(), cu_q, cu_k


@pytest.mark.parametrize("change, error, words", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 10])), TypeError, "cu_seqlens_q must be an int32"),
    (dict(cu_seqlens_k=[0, 5, 12]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
    (dict(cu_seqlens_q=torch.tensor([[0, 3, 10]], dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([0, 10], dtype=torch.int32)), ValueError, "same number of sequences"),
    (dict(cu_seqlens_q=torch.tensor([0, 7, 3], dtype=torch.int32)), ValueError, "never decrease"),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 10], dtype=torch.int32)), ValueError, "start at 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError, "cu_seqlens_k[-1] must equal"),
    (dict(max_seqlen_q=6), ValueError, "max_seqlen_q (6) is shorter than the longest sequence (7)"),
    (dict(max_seqlen_k=7.0), TypeError, "max_seqlen_k must be a non-negative Python int"),
    (dict(q=torch.randn(1, 10, 4, 64, dtype=torch.bfloat16)), ValueError, "q must be 3-D (total_tokens"),
    (dict(k=torch.randn(12, 3, 64, dtype=torch.bfloat16)), ValueError, "multiple of k's and v's nheads_k"),
])
def test_varlen_validation_names_the_argument(change, error, words):
    q, k, v, cu_q, cu_k = _inputs()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=7)
    args.update(change)
    if "k" in change:
        args["v"] = torch.randn_like(change["k"])
    with pytest.raises(error) as info:
        fa2.fwd_varlen(**args)
    assert words in str(info.value)


def test_varlen_bwd_checks_lse_layout():
    q, k, v, cu_q, cu_k = _inputs()
    lse = torch.randn(10, 4)  # (total_q, nheads): transposed
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 10\)"):
        fa2.bwd_varlen(torch.randn_like(q), q, k, v, torch.randn_like(q), lse, cu_q, cu_k, 7, 7)


def test_valid_cpu_inputs_reach_the_device_check():
    q, k, v, cu_q, cu_k = _inputs()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        fa2.fwd_varlen(q, k, v, cu_q, cu_k, 7, 7)

"""fa2.integrations.flash_attn against flash-attn 2.x: the same signatures, a NotImplementedError naming every option
fa2 lacks (raised before any other check), the arguments reaching fa2 (CPU); the numbers against the fp64
reference with FlashAttention's tolerance rule, forward and gradients, padded and varlen (GPU)."""
import inspect

import pytest
import torch

import fa2
from fa2.integrations import flash_attn
from fa2.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func
from fa2.reference import attention_ref
from fa2.testing import assert_close_to_ref

gpu = pytest.mark.gpu
REQUIRED = inspect.Parameter.empty

# flash-attn 2.8.x, flash_attn/flash_attn_interface.py: (name, default) in order, all positional-or-keyword.
FLASH_ATTN_FUNC = [
    ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False),
]
FLASH_ATTN_VARLEN_FUNC = [
    ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
    ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]


@pytest.mark.parametrize("func, expected", [(flash_attn_func, FLASH_ATTN_FUNC),
                                            (flash_attn_varlen_func, FLASH_ATTN_VARLEN_FUNC)],
                         ids=["flash_attn_func", "flash_attn_varlen_func"])
def test_signature_is_flash_attns(func, expected):
    params = list(inspect.signature(func).parameters.values())
    assert [(p.name, p.default) for p in params] == expected
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def _padded_args():  # CPU float32: any validation or device check would reject them with another error
    return torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)


def _varlen_args():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    return torch.randn(8, 2, 64), torch.randn(8, 2, 64), torch.randn(8, 2, 64), cu, cu, 8, 8


UNSUPPORTED_CASES = [(flash_attn_varlen_func, _varlen_args, "block_table", torch.zeros(1, 1, dtype=torch.int32))]


@pytest.mark.parametrize("func, args, option, value", UNSUPPORTED_CASES,
                         ids=[f"{f.__name__}-{o}={v if not isinstance(v, torch.Tensor) else 'tensor'}"
                              for f, _, o, v in UNSUPPORTED_CASES])
def test_unsupported_option_raises_naming_it(func, args, option, value):
    with pytest.raises(NotImplementedError, match=f"{option}="):
        func(*args(), **{option: value})


def test_arguments_reach_fa2_in_flash_attns_order(monkeypatch):
    calls = []
    monkeypatch.setattr(flash_attn, "attention", lambda *a, **kw: calls.append((a, kw)) or "out")
    monkeypatch.setattr(flash_attn, "attention_varlen", lambda *a, **kw: calls.append((a, kw)) or "out")
    q, k, v = _padded_args()
    # Positionally: dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic.
    # causal wins over the right bound, as in flash-attn (transformers passes (w, w) with causal=True).
    slopes = torch.ones(2)
    assert flash_attn_func(q, k, v, 0.0, 0.25, True, [64, 64], 30.0, slopes, True) == "out"
    assert calls[-1] == ((q, k, v), dict(causal=True, softmax_scale=0.25, deterministic=True, window_size=(64, 0),
                                         softcap=30.0, alibi_slopes=slopes, dropout_p=0.0))
    args = _varlen_args()
    assert flash_attn_varlen_func(*args, 0.0, None, False, (-1, -1), 0.0, None, False, False, None) == "out"
    assert calls[-1] == (args, dict(causal=False, softmax_scale=None, deterministic=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, dropout_p=0.0))


def test_dropped_probs_are_the_reference_probabilities_signed_by_the_dropout_mask():
    """S_dmask's glue on CPU: |S_dmask| is fa2.reference's probabilities, its sign bits the mask the state draws
    (varlen: per sequence, in the top-left corner of its slice, zeros elsewhere)."""
    torch.manual_seed(0)
    q1, k1 = torch.randn(1, 20, 4, 16), torch.randn(1, 33, 2, 16)
    q2, k2 = torch.randn(1, 7, 4, 16), torch.randn(1, 40, 2, 16)
    slopes = torch.rand(2, 4)
    options = dict(causal=True, softmax_scale=0.3, window_size=(9, 0), softcap=5.0)
    state = torch.tensor([123456789, 42])
    s_dmask = flash_attn._dropped_probs([(q1, k1, slopes[0]), (q2, k2, slopes[1])], options, 0.4, state, 20, 40)
    assert s_dmask.shape == (2, 4, 20, 40) and s_dmask.dtype == torch.float32
    keep = fa2.reference.dropout_keep_mask((123456789, 42), 2, 4, 20, 40, 0.4)
    for b, (q, k, alibi) in enumerate([(q1, k1, slopes[0]), (q2, k2, slopes[1])]):
        p = fa2.reference.attention_probs(q, k, alibi_slopes=alibi, dtype=torch.float32, **options)[0][0]
        corner = s_dmask[b, :, :q.shape[1], :k.shape[1]]
        assert torch.equal(corner.abs(), p)
        assert torch.equal(~torch.signbit(corner), keep[b, :, :q.shape[1], :k.shape[1]])
    assert not s_dmask[1, :, 7:].any() and not s_dmask[0, :, :, 33:].any()
    assert 0.5 < (~torch.signbit(s_dmask[0, :, :, :33])).float().mean() < 0.7  # about 1 - 0.4 kept


# ------------------------------------------------------------------------------------------------ GPU
def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def check(out, grads, ref_fn, inputs, dout, tag):
    """out and grads against ref_fn(*inputs, upcast=True) on fp64 copies of the inputs, with ref_fn in the
    inputs' own precision (upcast=False) setting the scale of the allowed error."""
    refs = {}
    for upcast in (True, False):
        leaves = [(t.double() if upcast else t).detach().clone().requires_grad_() for t in inputs]
        ref_out = ref_fn(*leaves, upcast)
        refs[upcast] = (ref_out, *torch.autograd.grad(ref_out, leaves, dout.to(ref_out.dtype)))
    for i, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
        assert_close_to_ref(got, refs[True][i], refs[False][i], name=f"{name} {tag}")


@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", [(2, 113, 203, 4, 4, 64), (1, 257, 129, 8, 2, 128), (2, 64, 64, 6, 1, 64)],
                         ids=["b2_113x203_mha", "b1_257x129_gqa4", "b2_64x64_mqa"])
def test_flash_attn_func_matches_reference(case, causal, deterministic, require_kernel):
    b, sq, sk, h, hk, d = case
    require_kernel("bwd", d, torch.bfloat16)
    q, k, v = randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d)
    out = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if deterministic:
        again = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal, deterministic=True), (q, k, v), dout)
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), "deterministic=True gradients differ"

    def ref(q, k, v, upcast):
        return attention_ref(q, k, v, causal=causal, upcast=upcast)[0]
    check(out, grads, ref, (q, k, v), dout, f"{case} causal={causal}")


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_flash_attn_varlen_func_matches_reference_per_sequence(heads, causal, require_kernel):
    h, hk = heads
    require_kernel("bwd", 64, torch.bfloat16)
    seqlens_q, seqlens_k = [1, 37, 128, 203, 64], [5, 37, 200, 64, 1]  # q longer and shorter than k
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(s).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
                  for s in (seqlens_q, seqlens_k))
    q, k, v = randn(sum(seqlens_q), h, 64), randn(sum(seqlens_k), hk, 64), randn(sum(seqlens_k), hk, 64)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), softmax_scale=0.1,
                                 causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def ref(q, k, v, upcast):  # each sequence on its own: nothing attends across a boundary
        bounds = zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])
        return torch.cat([attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                                        softmax_scale=0.1, upcast=upcast)[0][0] for q0, q1, k0, k1 in bounds])
    check(out, grads, ref, (q, k, v), dout, f"varlen h={h} hk={hk} causal={causal}")


@gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_return_attn_probs_gives_the_kernels_dropout_mask(varlen, require_kernel):
    """return_attn_probs=True: out and lse are the kernel's (the same seed gives the same out as a plain call), and
    out is what the reference computes with S_dmask's mask (its sign bits) and the same options; |S_dmask| is the
    reference's probabilities; without dropout S_dmask is None."""
    require_kernel("bwd", 64, torch.bfloat16)
    h, hk, d = 4, 2, 64
    slopes = torch.rand(2, h, device="cuda")
    options = dict(causal=True, window_size=(90, 90), softcap=15.0, alibi_slopes=slopes)
    seqlens_q, seqlens_k = [100, 37], [120, 200]
    if varlen:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(s).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
                      for s in (seqlens_q, seqlens_k))
        q, k, v = randn(sum(seqlens_q), h, d), randn(sum(seqlens_k), hk, d), randn(sum(seqlens_k), hk, d)
        sequences = [(q[None, a:b], k[None, c:e], v[None, c:e]) for a, b, c, e in
                     zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])]

        def call(**kw):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), **options, **kw)
    else:
        q, k, v = randn(2, 100, h, d), randn(2, 120, hk, d), randn(2, 120, hk, d)
        sequences = [(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(2)]

        def call(**kw):
            return flash_attn_func(q, k, v, **options, **kw)

    torch.manual_seed(11)
    out, lse, s_dmask = call(dropout_p=0.3, return_attn_probs=True)
    torch.manual_seed(11)
    assert torch.equal(out, call(dropout_p=0.3)), "the same seed must give the same mask"
    shape = (2, h, max(seqlens_q), max(seqlens_k)) if varlen else (2, h, 100, 120)
    assert s_dmask.dtype == q.dtype and s_dmask.shape == shape
    outs, lses = [], []
    flat_q = 0
    for b, (qb, kb, vb) in enumerate(sequences):
        lq, lk = qb.shape[1], kb.shape[1]
        corner = s_dmask[b, :, :lq, :lk]
        keep = ~torch.signbit(corner)[None]
        ref_options = dict(options, window_size=(90, 0), alibi_slopes=slopes[b], dropout_p=0.3, dropout_keep=keep)
        ref64, ref_lse = attention_ref(qb.double(), kb.double(), vb.double(), **ref_options)
        ref_low = attention_ref(qb, kb, vb, **ref_options, upcast=False)[0]
        got = out[None, flat_q:flat_q + lq] if varlen else out[b:b + 1]
        assert_close_to_ref(got, ref64, ref_low, name=f"out of sequence {b} with S_dmask's mask")
        p64 = fa2.reference.attention_probs(qb.double(), kb.double(), **dict(options, window_size=(90, 0),
                                                                             alibi_slopes=slopes[b]))[0]
        assert (corner.abs().double() - p64[0]).abs().max() <= 2 ** -8 * p64.max() + 1e-6
        got_lse = lse[:, flat_q:flat_q + lq] if varlen else lse[b]
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(got_lse), finite)
        assert (got_lse[finite].double() - ref_lse[0][finite]).abs().max() < 1e-3
        flat_q += lq
    assert torch.signbit(s_dmask).any() and not torch.signbit(s_dmask).all()
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    plain_out, plain_lse, none = call(return_attn_probs=True)
    assert none is None and torch.equal(plain_out, call())

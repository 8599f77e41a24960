"""fa2.integrations.flash_attn against flash-attn 2.x: the same signatures, errors that name tensors by shape, the
arguments reaching fa2 (CPU); the numbers against the fp64 reference with FlashAttention's tolerance rule, forward and
gradients, padded and varlen, paged prefill (GPU)."""
import inspect

import pytest
import torch

import fa2
from fa2.integrations import flash_attn
from fa2.integrations.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                         flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                         flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
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

_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
            ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FLASH_ATTN_QKVPACKED_FUNC = [("qkv", REQUIRED), *_OPTIONS]
FLASH_ATTN_KVPACKED_FUNC = [("q", REQUIRED), ("kv", REQUIRED), *_OPTIONS]
FLASH_ATTN_VARLEN_QKVPACKED_FUNC = [("qkv", REQUIRED), ("cu_seqlens", REQUIRED), ("max_seqlen", REQUIRED), *_OPTIONS]
FLASH_ATTN_VARLEN_KVPACKED_FUNC = [
    ("q", REQUIRED), ("kv", REQUIRED), ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
    ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), *_OPTIONS,
]
FLASH_ATTN_WITH_KVCACHE = [
    ("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED), ("k", None), ("v", None), ("rotary_cos", None),
    ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
    ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False),
]
SIGNATURES = [(flash_attn_func, FLASH_ATTN_FUNC), (flash_attn_varlen_func, FLASH_ATTN_VARLEN_FUNC),
              (flash_attn_qkvpacked_func, FLASH_ATTN_QKVPACKED_FUNC),
              (flash_attn_kvpacked_func, FLASH_ATTN_KVPACKED_FUNC),
              (flash_attn_varlen_qkvpacked_func, FLASH_ATTN_VARLEN_QKVPACKED_FUNC),
              (flash_attn_varlen_kvpacked_func, FLASH_ATTN_VARLEN_KVPACKED_FUNC),
              (flash_attn_with_kvcache, FLASH_ATTN_WITH_KVCACHE)]


@pytest.mark.parametrize("func, expected", SIGNATURES, ids=[f.__name__ for f, _ in SIGNATURES])
def test_signature_is_flash_attns(func, expected):
    params = list(inspect.signature(func).parameters.values())
    assert [(p.name, p.default) for p in params] == expected
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert getattr(fa2, func.__name__) is func and func.__name__ in fa2.__all__


def _padded_args():  # CPU float32: any validation or device check would reject them with another error
    return torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)


def _varlen_args():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    return torch.randn(8, 2, 64), torch.randn(8, 2, 64), torch.randn(8, 2, 64), cu, cu, 8, 8


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


# ------------------------------------------------------------------------------ window_size as flash-attn takes it
def _capture(monkeypatch):
    """Each drop-in's fa2 call, recorded instead of made: (function name, args, kwargs)."""
    calls = []
    for name in ("attention", "attention_varlen", "attention_with_kvcache"):
        monkeypatch.setattr(flash_attn, name, lambda *a, _name=name, **kw: calls.append((_name, a, kw)) or "out")
    return calls


@pytest.mark.parametrize("window, causal, expected", [
    (torch.tensor([5, 3]), False, (5, 3)),  # flash-attn's tests: torch.randint(0, seqlen, (2,))
    ((torch.tensor(7), 2), False, (7, 2)), ((torch.tensor(7, dtype=torch.int32), torch.tensor(9)), True, (7, 0)),
    ((-5, 4), False, (-1, 4)), ((3, -100), False, (3, -1)), (torch.tensor([-2, -3]), False, (-1, -1)),
    ([4, 4], True, (4, 0)),
], ids=["1d-tensor", "0d-tensor-and-int", "int32-causal", "left<-1", "right<-1", "both<-1-tensor", "list-causal"])
def test_window_size_takes_integer_tensors_and_any_negative_as_unbounded(monkeypatch, window, causal, expected):
    calls = _capture(monkeypatch)
    q, k, v = _padded_args()
    flash_attn_func(q, k, v, causal=causal, window_size=window)
    flash_attn_varlen_func(*_varlen_args(), causal=causal, window_size=window)
    flash_attn_with_kvcache(q, k, v, causal=causal, window_size=window)
    assert [(name, kw["window_size"]) for name, _, kw in calls] == [
        ("attention", expected), ("attention_varlen", expected), ("attention_with_kvcache", expected)]
    assert all(type(w) is int for _, _, kw in calls for w in kw["window_size"])


def test_tensor_window_reaches_the_kernels_as_ints(recording):
    """Through the real path (record mode): flash-attn's tensor window and -2 as the kernels take them."""
    q, k, v = (torch.randn(1, 40, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_func(q, k, v, window_size=torch.tensor([8, -2]))
    flash_attn_func(q, k, v, causal=True, window_size=(torch.tensor(16), torch.tensor(16)))
    (_, plain), (_, causal) = recording.calls
    assert (plain["window_left"], plain["window_right"], plain["causal"]) == (8, -1, False)
    assert (causal["window_left"], causal["window_right"], causal["causal"]) == (16, 0, True)


@pytest.mark.parametrize("window, pattern", [
    (torch.arange(3), r"window_size must be a pair .* got a cpu tensor of shape \(3,\) and dtype torch.int64"),
    (torch.ones(2, 50, dtype=torch.int64), r"window_size\[0\] \(left\) must be an int or an integer 0-d tensor, got "
                                           r"a cpu tensor of shape \(50,\)"),
    ((torch.tensor(2.0), 0), r"window_size\[0\] \(left\) .* got a cpu tensor of shape \(\) and dtype torch.float32"),
    ((0, True), r"window_size\[1\] \(right\) must be an int"), ((0, 1.5), r"window_size\[1\] \(right\) .* got 1.5"),
])
def test_bad_window_raises_without_printing_tensors(window, pattern):
    with pytest.raises(TypeError, match=pattern) as error:
        flash_attn_func(*_padded_args(), window_size=window)
    assert "tensor(" not in str(error.value)


def test_refusals_name_tensors_by_shape_not_values():
    big = torch.zeros(300, 400, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"block_table must be an int32 \(batch, max_pages\) tensor, got a cpu tensor "
                                        r"of shape \(300, 400\) and dtype torch.float32") as error:
        flash_attn_varlen_func(*_varlen_args(), block_table=big.float())
    assert "tensor(" not in str(error.value) and len(str(error.value)) < 300
    q, k, v, cu, _, _, _ = _varlen_args()
    with pytest.raises(TypeError, match=r"max_seqlen_q must be a non-negative Python int .* got a cpu tensor of "
                                        r"shape \(300, 400\)"):
        flash_attn_varlen_func(q, k, v, cu, cu, big, 8, return_attn_probs=True)


# ------------------------------------------------------------------------------------------- packed functions
def test_packed_functions_pass_views_and_every_argument_in_order(monkeypatch):
    """The packed forms slice without copying (views into the packed storage, fa2 takes their strides) and pass
    every argument, positional in flash-attn's order, to fa2."""
    calls = _capture(monkeypatch)
    slopes = torch.ones(4)
    qkv = torch.randn(2, 8, 3, 4, 64)
    options = (0.0, 0.25, True, torch.tensor([6, 6]), 30.0, slopes, True)  # dropout_p ... deterministic
    expected = dict(causal=True, softmax_scale=0.25, deterministic=True, window_size=(6, 0), softcap=30.0,
                    alibi_slopes=slopes, dropout_p=0.0)
    assert flash_attn_qkvpacked_func(qkv, *options) == "out"
    q, kv = torch.randn(2, 8, 4, 64), torch.randn(2, 16, 2, 2, 64)
    assert flash_attn_kvpacked_func(q, kv, *options) == "out"
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert flash_attn_varlen_qkvpacked_func(qkv[0], cu, 5, *options) == "out"
    cu_k = torch.tensor([0, 10, 16], dtype=torch.int32)
    assert flash_attn_varlen_kvpacked_func(q[0], kv[0], cu, cu_k, 5, 10, *options) == "out"
    (f1, a1, kw1), (f2, a2, kw2), (f3, a3, kw3), (f4, a4, kw4) = calls
    assert (f1, f2, f3, f4) == ("attention", "attention", "attention_varlen", "attention_varlen")
    assert kw1 == kw2 == kw3 == kw4 == expected
    for packed, views, dim in ((qkv, a1, 2), (kv, a2[1:], 2), (qkv[0], a3[:3], 1), (kv[0], a4[1:3], 1)):
        for i, view in enumerate(views):
            assert torch.equal(view, packed.select(dim, i)) and view.data_ptr() == packed.select(dim, i).data_ptr()
    assert a2[0] is q and torch.equal(a4[0], q[0])
    assert a3[3:] == (cu, cu, 5, 5) and a4[3:] == (cu, cu_k, 5, 10)


def _reference_attention(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic,
                         dropout_p):
    return attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                         softcap=softcap, alibi_slopes=alibi_slopes)[0]


def _reference_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return torch.cat([_reference_attention(q[None, bq[b]:bq[b + 1]], k[None, bk[b]:bk[b + 1]],
                                           v[None, bk[b]:bk[b + 1]], **options)[0] for b in range(len(bq) - 1)])


def test_packed_gradients_reach_the_packed_tensor(monkeypatch):
    """With fa2's calls replaced by the fp64 reference (CPU), autograd carries each packed function's gradient into
    the packed tensor: the same as the reference on explicit slices."""
    monkeypatch.setattr(flash_attn, "attention", _reference_attention)
    monkeypatch.setattr(flash_attn, "attention_varlen", _reference_attention_varlen)
    options = dict(causal=True, window_size=(5, 5))
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 7, 12], dtype=torch.int32)
    qkv = torch.randn(2, 8, 3, 4, 16, dtype=torch.float64, requires_grad=True)
    q = torch.randn(2, 8, 4, 16, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 12, 2, 2, 16, dtype=torch.float64, requires_grad=True)
    cases = [
        (lambda: flash_attn_qkvpacked_func(qkv, **options), (qkv,),
         lambda: attention_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, window_size=(5, 0))[0]),
        (lambda: flash_attn_kvpacked_func(q, kv, **options), (q, kv),
         lambda: attention_ref(q, kv[:, :, 0], kv[:, :, 1], causal=True, window_size=(5, 0))[0]),
        (lambda: flash_attn_varlen_qkvpacked_func(qkv[0], cu_q, 5, **options), (qkv,),
         lambda: _reference_attention_varlen(qkv[0, :, 0], qkv[0, :, 1], qkv[0, :, 2], cu_q, cu_q, 5, 5,
                                             causal=True, softmax_scale=None, window_size=(5, 0), softcap=0.0,
                                             alibi_slopes=None, deterministic=False, dropout_p=0.0)),
        (lambda: flash_attn_varlen_kvpacked_func(q[0], kv[0], cu_q, cu_k, 5, 7, **options), (q, kv),
         lambda: _reference_attention_varlen(q[0], kv[0, :, 0], kv[0, :, 1], cu_q, cu_k, 5, 7, causal=True,
                                             softmax_scale=None, window_size=(5, 0), softcap=0.0, alibi_slopes=None,
                                             deterministic=False, dropout_p=0.0)),
    ]
    for call, leaves, explicit in cases:
        out = call()
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
        expected = torch.autograd.grad(explicit(), leaves, dout)
        assert torch.equal(out, explicit())
        assert all(g.shape == leaf.shape and torch.allclose(g, e) for g, e, leaf in zip(grads, expected, leaves))
        assert all(g.abs().sum() > 0 for g in grads)


def test_packed_call_reaches_the_kernels_with_the_packed_strides(recording):
    """Record mode: the kernels read q, k, v in place in qkv (its strides, no copy), and the backward's gradient is
    one tensor shaped like qkv."""
    qkv = torch.randn(1, 16, 3, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    out.sum().backward()
    (fwd_kind, f), (bwd_kind, b) = recording.calls
    assert (fwd_kind, bwd_kind) == ("fwd", "bwd")
    assert f["q_stride"] == f["k_stride"] == (16 * 3 * 4 * 64, 3 * 4 * 64, 64)
    assert f["q"] == qkv.data_ptr() and f["k"] == qkv[:, :, 1].data_ptr() and f["v"] == qkv[:, :, 2].data_ptr()
    assert qkv.grad.shape == qkv.shape


@pytest.mark.parametrize("call, pattern", [
    (lambda: flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 4, 64)), r"qkv must be \(batch, seqlen, 3, nheads, "
                                                                     r"head_dim\), got shape \(1, 8, 2, 4, 64\)"),
    (lambda: flash_attn_kvpacked_func(torch.randn(1, 8, 4, 64), torch.randn(1, 8, 4, 64)), r"kv must be \(batch, "
                                                                                          r"seqlen_k, 2, nheads_k"),
    (lambda: flash_attn_varlen_qkvpacked_func(torch.randn(1, 8, 3, 4, 64), torch.zeros(2), 8), r"qkv must be "
                                                                                               r"\(total, 3,"),
    (lambda: flash_attn_varlen_kvpacked_func(torch.randn(8, 4, 64), [1], None, None, 8, 8), r"kv must be a torch"),
], ids=["qkvpacked", "kvpacked", "varlen_qkvpacked", "varlen_kvpacked-not-a-tensor"])
def test_packed_layouts_are_checked(call, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        call()


# ---------------------------------------------------------------------------------- return_attn_probs's S_dmask
def _decode_like_flash_attns_tests(s_dmask, scores, block_n):
    """flash-attn 2.8.3's tests/test_flash_attn.py reading of one sequence's S_dmask (convert_flash_attn_S_to_softmax
    crops it; normalize_flash_attn_S multiplies key block n by exp(cummax - lse) from the test's own scores):
    scores (nheads, seqlen_q, seqlen_k) are the scaled, biased, masked (-inf) logits. Returns the probabilities
    and the kept mask as the tests read them (`>= 0`)."""
    seqlen_q, seqlen_k = scores.shape[-2:]
    s = s_dmask[..., :seqlen_q, :seqlen_k].float()
    blocks = scores.split(block_n, dim=-1)
    lse = torch.logsumexp(torch.stack([torch.logsumexp(b, dim=-1) for b in blocks], dim=-1), dim=-1)
    lse[lse == float("-inf")] = float("inf")
    block_max = torch.stack([torch.amax(b, dim=-1) for b in blocks], dim=-1)
    cummax = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1).unbind(dim=-1)
    probs = torch.cat([a * torch.exp(m - lse)[..., None] for a, m in zip(s.abs().split(block_n, dim=-1), cummax)],
                      dim=-1)
    return probs, s >= 0


def _scores(q, k, *, causal, window_size, softmax_scale, alibi_slopes, softcap=0.0):
    """The logits flash-attn's tests build (q / sqrt(d) @ k, softcapped, the band as -inf, the ALiBi bias) for one
    sequence, (nheads, seqlen_q, seqlen_k)."""
    q, k = q[0].double().transpose(0, 1), k[0].double().transpose(0, 1)
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    rows, cols = torch.arange(seqlen_q, device=q.device), torch.arange(seqlen_k, device=q.device)
    s = (q @ k.transpose(-1, -2)) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    window = (window_size[0], 0) if causal else window_size
    s = s.masked_fill(~fa2.reference.window_visible(rows, cols, seqlen_q, seqlen_k, window), float("-inf"))
    return s + fa2.reference.alibi_bias(alibi_slopes.double(), rows, cols, seqlen_q, seqlen_k)[0]


def test_get_block_size_n_is_flash_attns_with_dropout():
    """flash-attn 2.8.3's _get_block_size_n with dropout (no GPU needed: S_dmask is empty without dropout)."""
    got = [flash_attn._get_block_size_n("cpu", d, True, causal) for causal in (False, True)
           for d in (8, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)]
    assert got == 2 * [128, 128, 64, 64, 64, 64, 64, 32, 32, 64, 64, 64, 64]


@pytest.mark.parametrize("head_dim", [48, 112], ids=["block64", "block32"])
def test_s_dmask_decodes_to_the_reference_probabilities_as_flash_attns_tests_read_it(head_dim):
    """S_dmask's glue on CPU (fp32 inputs): flash-attn's tests' decoding of it gives fa2.reference's probabilities,
    its signs are the mask the state draws, it is (batch, nheads, seqlen rounded up to 128 twice) with sequence b in
    the top-left corner of slice b and zeros elsewhere; blocks whose running max moves are where the encoding and
    the normalised probabilities differ."""
    torch.manual_seed(0)
    q1, k1 = torch.randn(1, 70, 4, head_dim), torch.randn(1, 90, 2, head_dim)
    q2, k2 = torch.randn(1, 7, 4, head_dim), torch.randn(1, 130, 2, head_dim)
    slopes = torch.rand(2, 4) * 0.3
    options = dict(causal=True, softmax_scale=head_dim ** -0.5, window_size=(60, 0), softcap=0.0)
    state = torch.tensor([123456789, 42])
    sequences = [(q1, k1, slopes[0]), (q2, k2, slopes[1])]
    s_dmask = flash_attn._s_dmask(sequences, options, 0.17, state, 70, 130)
    assert s_dmask.shape == (2, 4, 128, 256) and s_dmask.dtype == torch.float32
    keep = fa2.reference.dropout_keep_mask((123456789, 42), 2, 4, 70, 130, 0.17)
    block_n = flash_attn._get_block_size_n("cpu", head_dim, True, True)
    moved = False
    for b, (q, k, alibi) in enumerate(sequences):
        lq, lk = q.shape[1], k.shape[1]
        p = fa2.reference.attention_probs(q, k, alibi_slopes=alibi, dtype=torch.float64, **options)[0][0]
        scores = _scores(q, k, causal=True, window_size=(60, -1), softmax_scale=options["softmax_scale"],
                         alibi_slopes=alibi)
        probs, kept = _decode_like_flash_attns_tests(s_dmask[b], scores, block_n)
        assert (probs.double() - p).abs().max() < 1e-6
        visible = p > 0
        assert torch.equal(kept[visible], keep[b, :, :lq, :lk][visible])
        assert not s_dmask[b, :, lq:].any() and not s_dmask[b, :, :, lk:].any()
        assert not s_dmask[b, :, :lq, :lk][~visible].any()  # outside the band and the causal mask
        moved |= bool((s_dmask[b, :, :lq, :lk].abs().double() - p).abs().max() > 1e-3)
    assert moved, "no row's running max moved: the test does not tell the encoding from the probabilities"
    assert 0.75 < kept[visible].float().mean() < 0.9  # about 1 - 0.17 kept


def test_return_attn_probs_returns_flash_attns_triple(recording):
    """Record mode (no GPU): without dropout S_dmask is flash-attn's empty tensor; with it, the encoded matrix in q's
    dtype at flash-attn's rounded shape, padded and varlen, packed or not."""
    qkv = torch.randn(2, 100, 3, 4, 64, dtype=torch.bfloat16)
    out, lse, s_dmask = flash_attn_qkvpacked_func(qkv, return_attn_probs=True)
    assert out.shape == (2, 100, 4, 64) and lse.shape == (2, 4, 100)
    assert s_dmask.shape == (0,) and s_dmask.dtype == torch.bfloat16
    _, _, s_dmask = flash_attn_qkvpacked_func(qkv, 0.1, causal=True, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 128, 128) and s_dmask.dtype == torch.bfloat16 and torch.signbit(s_dmask).any()
    cu = torch.tensor([0, 30, 200], dtype=torch.int32)
    out, lse, s_dmask = flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 170, 0.1, return_attn_probs=True)
    assert lse.shape == (4, 200) and s_dmask.shape == (2, 4, 256, 256)
    assert s_dmask[0, :, :30, :30].abs().amax(-1).eq(1).all()  # each row's largest entry is 1 (d64: one block)
    assert not s_dmask[0, :, 30:].any() and not s_dmask[1, :, 170:].any()
    out, lse, s_dmask = flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 170, return_attn_probs=True)
    assert s_dmask.shape == (0,)


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
    out is what the reference computes with S_dmask's mask (its sign bits) and the same options; S_dmask, decoded
    as flash-attn's tests decode it, is the reference's probabilities; without dropout S_dmask is flash-attn's empty
    tensor."""
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
    shape = (2, h, 128, 256) if varlen else (2, h, 128, 128)  # flash-attn's: seqlens rounded up to 128
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
        scores = _scores(qb.detach(), kb.detach(), causal=True, window_size=(90, 90), softmax_scale=d ** -0.5,
                         alibi_slopes=slopes[b], softcap=15.0)
        block_n = flash_attn._get_block_size_n(q.device, d, True, True)
        probs, _ = _decode_like_flash_attns_tests(s_dmask[b], scores, block_n)
        assert (probs.double() - p64[0]).abs().max() <= 2 ** -7 * p64.max() + 1e-6
        got_lse = lse[:, flat_q:flat_q + lq] if varlen else lse[b]
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(got_lse), finite)
        assert (got_lse[finite].double() - ref_lse[0][finite]).abs().max() < 1e-3
        flat_q += lq
    assert torch.signbit(s_dmask).any() and not torch.signbit(s_dmask).all()
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    plain_out, plain_lse, empty = call(return_attn_probs=True)
    assert empty.shape == (0,) and empty.dtype == q.dtype and torch.equal(plain_out, call())


@gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_packed_functions_match_reference(varlen, require_kernel):
    """qkv- and kv-packed calls, forward and the gradient of the packed tensor, against the fp64 reference."""
    require_kernel("bwd", 64, torch.bfloat16)
    h, hk, d = 4, 2, 64
    seqlens_q, seqlens_k = [37, 128, 5], [37, 64, 200]
    if varlen:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(s).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
                      for s in (seqlens_q, seqlens_k))
        qkv, q, kv = randn(sum(seqlens_q), 3, h, d), randn(sum(seqlens_q), h, d), randn(sum(seqlens_k), 2, hk, d)
        out_qkv = flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(seqlens_q), causal=True)
        out_kv = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True)

        def ref_qkv(qkv, upcast):
            return _per_sequence(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_q, upcast)

        def ref_kv(q, kv, upcast):
            return _per_sequence(q, kv[:, 0], kv[:, 1], cu_q, cu_k, upcast)
    else:
        qkv, q, kv = randn(2, 113, 3, h, d), randn(2, 113, h, d), randn(2, 203, 2, hk, d)
        out_qkv = flash_attn_qkvpacked_func(qkv, causal=True)
        out_kv = flash_attn_kvpacked_func(q, kv, causal=True)

        def ref_qkv(qkv, upcast):
            return attention_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, upcast=upcast)[0]

        def ref_kv(q, kv, upcast):
            return attention_ref(q, kv[:, :, 0], kv[:, :, 1], causal=True, upcast=upcast)[0]
    for out, inputs, ref_fn, names in ((out_qkv, (qkv,), ref_qkv, ("dqkv",)), (out_kv, (q, kv), ref_kv, ("dq", "dkv"))):
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, dout)
        refs = {}
        for upcast in (True, False):
            leaves = [(t.double() if upcast else t).detach().clone().requires_grad_() for t in inputs]
            ref_out = ref_fn(*leaves, upcast)
            refs[upcast] = (ref_out, *torch.autograd.grad(ref_out, leaves, dout.to(ref_out.dtype)))
        for i, (name, got) in enumerate(zip(("out", *names), (out, *grads))):
            assert got.shape == refs[True][i].shape
            assert_close_to_ref(got, refs[True][i], refs[False][i], name=f"{name} varlen={varlen}")


def _per_sequence(q, k, v, cu_q, cu_k, upcast):
    bounds = zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])
    return torch.cat([attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True, upcast=upcast)[0][0]
                      for q0, q1, k0, k1 in bounds])


@gpu
def test_tensor_window_gives_the_int_windows_output(require_kernel):
    """flash-attn's tests' windows (torch.randint values, and a negative entry below -1) give the output of the
    same window as ints, padded, varlen and from the KV cache."""
    require_kernel("fwd", 64, torch.bfloat16)
    q, k, v = (torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    window = torch.randint(0, 100, (2,))
    ints = (int(window[0]), int(window[1]))
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), flash_attn_func(q, k, v, window_size=ints))
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-7, window[1])),
                       flash_attn_func(q, k, v, window_size=(-1, ints[1])))
    cu = torch.tensor([0, 100, 200], device="cuda", dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    assert torch.equal(flash_attn_varlen_func(*flat, cu, cu, 100, 100, window_size=window, causal=True),
                       flash_attn_varlen_func(*flat, cu, cu, 100, 100, window_size=(ints[0], 0), causal=True))
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    k_cache[:, :90], v_cache[:, :90] = k[:, :90], v[:, :90]
    lens = torch.full((2,), 90, device="cuda", dtype=torch.int32)
    assert torch.equal(flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=lens, window_size=window),
                       flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=lens, window_size=ints))

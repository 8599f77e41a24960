"""The executable specification (CPU, fp64): the tiled FlashAttention-2 algorithms equal plain attention,
for any block size, causal or not, GQA/MQA, equal and unequal sequence lengths."""
import pytest
import torch

from fa2.reference import attention_ref, dropout_keep_mask, flash_bwd_tiled, flash_fwd_tiled, philox4x32
from fa2.testing import assert_close_to_ref, assert_lse_close

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


# ------------------------------------------------------------------------------------ the attention variants
# flash-attn 2.8's semantics for window_size, softcap and alibi_slopes, and gpt-oss's learnable sinks, written
# into attention_ref before any kernel has them. Each is checked against a direct, element-by-element reading
# of its definition.
def _scores(q, k, scale):
    """(batch, nheads, seqlen_q, seqlen_k) scaled scores with K repeated over GQA groups, fp64."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bihd,bjhd->bhij", q, k) * scale


def _attend(S, v, nheads):
    """softmax over the last dim (rows of -inf give 0) times V, (batch, seqlen_q, nheads, d)."""
    v = v.repeat_interleave(nheads // v.shape[2], dim=2)
    P = torch.softmax(S, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", P, v)


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 2), (16, -1), (-1, 5), (40, 0)]


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("case", [(2, 37, 37, 4, 2, 16), (1, 23, 61, 2, 1, 8), (1, 61, 23, 2, 2, 8)],
                         ids=["square", "sq<sk", "sq>sk"])
def test_window_sees_exactly_its_band(case, window):
    q, k, v = _inputs(*case)
    sq, sk = case[1], case[2]
    left, right = window
    S = _scores(q, k, q.shape[-1] ** -0.5)
    for i in range(sq):
        for j in range(sk):
            d = i + sk - sq  # the key query i is aligned with
            if (left >= 0 and j < d - left) or (right >= 0 and j > d + right):
                S[:, :, i, j] = float("-inf")
    out, lse = attention_ref(q, k, v, window_size=window)
    torch.testing.assert_close(out, _attend(S, v, case[3]), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(S, dim=-1), rtol=0, atol=1e-12)  # -inf rows included


def test_causal_is_the_window_minus_one_zero():
    q, k, v = _inputs(1, 29, 41, 2, 2, 16)
    for left in (-1, 7):
        a = attention_ref(q, k, v, causal=True, window_size=(left, -1))
        b = attention_ref(q, k, v, window_size=(left, 0))
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,names", [
    (dict(causal=True, window_size=(4, 3)), ["causal", "window_size"]),
    (dict(window_size=(-2, 0)), ["window_size"]),
    (dict(window_size=(1, 2, 3)), ["window_size"]),
    (dict(softcap=-1.0), ["softcap"]),
    (dict(dropout_p=1.0), ["dropout_p"]),
    (dict(dropout_p=0.1), ["dropout_p", "dropout_keep"]),
])
def test_options_that_make_no_sense_name_their_arguments(kwargs, names):
    q, k, v = _inputs(1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError) as e:
        attention_ref(q, k, v, **kwargs)
    assert all(name in str(e.value) for name in names), str(e.value)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_softcap_is_tanh_of_the_scaled_score(softcap):
    q, k, v = _inputs(2, 19, 33, 4, 2, 16)
    q = q * 4  # scores well into tanh's bend
    S = _scores(q, k, 0.3)
    S = softcap * torch.tanh(S / softcap)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, softcap=softcap)
    torch.testing.assert_close(out, _attend(S, v, 4), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(S, dim=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_h", "slopes_bh"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_adds_minus_slope_times_distance(causal, per_batch):
    b, sq, sk, h = 2, 13, 29, 4
    q, k, v = _inputs(b, sq, sk, h, 2, 16)
    slopes = torch.rand(b, h, dtype=torch.float32) if per_batch else torch.rand(h, dtype=torch.float32)
    S = _scores(q, k, 16 ** -0.5)
    for bi in range(b):
        for hi in range(h):
            slope = float(slopes[bi, hi] if per_batch else slopes[hi])
            for i in range(sq):
                for j in range(sk):
                    S[bi, hi, i, j] -= slope * abs(i + sk - sq - j)
                    if causal and j > i + sk - sq:
                        S[bi, hi, i, j] = float("-inf")
    out, lse = attention_ref(q, k, v, causal=causal, alibi_slopes=slopes)
    torch.testing.assert_close(out, _attend(S, v, h), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(S, dim=-1), rtol=0, atol=1e-12)


def test_sink_joins_the_denominator_and_its_gradient_has_the_closed_form():
    q, k, v = _inputs(2, 17, 23, 4, 2, 16)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True, sink=sink)
    S = _scores(q, k, 16 ** -0.5).masked_fill(~torch.ones(17, 23, dtype=torch.bool).tril(23 - 17), float("-inf"))
    S_sink = torch.cat([S, sink.detach()[None, :, None, None].expand(2, 4, 17, 1)], dim=-1)
    torch.testing.assert_close(lse.detach(), torch.logsumexp(S_sink, dim=-1), rtol=0, atol=1e-12)
    P = torch.softmax(S_sink, dim=-1)[..., :-1]
    v_ = v.repeat_interleave(2, dim=2)
    torch.testing.assert_close(out.detach(), torch.einsum("bhij,bjhd->bihd", P, v_), rtol=0, atol=1e-12)
    # d sink_h = -sum_i exp(sink_h - lse_i) * D_i, D_i = rowsum(dO * O): what the kernel's backward will compute
    dout = torch.randn_like(out)
    (dsink,) = torch.autograd.grad(out, sink, dout)
    D = (dout * out.detach()).sum(-1).transpose(1, 2)  # (batch, nheads, seqlen_q)
    closed = -(torch.exp(sink.detach()[None, :, None] - lse.detach()) * D).sum(dim=(0, 2))
    torch.testing.assert_close(dsink, closed, rtol=0, atol=1e-12)


def test_sink_of_minus_infinity_is_no_sink():
    q, k, v = _inputs(1, 9, 9, 2, 2, 8)
    a = attention_ref(q, k, v, causal=True)
    b = attention_ref(q, k, v, causal=True, sink=torch.full((2,), float("-inf"), dtype=torch.float64))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dropout_scales_the_kept_probabilities_after_the_softmax():
    q, k, v = _inputs(2, 11, 15, 4, 4, 8)
    p = 0.3
    keep = torch.rand(2, 4, 11, 15) >= p
    out, lse = attention_ref(q, k, v, dropout_p=p, dropout_keep=keep)
    S = _scores(q, k, 8 ** -0.5)
    P = torch.softmax(S, dim=-1) * keep / (1 - p)
    torch.testing.assert_close(out, torch.einsum("bhij,bjhd->bihd", P, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(S, dim=-1), rtol=0, atol=1e-12)  # lse is the undropped one


_PI_COUNTER, _PI_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)


@pytest.mark.parametrize("rounds, counter, key, expected", [  # Random123's known-answer vectors (kat_vectors)
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, _PI_COUNTER, _PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, _PI_COUNTER, _PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
])
def test_philox_matches_the_known_answers(rounds, counter, key, expected):
    assert tuple(int(x) for x in philox4x32(counter, key, rounds)) == expected


def test_dropout_mask_takes_each_score_s_16_bits_of_its_group_s_philox_block():
    """Score (i, j) of one (batch, head), spelled out with plain ints: its group's Philox4x32-7 block, then the
    output and half its position selects."""
    seed, offset, p, nheads = 0x1234_5678_9ABC_DEF0, 0x1_0000_0005, 0.25, 3
    mask = dropout_keep_mask((seed, offset), 2, nheads, 24, 70, p)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 9, 33), (1, 1, 23, 69), (0, 2, 15, 38), (1, 0, 8, 1)]:
        block = philox4x32((j & ~33, i & ~8, b * nheads + h, offset & 0xFFFFFFFF), (seed & 0xFFFFFFFF, seed >> 32),
                           7)
        word = int(block[2 * ((j >> 5) & 1) + ((i >> 3) & 1)])
        assert mask[b, h, i, j].item() == (((word >> (16 * (j & 1))) & 0xFFFF) < int(0.75 * 65536))


def test_dropout_mask_is_a_function_of_the_rng_state():
    """Same state, same mask; another seed or offset, another mask; each element kept with probability 1 - p
    (here within 5 standard deviations over 2^20 draws), independently of its position."""
    shape = (2, 4, 128, 1024)
    p = 0.3
    a = dropout_keep_mask((12345, 7), *shape, p)
    assert a.shape == shape and a.dtype == torch.bool and torch.equal(a, dropout_keep_mask((12345, 7), *shape, p))
    assert not torch.equal(a, dropout_keep_mask((12346, 7), *shape, p))
    assert not torch.equal(a, dropout_keep_mask((12345, 8), *shape, p))
    n = a.numel()
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(a.sum().item() - n * (1 - p)) < 5 * sigma
    for part in (a[..., 0::2], a[..., 1::2], a[..., 32:64], a[:, :, 8:16], a[:, :, 1::2], a[1]):  # each word/half
        m = part.numel()
        assert abs(part.sum().item() - m * (1 - p)) < 5 * (m * p * (1 - p)) ** 0.5
    assert dropout_keep_mask((1, 0), *shape, 0.0).all()


def test_dropout_mask_of_a_negative_seed_uses_its_twos_complement_bits():
    shape = (1, 2, 8, 16)
    assert torch.equal(dropout_keep_mask((-1, 0), *shape, 0.5), dropout_keep_mask((2 ** 64 - 1, 0), *shape, 0.5))


def test_every_variant_together_is_differentiable():
    """gradcheck through window + softcap + ALiBi + sink + GQA + unequal lengths: the reference backward the
    kernels' will be held to."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 7, 11, 4, 2, 8))
    slopes = torch.rand(4, dtype=torch.float64)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sink):
        return attention_ref(q, k, v, window_size=(3, 1), softcap=2.0, alibi_slopes=slopes, sink=sink)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, sink))

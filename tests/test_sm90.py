"""The Hopper forward family (csrc/sm90/, GPU): asked for, it runs every call it serves (padded or packed q, k, v at
head dims 64, 128 and 256, full or causal, MHA/GQA/MQA, any lengths) on an sm90 device whose build has it, and the
plan falls back to the mma.sync family everywhere else; either way the result meets the fp64 reference rule. The
kernel names in a profile say which family ran. CPU (record mode): the plan's family."""
import functools
import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fa2
from fa2 import ops
from fa2.reference import attention_ref, dropout_keep_mask
from fa2.testing import assert_close_to_ref, assert_lse_close, assert_written, poison

from test_features import check_against_reference
from test_fwd import check_fwd, randn
from test_varlen import pack, per_sequence_lse32, per_sequence_ref


def hopper_expected():
    """Whether this build and device run the Hopper family."""
    return "sm90" in fa2.build_info().get("families", []) and torch.cuda.get_device_capability() == (9, 0)


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "fa2" in e.name and "kernel" in e.name}


SHAPES = [(1, 1), (113, 203), (128, 128), (1000, 1000), (2048, 1023), (1023, 2048)]
HEADS = [(2, 4, 4), (1, 8, 1), (1, 16, 2)]
GRID = [(d, sq, sk, b, h, hk) for d in (64, 128, 256) for sq, sk in SHAPES for b, h, hk in HEADS
        if sq * sk * h <= 2048 * 1024 * 8 or d != 256]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d,sq,sk,b,h,hk", GRID, ids=["d{}_{}x{}_b{}_h{}kv{}".format(*g) for g in GRID])
def test_hopper_forward_matches_the_reference(d, sq, sk, b, h, hk, dtype, causal, launch_overrides):
    launch_overrides(family="sm90")
    q, k, v = randn(b, sq, h, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype), randn(b, sk, hk, d, dtype=dtype)
    check_fwd(q, k, v, causal=causal, tag=f"sm90 d{d} {sq}x{sk} h{h}/{hk} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_family_that_runs_is_the_one_planned(d, launch_overrides):
    q, k, v = (randn(2, 300, 4, d) for _ in range(3))
    launch_overrides(family="sm90")
    names = kernel_names(lambda: fa2.fwd(q, k, v, causal=True))
    hopper = any("sm90" in n for n in names)
    assert hopper == hopper_expected(), names
    launch_overrides(family="sm80")
    assert not any("sm90" in n for n in kernel_names(lambda: fa2.fwd(q, k, v, causal=True)))
    # What the family does not serve (here a decode's 64 query rows) falls back by the plan, never by error.
    launch_overrides(family="sm90")
    names = kernel_names(lambda: fa2.fwd(q[:, :64], k, v))
    assert names and not any("sm90" in n for n in names), names
    state = torch.tensor([1, 2], device="cuda")
    names = kernel_names(lambda: fa2.fwd(q, k, v, dropout_p=0.1, rng_state=state))
    assert any("sm90" in n for n in names) == hopper_expected(), names  # dropout: served


THREAD_SHAPES = [(100, 8), (65, 65), (128, 1), (200, 1), (300, 16), (113, 203)]


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", THREAD_SHAPES, ids=["{}x{}".format(*s) for s in THREAD_SHAPES])
def test_the_forward_off_the_main_thread_and_under_checkpoint(sq, sk, launch_overrides):
    """The driver encodes the TMA descriptors on the calling thread, which needs a current context: off the main
    thread (a user's thread; autograd's, which runs a checkpointed forward again in the backward), with every tensor
    served by the caching allocator, the Hopper forward gives the main thread's results, bitwise
    (common/launch.h: bind_context). Lengths from the draft Hopper backward's failures on autograd's thread."""
    launch_overrides(family="sm90")
    q, k, v = (randn(2, s, 4, 128).requires_grad_() for s in (sq, sk, sk))
    want, want_lse = fa2.fwd(q, k, v)
    fa2.fwd(q, k, v)  # freed at once: the worker's out and lse come from the allocator's cache, with no cudaMalloc
    got = {}
    worker = threading.Thread(target=lambda: got.update(zip(("out", "lse"), fa2.fwd(q, k, v))))
    worker.start()
    worker.join()
    assert torch.equal(got["out"], want) and torch.equal(got["lse"], want_lse)
    dout = torch.randn_like(want)
    attend = functools.partial(fa2.attention, deterministic=True)  # bitwise repeatable gradients
    plain = torch.autograd.grad(attend(q, k, v), (q, k, v), dout)
    recomputed = torch.autograd.grad(checkpoint(attend, q, k, v, use_reentrant=False), (q, k, v), dout)
    for name, a, b in zip("qkv", recomputed, plain):
        assert torch.equal(a, b), f"d{name} under checkpoint differs from the plain call's"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,sq,sk,hk", [(64, 300, 257, 4), (128, 1000, 1000, 2), (256, 129, 700, 1), (128, 200, 70, 4)])
def test_hopper_forward_with_sinks_matches_the_reference(d, sq, sk, hk, causal, launch_overrides):
    """Sinks (gpt-oss): one logit per head joins every row's denominator, in the Hopper family's finalize; rows that
    see no key (causal, seqlen_q > seqlen_k) get O = 0 and lse = the sink. Sinks from -8 to 8 against scores of ~N(0, 1)
    magnitude, so the sink dominates some rows and vanishes in others."""
    launch_overrides(family="sm90")
    q, k, v = randn(2, sq, 4, d), randn(2, sk, hk, d), randn(2, sk, hk, d)
    sink = torch.linspace(-8, 8, 4, device="cuda").to(q.dtype)
    out = poison(torch.empty_like(q))
    result, lse = fa2.fwd(q, k, v, causal=causal, sink=sink, out=out)
    assert result is out
    assert_written(out, name="out")
    out64, lse64 = attention_ref(q.double(), k.double(), v.double(), causal=causal, sink=sink.double())
    out_low, _ = attention_ref(q, k, v, causal=causal, sink=sink, upcast=False)
    _, lse32 = attention_ref(q, k, v, causal=causal, sink=sink.float(), dtype=torch.float32)
    tag = f"sm90 sink d{d} {sq}x{sk} causal={causal}"
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")


WINDOWS = [(64, 0), (200, 50), (-1, 30), (0, 0), (100, -1), (300, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("window", WINDOWS, ids=["w{}_{}".format(*w) for w in WINDOWS])
@pytest.mark.parametrize("d,sq,sk,hk", [(64, 1000, 1000, 4), (128, 300, 1030, 2), (256, 777, 129, 1)])
def test_hopper_forward_with_windows_matches_the_reference(d, sq, sk, hk, window, launch_overrides):
    """Sliding windows (Mistral, Gemma): the key blocks outside a query block's band are never loaded, those its
    edges cross are masked; bottom-right aligned, with seqlen_q above and below seqlen_k (rows that see no key)."""
    launch_overrides(family="sm90")
    q, k, v = randn(2, sq, 4, d), randn(2, sk, hk, d), randn(2, sk, hk, d)
    out = poison(torch.empty_like(q))
    result, lse = fa2.fwd(q, k, v, window_size=window, out=out)
    assert result is out
    assert_written(out, name="out")
    out64, lse64 = attention_ref(q.double(), k.double(), v.double(), window_size=window)
    out_low, _ = attention_ref(q, k, v, window_size=window, upcast=False)
    _, lse32 = attention_ref(q, k, v, window_size=window, dtype=torch.float32)
    tag = f"sm90 window {window} d{d} {sq}x{sk}"
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,sq,sk,hk", [(64, 300, 257, 4), (128, 1000, 1000, 2), (256, 129, 700, 1)])
def test_hopper_forward_with_alibi_matches_the_reference(d, sq, sk, hk, causal, launch_overrides):
    """ALiBi: -slope * |i + seqlen_k - seqlen_q - j| on the scaled scores, per (batch, head) slopes; with softcap 30
    alone and under softcap 30 (the reference's order: softcap, then the bias)."""
    launch_overrides(family="sm90")
    q, k, v = randn(2, sq, 4, d), randn(2, sk, hk, d), randn(2, sk, hk, d)
    slopes = torch.rand(2, 4, device="cuda") * 0.5
    for softcap in (0.0, 30.0):
        out = poison(torch.empty_like(q))
        result, lse = fa2.fwd(q, k, v, causal=causal, alibi_slopes=slopes, softcap=softcap, out=out)
        assert result is out
        assert_written(out, name="out")
        options = dict(causal=causal, alibi_slopes=slopes, softcap=softcap)
        out64, lse64 = attention_ref(q.double(), k.double(), v.double(), **options)
        out_low, lse_low = attention_ref(q, k, v, upcast=False, **options)
        _, lse32 = (None, lse_low) if softcap else attention_ref(q, k, v, dtype=torch.float32, **options)
        tag = f"sm90 alibi softcap {softcap} d{d} {sq}x{sk} causal={causal}"
        assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
        assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,sq,sk,hk", [(64, 300, 257, 4), (128, 1000, 1000, 2), (256, 129, 700, 1)])
def test_hopper_forward_with_softcap_matches_the_reference(d, sq, sk, hk, causal, softcap, launch_overrides):
    """Softcap (Gemma 2): scores softcap * tanh(s / softcap) before the masks; 5 caps most scores (scaled by 3 so that
    they reach it), 30 few."""
    launch_overrides(family="sm90")
    q, k, v = 3 * randn(2, sq, 4, d), randn(2, sk, hk, d), randn(2, sk, hk, d)
    out = poison(torch.empty_like(q))
    result, lse = fa2.fwd(q, k, v, causal=causal, softcap=softcap, out=out)
    assert result is out
    assert_written(out, name="out")
    out64, lse64 = attention_ref(q.double(), k.double(), v.double(), causal=causal, softcap=softcap)
    # lse under softcap: held to attention's error in the inputs' precision, as test_features does (tanh.approx's
    # relative error ~2^-11 is not in float32 attention's)
    out_low, lse_low = attention_ref(q, k, v, causal=causal, softcap=softcap, upcast=False)
    tag = f"sm90 softcap {softcap} d{d} {sq}x{sk} causal={causal}"
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, lse_low, name=f"lse {tag}")


@pytest.mark.gpu
def test_hopper_forward_reads_strided_views(launch_overrides):
    """q, k and v as slices of one packed (batch, seqlen, 3, heads, d) tensor: TMA reads the caller's strides."""
    launch_overrides(family="sm90")
    qkv = randn(2, 257, 3, 4, 128)
    q, k, v = qkv.unbind(2)
    check_fwd(q, k, v, causal=True, tag="sm90 packed qkv")


# Packed batches (lengths_q, lengths_k, nheads, nheads_k): sequences shorter than a tile, of one token, empty, longer
# than a tile by one; seqlen_q != seqlen_k per sequence (queries without keys, keys without queries); GQA and MQA.
VARLEN = [
    ([1, 5, 128, 300, 0, 77, 129, 1000, 1, 64], None, 4, 4),
    ([3, 200, 0, 64, 129, 17, 700, 1], [70, 150, 9, 0, 257, 1, 300, 999], 8, 2),
    ([513, 65, 2, 1100], [1, 2000, 130, 1100], 4, 1),
]


def check_varlen(lengths_q, lengths_k, h, hk, d, causal, dtype=torch.bfloat16):
    """fa2.fwd_varlen against the fp64 reference run sequence by sequence, out and lse. out is a view of a poisoned
    buffer with rows past the packed tensor: a tile that wrote rows of another sequence (or past the end) leaves NaN
    or wrong values there, whichever sequence's tile ran last."""
    lengths_k = lengths_k or lengths_q
    q, cu_q = pack(lengths_q, h, d, dtype)
    k, cu_k = pack(lengths_k, hk, d, dtype)
    v = torch.randn_like(k)
    buffer = poison(torch.empty(q.shape[0] + 200, h, d, device="cuda", dtype=dtype))
    out = buffer[: q.shape[0]]
    result, lse = fa2.fwd_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal, out=out)
    assert result is out
    tag = f"sm90 varlen d{d} q{lengths_q} k{lengths_k} h{h}/{hk} causal={causal}"
    assert_written(out, name=f"out {tag}")
    assert torch.isnan(buffer[q.shape[0]:]).all(), f"{tag}: rows past the packed tensor were written"
    dout = torch.zeros_like(q)  # the references' gradients are not needed here
    out64, lse64, _ = per_sequence_ref(q, k, v, cu_q, cu_k, causal, dout, upcast=True)
    out_low, _, _ = per_sequence_ref(q, k, v, cu_q, cu_k, causal, dout, upcast=False)
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, per_sequence_lse32(q, k, v, cu_q, cu_k, causal), name=f"lse {tag}")
    return q, k, v, cu_q, cu_k


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(VARLEN)), ids=["self", "cross_gqa", "cross_mqa"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_varlen_forward_matches_the_reference(d, case, causal, launch_overrides, require_kernel):
    """Packed sequences on the Hopper forward: TMA reads each sequence through views whose row bound is the
    sequence's end (sm90/fwd_launch.h), tiles past a sequence's end are skipped, causal is bottom-right per sequence."""
    require_kernel("fwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    lengths_q, lengths_k, h, hk = VARLEN[case]
    check_varlen(lengths_q, lengths_k, h, hk, d, causal)
    if hopper_expected():  # the call above ran on the Hopper family: the plan serves it
        q, cu = pack([300, 7], 2, d, torch.bfloat16)
        names = kernel_names(lambda: fa2.fwd_varlen(q, q, q, cu, cu, 300, 300, causal=causal))
        assert any("sm90" in n for n in names), names


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_hopper_varlen_many_sequences(dtype, launch_overrides, require_kernel):
    """Many sequences of random lengths (mostly shorter than a tile, the longest a few tiles), causal: most tiles of
    the grid lie past their sequence's end."""
    require_kernel("fwd", 128, dtype)
    launch_overrides(family="sm90")
    lengths = torch.randint(0, 90, (300,)).tolist() + [700]
    check_varlen(lengths, None, 4, 2, 128, True, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_varlen_more_sequences_than_the_prefix_block(causal, launch_overrides, require_kernel):
    """The producer draws real tiles only, numbered from a prefix of query blocks that one CTA of 1024 threads scans
    in chunks (sm90/fwd_launch.h: varlen_tile_prefix): 1300 sequences carry a sum across chunks, and every tile of
    every sequence is drawn once (poisoned out, rows past each end)."""
    require_kernel("fwd", 64, torch.bfloat16)
    launch_overrides(family="sm90")
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 40, (1300,), generator=gen).tolist()
    for i, n in ((3, 300), (1030, 513), (1299, 260)):
        lengths[i] = n
    check_varlen(lengths, None, 2, 1, 64, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_varlen_equals_the_padded_batch(d, launch_overrides, require_kernel):
    """Equal lengths packed give exactly what the Hopper family gives for the padded batch: the same tiles, key blocks
    and zero-filled rows past each sequence's end."""
    require_kernel("fwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    q4, k4, v4 = (randn(3, 200, 4, d) for _ in range(3))
    cu = torch.tensor([0, 200, 400, 600], dtype=torch.int32, device="cuda")
    out4, lse4 = fa2.fwd(q4, k4, v4, causal=True)
    out, lse = fa2.fwd_varlen(q4.flatten(0, 1), k4.flatten(0, 1), v4.flatten(0, 1), cu, cu, 200, 200, causal=True)
    assert torch.equal(out, out4.flatten(0, 1))
    assert torch.equal(lse, lse4.transpose(0, 1).flatten(1))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_varlen_training_step_matches_the_reference(causal, launch_overrides, require_kernel):
    """fa2.attention_varlen with the Hopper forward and backward (which reads its out and the packed lse): out and
    gradients against the per-sequence fp64 reference."""
    require_kernel("bwd", 128, torch.bfloat16)
    launch_overrides(family="sm90")
    lengths = [12, 0, 300, 1, 129, 77]
    q, cu = pack(lengths, 4, 128, torch.bfloat16)
    k, v = (torch.randn(q.shape[0], 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()
    out = fa2.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    out64, _, g64 = per_sequence_ref(q, k, v, cu, cu, causal, dout, upcast=True)
    out_low, _, g_low = per_sequence_ref(q, k, v, cu, cu, causal, dout, upcast=False)
    assert_close_to_ref(out, out64, out_low, name=f"sm90 attention_varlen out causal={causal}")
    for name, g, r64, rl in zip(("dq", "dk", "dv"), got, g64, g_low):
        assert_close_to_ref(g, r64, rl, name=f"sm90 attention_varlen {name} causal={causal}")


@pytest.mark.gpu
def test_hopper_training_step_matches_the_mma_sync_one(launch_overrides):
    """fa2.attention's backward (mma.sync) takes the Hopper forward's out and lse: gradients agree with an all-sm80
    step to rounding."""
    q, k, v = (randn(2, 512, 8, 128).requires_grad_() for _ in range(3))
    grads = {}
    for family in ("sm80", "sm90"):
        launch_overrides(family=family)
        out = fa2.attention(q, k, v, causal=True)
        grads[family] = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    for name, a, b in zip("qkv", grads["sm80"], grads["sm90"]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=f"d{name}")


# ------------------------------------------------------------------------------------------------ dropout
# The Hopper forward must drop exactly the scores the mma.sync family drops (its backward draws the mask again):
# csrc/sm90/dropout.h. Shapes whose lengths are not multiples of the tiles (128 x 128; d256's 128 x 80, whose key
# blocks start at every multiple of 16 mod 64), seqlen_q above and below seqlen_k, GQA/MQA.
DROPOUT_SHAPES = [(64, 300, 257, 2), (128, 1000, 1000, 4), (128, 200, 333, 1), (256, 129, 700, 1)]


def dropout_state():
    """A fresh (seed, offset) from the test's seeded generator, with high bits set in both (the kernels take the
    seed's 64 bits and the offset's low 32)."""
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (2,), dtype=torch.int64).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,sq,sk,hk", DROPOUT_SHAPES, ids=["d{}_{}x{}_kv{}".format(*s) for s in DROPOUT_SHAPES])
def test_hopper_dropout_matches_the_mma_sync_forward_and_the_reference(d, sq, sk, hk, causal, p, launch_overrides):
    """Both families' forward with one (seed, offset): each meets the fp64 reference with the mask that state draws
    (fa2.reference.dropout_keep_mask) under the 2x rule, out and lse (the undropped one), and they agree with each
    other to rounding, which a single score dropped differently would break."""
    q, k, v = randn(2, sq, 4, d), randn(2, sk, hk, d), randn(2, sk, hk, d)
    state = dropout_state()
    runs = {}
    for family in ("sm80", "sm90"):
        launch_overrides(family=family)
        out = poison(torch.empty_like(q))
        result, lse = fa2.fwd(q, k, v, causal=causal, dropout_p=p, rng_state=state, out=out)
        assert result is out
        assert_written(out, name=f"out {family}")
        runs[family] = out, lse
    keep = dropout_keep_mask(state.tolist(), 2, 4, sq, sk, p, device="cuda")
    options = dict(causal=causal, dropout_p=p, dropout_keep=keep)
    out64, lse64 = attention_ref(q.double(), k.double(), v.double(), **options)
    out_low, _ = attention_ref(q, k, v, upcast=False, **options)
    _, lse32 = attention_ref(q, k, v, dtype=torch.float32, **options)
    for family, (out, lse) in runs.items():
        tag = f"{family} dropout {p} d{d} {sq}x{sk} causal={causal}"
        assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
        assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")
    torch.testing.assert_close(runs["sm90"][0], runs["sm80"][0], atol=2e-2, rtol=2e-2, msg="out: sm90 vs sm80")
    torch.testing.assert_close(runs["sm90"][1], runs["sm80"][1], atol=1e-4, rtol=1e-5, msg="lse: sm90 vs sm80")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_dropout_keeps_exactly_the_mma_sync_scores(d, causal, launch_overrides):
    """The kept set read out exactly: with q = 0 every visible probability is 1 / (its row's visible keys), and with v
    a one-hot window of d keys (v[o + j, j] = 1) out[i, j] is that probability / (1 - p) where key o + j is kept and
    exactly 0 where it is dropped. Windows over all 300 keys (every key block, d256's at every phase mod 64), 200 query
    rows (two blocks, the second ragged), two batch entries and three heads: the sm90 kept set equals the sm80
    forward's and the reference's."""
    b, h, sq, sk, p = 2, 3, 200, 300, 0.4
    q, k = torch.zeros(b, sq, h, d, device="cuda", dtype=torch.bfloat16), randn(b, sk, h, d)
    state = dropout_state()
    keep = dropout_keep_mask(state.tolist(), b, h, sq, sk, p, device="cuda")
    rows, keys = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None]
    visible = keys <= rows + sk - sq if causal else torch.ones(sq, sk, dtype=torch.bool, device="cuda")
    kept = {}
    for family in ("sm80", "sm90"):
        launch_overrides(family=family)
        names = kernel_names(lambda: fa2.fwd(q, k, k, causal=causal, dropout_p=p, rng_state=state))
        assert any("sm90" in n for n in names) == (family == "sm90" and hopper_expected()), names
        windows = []
        for o in range(0, sk, d):
            v = torch.zeros(b, sk, h, d, device="cuda", dtype=torch.bfloat16)
            width = min(d, sk - o)
            v[:, o + torch.arange(width), :, torch.arange(width)] = 1
            out, _ = fa2.fwd(q, k, v, causal=causal, dropout_p=p, rng_state=state)
            windows.append(out.permute(0, 2, 1, 3)[..., :width])  # (b, h, i, key - o)
        kept[family] = torch.cat(windows, dim=-1)
    expected = keep & visible
    for family, got in kept.items():
        assert torch.equal(got != 0, expected), f"{family}: {(got != 0).ne(expected).sum().item()} scores differ"
    torch.testing.assert_close(kept["sm90"], kept["sm80"], rtol=1e-2, atol=0)
    values = (1 / (visible.sum(-1, keepdim=True) * (1 - p))).expand(sq, sk)[None, None].expand_as(expected)
    torch.testing.assert_close(kept["sm90"][expected].float(), values[expected].float(), rtol=1e-2, atol=0)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("d,p,causal", [(64, 0.1, True), (128, 0.5, False), (128, 0.1, True), (256, 0.5, True)])
def test_hopper_dropout_training_step_matches_the_reference(d, p, causal, launch_overrides):
    """A training step with dropout: the Hopper forward, the mma.sync backward drawing the mask again from the same
    state. out, lse, dq, dk and dv meet the fp64 reference with that mask (2x rule); and fa2.attention under one
    torch.manual_seed gives the same gradients whichever family ran the forward."""
    launch_overrides(family="sm90")
    q, k, v = randn(2, 333, 4, d), randn(2, 419, 2, d), randn(2, 419, 2, d)
    state = dropout_state()
    out, lse = fa2.fwd(q, k, v, causal=causal, dropout_p=p, rng_state=state)
    dout = torch.randn_like(out)
    grads = fa2.bwd(dout, q, k, v, out, lse, causal=causal, dropout_p=p, rng_state=state)
    keep = dropout_keep_mask(state.tolist(), 2, 4, 333, 419, p, device="cuda")
    options = dict(causal=causal, window_size=(-1, -1), softcap=0.0, dropout_p=p, dropout_keep=keep)
    check_against_reference(out, lse, grads, q, k, v, None, dout, options, f"sm90 fwd dropout {p} d{d}")

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    steps = {}
    for family in ("sm80", "sm90"):
        launch_overrides(family=family)
        torch.manual_seed(1234)
        out = fa2.attention(*leaves, causal=causal, dropout_p=p)
        steps[family] = torch.autograd.grad(out, leaves, dout)  # a fixed dO: what differs is the forward
    for name, a, b in zip("qkv", steps["sm80"], steps["sm90"]):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2, msg=f"d{name}: sm90 forward vs sm80 forward")


def test_the_plan_names_the_family(recording, launch_overrides):
    """Record mode: the mma.sync family unless a test asks for the Hopper one, which it gets only where this build
    compiled it and the call is one it serves."""
    built = ops._C.build_info()
    d = min(set(built["fwd_head_dims"]) & {64, 128, 256})  # a head dim both families may have
    q, k, v = (torch.randn(1, 256, 4, d, dtype=torch.bfloat16) for _ in range(3))
    fa2.fwd(q, k, v)
    assert recording.calls[-1][1]["plan"]["family"] == "sm80"
    launch_overrides(record=True, family="sm90")
    fa2.fwd(q, k, v, causal=True)
    hopper = "sm90" in built["families"]
    plan = recording.calls[-1][1]["plan"]
    assert plan["family"] == ("sm90" if hopper else "sm80")
    fa2.fwd(q, k, v, sink=torch.zeros(4))
    assert recording.calls[-1][1]["plan"]["family"] == plan["family"]  # sinks: the Hopper finalize adds them
    fa2.fwd(q, k, v, softcap=30.0)
    assert recording.calls[-1][1]["plan"]["family"] == plan["family"]  # softcap: a tanh per score
    fa2.fwd(q, k, v, alibi_slopes=torch.ones(4), window_size=(100, 0))
    assert recording.calls[-1][1]["plan"]["family"] == plan["family"]  # ALiBi and windows: in the score transforms
    fa2.fwd(q, k, v, dropout_p=0.1, rng_state=torch.zeros(2, dtype=torch.int64))
    assert recording.calls[-1][1]["plan"]["family"] == plan["family"]  # dropout: the mma.sync family's mask
    fa2.fwd(q[:, :64], k, v)
    assert recording.calls[-1][1]["plan"]["family"] == "sm80"  # a decode's 64 rows: not served
    packed, cu = q.flatten(0, 1), torch.tensor([0, 100, 256], dtype=torch.int32)
    fa2.fwd_varlen(packed, packed, packed, cu, cu, 156, 156, causal=True)
    assert recording.calls[-1][1]["plan"]["family"] == plan["family"]  # packed sequences: per-sequence TMA views
    short = torch.tensor([0, 64, 128, 192, 256], dtype=torch.int32)
    fa2.fwd_varlen(packed, packed, packed, short, short, 64, 64)
    assert recording.calls[-1][1]["plan"]["family"] == "sm80"  # at most 64 query rows in the longest: decoding's


def test_a_family_override_must_name_a_family():
    if ops._C is None:
        pytest.skip("fa2._C is not built")
    with pytest.raises(ValueError, match="family"):
        ops._C.set_test_overrides(family="sm70")
    ops._C.set_test_overrides()

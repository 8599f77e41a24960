"""Sliding window, softcap, ALiBi, attention sinks and dropout (GPU): forward (out, lse) and backward (dq, dk, dv,
dsink) against the fp64 reference with FlashAttention's rule, alone and combined, with GQA, padded head dims, packed
batches, deterministic mode, given buffers and torch.compile; dropout's kept scores exactly as the reference draws
them, its reproducibility from torch.manual_seed and its fresh draws under CUDA-graph replay."""
import re

import pytest
import torch

import fa2
from fa2.reference import attention_ref, dropout_keep_mask
from fa2.testing import assert_close_to_ref, assert_lse_close, assert_written, poison

gpu = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window_size, softcap, sink, alibi), alibi None, "h"
# (slopes (nheads,)) or "bh" (slopes (batch, nheads))
CASES = [
    (2, 300, 300, 4, 4, 64, False, (64, 32), 0.0, False, None),
    (1, 1000, 1000, 4, 2, 128, True, (256, -1), 0.0, False, None),   # causal sliding window (Mistral)
    (1, 203, 513, 4, 1, 96, False, (100, 7), 0.0, False, None),      # seqlen_q < seqlen_k, MQA
    (1, 513, 203, 2, 2, 64, False, (30, 0), 0.0, False, None),       # seqlen_q > seqlen_k: rows that see no key
    (1, 777, 777, 2, 2, 256, False, (128, -1), 0.0, False, None),    # left bound only
    (1, 400, 600, 2, 2, 32, False, (-1, 40), 0.0, False, None),      # right bound only
    (1, 333, 333, 2, 1, 160, False, (0, 0), 0.0, False, None),       # the diagonal alone
    (2, 257, 300, 4, 2, 64, False, (-1, -1), 30.0, False, None),     # softcap (Gemma 2)
    (1, 1000, 1000, 4, 4, 128, True, (-1, -1), 50.0, False, None),
    (1, 300, 300, 2, 2, 224, False, (-1, -1), 5.0, False, None),     # a small softcap: tanh saturates
    (1, 513, 203, 2, 2, 128, False, (30, 0), 30.0, False, None),     # softcap on rows that see no key
    (2, 300, 257, 4, 4, 64, False, (-1, -1), 0.0, True, None),       # sinks (gpt-oss)
    (1, 1000, 1000, 8, 2, 128, True, (-1, -1), 0.0, True, None),
    (1, 200, 200, 2, 2, 192, True, (128, 0), 0.0, True, None),       # gpt-oss: banded layers with sinks
    (2, 300, 257, 4, 4, 64, False, (-1, -1), 0.0, False, "h"),       # ALiBi, both sides of the diagonal
    (2, 700, 700, 8, 2, 128, True, (-1, -1), 0.0, False, "bh"),      # ALiBi per batch entry, causal
    (1, 2048, 1536, 8, 8, 64, False, (-1, -1), 0.0, False, "h"),     # ALiBi: tiles far from the diagonal
    (1, 1024, 1024, 8, 2, 128, True, (200, -1), 30.0, True, "h"),    # all of them, GQA 4:1
    (2, 173, 301, 4, 1, 96, False, (50, 10), 20.0, True, "bh"),
]
CASE_IDS = ["b{}_{}x{}_h{}kv{}_d{}_c{:d}_w{}_{}_cap{}_sink{:d}_alibi{}".format(*c[:7], *c[7], *c[8:])
            for c in CASES]


def randn(*shape, dtype=torch.bfloat16, **kw):
    return torch.randn(*shape, device="cuda", dtype=dtype, **kw)


def _options(causal, window, softcap, alibi_slopes=None):
    return dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes)


def alibi_slopes(kind, batch, nheads):
    """ALiBi's geometric slopes 2^(-8 (i + 1) / nheads), per head or varied per batch entry; None for kind None."""
    if kind is None:
        return None
    per_head = 2.0 ** (-8.0 * torch.arange(1, nheads + 1, device="cuda") / nheads)
    return per_head if kind == "h" else per_head * torch.rand(batch, 1, device="cuda").add(0.5)


def _reference(q, k, v, sink, dout, options, upcast):
    """out, lse and the gradients of (q, k, v, sink) of the reference: in fp64 (upcast) or in the inputs' own
    precision, as plain PyTorch attention would compute them."""
    cast = (lambda t: t.double()) if upcast else (lambda t: t)
    leaves = [cast(t).detach().clone().requires_grad_() for t in (q, k, v)]
    s = None if sink is None else cast(sink).detach().clone().requires_grad_()
    out, lse = attention_ref(*leaves, sink=s, upcast=upcast, **options)
    grads = torch.autograd.grad(out, leaves + ([s] if s is not None else []), cast(dout))
    return out, lse, grads


def check_against_reference(out, lse, grads, q, k, v, sink, dout, options, tag):
    out64, lse64, grads64 = _reference(q, k, v, sink, dout, options, True)
    out_low, lse_low, grads_low = _reference(q, k, v, sink, dout, options, False)
    # lse is held to float32 attention's error, except with softcap: there the scores go through a one-instruction
    # tanh (relative error ~2^-11, as in flash-attn), which float32 attention does not have; the bar is then the
    # brief's own, attention in the inputs' precision.
    _, lse32, _ = (None, lse_low, None) if options["softcap"] else _reference(
        q.float(), k.float(), v.float(), None if sink is None else sink.float(), dout.float(), options, False)
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    if lse is not None:
        assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")
    scale = max(g.abs().max().item() for g in grads64[:3] if g.numel())
    for name, g, r64, rl in zip(("dq", "dk", "dv", "dsink"), grads, grads64, grads_low):
        assert_close_to_ref(g, r64, rl, name=f"{name} {tag}", scale=None if name == "dsink" else scale)


def check_forward(out, lse, q, k, v, tag, **options):
    """out and lse against the fp64 reference (FlashAttention's rule), without a backward."""
    out64, lse64 = attention_ref(q, k, v, **options)
    out_low, _ = attention_ref(q, k, v, upcast=False, **options)
    _, lse32 = attention_ref(q.float(), k.float(), v.float(), upcast=False, **options)
    assert_close_to_ref(out, out64, out_low, name=f"out {tag}")
    assert_lse_close(lse, lse64, lse32, name=f"lse {tag}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_features_match_reference(case, dtype, require_kernel):
    b, sq, sk, h, hk, d, causal, window, softcap, with_sink, alibi = case
    require_kernel("bwd", d, dtype)
    q, k, v = (randn(b, s, n, d, dtype=dtype, requires_grad=True) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    sink = randn(h, dtype=dtype, requires_grad=True) if with_sink else None
    options = _options(causal, window, softcap, alibi_slopes(alibi, b, h))
    out = fa2.attention(q, k, v, sink=sink, **options)
    _, lse = fa2.fwd(q.detach(), k.detach(), v.detach(), sink=sink, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v] + ([sink] if with_sink else []), dout)
    check_against_reference(out, lse, grads, q, k, v, sink, dout, options, f"{case} {dtype}")


@gpu
@pytest.mark.parametrize("with_sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("d", [64, 128])
def test_softcap_rows_at_either_end_of_its_range(d, softcap, dtype, with_sink, require_kernel):
    """Scores at the ends of softcap's range: the forward's softcap loop may fix the softmax's max instead of tracking
    it (fwd_kernel.h), so P, l and O must hold there. Head 0: every score of a row within [1, 3] softcaps of +softcap
    or of -softcap (rows alternate in runs of 37), weights still far from uniform; head 1: every row spans both ends."""
    require_kernel("bwd", d, dtype)
    b, n, h = 1, 300, 2
    u = torch.randn(d, device="cuda")
    u = u / u.norm() * d ** 0.5
    # k_j = c_j u + noise; q_i = +-a u with a |u|^2 / sqrt(d) = 2 softcap: the scaled score is about 2 softcap c_j.
    uniform = lambda lo, hi: torch.empty(n, device="cuda").uniform_(lo, hi)  # noqa: E731
    c = torch.stack([uniform(0.5, 1.5), uniform(-1.5, 1.5)], dim=-1)  # (n, h)
    k = (c[None, :, :, None] * u + 0.3 * torch.randn(b, n, h, d, device="cuda")).to(dtype)
    sign = torch.where((torch.arange(n, device="cuda") // 37) % 2 == 0, 1.0, -1.0)
    a = 2 * softcap / d ** 0.5
    q = (a * sign[None, :, None, None] * u + 0.3 * torch.randn(b, n, h, d, device="cuda")).to(dtype)
    v = randn(b, n, h, d, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink = randn(h, dtype=dtype, requires_grad=True) if with_sink else None
    options = _options(False, (-1, -1), softcap)
    out = fa2.attention(q, k, v, sink=sink, **options)
    _, lse = fa2.fwd(q.detach(), k.detach(), v.detach(), sink=sink, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v] + ([sink] if with_sink else []), dout)
    check_against_reference(out, lse, grads, q, k, v, sink, dout, options, f"d{d} cap{softcap} {dtype}")


@gpu
@pytest.mark.parametrize("head_dim", [20, 100])
def test_features_with_a_padded_head_dim(head_dim, require_kernel):
    require_kernel("bwd", head_dim, torch.bfloat16)
    q, k, v = (randn(2, 300, 4, head_dim, requires_grad=True) for _ in range(3))
    sink = randn(4, requires_grad=True)
    options = _options(True, (64, 0), 25.0)
    out = fa2.attention(q, k, v, sink=sink, **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    check_against_reference(out, None, grads, q, k, v, sink, dout, options, f"d{head_dim}")


@gpu
@pytest.mark.parametrize("causal, window, softcap, alibi", [(True, (40, 0), 0.0, None), (False, (30, 20), 15.0, "bh"),
                                                            (False, (-1, -1), 10.0, "h")])
def test_packed_batches_with_features(causal, window, softcap, alibi, require_kernel):
    """Each sequence of a packed batch is its own window (and its own ALiBi slopes), aligned at its own end; dsink
    sums over all of them."""
    require_kernel("bwd", 64, torch.bfloat16)
    lens_q, lens_k = [1, 90, 300, 47], [130, 90, 250, 47]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = randn(sum(lens_q), 4, 64, requires_grad=True)
    k, v = (randn(sum(lens_k), 2, 64, requires_grad=True) for _ in range(2))
    sink = randn(4, requires_grad=True)
    slopes = alibi_slopes(alibi, len(lens_q), 4)
    options = _options(causal, window, softcap, slopes)
    out = fa2.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sink=sink, **options)
    dout = torch.randn_like(out)
    dq, dk, dv, dsink = torch.autograd.grad(out, (q, k, v, sink), dout)
    dsink_ref64, dsink_low = torch.zeros(4, device="cuda", dtype=torch.float64), torch.zeros(4, device="cuda")
    for i in range(len(lens_q)):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        seq = [t[None, s] for t, s in ((q, sq), (k, sk), (v, sk))]
        grads = (dq[None, sq], dk[None, sk], dv[None, sk], dsink)
        seq_options = dict(options, alibi_slopes=None if slopes is None else slopes[i] if slopes.dim() == 2 else slopes)
        out64, _, g64 = _reference(*seq, sink, dout[None, sq], seq_options, True)
        out_low, _, g_low = _reference(*seq, sink, dout[None, sq], seq_options, False)
        assert_close_to_ref(out[None, sq], out64, out_low, name=f"out seq {i}")
        # dk, dv per sequence; dq per sequence; dsink summed over the sequences below.
        scale = max(g.abs().max().item() for g in g64[:3])
        for name, g, r64, rl in zip(("dq", "dk", "dv"), grads, g64, g_low):
            assert_close_to_ref(g, r64, rl, name=f"{name} seq {i}", scale=scale)
        dsink_ref64 += g64[3]
        dsink_low += g_low[3].float()
    assert_close_to_ref(dsink, dsink_ref64, dsink_low.to(sink.dtype), name="dsink packed")


@gpu
def test_rows_that_see_only_the_sink(require_kernel):
    """A row with no visible key has out = 0 and lse = its head's sink; its gradients are 0."""
    require_kernel("bwd", 64, torch.bfloat16)
    q, k, v = randn(1, 64, 2, 64), randn(1, 16, 2, 64), randn(1, 16, 2, 64)
    sink = torch.tensor([0.5, -3.0], device="cuda")
    out, lse = fa2.fwd(q, k, v, window_size=(-1, 0), sink=sink)  # row i sees keys j <= i - 48: rows < 48 none
    out_none, lse_none = fa2.fwd(q, k[:, :0], v[:, :0], sink=sink)  # no keys at all
    _, lse64 = attention_ref(q, k, v, window_size=(-1, 0), sink=sink)
    assert torch.isfinite(lse).all() and torch.isfinite(lse_none).all()
    assert torch.equal(out[:, :48], torch.zeros_like(out[:, :48]))
    assert torch.equal(out_none, torch.zeros_like(out_none))
    assert torch.allclose(lse_none, sink[None, :, None].expand_as(lse_none))
    assert torch.allclose(lse, lse64.float(), atol=1e-5, rtol=1e-5)


@gpu
def test_deterministic_features_are_bit_identical(require_kernel):
    require_kernel("bwd", 128, torch.bfloat16)
    q, k, v = (randn(2, 1500, 8, 128) for _ in range(3))
    sink = randn(8)
    options = _options(True, (300, 0), 30.0, alibi_slopes("h", 2, 8))
    out, lse = fa2.fwd(q, k, v, sink=sink, **options)
    dout = torch.randn_like(out)
    first = fa2.bwd(dout, q, k, v, out, lse, deterministic=True, **options)
    second = fa2.bwd(dout, q, k, v, out, lse, deterministic=True, **options)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    atomic = fa2.bwd(dout, q, k, v, out, lse, **options)
    for name, a, b in zip(("dq", "dk", "dv"), first, atomic):
        # The same sums in another order: at most a rounding step of the output dtype apart.
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item(), name


@gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_the_backward_writes_d_for_the_sinks_gradient(varlen, require_kernel):
    """The bwd ops write D = rowsum(dO * O) into a given d_sum laid out like lse (the sink's gradient reads it there
    instead of recomputing it): every row written, against float64; the sink's gradient through autograd bit-identical
    between two deterministic backwards."""
    require_kernel("bwd", 128, torch.bfloat16)
    q, k, v = randn(2, 700, 8, 128), randn(2, 900, 2, 128), randn(2, 900, 2, 128)
    sink = randn(8, dtype=torch.float32)
    out, lse = fa2.fwd(q, k, v, sink=sink, causal=True)
    dout = torch.randn_like(out)
    d64 = (dout.double() * out.double()).sum(-1).transpose(1, 2)  # (batch, nheads, seqlen_q), lse's layout
    if varlen:
        cu_q = torch.tensor([0, 700, 1400], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, 900, 1800], device="cuda", dtype=torch.int32)
        flat = [t.flatten(0, 1) for t in (dout, q, k, v, out)]
        lse = lse.transpose(0, 1).flatten(1).contiguous()  # (nheads, total_q)
        d64 = d64.transpose(0, 1).flatten(1)
        d_sum = poison(torch.empty_like(lse))
        torch.ops.fa2.bwd_varlen(*flat, lse, cu_q, cu_k, 700, 900, None, True, False, d_sum=d_sum)
    else:
        d_sum = poison(torch.empty_like(lse))
        torch.ops.fa2.bwd(dout, q, k, v, out, lse, None, True, False, d_sum=d_sum)
    assert_written(d_sum, name="d_sum")
    assert (d_sum.double() - d64).abs().max().item() <= 1e-4 * d64.abs().max().item()  # fp32 sums of 128 products
    grads = []
    for _ in range(2):
        leaf = sink.clone().requires_grad_()
        fa2.attention(q, k, v, sink=leaf, causal=True, deterministic=True).backward(dout)
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1]), "the sink's gradient differs between two deterministic backwards"


@gpu
def test_given_buffers_are_written_in_full(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    q, k, v = randn(2, 177, 4, 64), randn(2, 301, 2, 64), randn(2, 301, 2, 64)
    options = _options(False, (90, 5), 12.0, alibi_slopes("bh", 2, 4))
    out = poison(torch.empty_like(q))
    _, lse = fa2.fwd(q, k, v, out=out, sink=randn(4), **options)
    assert_written(out, name="out")
    dq, dk, dv = (poison(torch.empty_like(t)) for t in (q, k, v))
    fa2.bwd(torch.randn_like(out), q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **options)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_written(g, name=name)


@gpu
def test_compiled_fullgraph_matches_eager(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    q, k, v = (randn(2, 200, 4, 64, requires_grad=True) for _ in range(3))
    sink, slopes = randn(4, requires_grad=True), alibi_slopes("h", 2, 4)

    def f(q, k, v, sink):
        return fa2.attention(q, k, v, causal=True, window_size=(50, 0), softcap=20.0, alibi_slopes=slopes, sink=sink)

    compiled = torch.compile(f, fullgraph=True)
    dout = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16)
    eager_out = f(q, k, v, sink)
    eager = torch.autograd.grad(eager_out, (q, k, v, sink), dout)
    comp_out = compiled(q, k, v, sink)
    comp = torch.autograd.grad(comp_out, (q, k, v, sink), dout)
    assert torch.equal(eager_out, comp_out)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), eager, comp):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2), name


@gpu
def test_flash_attn_func_takes_window_softcap_and_alibi(require_kernel):
    require_kernel("fwd", 64, torch.bfloat16)
    q, k, v = (randn(1, 256, 2, 64) for _ in range(3))
    slopes = alibi_slopes("h", 1, 2)
    out = fa2.flash_attn_func(q, k, v, causal=True, window_size=(32, 32), softcap=10.0, alibi_slopes=slopes)
    assert torch.equal(out, fa2.attention(q, k, v, causal=True, window_size=(32, 0), softcap=10.0, alibi_slopes=slopes))


@gpu
def test_forward_runs_the_smallest_instance_that_covers_the_call(require_kernel, launch_overrides):
    """The mma.sync forward's main tile has three instances (sm80/fwd_launch.h): plain, softcap, ALiBi, a window's
    left edge and split-KV (kLogits), and everything (kAll, for dropout). Sinks and a right edge alone (causal's) run
    in the plain one. The shape fills the GPU (1024 CTAs), so the launch does not split it."""
    require_kernel("fwd", 128, torch.bfloat16)
    launch_overrides(family="sm80")
    q, k, v = (randn(8, 2048, 8, 128) for _ in range(3))
    state = torch.tensor([1, 2], device="cuda")
    names = ["kNone", "kLogits", "kAll"]

    def instance(**options):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fa2.fwd(q, k, v, **options)
            torch.cuda.synchronize()
        kernels = {e.name for e in prof.events() if "fwd_kernel<" in e.name}
        assert len(kernels) == 1, kernels
        # The demangler prints the enum argument as "(fa2::ScoreTransforms)1" or as "fa2::ScoreTransforms::kLogits".
        value = re.search(r"ScoreTransforms(?:\)|::)(\w+)>", kernels.pop()).group(1)
        return names[int(value)] if value.isdigit() else value

    assert instance() == "kNone" and instance(causal=True, sink=torch.randn(8, device="cuda")) == "kNone"
    assert instance(window_size=(-1, 100)) == "kNone" and instance(window_size=(100, 0)) == "kLogits"
    assert instance(softcap=20.0) == "kLogits" and instance(alibi_slopes=torch.ones(8, device="cuda")) == "kLogits"
    assert instance(dropout_p=0.1, rng_state=state) == "kAll"
    assert instance(dropout_p=0.1, rng_state=state, softcap=20.0, alibi_slopes=torch.ones(8, device="cuda")) == "kAll"
    q, k, v = randn(1, 1, 8, 128), randn(1, 8192, 8, 128), randn(1, 8192, 8, 128)  # a decode: 8 CTAs, split
    assert instance() == "kLogits"


@gpu
@pytest.mark.parametrize("variant", ["alone", "window", "splits"])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (300, 1000), (1000, 300), (40, 1000)], ids=lambda s: "{}x{}".format(*s))
@pytest.mark.parametrize("d", [64, 96, 128])
def test_alibi_forward_in_every_loop_window_and_split(d, seqlens, variant, require_kernel, launch_overrides):
    """Non-causal ALiBi forwards through each of the forward's key-block loops (d64: two stages, unrolled; d96: two
    stages; d128: one stage; 40 rows: the decode tile), with seqlen_k cutting the last block, alone, within a window's
    band and split three ways. The slopes run from ~2^-2 to ~2^-8 per key: the shallow heads weigh far blocks, so a
    block visited twice or missed, or the cut block's rows left unmasked, shows in out and lse; the steep heads raise
    each row's max on nearly every block before its diagonal."""
    require_kernel("fwd", d, torch.bfloat16)
    (sq, sk), b, h = seqlens, 2, 4
    if variant == "splits":
        launch_overrides(num_splits=3)
    window = (300, 200) if variant == "window" else (-1, -1)
    q, k, v = randn(b, sq, h, d), randn(b, sk, h, d), randn(b, sk, h, d)
    options = _options(False, window, 0.0, alibi_slopes("bh", b, h))
    out = poison(torch.empty_like(q))
    _, lse = fa2.fwd(q, k, v, out=out, **options)
    assert_written(out, name="out")
    check_forward(out, lse, q, k, v, f"d{d} {sq}x{sk} {variant}", **options)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_alibi_forward_from_steep_to_shallow_slopes(d, dtype, causal, require_kernel):
    """Slopes from 4 (a key's bias falls by 4 per position: each row weighs its few nearest keys) through 1.5, 1.0 and
    0.9 (steeper than any geometric ALiBi slope) to 1/256 (nearly flat), with scaled scores of standard deviation 2.5,
    so that a row's max lies a few keys from its diagonal or anywhere: a max that misses the bias, or a split-form tile
    that adds it at the wrong magnitude, shows in out and lse."""
    require_kernel("fwd", d, dtype)
    b, s, h = 2, 700, 5
    q, k, v = randn(b, s, h, d, dtype=dtype), randn(b, s, h, d, dtype=dtype), randn(b, s, h, d, dtype=dtype)
    q = (q * 2.5).to(dtype)
    options = _options(causal, (-1, -1), 0.0, torch.tensor([4.0, 1.5, 1.0, 0.9, 1 / 256], device="cuda"))
    out = poison(torch.empty_like(q))
    _, lse = fa2.fwd(q, k, v, out=out, **options)
    assert_written(out, name="out")
    check_forward(out, lse, q, k, v, f"d{d} {dtype} causal={causal}", **options)


# ------------------------------------------------------------------------------------------------ dropout
DROPOUT_CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window_size, softcap, alibi, sink)
    (2, 300, 257, 4, 2, 64, False, (-1, -1), 0.0, None, False),
    (1, 700, 700, 4, 4, 128, True, (-1, -1), 0.0, None, False),
    (1, 513, 513, 4, 1, 96, True, (128, 0), 30.0, "h", True),
    (1, 200, 333, 2, 2, 256, False, (50, 20), 0.0, "bh", False),
]


@gpu
@pytest.mark.parametrize("dropout_p", [0.17, 0.5])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[f"b{c[0]}_{c[1]}x{c[2]}_d{c[5]}_c{c[6]:d}" for c in DROPOUT_CASES])
def test_dropout_matches_reference_with_its_mask(case, dropout_p, require_kernel):
    """fa2.fwd / fa2.bwd with a given (seed, offset) against the reference with the mask that state draws
    (fa2.reference.dropout_keep_mask): out, dq, dk, dv, and dsink through sink_grad."""
    b, sq, sk, h, hk, d, causal, window, softcap, alibi, with_sink = case
    require_kernel("bwd", d, torch.bfloat16)
    q, k, v = (randn(b, s, n, d) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    sink = randn(h) if with_sink else None
    state = torch.tensor([0x1234_5678_9ABC_DEF0 - 2 ** 63, 77], device="cuda")
    options = _options(causal, window, softcap, alibi_slopes(alibi, b, h))
    out, lse = fa2.fwd(q, k, v, dropout_p=dropout_p, rng_state=state, sink=sink, **options)
    dout = torch.randn_like(out)
    grads = fa2.bwd(dout, q, k, v, out, lse, dropout_p=dropout_p, rng_state=state, **options)
    if with_sink:
        grads = (*grads, fa2.ops.sink_grad(dout, out, lse, sink.float()))
    keep = dropout_keep_mask(state.tolist(), b, h, sq, sk, dropout_p, device="cuda")
    dropped = dict(options, dropout_p=dropout_p, dropout_keep=keep)
    check_against_reference(out, lse, grads, q, k, v, sink, dout, dropped, f"{case} p={dropout_p}")


CONSUMER_SMEM = 99 * 1024  # shared memory a block may use on sm86/sm89/sm120: other tiles (32-key blocks)


@gpu
@pytest.mark.parametrize("smem_limit", [None, CONSUMER_SMEM], ids=["device", "99KB"])
@pytest.mark.parametrize("d", [64, 128, 160, 256])
def test_dropout_keeps_exactly_the_reference_s_scores(d, smem_limit, require_kernel, launch_overrides):
    """Both kernels' kept scores, read out exactly rather than through a tolerance: with q = 0 every probability is
    1 / seqlen_k, so with v the identity out[i, j] = keep[i, j] / (seqlen_k (1 - p)), and with dout the identity
    dv[j, i] is the same. seqlen_q = seqlen_k = head_dim: several query and key blocks, every bit of the mapping."""
    require_kernel("bwd", d, torch.bfloat16)
    if smem_limit:
        launch_overrides(smem_limit=smem_limit)
    b, h, n, p = 2, 3, d, 0.4
    eye = torch.eye(n, d, device="cuda", dtype=torch.bfloat16)[None, :, None].expand(b, n, h, d).contiguous()
    q, k = torch.zeros(b, n, h, d, device="cuda", dtype=torch.bfloat16), randn(b, n, h, d)
    state = torch.tensor([0x0123_4567_89AB_CDEF, 0x5_0000_0003], device="cuda")
    out, lse = fa2.fwd(q, k, eye, dropout_p=p, rng_state=state)
    _, _, dv = fa2.bwd(eye, q, k, eye, out, lse, dropout_p=p, rng_state=state)
    keep = dropout_keep_mask(state.tolist(), b, h, n, n, p, device="cuda")
    fwd_kept, bwd_kept = out.permute(0, 2, 1, 3), dv.permute(0, 2, 3, 1)  # (b, h, i, j)
    assert torch.equal(fwd_kept != 0, keep), f"forward: {(fwd_kept != 0).ne(keep).sum().item()} scores differ"
    assert torch.equal(bwd_kept != 0, keep), f"backward: {(bwd_kept != 0).ne(keep).sum().item()} scores differ"
    kept_value = torch.tensor(1 / (n * (1 - p)), device="cuda").bfloat16().float()
    for got in (fwd_kept, bwd_kept):
        torch.testing.assert_close(got[keep].float(), kept_value.expand(int(keep.sum())), rtol=1e-2, atol=0)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02


@gpu
def test_packed_dropout_draws_per_sequence(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    lens_q, lens_k = [1, 90, 300, 47], [130, 90, 250, 47]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = randn(sum(lens_q), 4, 64), randn(sum(lens_k), 2, 64), randn(sum(lens_k), 2, 64)
    state, p = torch.tensor([42, 0], device="cuda"), 0.3
    sizes = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = fa2.fwd_varlen(q, k, v, *sizes, causal=True, dropout_p=p, rng_state=state)
    dout = torch.randn_like(out)
    dq, dk, dv = fa2.bwd_varlen(dout, q, k, v, out, lse, *sizes, causal=True, dropout_p=p, rng_state=state)
    keep = dropout_keep_mask(state.tolist(), len(lens_q), 4, max(lens_q), max(lens_k), p, device="cuda")
    for i in range(len(lens_q)):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        seq = [t[None, s] for t, s in ((q, sq), (k, sk), (v, sk))]
        options = dict(causal=True, window_size=(-1, -1), softcap=0.0, dropout_p=p,
                       dropout_keep=keep[i:i + 1, :, :lens_q[i], :lens_k[i]])
        out64, _, g64 = _reference(*seq, None, dout[None, sq], options, True)
        out_low, _, g_low = _reference(*seq, None, dout[None, sq], options, False)
        assert_close_to_ref(out[None, sq], out64, out_low, name=f"out seq {i}")
        scale = max(g.abs().max().item() for g in g64)
        for name, g, r64, rl in zip(("dq", "dk", "dv"), (dq[None, sq], dk[None, sk], dv[None, sk]), g64, g_low):
            assert_close_to_ref(g, r64, rl, name=f"{name} seq {i}", scale=scale)


@gpu
def test_dropout_is_reproducible_from_torch_manual_seed(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    q, k, v = (randn(2, 256, 4, 64, requires_grad=True) for _ in range(3))
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        out = fa2.attention(q, k, v, causal=True, dropout_p=0.2)
        runs.append((out, *torch.autograd.grad(out.float().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])
    plain = fa2.attention(q, k, v, causal=True)
    kept = (runs[0][0] != 0).float().mean().item()  # a row of out is 0 only where every key was dropped
    assert 0.99 < kept and not torch.equal(runs[0][0], plain)


@gpu
def test_a_dropout_too_small_to_drop_anything_is_no_dropout(require_kernel):
    """p <= 2^-54 (1 - p rounds to 1): the reference's threshold is 2^16, every score is kept at scale 1, so the
    kernels' results are exactly those without dropout, in both directions."""
    require_kernel("bwd", 64, torch.bfloat16)
    q, k, v = (randn(1, 200, 2, 64, requires_grad=True) for _ in range(3))
    assert dropout_keep_mask((7, 9), 1, 2, 200, 200, 1e-20).all()
    runs = []
    for p in (0.0, 1e-20):
        out = fa2.attention(q, k, v, causal=True, dropout_p=p)
        runs.append((out, *torch.autograd.grad(out.float().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@gpu
def test_dropout_draws_anew_at_each_cuda_graph_replay(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    q, k, v = (randn(1, 128, 2, 64, requires_grad=True) for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        fa2.attention(q, k, v, dropout_p=0.3).float().sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa2.attention(q, k, v, dropout_p=0.3)
        dq, = torch.autograd.grad(out.float().sum(), (q,))
    graph.replay()
    first = (out.clone(), dq.clone())
    graph.replay()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert not torch.equal(first[0], out) and not torch.equal(first[1], dq)

"""Forwards too small to fill the GPU, decoding's above all (one query row per sequence against a long KV cache).
GPU: split-KV (a query block's keys divided among CTAs, their partial results merged by fwd_combine.h) and GQA
packing (a group's query heads as the rows of one block), alone and with the features, against the fp64 reference
with FlashAttention's rule, outputs poisoned first; the default launch splits a decode and does not split a large
forward, and forwards of at most 64 query rows run the decode tile (config.h). CPU (recorded launches): which calls
are packed, and the split count a test forces."""
import re

import pytest
import torch

import fa2
from fa2 import ops
from fa2.testing import assert_written, poison
from test_features import CONSUMER_SMEM, alibi_slopes, check_against_reference, check_forward, randn

# This file's configurations are the mma.sync family's (csrc/sm80/config.h): conftest pins its calls there.
FAMILY = "sm80"


gpu = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window_size, softcap, sink, alibi)
CASES = [
    (2, 1, 1000, 8, 2, 128, True, (-1, -1), 0.0, False, None),     # GQA decode: packed
    (1, 1, 777, 4, 4, 64, False, (-1, -1), 0.0, False, None),      # MHA decode
    (3, 7, 513, 8, 1, 96, True, (-1, -1), 0.0, False, None),       # a chunk against the cache, MQA
    (2, 1, 1300, 8, 2, 256, False, (-1, -1), 50.0, False, None),   # softcap, packed: d256's narrow tile decodes
    (1, 1, 3000, 8, 2, 160, True, (-1, -1), 0.0, True, None),      # d160's narrow tile decodes, with a sink
    (2, 1, 2500, 8, 2, 192, False, (-1, -1), 0.0, False, "h"),     # d192's, with ALiBi (not packed)
    (1, 1, 2000, 8, 2, 128, True, (256, 0), 30.0, True, "h"),      # a windowed gpt-oss/Gemma decode: not packed
    (2, 200, 1200, 4, 2, 64, True, (300, 0), 0.0, True, "bh"),     # many rows, rows that see no key of a split
]
CASE_IDS = ["b{}_{}x{}_h{}kv{}_d{}_c{:d}_w{}_{}_cap{}_sink{:d}_alibi{}".format(*c[:7], *c[7], *c[8:])
            for c in CASES]


@pytest.fixture
def splits(request, launch_overrides):
    """Forces the forward's split count (0: the launch chooses)."""
    if request.param:
        launch_overrides(num_splits=request.param)
    return request.param


@gpu
@pytest.mark.parametrize("splits", [0, 3, 16, 128], indirect=True, ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_split_forward_matches_reference(case, splits, require_kernel):
    """More splits than key blocks (128) leaves splits empty: they must weigh nothing."""
    b, sq, sk, h, hk, d, causal, window, softcap, with_sink, alibi = case
    require_kernel("bwd", d, torch.bfloat16)
    q, k, v = (randn(b, s, n, d, requires_grad=True) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    # With one query row a head's sink gradient is one product, -exp(sink - lse) rowsum(dO * O), whose error is one
    # draw of O's bf16 rounding, for ours and for the low-precision reference alike: the 2x rule needs an average
    # over rows, so dsink is judged where a head has many (the last case), and out and lse carry the sink here.
    sink_grad = with_sink and sq > 1
    sink = randn(h, requires_grad=sink_grad) if with_sink else None
    options = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes(alibi, b, h))
    out = fa2.attention(q, k, v, sink=sink, **options)
    given = poison(torch.empty_like(q))
    _, lse = fa2.fwd(q.detach(), k.detach(), v.detach(), out=given, sink=sink, **options)
    assert_written(given, name="out")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v] + ([sink] if sink_grad else []), dout)
    check_against_reference(out, lse, grads, q, k, v, sink, dout, options, f"{case} splits {splits}")
    check_against_reference(given, lse, grads, q, k, v, sink, dout, options, f"{case} splits {splits}, out=")


@gpu
@pytest.mark.parametrize("splits", [0, 5], indirect=True, ids=lambda s: f"splits{s}")
def test_split_varlen_forward_matches_reference(splits, require_kernel):
    """Packed decodes of unequal lengths, one of them without a query (its rows must not be touched)."""
    require_kernel("fwd", 128, torch.bfloat16)
    lens_q, lens_k = [1, 3, 0, 1], [900, 40, 17, 2049]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).int()
    q, k, v = randn(sum(lens_q), 8, 128), randn(sum(lens_k), 2, 128), randn(sum(lens_k), 2, 128)
    out = poison(torch.empty_like(q))
    _, lse = fa2.fwd_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, out=out)
    assert_written(out, name="out")
    for i in range(len(lens_q)):
        if lens_q[i] == 0:
            continue
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        check_forward(out[qs][None], lse[:, qs][None], q[qs][None], k[ks][None], v[ks][None],
                      f"sequence {i} splits {splits}", causal=True)


def _kernel_names(fn):
    """The full (demangled) names of the fa2 kernels fn launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "fa2::" in e.name}


def _kernels(fn):
    return {name.split("<")[0].split("::")[-1] for name in _kernel_names(fn)}


@gpu
def test_the_launch_splits_a_decode_and_not_a_large_forward(require_kernel):
    require_kernel("fwd", 128, torch.bfloat16)
    q, k, v = randn(1, 1, 32, 128), randn(1, 32768, 8, 128), randn(1, 32768, 8, 128)
    assert _kernels(lambda: fa2.fwd(q, k, v, causal=True)) == {"fwd_kernel", "fwd_combine_kernel"}
    out, lse = fa2.fwd(q, k, v, causal=True)
    check_forward(out, lse, q, k, v, "decode 32k", causal=True)
    q, k, v = (randn(4, 2048, 16, 128) for _ in range(3))
    assert _kernels(lambda: fa2.fwd(q, k, v)) == {"fwd_kernel"}


@gpu
@pytest.mark.parametrize("case", ["dropout", "d256 short", "d256 on 99 KB"])
def test_dropout_runs_whole_and_the_narrow_tile_splits(case, require_kernel, launch_overrides):
    """Only the kLogits instances have split-KV (config.h): a decode with dropout runs in one kernel whatever the
    override asks, exactly as without it; d256 decodes that take the narrow tile (a short cache, or a 99 KB GPU) split
    on its kLogits instance, and match the reference."""
    d, seqlen_k = (128, 4096) if case == "dropout" else (256, 1000 if case == "d256 short" else 4096)
    require_kernel("fwd", d, torch.bfloat16)
    q, k, v = randn(2, 1, 8, d), randn(2, seqlen_k, 2, d), randn(2, seqlen_k, 2, d)
    if case == "dropout":
        options = dict(dropout_p=0.2, rng_state=torch.tensor([1234, 56], device="cuda"))
    else:
        options = dict(softcap=30.0)
    smem_limit = CONSUMER_SMEM if case == "d256 on 99 KB" else 0
    launch_overrides(smem_limit=smem_limit)
    whole_out, whole_lse = fa2.fwd(q, k, v, **options)
    launch_overrides(num_splits=16, smem_limit=smem_limit)
    split = case != "dropout"
    assert _kernels(lambda: fa2.fwd(q, k, v, **options)) == ({"fwd_kernel", "fwd_combine_kernel"} if split
                                                            else {"fwd_kernel"})
    out, lse = fa2.fwd(q, k, v, **options)
    if split:
        check_forward(out, lse, q, k, v, case, **options)
    else:
        assert torch.equal(out, whole_out) and torch.equal(lse, whole_lse)


def _fwd_tiles(fn):
    """(kBlockM, kBlockN, warps, stages) of each forward kernel fn launches."""
    names = {name for name in _kernel_names(fn) if "fwd_kernel<" in name}
    return {tuple(map(int, re.search(r"FwdTraits<\d+, (\d+), (\d+), (\d+), (\d+),", n).groups())) for n in names}


@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_forwards_of_at_most_64_rows_run_the_decode_tile(d, require_kernel, launch_overrides):
    """config.h's decode tile (64 x 64, 4 warps, 2 stages) for at most 64 query rows after GQA packing, unless the
    call has dropout or the tile does not fit the block's shared memory; the main tile (128 rows) otherwise. Each
    result against the reference."""
    require_kernel("fwd", d, torch.bfloat16)
    decode, main = {(64, 64, 4, 2)}, {(128, 64, 4, 2 if d == 64 else 1)}
    state = torch.tensor([7, 8], device="cuda")
    for sq, h, hk, options, tile in [(1, 32, 8, {}, decode),               # packed: 4 rows
                                     (64, 8, 8, dict(causal=True), decode),
                                     (65, 8, 8, dict(causal=True), main),
                                     (1, 32, 8, dict(dropout_p=0.1, rng_state=state), main)]:
        q, k, v = randn(2, sq, h, d), randn(2, 3000, hk, d), randn(2, 3000, hk, d)
        assert _fwd_tiles(lambda: fa2.fwd(q, k, v, **options)) == tile, (sq, h, options)
        if "dropout_p" not in options:
            out, lse = fa2.fwd(q, k, v, **options)
            check_forward(out, lse, q, k, v, f"{sq} rows, {h}/{hk} heads, d{d}", **options)
    q, k, v = randn(2, 1, 32, d), randn(2, 3000, 8, d), randn(2, 3000, 8, d)
    # 99 KB GPUs fit it (80 KB at d128); below its size and above the main tile's (64 KB at d128) the main tile runs.
    for smem_limit, tile in [(CONSUMER_SMEM, decode)] + ([(72 * 1024, main)] if d == 128 else []):
        launch_overrides(smem_limit=smem_limit)
        assert _fwd_tiles(lambda: fa2.fwd(q, k, v)) == tile, smem_limit
        out, lse = fa2.fwd(q, k, v)
        check_forward(out, lse, q, k, v, f"decode d{d} within {smem_limit} bytes")


# ------------------------------------------------------------------------------------------------ CPU
def _recorded_fwd(recording, q, k, v, **options):
    fa2.fwd(q, k, v, **options)
    kind, launch = recording.calls[-1]
    assert kind == "fwd"
    return launch


def test_gqa_decode_packs_the_group_into_rows(recording):
    q, k, v = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16), *(torch.randn(2, 100, 2, 64, dtype=torch.bfloat16)
                                                                 for _ in range(2))
    launch = _recorded_fwd(recording, q, k, v, causal=True)
    assert (launch["seqlen_q"], launch["nheads"], launch["nheads_k"]) == (4, 2, 2)
    assert launch["q_stride"] == (q.stride(0), q.stride(2), 4 * q.stride(2))
    assert launch["out_stride"] == launch["q_stride"]  # out is allocated like q
    assert not launch["causal"] and launch["window_right"] == -1  # one query row sees every key anyway
    assert launch["num_splits"] == 1  # record mode has no GPU to size splits for


@pytest.mark.parametrize("options", [dict(sink=torch.zeros(8)), dict(window_size=(50, 0)),
                                     dict(alibi_slopes=torch.ones(8)), dict(dropout_p=0.1, rng_state="state")],
                         ids=["sink", "window", "alibi", "dropout"])
def test_per_row_or_per_head_features_keep_the_layout(options, recording):
    q, k, v = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16), *(torch.randn(2, 100, 2, 64, dtype=torch.bfloat16)
                                                                 for _ in range(2))
    if options.get("rng_state") == "state":
        options["rng_state"] = torch.tensor([1, 2])
    launch = _recorded_fwd(recording, q, k, v, **options)
    assert (launch["seqlen_q"], launch["nheads"]) == (1, 8)


def test_only_single_query_grouped_calls_are_packed(recording):
    mha = [torch.randn(1, 1, 4, 64, dtype=torch.bfloat16) for _ in range(3)]
    assert _recorded_fwd(recording, *mha)["seqlen_q"] == 1
    q, k, v = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16), *(torch.randn(1, 9, 2, 64, dtype=torch.bfloat16)
                                                                 for _ in range(2))
    assert _recorded_fwd(recording, q, k, v)["seqlen_q"] == 2


def test_a_forced_split_count_reaches_the_launch_unless_it_has_dropout(recording):
    q, k, v = (torch.randn(1, 1, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    ops._C.set_test_overrides(record=True, num_splits=7)
    assert _recorded_fwd(recording, q, k, v)["num_splits"] == 7
    dropped = _recorded_fwd(recording, q, k, v, dropout_p=0.1, rng_state=torch.tensor([1, 2]))
    assert dropped["num_splits"] == 1  # kAll, the dropout instance, has no split-KV


def test_a_forced_split_count_splits_the_narrow_tile_on_its_logits_instance(recording, require_kernel):
    """A d256 decode runs the narrow tile (config.h: fwd_tile_for), split on its kLogits instance, against a short
    cache or a long one; 65 query rows against 1100 keys run the main tile, which splits too."""
    require_kernel("fwd", 256, torch.bfloat16)
    ops._C.set_test_overrides(record=True, num_splits=7)
    for seqlen_q, seqlen_k, tile in [(1, 1000, "narrow"), (1, 1100, "narrow"), (65, 1100, "main")]:
        q = torch.randn(1, seqlen_q, 8, 256, dtype=torch.bfloat16)
        k, v = (torch.randn(1, seqlen_k, 2, 256, dtype=torch.bfloat16) for _ in range(2))
        launch = _recorded_fwd(recording, q, k, v)
        assert (launch["num_splits"], launch["plan"]["transforms"], launch["plan"]["tile"]) == (7, "logits", tile)
    with pytest.raises(ValueError, match="num_splits"):
        ops._C.set_test_overrides(num_splits=129)  # past kMaxSplits (params.h)

"""The Hopper backward (csrc/sm90/bwd_*.h; docs/tuning.md#sm90-backward): asked for, it computes dq, dk and dv of
every call it serves (padded and packed batches at d64, d128 and d256, full or causal, MHA/GQA/MQA, lengths that are
not multiples of its tiles: 128 x 128 at d64, 80 x 128 (full) and 64 x 128 (causal, packed) at d128, 64 x 64 at d256)
within the fp64 reference rule, and the plan sends everything else to the
mma.sync backward. Every build with the Hopper family has it (a build without arch 90 runs these tests on the mma.sync
backward); the kernel names of a profile say which family ran. CPU (record mode): the plan's family."""
import json
import math
import os
import tempfile

import pytest
import torch

import fa2
from fa2 import ops

from fa2.testing import assert_close_to_ref, assert_written, poison
from test_bwd import check_grads, randn
from test_varlen import check as check_varlen, pack, per_sequence_ref


def sm90_bwd_built(d=128):
    """Whether this build compiled the Hopper backward at head dim d: the plan of a call that asks for the Hopper
    family, in record mode (CPU tensors, no launch)."""
    if ops._C is None:
        pytest.skip("fa2._C is not built")
    if d not in fa2.build_info()["bwd_head_dims"]:
        return False
    q, k, v = (torch.randn(1, 128, 2, d, dtype=torch.bfloat16) for _ in range(3))
    ops._C.set_test_overrides(record=True, family="sm90")
    try:
        fa2.bwd(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.zeros(1, 2, 128))
        launches = [launch for launch in ops._C.take_recorded_launches() if launch["kind"] == "bwd"]
    finally:
        ops._C.set_test_overrides()
    return launches[-1]["plan"]["family"] == "sm90"


def test_a_build_with_the_hopper_family_has_its_backward(require_kernel):
    """CPU: the Hopper backward is compiled wherever the Hopper family is (instantiations/axes.json), so a build that
    lost it fails here instead of quietly running the mma.sync backward."""
    require_kernel("bwd", 128, torch.bfloat16)
    info = fa2.build_info()
    assert sm90_bwd_built() == ("sm90" in info["families"] and 128 in info["bwd_head_dims"]), info


def hopper_bwd_expected(d=128):
    return sm90_bwd_built(d) and torch.cuda.get_device_capability() == (9, 0)


def bwd_kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if "bwd_kernel" in e.name}


def bwd_kernel_grids(fn):
    """The grids of the Hopper backward kernels that fn launches, from the profiler's trace (its kernel events carry
    them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [tuple(e.get("args", {}).get("grid", ())) for e in events if "sm90::bwd_kernel" in e.get("name", "")]


# 241 = 3 x 80 + 1: one query in d128's last 80-row block (1000: 40 rows, 1023: 63).
SHAPES = [(1, 1), (113, 203), (128, 128), (203, 113), (241, 300), (1000, 1000), (1023, 2048), (2048, 1023)]
HEADS = [(2, 4, 4), (1, 8, 1), (1, 16, 2)]  # MHA, MQA, GQA 8:1
GRID = [(d, sq, sk, b, h, hk) for d in (64, 128, 256) for sq, sk in SHAPES for b, h, hk in HEADS]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d,sq,sk,b,h,hk", GRID, ids=["d{}_{}x{}_b{}_h{}kv{}".format(*g) for g in GRID])
def test_hopper_backward_matches_the_reference(d, sq, sk, b, h, hk, dtype, causal, launch_overrides, require_kernel):
    require_kernel("bwd", d, dtype)
    launch_overrides(family="sm90")
    q = randn(b, sq, h, d, dtype=dtype, requires_grad=True)
    k, v = (randn(b, sk, hk, d, dtype=dtype, requires_grad=True) for _ in range(2))
    out = fa2.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    check_grads(got, q, k, v, dout, causal, f"sm90 bwd d{d} {sq}x{sk} b{b} h{h}/{hk} {dtype} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,b,sq,sk,h,hk", [(64, 3, 1000, 1100, 16, 4), (128, 8, 300, 300, 16, 16),
                                             (128, 2, 1500, 700, 24, 8), (256, 2, 700, 900, 16, 2)],
                         ids=["d64_1000x1100_gqa", "d128_b8_300", "d128_1500x700_gqa", "d256_700x900"])
def test_a_persistent_cta_computes_every_tile_it_draws(d, b, sq, sk, h, hk, causal, launch_overrides, require_kernel):
    """d64 and d128's causal tile run one persistent CTA per SM, drawing (key block, head, batch) tiles from a counter
    that the preprocess zeroes (bwd_kernel.h, config.h: bwd_persistent): here several tiles a CTA, of unequal lengths
    (causal, ragged ends, GQA), twice in a row, so a counter left from the first call (or a tile two CTAs both took,
    or none did) shows in the second's gradients; the grid says which launch ran. d128's full-attention tile and
    d256 keep a CTA per tile (a 3-D grid): the same check on that path over several waves. A tile per query head
    (walk_heads=1), whatever the plan would walk on this GPU: the walks have their own test, below."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90", walk_heads=1)
    block_n = 64 if d == 256 else 128  # config.h: bwd_tile
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert -(-sk // block_n) * h * b > 2 * sms, "the case must span several waves"
    q = randn(b, sq, h, d)
    k, v = (randn(b, sk, hk, d) for _ in range(2))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    first = fa2.bwd(dout, q, k, v, out, lse, causal=causal)
    second = fa2.bwd(dout, q, k, v, out, lse, causal=causal)
    label = f"sm90 persistent d{d} b{b} {sq}x{sk} h{h}/{hk} causal={causal}"
    check_grads(first, q, k, v, dout, causal, label)
    check_grads(second, q, k, v, dout, causal, label + " (second call)")
    grids = bwd_kernel_grids(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=causal))
    if hopper_bwd_expected(d):
        persistent = d == 64 or (d == 128 and causal)
        assert grids == [(sms, 1, 1) if persistent else (-(-sk // block_n), h, b)], grids
    else:
        assert grids == [], grids


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_persistent_tiles_convert_dq_themselves(d, causal, deterministic, launch_overrides, require_kernel):
    """Persistent tiles (d64, d128's causal tile; not deterministic) write dQ in the input dtype themselves, each query
    block once every key block that sees it has added its share (sm90/bwd_dq_convert.h), so no convert kernel runs
    after them; every other Hopper backward keeps that kernel. Twice in a row (a count left from the first call shows
    in the second's dq), with more query rows than keys (causal: the first 1025 rows see no key, so the blocks of the
    first 1024 have no share and are converted from the zeroed sums) and dq the caller's NaN-filled, strided buffer."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    q = randn(2, 2048, 4, d)
    k, v = (randn(2, 1023, 2, d) for _ in range(2))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    label = f"sm90 dq conversion d{d} causal={causal} deterministic={deterministic}"
    for call in range(2):
        dq = torch.full((2, 2048, 6, d), float("nan"), device=q.device, dtype=q.dtype)[:, :, 1:5]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _, dk, dv = fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, dq=dq)
            torch.cuda.synchronize()
        check_grads((dq, dk, dv), q, k, v, dout, causal, f"{label} (call {call})")
    names = {e.name for e in prof.events()}
    hopper = hopper_bwd_expected(d)
    in_kernel = hopper and not deterministic and (d == 64 or (d == 128 and causal))
    # The mma.sync family's deterministic dQ comes from its own kernel (bwd_dq_kernel), not from a conversion.
    converts_after = not in_kernel and (hopper or not deterministic)
    assert any("convert_dq" in n for n in names) == converts_after, names


WALKS = [(64, 3, 1000, 1100, 16, 4), (128, 2, 1500, 700, 24, 8), (128, 2, 700, 1500, 16, 2), (256, 2, 700, 900, 8, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("walk", ["group", 2], ids=["walk_group", "walk_2"])
@pytest.mark.parametrize("d,b,sq,sk,h,hk", WALKS, ids=["d64_gqa4", "d128_gqa3", "d128_gqa8", "d256_mqa8"])
def test_a_tile_walks_the_query_heads_of_a_kv_group(d, b, sq, sk, h, hk, walk, causal, deterministic, launch_overrides,
                                                    require_kernel):
    """GQA/MQA on the Hopper backward: a tile visits the query heads of one K/V head in turn and sums their dK and dV
    in registers (bwd_kernel.h: BwdWork; host/plan.cpp: walk_heads), forced here to the whole group (dK and dV
    written in the input dtype, no sum after the kernel) and to walks of 2 heads (gcd with the group: 1 where the
    group is 3; the walks' float32 slices summed by the host). Twice in a row (the persistent counter), the grid of
    walks, and deterministic mode bitwise repeatable with its turns across a walk's heads."""
    require_kernel("bwd", d, torch.bfloat16)
    group = h // hk
    walk = group if walk == "group" else math.gcd(walk, group)
    launch_overrides(family="sm90", walk_heads=walk)
    q = randn(b, sq, h, d)
    k, v = (randn(b, sk, hk, d) for _ in range(2))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    runs = [fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic) for _ in range(2)]
    label = f"sm90 walk {walk} d{d} b{b} {sq}x{sk} h{h}/{hk} causal={causal} deterministic={deterministic}"
    check_grads(runs[0], q, k, v, dout, causal, label)
    check_grads(runs[1], q, k, v, dout, causal, label + " (second call)")
    if deterministic:
        for name, a, b_ in zip(("dq", "dk", "dv"), *runs):
            assert torch.equal(a, b_), f"{name} differs between two deterministic runs, {label}"
    grids = bwd_kernel_grids(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic))
    if hopper_bwd_expected(d):
        block_n = 64 if d == 256 else 128  # config.h: bwd_tile
        tiles = (-(-sk // block_n), h // walk, b)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        # bwd_launch.h: the persistent tiles (config.h: bwd_persistent) launch one CTA per SM, or one per tile (1-D)
        # in deterministic mode; the others a (key blocks, walks, batch) grid.
        if d == 64 or (d == 128 and causal):
            expected = (math.prod(tiles), 1, 1) if deterministic else (min(math.prod(tiles), sms), 1, 1)
        else:
            expected = tiles
        assert grids == [expected], (grids, expected)
    else:
        assert grids == [], grids


PLANNED = [(128, False, False, 1, 16, 1), (128, False, False, 16, 16, 4), (128, False, False, 3, 32, 4),
           (128, False, False, 1, 32, 8), (256, True, False, 1, 8, 1), (256, True, False, 16, 8, 2),
           (256, True, False, 3, 16, 2), (256, True, True, 16, 8, 2), (256, True, True, 16, 16, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,deterministic,b,h,hk", PLANNED, ids=[
    "d128_b1_mqa", "d128_b16_gqa4", "d128_b3_gqa8", "d128_b1_gqa4", "d256_causal_b1_mqa", "d256_causal_b16_gqa4",
    "d256_causal_b3_gqa8", "d256_causal_deterministic_b16_gqa4", "d256_causal_deterministic_b16_gqa8"])
def test_the_plan_walks_whole_groups_where_the_grid_stays_full(d, causal, deterministic, b, h, hk, launch_overrides,
                                                               require_kernel):
    """The plan's walk (host/plan.cpp: walk_heads), read from the grid of a tile that runs a CTA per tile (key blocks
    x walks x batch: d128's full-attention tile, d256's), 1024 tokens: full attention, whose tiles are equal, the
    longest walk of the fewest waves x walk; causal the whole group while the grid keeps two tiles per SM (twelve in
    deterministic mode, whose heaviest tiles run last), else the largest divisor of the group that does, down to a
    tile per query head."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    q = randn(b, 1024, h, d)
    k, v = (randn(b, 1024, hk, d) for _ in range(2))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grids = bwd_kernel_grids(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic))
    if not hopper_bwd_expected(d):
        assert grids == [], grids
        return
    sms, group = torch.cuda.get_device_properties(0).multi_processor_count, h // hk
    blocks = 1024 // (64 if d == 256 else 128)  # config.h: bwd_tile
    walks = [w for w in range(group, 0, -1) if group % w == 0]  # longest first
    if causal:
        walk = next(w for w in walks if w == 1 or blocks * b * (h // w) >= (12 if deterministic else 2) * sms)
    else:
        walk = min(walks, key=lambda w: -(-blocks * b * (h // w) // sms) * w)  # min keeps the first (longest) of ties
    assert grids == [(blocks, h // walk, b)], (grids, walk)
    label = f"sm90 planned walk {walk} d{d} b{b} h{h}/{hk} causal={causal} deterministic={deterministic}"
    grads = fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    check_grads(grads, q, k, v, dout, causal, label)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 256], ids=["d128", "d256"])
def test_hopper_backward_with_strided_inputs_and_given_buffers(d, causal, launch_overrides, require_kernel):
    """q, k, v as slices of a packed qkv tensor (TMA reads them in place), dq/dk/dv the caller's, every element
    written."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    qkv = randn(2, 333, 3, 4, d)
    q, k, v = qkv.unbind(2)
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(3))
    fa2.bwd(dout, q, k, v, out, lse, causal=causal, dq=dq, dk=dk, dv=dv)
    check_grads((dq, dk, dv), q, k, v, dout, causal, f"sm90 bwd strided d{d} causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False], ids=["tma", "registers"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_dk_and_dv_leave_by_tma_where_the_buffers_allow(d, causal, aligned, launch_overrides, require_kernel):
    """d64's and d128's tiles write dK and dV through K's and V's shared memory and a TMA store (sm90/config.h:
    bwd_stores_dkv_by_tma; persistent tiles load the next tile's K and V there afterwards); given buffers whose stride
    along a dimension of size 1 is no multiple of 16 bytes, which the checks accept and TMA does not, get them from
    registers instead. A last key block of 77 rows: the store drops the rest. 64 heads of 333 rows are 192 tiles, so
    persistent CTAs take more than one."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    q, k, v = (randn(1, 333, 64, d) for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    row = 64 * d
    strides = (333 * row if aligned else 3, row, d, 1)
    dk, dv = (torch.full((333 * row + 8,), float("nan"), device=q.device, dtype=q.dtype).as_strided(q.shape, strides)
              for _ in range(2))
    dq, dk_out, dv_out = fa2.bwd(dout, q, k, v, out, lse, causal=causal, dk=dk, dv=dv)
    assert dk_out.data_ptr() == dk.data_ptr() and dv_out.data_ptr() == dv.data_ptr()
    check_grads((dq, dk, dv), q, k, v, dout, causal,
                f"sm90 bwd d{d} causal={causal} dk/dv {'by TMA' if aligned else 'from registers'}")


@pytest.mark.gpu
def test_the_backward_family_that_runs_is_the_one_planned(launch_overrides, require_kernel):
    require_kernel("bwd", 128, torch.bfloat16)
    q, k, v = (randn(2, 300, 4, 128) for _ in range(3))
    out, lse = fa2.fwd(q, k, v, causal=True)
    dout = torch.randn_like(out)
    launch_overrides(family="sm90")
    names = bwd_kernel_names(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=True))
    assert any("sm90" in n for n in names) == hopper_bwd_expected(), names
    launch_overrides(family="sm80")
    names = bwd_kernel_names(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=True))
    assert names and not any("sm90" in n for n in names), names
    # What the Hopper backward does not serve falls back by the plan, never by error: softcap, here.
    launch_overrides(family="sm90")
    for options in (dict(softcap=30.0),):
        names = bwd_kernel_names(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=True, **options))
        assert names and not any("sm90" in n for n in names), (options, names)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,b,sq,sk,h,hk", [(128, 2, 1000, 1000, 4, 2), (64, 2, 1023, 2048, 4, 4),
                                             (128, 2, 2048, 1023, 2, 1), (128, 4, 2048, 2048, 16, 16),
                                             (64, 2, 300, 1000, 2, 2), (64, 1, 256, 9000, 2, 2),
                                             (128, 2, 961, 1000, 4, 4), (256, 2, 1000, 1100, 4, 2),
                                             (256, 1, 128, 4500, 2, 2)],
                         ids=["d128_1000x1000_gqa", "d64_1023x2048", "d128_2048x1023_mqa", "d128_2048_b4h16_waves",
                              "d64_300x1000_rem", "d64_256x9000_keyorder", "d128_961x1000_tail", "d256_1000x1100_gqa",
                              "d256_128x4500_keyorder"])
def test_hopper_deterministic_backward_is_bitwise_repeatable(d, b, sq, sk, h, hk, causal, launch_overrides,
                                                            require_kernel):
    """deterministic=True on the Hopper backward: the key blocks add their dQ shares in turn, so three runs agree bit
    for bit (dq, dk, dv) and meet the reference; the kernel that ran is the Hopper family's. d128_2048_b4h16 is 1024
    CTAs, several waves on any GPU: CTAs wait for others that started before them or, full attention's rotated walks
    (bwd_kernel.h), for their own head's, all resident together. Full attention rotates where 2 x key blocks <= SMs:
    every shape here but d64_256x9000 (71 key blocks, key-block order on H100/H200); 300x1000: 8 key blocks over 3
    query blocks (N > M, N mod M = 2); 961 = 12 x 80 + 1 rows: a last query block of one row at d128's 80-row tile;
    d256: bwd_mma_wide.h's walk, rotated too (128x4500: 71 key blocks, key-block order)."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    q = randn(b, sq, h, d)
    k, v = (randn(b, sk, hk, d) for _ in range(2))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    runs = [fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    check_grads(runs[0], q, k, v, dout, causal, f"sm90 deterministic d{d} {sq}x{sk} h{h}/{hk} causal={causal}")
    names = bwd_kernel_names(lambda: fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True))
    assert any("sm90" in n for n in names) == hopper_bwd_expected(d), names


# Packed sequences (varlen): empty ones, one token, lengths past a tile by one, queries without keys and keys without
# queries, GQA and MQA (tests/test_sm90.py's forward cases); the last with max_seqlen past the longest sequence.
VARLEN = [
    ([1, 5, 128, 300, 0, 77, 129, 1000, 1, 64], None, 4, 4),
    ([3, 200, 0, 64, 129, 17, 700, 1], [70, 150, 9, 0, 257, 1, 300, 999], 8, 2),
    ([513, 65, 2, 1100], [1, 2000, 130, 1100], 4, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(len(VARLEN)), ids=["self", "cross_gqa", "cross_mqa"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_varlen_backward_matches_the_reference(d, case, causal, deterministic, launch_overrides,
                                                      require_kernel):
    """Packed sequences on the Hopper backward: TMA reads (and the dQ writer adds into) each sequence through views
    whose row bound is the sequence's end (sm90/bwd_launch.h), causal is bottom-right per sequence, key blocks past a
    sequence's end do nothing, and dK/dV land at each sequence's rows (poisoned outputs, the per-sequence fp64
    reference). Deterministic: the same bits twice."""
    require_kernel("bwd", d, torch.bfloat16)
    launch_overrides(family="sm90")
    lengths_q, lengths_k, h, hk = VARLEN[case]
    lengths_k = lengths_k or lengths_q
    extra = 70 if case == 2 else 0
    check_varlen(lengths_q, lengths_k, h, hk, d, torch.bfloat16, causal, max_extra=extra, deterministic=deterministic)
    q, cu_q = pack(lengths_q, h, d, torch.bfloat16)
    k, cu_k = pack(lengths_k, hk, d, torch.bfloat16)
    v = torch.randn_like(k)
    max_q, max_k = max(lengths_q) + extra, max(lengths_k) + extra
    out, lse = fa2.fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    dout = torch.randn_like(q)
    run = lambda: fa2.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,  # noqa: E731
                                 deterministic=deterministic)
    names = bwd_kernel_names(run)
    assert any("sm90" in n for n in names) == hopper_bwd_expected(d), names
    if deterministic:
        for name, a, b in zip(("dq", "dk", "dv"), run(), run()):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_varlen_backward_of_strided_heads_walking_part_of_a_group(d, dtype, causal, launch_overrides,
                                                                        require_kernel):
    """Packed q, k and v as head slices of one (total, h + 2 hk, d) tensor (rows h + 2 hk heads apart, the stride the
    views' batch mode reuses), 8 query heads on 2 K/V heads walked two at a time: float32 dK/dV slices at each
    sequence's rows, and the stats offset stepping by total_q (not a multiple of 4) from head to head."""
    require_kernel("bwd", d, dtype)
    launch_overrides(family="sm90", walk_heads=2)
    lengths = [70, 1, 0, 259, 130]
    h, hk, total = 8, 2, sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qkv = torch.randn(total, h + 2 * hk, d, device="cuda", dtype=dtype)
    q, k, v = qkv[:, :h], qkv[:, h:h + hk], qkv[:, h + hk:]
    out, lse = fa2.fwd_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    dout = torch.randn_like(out)
    grads = [poison(torch.empty_like(t)) for t in (q, k, v)]
    run = lambda: fa2.bwd_varlen(dout, q, k, v, out, lse, cu, cu, max(lengths), max(lengths), causal=causal,  # noqa: E731
                                 dq=grads[0], dk=grads[1], dv=grads[2])
    names = bwd_kernel_names(run)
    assert any("sm90" in n for n in names) == hopper_bwd_expected(d), names
    _, _, g64 = per_sequence_ref(q, k, v, cu, cu, causal, dout, upcast=True)
    _, _, g_low = per_sequence_ref(q, k, v, cu, cu, causal, dout, upcast=False)
    tag = f"sm90 varlen strided walk 2 d{d} {dtype} causal={causal}"
    for name, g, r64, rl in zip(("dq", "dk", "dv"), grads, g64, g_low):
        assert_written(g, name=f"{name} {tag}")
        assert_close_to_ref(g, r64, rl, name=f"{name} {tag}")


def test_a_packed_batch_past_the_int_offsets_goes_to_the_mma_sync_backward(launch_overrides, recording,
                                                                          require_kernel):
    """CPU: the Hopper backward's grid, statistics and deterministic semaphores take int offsets over (sequences,
    heads, max_seqlen_q); a packed batch whose max_seqlen_q makes that product pass 2^31 (its tokens do not) runs on
    the mma.sync backward, by the plan (the launch would refuse it)."""
    require_kernel("bwd", 128, torch.bfloat16)
    built = sm90_bwd_built()
    launch_overrides(record=True, family="sm90")
    q, cu = pack([100, 0, 300], 4, 128, torch.bfloat16, device="cpu")
    k, v = (torch.randn_like(q) for _ in range(2))
    for max_seqlen, expected in ((300, "sm90" if built else "sm80"), (2 ** 28, "sm80")):
        fa2.bwd_varlen(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.zeros(4, q.shape[0]), cu, cu,
                       max_seqlen, max_seqlen)
        kind, launch = recording.calls[-1]
        assert kind == "bwd" and launch["plan"]["family"] == expected, (max_seqlen, launch["plan"])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_packed_sequences_plan_the_hopper_backward(d, causal, launch_overrides, recording, require_kernel):
    """CPU: a varlen backward runs on the Hopper family where the build has it, on a tile that reads each sequence's
    lengths (d128: the causal 64-row tile, full attention too; sm90/config.h: bwd_tile)."""
    require_kernel("bwd", d, torch.bfloat16)
    built = sm90_bwd_built(d)
    launch_overrides(record=True, family="sm90")
    q, cu = pack([100, 0, 300], 4, d, torch.bfloat16, device="cpu")
    k, v = (torch.randn_like(q) for _ in range(2))
    fa2.bwd_varlen(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.zeros(4, q.shape[0]), cu, cu, 300, 300,
                   causal=causal)
    kind, launch = recording.calls[-1]
    assert kind == "bwd" and launch["plan"]["family"] == ("sm90" if built else "sm80"), launch["plan"]
    if built:
        assert launch["plan"]["shape"][1:3] == {64: (128, 128), 128: (64, 128), 256: (64, 64)}[d], launch["plan"]


@pytest.mark.parametrize("options,served", [
    ({}, True), (dict(causal=True), True), (dict(deterministic=True), True), (dict(softcap=30.0), False),
    (dict(window_size=(64, 0)), False), (dict(alibi_slopes=torch.ones(4)), False),
    (dict(dropout_p=0.1, rng_state=torch.tensor([1, 2])), False),
], ids=["plain", "causal", "deterministic", "softcap", "window", "alibi", "dropout"])
@pytest.mark.parametrize("d,hk", [(128, 4), (128, 1), (64, 4), (96, 4), (256, 4), (256, 1)],
                         ids=["d128", "d128_mqa", "d64", "d96", "d256", "d256_mqa"])
def test_the_plan_sends_the_hopper_backward_only_what_it_serves(options, served, d, hk, launch_overrides, recording,
                                                                require_kernel):
    """CPU: with the Hopper family asked for, a backward runs on it only where the build has it and it
    serves the call (d64, d128 and d256, padded, full or causal, deterministic or not, no score transform)."""
    require_kernel("bwd", d, torch.bfloat16)
    built = sm90_bwd_built(d)
    launch_overrides(record=True, family="sm90")
    q, k, v = torch.randn(1, 256, 4, d, dtype=torch.bfloat16), *(
        torch.randn(1, 256, hk, d, dtype=torch.bfloat16) for _ in range(2))
    fa2.bwd(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.zeros(1, 4, 256), **options)
    kind, launch = recording.calls[-1]
    assert kind == "bwd"
    expected = "sm90" if built and served and d in (64, 128, 256) else "sm80"  # sm90/config.h: bwd_has_tile
    assert launch["plan"]["family"] == expected, (options, launch["plan"])
    if expected == "sm90":
        tiles = {64: (128, 128), 128: (64 if options.get("causal") else 80, 128), 256: (64, 64)}  # config.h: bwd_tile
        assert launch["plan"]["shape"][1:3] == tiles[d], launch["plan"]
        # Causal: heaviest key blocks first within head groups (record mode plans groups of 1); else the grid order.
        assert launch["plan"]["head_group"] == (1 if options.get("causal") else 0), launch["plan"]


def test_an_lse_not_on_a_16_byte_boundary_goes_to_the_mma_sync_backward(launch_overrides, recording, require_kernel):
    """CPU: the Hopper backward loads lse and D by TMA, whose base must be 16-byte aligned; an lse that is a view
    starting one float into its storage is served, by the mma.sync backward."""
    require_kernel("bwd", 128, torch.bfloat16)
    built = sm90_bwd_built()
    launch_overrides(record=True, family="sm90")
    q, k, v = (torch.randn(1, 256, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    for offset, expected in ((0, "sm90" if built else "sm80"), (1, "sm80")):
        lse = torch.zeros(4 * 256 + offset)[offset:].view(1, 4, 256)
        fa2.bwd(torch.randn_like(q), q, k, v, torch.randn_like(q), lse)
        kind, launch = recording.calls[-1]
        assert kind == "bwd" and launch["plan"]["family"] == expected, (offset, launch["plan"])


@pytest.mark.parametrize("walk,slices", [(0, 2), (4, 2), (2, 4), (1, 8)], ids=["planned", "group", "walk_2", "walk_1"])
def test_a_grouped_backward_writes_dk_and_dv_once_per_walk(walk, slices, launch_overrides, recording, require_kernel):
    """CPU: 8 query heads on 2 K/V heads. The Hopper backward writes one dK/dV slice per walk (host/plan.cpp:
    walk_heads; record mode plans whole groups): a walk of the whole group writes the caller's dk and dv in the input
    dtype, shorter walks float32 slices the host sums afterwards; the mma.sync backward one per query head."""
    require_kernel("bwd", 128, torch.bfloat16)
    built = sm90_bwd_built()
    launch_overrides(record=True, family="sm90", walk_heads=walk)
    q = torch.randn(1, 256, 8, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 256, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    dq, dk, dv = fa2.bwd(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.zeros(1, 8, 256))
    kind, launch = recording.calls[-1]
    if not built:
        slices = 8
    assert kind == "bwd" and launch["plan"]["walk_heads"] == 8 // slices, launch["plan"]
    assert launch["dkv_fp32"] is (slices != 2) and launch["dk_stride"] == (256 * slices * 128, slices * 128, 128)
    assert (launch["dk"] == dk.data_ptr()) is (slices == 2) and (launch["dv"] == dv.data_ptr()) is (slices == 2)

"""The launch plan (csrc/common/plan.h, csrc/host/plan.cpp): each call's family, compiled head dim, tile, transforms
instance, splits, GQA packing, paged or not and causal order, decided once on the host from the family's table
(csrc/sm80/config.h) and executed by the launch. CPU: record mode shows the plan each call would run with."""
import pytest
import torch

import fa2
from fa2 import ops

BF16 = torch.bfloat16


def qkv(batch=1, seqlen_q=256, seqlen_k=256, nheads=4, nheads_k=4, d=64):
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=BF16)
    return q, *(torch.randn(batch, seqlen_k, nheads_k, d, dtype=BF16) for _ in range(2))


def fwd_plan(recording, *tensors, **options):
    fa2.fwd(*tensors, **options)
    kind, launch = recording.calls[-1]
    assert kind == "fwd"
    assert launch["plan"]["num_splits"] == launch["num_splits"] and launch["plan"]["head_group"] == launch["head_group"]
    return launch["plan"]


@pytest.mark.parametrize("options,transforms", [
    ({}, "none"), (dict(causal=True), "none"), (dict(softcap=30.0), "logits"), (dict(window_size=(64, 0)), "logits"),
    (dict(alibi_slopes=torch.ones(4)), "logits"), (dict(dropout_p=0.1, rng_state=torch.tensor([1, 2])), "all"),
], ids=["plain", "causal", "softcap", "window", "alibi", "dropout"])
def test_the_main_tile_runs_the_smallest_instance_that_covers_the_call(options, transforms, recording):
    plan = fwd_plan(recording, *qkv(), **options)
    assert (plan["family"], plan["head_dim"], plan["dtype"], plan["tile"]) == ("sm80", 64, "bf16", "main")
    assert plan["transforms"] == transforms
    assert plan["shape"][:3] == (128, 64, 4)  # config.h: fwd_main_tile(64)
    assert not plan["pack_gqa"] and not plan["paged"] and plan["num_splits"] == 1


def test_a_head_dim_between_compiled_ones_runs_the_next_one(recording):
    assert fwd_plan(recording, *qkv(d=40))["head_dim"] == 64


def test_few_query_rows_run_the_decode_tile_unless_dropout(recording):
    plan = fwd_plan(recording, *qkv(seqlen_q=64, seqlen_k=1000))
    assert (plan["tile"], plan["transforms"], plan["shape"]) == ("decode", "logits", (64, 64, 4, 2))
    assert fwd_plan(recording, *qkv(seqlen_q=65, seqlen_k=1000))["tile"] == "main"
    dropped = fwd_plan(recording, *qkv(seqlen_q=64, seqlen_k=1000), dropout_p=0.1, rng_state=torch.tensor([1, 2]))
    assert (dropped["tile"], dropped["transforms"]) == ("main", "all")


def test_a_gqa_decode_is_packed_and_loses_its_causal_order(recording):
    plan = fwd_plan(recording, *qkv(seqlen_q=1, seqlen_k=100, nheads=8, nheads_k=2), causal=True)
    assert plan["pack_gqa"] and plan["tile"] == "decode" and plan["head_group"] == 0


def test_causal_grids_get_a_head_group_and_others_none(recording, launch_overrides):
    assert fwd_plan(recording, *qkv(), causal=True)["head_group"] == 1  # record mode: no SM count to size it for
    assert fwd_plan(recording, *qkv())["head_group"] == 0
    launch_overrides(record=True, head_group=2)
    assert fwd_plan(recording, *qkv(), causal=True)["head_group"] == 2
    assert fwd_plan(recording, *qkv())["head_group"] == 0  # the plain order, override or not


def test_a_paged_cache_is_read_by_the_decode_tile(recording):
    q = torch.randn(2, 1, 8, 64, dtype=BF16)
    k_cache, v_cache = (torch.randn(4, 64, 2, 64, dtype=BF16) for _ in range(2))
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    fa2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([100, 7], dtype=torch.int32),
                               block_table=block_table)
    plan = next(launch["plan"] for kind, launch in reversed(recording.calls) if kind == "fwd")
    assert plan["paged"] and plan["tile"] == "decode"


def test_a_paged_decode_at_d256_splits_on_the_narrow_tile(recording, launch_overrides, require_kernel):
    """Paged caches at d160-d256 are read by the narrow tile's kLogits instance, whole or with the keys split (a decode
    against a long cache would otherwise get one CTA per K/V head); the kAll instance has no page code."""
    require_kernel("fwd", 256, BF16)
    q = torch.randn(1, 1, 8, 256, dtype=BF16)
    k_cache, v_cache = (torch.randn(4, 256, 2, 256, dtype=BF16) for _ in range(2))
    table, lens = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.tensor([1000], dtype=torch.int32)
    plans = []
    for splits in (0, 4):
        launch_overrides(record=True, num_splits=splits)
        fa2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
        plans.append(next(launch["plan"] for kind, launch in reversed(recording.calls) if kind == "fwd"))
    assert [(p["tile"], p["transforms"], p["num_splits"]) for p in plans] == [("narrow", "logits", 1),
                                                                              ("narrow", "logits", 4)]


def test_a_paged_cache_at_d160_is_read_by_its_own_narrow_tile(recording):
    """d160's narrow tile (its kLogits instance) reads paged caches and runs decodes, paged or not; more query rows
    than it holds keep the main tile."""
    if 160 not in fa2.build_info()["fwd_head_dims"]:
        pytest.skip("this build has no d160 forward (FA2_HEAD_DIMS)")
    q = torch.randn(1, 1, 8, 160, dtype=BF16)
    k_cache, v_cache = (torch.randn(4, 256, 2, 160, dtype=BF16) for _ in range(2))
    lens = torch.tensor([1000], dtype=torch.int32)
    plans = []
    for where in (dict(block_table=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)), {}):
        kv = (k_cache, v_cache) if where else (k_cache.reshape(1, 1024, 2, 160), v_cache.reshape(1, 1024, 2, 160))
        fa2.attention_with_kvcache(q, *kv, cache_seqlens=lens, **where)
        plans.append(next(launch["plan"] for kind, launch in reversed(recording.calls) if kind == "fwd"))
    q = torch.randn(1, 65, 8, 160, dtype=BF16)
    fa2.attention_with_kvcache(q, *kv, cache_seqlens=lens)
    plans.append(next(launch["plan"] for kind, launch in reversed(recording.calls) if kind == "fwd"))
    assert [(p["head_dim"], p["tile"], p["transforms"], p["paged"]) for p in plans[:2]] == [
        (160, "narrow", "logits", True), (160, "narrow", "logits", False)]
    assert (plans[2]["head_dim"], plans[2]["tile"]) == (160, "main")


def test_the_forward_starts_early_only_where_its_code_waits(recording):
    """Programmatic dependent launch (csrc/common/pdl.h): the forward behind a KV append and the combine behind the
    splits start early where the device code is sm90's, which waits for the kernel ahead; sm80 code has no wait, so
    an sm80-only build never asks for it (record mode plans for the build's highest arch)."""
    q = torch.randn(2, 1, 8, 64, dtype=BF16)
    k_cache, v_cache = (torch.randn(2, 512, 2, 64, dtype=BF16) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, dtype=BF16) for _ in range(2))
    fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([100, 7], dtype=torch.int32))
    plan = next(launch["plan"] for kind, launch in reversed(recording.calls) if kind == "fwd")
    assert plan["pdl"] == (max(fa2.build_info()["archs"]) >= 90)


def test_the_backward_takes_the_first_tile_that_fits(recording, launch_overrides):
    q, k, v = qkv()
    out, lse = torch.empty_like(q), torch.empty(1, 4, 256)
    for limit, tile, shape in [(0, "main", (64, 128, 128, 2)), (99 * 1024, "small_smem", (64, 64, 128, 2))]:
        launch_overrides(record=True, smem_limit=limit)
        fa2.bwd(torch.randn_like(q), q, k, v, out, lse)
        kind, launch = recording.calls[-1]
        assert kind == "bwd" and (launch["plan"]["tile"], launch["plan"]["shape"]) == (tile, shape), limit
        assert launch["plan"]["family"] == "sm80"


def test_build_info_names_the_families():
    """The mma.sync family in every build; the Hopper family's sm_90a code where the build has arch 90."""
    if ops._C is None:
        pytest.skip("fa2._C is not built")
    info = fa2.build_info()
    assert info["families"] == (["sm80", "sm90"] if 90 in info["archs"] else ["sm80"])

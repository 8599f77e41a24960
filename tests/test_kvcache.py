"""fa2.attention_with_kvcache (and flash-attn's flash_attn_with_kvcache on it): a step's new keys and values appended
to each sequence's cache in place, then attention over what the cache holds, for caches with one entry per sequence,
entries picked by cache_batch_idx, and paged caches. GPU: out and lse against the fp64 reference per sequence
(FlashAttention's rule), the caches after the call exactly the reference's, every cache row the call must not read
or write poisoned with NaN; split counts, CUDA-graph replay with new lengths, torch.compile, and index values out of
range (clamped: nothing outside the tensors is read or written). CPU (recorded launches): the argument checks and
what reaches the kernels."""
import pytest
import torch

import fa2
from fa2 import ops, reference
from fa2.integrations.flash_attn import flash_attn_with_kvcache
from fa2.testing import assert_close_to_ref, assert_lse_close
from test_features import alibi_slopes, check_forward

gpu = pytest.mark.gpu

# (batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, capacity, causal, window_size, softcap, sink, alibi)
CASES = [
    (3, 1, 1, 8, 2, 128, 1000, True, (-1, -1), 0.0, False, None),     # GQA decode step: packed, split
    (2, 1, 0, 4, 4, 64, 512, False, (-1, -1), 0.0, False, None),      # attend only, nothing appended
    (2, 6, 6, 8, 1, 96, 640, True, (-1, -1), 0.0, False, None),       # a chunk of prompt appended, MQA, causal
    (2, 1, 2, 8, 2, 256, 768, True, (-1, -1), 0.0, False, None),      # d256: the narrow tile
    (2, 1, 1, 8, 2, 160, 1500, True, (-1, -1), 0.0, False, None),     # d160: paged on its own narrow tile, split
    (2, 3, 2, 4, 2, 160, 700, True, (200, 0), 20.0, True, None),      # d160 with a window, softcap and a sink
    (2, 1, 1, 8, 2, 128, 2048, True, (300, 0), 30.0, True, None),     # windowed softcapped decode with a sink
    (1, 70, 70, 4, 2, 64, 320, True, (-1, -1), 0.0, False, "bh"),     # past the decode tile: the main tile
]
CASE_IDS = ["b{}_q{}_new{}_h{}kv{}_d{}_cap{}_c{:d}_w{}_{}_cap{}_sink{:d}_alibi{}".format(*c[:8], *c[8], *c[9:])
            for c in CASES]
LAYOUTS = ["entries", "batch_idx", "paged64", "paged256"]
PAGED_HEAD_DIMS = (64, 128, 160, 192, 224, 256)  # the head dims with a 64-row forward tile (config.h: fwd_reads_pages)


def _paged_kernel(d):
    """The compiled head dim a paged cache of head dim d runs on (host/plan.cpp: pick_paged_head_dim), or None."""
    return min((x for x in fa2.build_info()["fwd_head_dims"] if x >= d and x in PAGED_HEAD_DIMS), default=None)


def _cache(layout, batch, capacity, nheads_k, d, dtype):
    """(k_cache, v_cache, cache_batch_idx, block_table) poisoned with NaN: a read of a row the call must not read
    turns the output into NaN. Paged caches get a shuffled page table with spare pages; batch_idx ones spare
    entries in a shuffled order."""
    kw = dict(cache_batch_idx=None, block_table=None)
    if layout.startswith("paged"):
        page = int(layout[5:])
        pages_per_seq = -(-capacity // page)
        num_pages = batch * pages_per_seq + 3
        kw["block_table"] = torch.randperm(num_pages, device="cuda")[:batch * pages_per_seq].view(
            batch, pages_per_seq).int()
        shape = (num_pages, page, nheads_k, d)
    elif layout == "batch_idx":
        kw["cache_batch_idx"] = torch.randperm(batch + 2, device="cuda")[:batch].int()
        shape = (batch + 2, capacity, nheads_k, d)
    else:
        shape = (batch, capacity, nheads_k, d)
    k_cache = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    return k_cache, torch.full_like(k_cache, float("nan")), kw


def _fill(cache, held, **where):
    """Random values in rows [0, held[b]) of each sequence's cache."""
    for b, n in enumerate(held):
        rows = torch.arange(n, device="cuda")
        if where["block_table"] is not None:
            page = cache.shape[1]
            cache[where["block_table"][b].long()[rows // page], rows % page] = torch.randn(
                n, *cache.shape[2:], device="cuda", dtype=cache.dtype)
        else:
            entry = b if where["cache_batch_idx"] is None else int(where["cache_batch_idx"][b])
            cache[entry, :n] = torch.randn(n, *cache.shape[2:], device="cuda", dtype=cache.dtype)


def _check(out, lse, q, k_cache, v_cache, held, seqlen_new, where, options, tag):
    """out and lse per sequence against the reference over its first held[b] + seqlen_new rows."""
    for b in range(q.shape[0]):
        keys = reference.kvcache_rows(k_cache, b, held[b] + seqlen_new, **where)[None]
        values = reference.kvcache_rows(v_cache, b, held[b] + seqlen_new, **where)[None]
        slopes = options.get("alibi_slopes")
        opts = dict(options, alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2 else slopes)
        check_forward(out[b:b + 1], lse[b:b + 1], q[b:b + 1], keys, values, f"{tag} sequence {b}", **opts)


def _assert_same(ours, ref, name):
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kvcache_matches_reference(case, layout, dtype, require_kernel):
    b, sq, new, h, hk, d, capacity, causal, window, softcap, with_sink, alibi = case
    require_kernel("fwd", d, dtype)
    k_cache, v_cache, where = _cache(layout, b, capacity, hk, d, dtype)
    held = torch.randint(capacity // 4, capacity - new + 1, (b,)).tolist()
    if not softcap:
        # An empty cache (only the new rows), or a single row. Not under softcap: with one or two keys nothing averages
        # the error of MUFU's tanh.approx (flash-attn's too; ~1e-5 in lse), which the rule then holds to float32's.
        held[0] = 0 if new else 1
    if b > 1:
        held[-1] = capacity - new  # a full one
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, new, hk, d, device="cuda", dtype=dtype) for _ in range(2)) if new else (None, None)
    sink = torch.randn(h, device="cuda") if with_sink else None
    options = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes(alibi, b, h))
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    if layout.startswith("paged") and _paged_kernel(d) is None:  # paged: on a wider kernel that reads pages
        with pytest.raises(ValueError, match="a paged KV cache .* this build has none"):
            fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, **where)
        return
    _, _, k_ref, v_ref = reference.attention_with_kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=lens, **where,
                                                              sink=sink, **options)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, sink=sink, return_lse=True,
                                          **where, **options)
    _assert_same(k_cache, k_ref, "k_cache after the append")
    _assert_same(v_cache, v_ref, "v_cache after the append")
    _check(out, lse, q, k_cache, v_cache, held, new, where, dict(options, sink=sink), f"{case} {layout} {dtype}")


@gpu
@pytest.mark.parametrize("num_splits", [1, 3, 128])
@pytest.mark.parametrize("layout", ["entries", "paged64"])
def test_kvcache_split_counts(layout, num_splits, require_kernel):
    """The caller's split count; 128 leaves most splits without a key block (they must weigh nothing)."""
    require_kernel("fwd", 128, torch.bfloat16)
    k_cache, v_cache, where = _cache(layout, 2, 4096, 2, 128, torch.bfloat16)
    held = [4000, 129]
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    q, k, v = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16), None, None
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits,
                                          return_lse=True, **where)
    _check(out, lse, q, k_cache, v_cache, held, 0, where, {}, f"{layout} splits {num_splits}")


@gpu
def test_kvcache_int_lengths_and_the_whole_cache(require_kernel):
    """cache_seqlens as one int for every sequence, and None (every row of the cache)."""
    require_kernel("fwd", 64, torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 3, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    where = dict(cache_batch_idx=None, block_table=None)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=100, causal=True, return_lse=True)
    _check(out, lse, q, k_cache, v_cache, [100, 100], 3, where, dict(causal=True), "int lengths")
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, return_lse=True)
    _check(out, lse, q, k_cache, v_cache, [300, 300], 0, where, {}, "whole cache")


@gpu
@pytest.mark.parametrize("layout", ["entries", "paged64"])
def test_kvcache_decode_loop_in_a_cuda_graph(layout, require_kernel):
    """A decode step captured once and replayed with the lengths advanced in place: each replay appends its row
    where the lengths say and attends to the grown cache."""
    require_kernel("fwd", 128, torch.bfloat16)
    k_cache, v_cache, where = _cache(layout, 2, 1024, 2, 128, torch.bfloat16)
    held = [37, 500]
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(2, 1, n, 128, device="cuda", dtype=torch.bfloat16) for n in (8, 2, 2))

    def step():
        return fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, return_lse=True,
                                          **where)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture (it appends at 37 and 500, which the first replay overwrites)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for i in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, q, k_cache, v_cache, lens.tolist(), 1, where, dict(causal=True), f"{layout} replay {i}")
        lens += 1


@gpu
def test_kvcache_under_torch_compile(require_kernel):
    """fullgraph compile of a decode step: the same output and the same cache as eager."""
    require_kernel("fwd", 64, torch.bfloat16)
    caches = [torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    eager = [c.clone() for c in caches]
    lens = torch.tensor([10, 200], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(2, 1, n, 64, device="cuda", dtype=torch.bfloat16) for n in (4, 2, 2))

    def step(q, k_cache, v_cache, k, v, lens):
        return fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True) * 2

    compiled = torch.compile(step, fullgraph=True)(q, *caches, k, v, lens)
    expected = step(q, *eager, k, v, lens)
    assert torch.equal(compiled, expected)
    assert torch.equal(caches[0], eager[0]) and torch.equal(caches[1], eager[1])


@gpu
@pytest.mark.parametrize("layout", ["entries", "batch_idx", "paged64"])
def test_kvcache_index_values_out_of_range_stay_inside_the_tensors(layout, require_kernel):
    """Lengths past the capacity or negative, cache entries and page ids out of range: the call neither reads nor
    writes outside the tensors (they are views into guarded buffers, whose guards must stay untouched), the process
    stays healthy, and a correct call afterwards is right."""
    require_kernel("fwd", 64, torch.bfloat16)
    k_cache, v_cache, where = _cache(layout, 2, 256, 2, 64, torch.bfloat16)
    guard = 4096
    buffers = [torch.full((c.numel() + 2 * guard,), 7.0, device="cuda", dtype=c.dtype) for c in (k_cache, v_cache)]
    k_cache, v_cache = (buf[guard:guard + c.numel()].view(c.shape).copy_(torch.randn_like(c))
                        for buf, c in zip(buffers, (k_cache, v_cache)))
    if where["block_table"] is not None:
        where["block_table"][0, 0], where["block_table"][1, -1] = -5, 10 ** 6
    if where["cache_batch_idx"] is not None:
        where["cache_batch_idx"][0], where["cache_batch_idx"][1] = -1, 1000
    q, k, v = (torch.randn(2, 1, n, 64, device="cuda", dtype=torch.bfloat16) for n in (4, 2, 2))
    for held in ([256, -3], [2 ** 31 - 1, 255]):
        lens = torch.tensor(held, device="cuda", dtype=torch.int32)
        out = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, **where)
        torch.cuda.synchronize()
        assert out.shape == q.shape
    for buf in buffers:
        assert (buf[:guard] == 7).all() and (buf[-guard:] == 7).all(), "a guard was written"
    k_cache.copy_(torch.randn_like(k_cache)), v_cache.copy_(torch.randn_like(v_cache))
    if where["block_table"] is not None:
        where["block_table"].copy_(torch.randperm(k_cache.shape[0], device="cuda")[:where["block_table"].numel()]
                                   .view_as(where["block_table"]))
    if where["cache_batch_idx"] is not None:
        where["cache_batch_idx"].copy_(torch.tensor([1, 0], device="cuda"))
    lens = torch.tensor([5, 100], device="cuda", dtype=torch.int32)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, return_lse=True, **where)
    _check(out, lse, q, k_cache, v_cache, [5, 100], 1, where, {}, f"{layout} after bad indices")


@gpu
def test_flash_attn_with_kvcache_is_attention_with_kvcache(require_kernel):
    """flash-attn's signature, positional as flash-attn's callers write it, return_softmax_lse included."""
    require_kernel("fwd", 128, torch.bfloat16)
    k_cache, v_cache, where = _cache("paged256", 2, 512, 2, 128, torch.bfloat16)
    held = [3, 300]
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(2, 1, n, 128, device="cuda", dtype=torch.bfloat16) for n in (8, 2, 2))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, None, None, lens, None, None, where["block_table"],
                                       None, True, (-1, -1), 0.0, True, None, 0, True)
    _check(out, lse, q, k_cache, v_cache, held, 1, where, dict(causal=True), "flash_attn_with_kvcache")


# (batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, capacity, rotary_dim, causal, window_size)
ROTARY_CASES = [
    (3, 1, 1, 8, 2, 128, 1000, 128, True, (-1, -1)),  # a GQA decode step (packed), the whole head rotated
    (2, 1, 1, 32, 8, 128, 4096, 64, False, (-1, -1)),  # split many ways: q's rotated copy is the output's buffer
    (2, 6, 6, 8, 2, 128, 640, 64, True, (-1, -1)),    # a causal prompt chunk: q's rows at cache_seqlens + i
    (2, 5, 3, 4, 4, 64, 320, 32, False, (-1, -1)),    # not causal, more q rows than new ones: all at cache_seqlens
    (2, 4, 4, 4, 2, 64, 512, 16, False, (40, 3)),     # a window: q's rows advance
    (2, 3, 2, 4, 1, 96, 384, 20, True, (-1, -1)),     # rotary_dim / 2 = 10: pairs straddle the 8-element chunks
]
ROTARY_IDS = ["b{}_q{}_new{}_h{}kv{}_d{}_cap{}_rot{}_c{:d}_w{}_{}".format(*c[:9], *c[9]) for c in ROTARY_CASES]


def _rotary_tables(rows, rotary_dim, dtype):
    angle = torch.rand(rows, rotary_dim // 2, device="cuda", dtype=torch.float64) * 2 * torch.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _check_rotated(out, lse, q, k_cache, v_cache, held, pads, seqlen_new, where, rotary, options, tag):
    """out and lse per sequence against the reference with q rotated as flash-attn rotates it: in float64 for the
    reference, in q's dtype for plain PyTorch's (whose error sets the bound); the keys are the cache's rows after the
    call (the appended ones rotated by the kernel, checked on their own)."""
    cos, sin, interleaved = rotary
    per_row = reference.rotary_q_per_row(k_cache.shape[1] * (1 if where["block_table"] is None else
                                                             where["block_table"].shape[1]), **options)
    for b in range(q.shape[0]):
        positions = held[b] + (torch.arange(q.shape[1], device="cuda") if per_row else
                               torch.zeros(q.shape[1], dtype=torch.long, device="cuda"))
        q64 = reference.apply_rotary(q[b].double(), cos, sin, positions, interleaved=interleaved)[None]
        q_low = reference.apply_rotary(q[b], cos, sin, positions, interleaved=interleaved)[None]
        keys = reference.kvcache_rows(k_cache, b, held[b] + seqlen_new, **where)[None, pads[b]:]
        values = reference.kvcache_rows(v_cache, b, held[b] + seqlen_new, **where)[None, pads[b]:]
        out64, lse64 = reference.attention_ref(q64, keys.double(), values.double(), **options)
        out_low, _ = reference.attention_ref(q_low, keys, values, upcast=False, **options)
        _, lse32 = reference.attention_ref(q_low.float(), keys.float(), values.float(), upcast=False, **options)
        assert_close_to_ref(out[b:b + 1], out64, out_low, name=f"out {tag} sequence {b}")
        assert_lse_close(lse[b:b + 1], lse64, lse32, name=f"lse {tag} sequence {b}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["entries", "entries_leftpad", "batch_idx", "paged64"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("case", ROTARY_CASES, ids=ROTARY_IDS)
def test_kvcache_rotary_matches_reference(case, interleaved, layout, dtype, require_kernel):
    """rotary_cos/rotary_sin: the new keys rotated at their cache rows into the cache, q at flash-attn's positions,
    q itself untouched; with cache_leftpad (a NaN pad that must not be read) the positions stay the cache rows'."""
    b, sq, new, h, hk, d, capacity, rotary_dim, causal, window = case
    require_kernel("fwd", d, dtype)
    if layout == "paged64" and _paged_kernel(d) is None:
        pytest.skip(f"this build has no forward that reads pages at head_dim >= {d}")
    leftpad = layout == "entries_leftpad"
    k_cache, v_cache, where = _cache("entries" if leftpad else layout, b, capacity, hk, d, dtype)
    held = torch.randint(capacity // 4, capacity - max(new, sq) + 1, (b,)).tolist()
    held[0] = 1 if leftpad else 0  # an empty cache (only the new rows), or with a pad of 1 nothing before them
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    pads = [0] * b
    if leftpad:
        pads = [n if i == 0 else int(torch.randint(0, n, ())) for i, n in enumerate(held)]
        for i, pad in enumerate(pads):
            k_cache[i, :pad], v_cache[i, :pad] = float("nan"), float("nan")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, new, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    # A row of cos and sin per position the cache holds (a paged cache's whole pages), as flash-attn requires.
    seqlen_ro = k_cache.shape[1] * (1 if where["block_table"] is None else where["block_table"].shape[1])
    cos, sin = _rotary_tables(seqlen_ro, rotary_dim, dtype)
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    pad_t = torch.tensor(pads, device="cuda", dtype=torch.int32) if leftpad else None
    options = dict(causal=causal, window_size=window)
    rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, cache_leftpad=pad_t)
    q_before = q.clone()
    _, _, k_ref, v_ref = reference.attention_with_kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=lens, **where,
                                                              **rotary, **options)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, return_lse=True, **where,
                                          **rotary, **options)
    tag = f"{case} {layout} {interleaved} {dtype}"
    assert torch.equal(q, q_before), "q was modified"
    _assert_same(v_cache, v_ref, "v_cache after the append")
    for i in range(b):  # the appended keys: rotated, within the rule; every other row exactly as it was
        rows = torch.arange(held[i], held[i] + new, device="cuda")
        at = reference.kvcache_index(k_cache, i, rows, **where)
        k64 = reference.apply_rotary(k[i].double(), cos, sin, rows, interleaved=interleaved)
        k_low = reference.apply_rotary(k[i], cos, sin, rows, interleaved=interleaved)
        assert_close_to_ref(k_cache[at], k64, k_low, name=f"appended keys {tag} sequence {i}")
        k_ref[at] = k_cache[at]
    _assert_same(k_cache, k_ref, "k_cache after the append")
    _check_rotated(out, lse, q, k_cache, v_cache, held, pads, new, where, (cos, sin, interleaved), options, tag)


@gpu
@pytest.mark.parametrize("layout", ["entries", "batch_idx"])
@pytest.mark.parametrize("case", [(2, 1, 1, 8, 2, 128, 700, True, (-1, -1), None),
                                  (3, 5, 5, 4, 2, 64, 300, True, (50, 0), "bh"),
                                  (2, 4, 0, 4, 4, 64, 256, False, (-1, -1), None)],
                         ids=["decode", "chunk_window_alibi", "attend_only"])
def test_kvcache_leftpad_matches_reference(case, layout, require_kernel):
    """cache_leftpad: sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), the pad rows
    (NaN) never read, and causal, windows and ALiBi count from the pad's end."""
    b, sq, new, h, hk, d, capacity, causal, window, alibi = case
    require_kernel("fwd", d, torch.bfloat16)
    k_cache, v_cache, where = _cache(layout, b, capacity, hk, d, torch.bfloat16)
    held = torch.randint(capacity // 4, capacity - new + 1, (b,)).tolist()
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    pads = [int(torch.randint(0, n, ())) for n in held]
    pads[0] = held[0] if new else held[0] - 1  # all of it padding: only the new rows (or one row) seen
    for i, pad in enumerate(pads):
        entry = i if where["cache_batch_idx"] is None else int(where["cache_batch_idx"][i])
        k_cache[entry, :pad], v_cache[entry, :pad] = float("nan"), float("nan")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, new, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)) if new else (None, None)
    options = dict(causal=causal, window_size=window, alibi_slopes=alibi_slopes(alibi, b, h))
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    pad_t = torch.tensor(pads, device="cuda", dtype=torch.int32)
    _, _, k_ref, v_ref = reference.attention_with_kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                              cache_leftpad=pad_t, **where, **options)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_leftpad=pad_t,
                                          return_lse=True, **where, **options)
    _assert_same(k_cache, k_ref, "k_cache after the append")
    _assert_same(v_cache, v_ref, "v_cache after the append")
    for i in range(b):
        keys = reference.kvcache_rows(k_cache, i, held[i] + new, **where)[None, pads[i]:]
        values = reference.kvcache_rows(v_cache, i, held[i] + new, **where)[None, pads[i]:]
        slopes = options["alibi_slopes"]
        opts = dict(options, alibi_slopes=slopes[i] if slopes is not None and slopes.dim() == 2 else slopes)
        check_forward(out[i:i + 1], lse[i:i + 1], q[i:i + 1], keys, values, f"{case} {layout} sequence {i}", **opts)


@gpu
@pytest.mark.parametrize("layout", ["entries", "paged64"])
@pytest.mark.parametrize("d", [36, 100, 250])
def test_kvcache_head_dim_not_a_multiple_of_8(d, layout, require_kernel):
    """Zero-padded as flash-attn pads: the output at the true head dim with its scale, the append in the caller's
    caches."""
    require_kernel("fwd", d + (-d % 8), torch.bfloat16)
    if layout == "paged64" and _paged_kernel(d) is None:
        pytest.skip(f"this build has no forward that reads pages at head_dim >= {d}")
    k_cache, v_cache, where = _cache(layout, 2, 256, 2, d, torch.bfloat16)
    held = [0, 200]
    _fill(k_cache, held, **where), _fill(v_cache, held, **where)
    q, k, v = (torch.randn(2, 2, n, d, device="cuda", dtype=torch.bfloat16) for n in (4, 2, 2))
    lens = torch.tensor(held, device="cuda", dtype=torch.int32)
    _, _, k_ref, v_ref = reference.attention_with_kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens=lens, **where,
                                                              causal=True)
    out, lse = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                          return_lse=True, **where)
    assert out.shape == q.shape
    _assert_same(k_cache, k_ref, "k_cache after the append")
    _assert_same(v_cache, v_ref, "v_cache after the append")
    _check(out, lse, q, k_cache, v_cache, held, 2, where, dict(causal=True), f"d{d} {layout}")


@gpu
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("api", ["fa2", "flash_attn"])
def test_paged_prefill_matches_reference(api, d, require_kernel):
    """Paged prefill: varlen queries against keys and values in paged caches (block_table), rows [0, len_k) of each
    sequence's pages; causal, GQA; through fa2's call and flash-attn's."""
    require_kernel("fwd", d, torch.bfloat16)
    lens_q, lens_k = [5, 130, 1], [70, 130, 300]
    k_cache, v_cache, where = _cache("paged64", 3, 320, 2, d, torch.bfloat16)
    _fill(k_cache, lens_k, **where), _fill(v_cache, lens_k, **where)
    cu_q = torch.tensor([0, 5, 135, 136], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 200, 500], device="cuda", dtype=torch.int32)
    q = torch.randn(136, 8, d, device="cuda", dtype=torch.bfloat16)
    table = where["block_table"]
    if api == "fa2":
        out = fa2.attention_varlen(q, k_cache, v_cache, cu_q, cu_k, 130, 300, causal=True, block_table=table)
    else:
        out = fa2.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 130, 300, causal=True, block_table=table)
    for i in range(3):
        keys = reference.kvcache_rows(k_cache, i, lens_k[i], **where)[None]
        values = reference.kvcache_rows(v_cache, i, lens_k[i], **where)[None]
        queries = q[None, int(cu_q[i]):int(cu_q[i + 1])]
        out64, _ = reference.attention_ref(queries.double(), keys.double(), values.double(), causal=True)
        out_low, _ = reference.attention_ref(queries, keys, values, upcast=False, causal=True)
        assert_close_to_ref(out[None, int(cu_q[i]):int(cu_q[i + 1])], out64, out_low, name=f"{api} d{d} seq {i}")


# ------------------------------------------------------------------------------------------- CPU: checks
def _cpu(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(k=_cpu(2, 1, 2, 64)), ValueError, "k and v .* go together"),
    (dict(k=_cpu(2, 1, 2, 64), v=_cpu(2, 1, 2, 64), cache_seqlens=None), ValueError, "needs cache_seqlens"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_seqlens must be an int32"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, r"cache_seqlens must be \(batch,\)"),
    (dict(cache_seqlens=-1), TypeError, "cache_seqlens must be an int >= 0"),
    (dict(cache_seqlens=300), ValueError, "must not exceed the cache's capacity"),
    (dict(k=_cpu(2, 9, 2, 64), v=_cpu(2, 9, 2, 64), cache_seqlens=250), ValueError, "overflows the cache's capacity"),
    (dict(k=_cpu(2, 1, 4, 64), v=_cpu(2, 1, 4, 64), cache_seqlens=3), ValueError, "k must be .batch=2, seqlen_new, "
                                                                                  "nheads_k=2"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int32), cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
     ValueError, "cache_batch_idx and block_table cannot be combined"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, r"block_table must be \(batch, max_pages\)"),
    (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_batch_idx must be an int32"),
    (dict(num_splits=129), ValueError, "num_splits must be 0"),
    (dict(causal=True, window_size=(4, 4)), ValueError, "causal=True sees no key right of the diagonal"),
    (dict(rotary_cos=_cpu(256, 32)), ValueError, "rotary_cos and rotary_sin go together"),
    (dict(rotary_cos=_cpu(256, 32), rotary_sin=_cpu(256, 32)), ValueError, "pass k and v too"),
    (dict(k=_cpu(2, 1, 2, 64), v=_cpu(2, 1, 2, 64), rotary_cos=_cpu(256, 32).half(), rotary_sin=_cpu(256, 32).half()),
     TypeError, "rotary_cos must have q's dtype"),
    (dict(k=_cpu(2, 1, 2, 64), v=_cpu(2, 1, 2, 64), rotary_cos=_cpu(256, 33), rotary_sin=_cpu(256, 33)), ValueError,
     r"rotary_cos must be \(seqlen_ro, rotary_dim / 2\) with 2 <= rotary_dim <= head_dim \(64\)"),
    (dict(k=_cpu(2, 1, 2, 64), v=_cpu(2, 1, 2, 64), rotary_cos=_cpu(255, 32), rotary_sin=_cpu(255, 32)), ValueError,
     "rotary_cos must have a row for each of the cache's 256 positions"),
    (dict(k=_cpu(2, 1, 2, 64), v=_cpu(2, 1, 2, 64), rotary_cos=_cpu(256, 32), rotary_sin=_cpu(256, 16)), ValueError,
     "rotary_sin must have rotary_cos's shape"),
    (dict(k=_cpu(2, 1, 2, 64), v=_cpu(2, 1, 2, 64), rotary_cos=_cpu(32, 256).t(), rotary_sin=_cpu(256, 32)),
     ValueError, "rotary_cos must be contiguous"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_leftpad must be an int32"),
    (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), ValueError, r"cache_leftpad must be \(batch,\)"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32), block_table=torch.zeros(2, 1, dtype=torch.int32)),
     ValueError, "cache_leftpad and block_table cannot be combined"),
    (dict(cache_leftpad=[0, 0]), TypeError, "cache_leftpad must be a torch.Tensor or None"),
])
def test_kvcache_argument_errors(kwargs, error, message, recording):
    q, k_cache, v_cache = _cpu(2, 1, 4, 64), _cpu(2, 256, 2, 64), _cpu(2, 256, 2, 64)
    kwargs = dict(dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)), **kwargs)
    with pytest.raises(error, match=message):
        fa2.attention_with_kvcache(q, k_cache, v_cache, **kwargs)
    assert recording.calls == []


@pytest.mark.parametrize("case, message", [
    ("page size", "page_size .* must be a positive multiple of 64"),
    ("cache dtype", "k_cache must have q's dtype"),
    ("cache batch", "k_cache must have one entry per sequence"),
    ("cache shape", "v_cache must have the same shape as k_cache"),
])
def test_kvcache_cache_errors(case, message, recording):
    q, k_cache, v_cache = _cpu(2, 1, 4, 64), _cpu(2, 256, 2, 64), _cpu(2, 256, 2, 64)
    kw = {}
    if case == "page size":
        k_cache, v_cache, kw = _cpu(8, 96, 2, 64), _cpu(8, 96, 2, 64), dict(block_table=torch.zeros(2, 3, dtype=torch.int32))
    elif case == "cache dtype":
        k_cache = k_cache.half()
    elif case == "cache batch":
        k_cache, v_cache = _cpu(3, 256, 2, 64), _cpu(3, 256, 2, 64)
    else:
        v_cache = _cpu(2, 128, 2, 64)
    with pytest.raises((ValueError, TypeError), match=message):
        fa2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **kw)
    assert recording.calls == []


def test_kvcache_launches(recording):
    """What reaches the kernels: the append (rows, strides, the cache's layout), then the forward over the cache
    with its capacity as seqlen_k and the lengths on the device; an int length is the forward's own seqlen_k."""
    q, k_cache, v_cache = _cpu(2, 1, 8, 64), _cpu(9, 128, 2, 64), _cpu(9, 128, 2, 64)
    k, v = _cpu(2, 1, 2, 64), _cpu(2, 1, 2, 64)
    lens, table = torch.tensor([3, 70], dtype=torch.int32), torch.tensor([[4, 1, 7], [0, 2, 3]], dtype=torch.int32)
    fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table, causal=True)
    (append_kind, append), (fwd_kind, fwd) = recording.calls
    assert (append_kind, fwd_kind) == ("kv_append", "fwd")
    for launch in (append, fwd):
        assert launch["cache_seqlens"] == lens.data_ptr() and launch["block_table"] == table.data_ptr()
        assert (launch["cache_appended"], launch["cache_capacity"], launch["page_size"]) == (1, 384, 128)
        assert (launch["block_table_stride"], launch["cache_batch"]) == (3, 9)
    assert (append["k_new"], append["k_cache"], append["seqlen_new"], append["row_bytes"]) == \
        (k.data_ptr(), k_cache.data_ptr(), 1, 128)
    assert append["k_cache_stride"] == (128 * 2 * 64, 2 * 64, 64)
    assert (fwd["seqlen_k"], fwd["seqlen_q"], fwd["nheads"]) == (384, 4, 2)  # one query row: GQA-packed
    fa2.attention_with_kvcache(q, k_cache[:2], v_cache[:2], k, v, cache_seqlens=50)
    (_, append), (_, fwd) = recording.calls[2:]
    assert (append["cache_seqlens"], append["cache_seqlen"]) == (0, 50)
    assert (fwd["cache_seqlens"], fwd["seqlen_k"], fwd["block_table"]) == (0, 51, 0)


def test_reference_kvcache_appends_and_attends():
    """The specification against attention_ref on the same rows laid out contiguously: paged and not."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    full_k, full_v = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)
    lens = torch.tensor([5, 30])
    table = torch.tensor([[3, 0], [1, 2]])
    paged_k, paged_v = torch.zeros(4, 32, 2, 16), torch.zeros(4, 32, 2, 16)
    for b in range(2):
        for page in range(2):
            paged_k[table[b, page]] = full_k[b, 32 * page:32 * page + 32]
            paged_v[table[b, page]] = full_v[b, 32 * page:32 * page + 32]
    dense = reference.attention_with_kvcache_ref(q, full_k, full_v, k, v, cache_seqlens=lens, causal=True)
    paged = reference.attention_with_kvcache_ref(q, paged_k, paged_v, k, v, cache_seqlens=lens, block_table=table,
                                                 causal=True)
    for b, n in enumerate(lens.tolist()):
        keys = torch.cat([full_k[b, :n], k[b]])[None]
        values = torch.cat([full_v[b, :n], v[b]])[None]
        out, lse = reference.attention_ref(q[b:b + 1], keys, values, causal=True)
        for result in (dense, paged):
            torch.testing.assert_close(result[0][b:b + 1], out)
            torch.testing.assert_close(result[1][b:b + 1], lse)
        torch.testing.assert_close(reference.kvcache_rows(paged[2], b, n + 2, block_table=table), keys[0])
    assert torch.equal(dense[2][0, :5], full_k[0, :5]) and torch.equal(dense[2][0, 5:7], k[0])


def test_kvcache_rotary_and_leftpad_launches(recording):
    """One append launch rotates q into a buffer of its own, which the forward then reads, and the new keys on their
    way into the cache; its grid covers q's rows where they outnumber the new ones; q's rows advance in position
    only for causal or windowed calls (flash-attn's rule); cache_leftpad reaches both launches."""
    q, k_cache, v_cache = _cpu(2, 3, 8, 64), _cpu(2, 256, 2, 64), _cpu(2, 256, 2, 64)
    k, v = _cpu(2, 1, 2, 64), _cpu(2, 1, 2, 64)
    cos, sin = _cpu(300, 16), _cpu(300, 16)
    lens, pads = torch.tensor([3, 70], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    for causal, window, per_row in ((True, (-1, -1), True), (False, (-1, -1), False), (False, (255, 3), True),
                                    (False, (256, 256), False)):
        fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin,
                                   rotary_interleaved=True, cache_leftpad=pads, causal=causal, window_size=window)
        (append_kind, append), (_, fwd) = recording.calls
        recording.calls.clear()
        assert append_kind == "kv_append"
        assert (append["rotary_dim"], append["seqlen_ro"], append["rotary_interleaved"]) == (32, 300, True)
        assert (append["rotary_cos"], append["rotary_sin"], append["rotary_bf16"]) == (cos.data_ptr(),
                                                                                       sin.data_ptr(), True)
        assert append["rotary_q_per_row"] == per_row, (causal, window)
        assert (append["q"], append["seqlen_q"], append["nheads"], append["seqlen_new"]) == (q.data_ptr(), 3, 8, 3)
        assert append["q_rotated"] not in (0, q.data_ptr()) and fwd["q"] == append["q_rotated"]
        assert append["cache_leftpad"] == fwd["cache_leftpad"] == pads.data_ptr()
    fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)  # no rotary: q as it is
    (_, append), (_, fwd) = recording.calls
    assert (append["rotary_dim"], append["q_rotated"], append["seqlen_new"], fwd["q"]) == (0, 0, 1, q.data_ptr())
    assert fwd["cache_leftpad"] == 0


def test_kvcache_pads_a_head_dim_not_a_multiple_of_8(recording):
    """head_dim 60 runs at 64: zero-padded copies of q and the caches reach the kernels, with the true head dim's
    scale; out comes back at 60, and the caches (the append's target) are copied back into the caller's."""
    q, k_cache, v_cache = _cpu(2, 1, 4, 60), _cpu(2, 256, 2, 60), _cpu(2, 256, 2, 60)
    k, v = _cpu(2, 1, 2, 60), _cpu(2, 1, 2, 60)
    before = k_cache.clone()
    out = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    (_, append), (_, fwd) = recording.calls
    assert out.shape == q.shape
    assert append["row_bytes"] == 64 * 2 and append["k_cache"] != k_cache.data_ptr()
    assert fwd["head_dim"] == 64 and fwd["softmax_scale"] == pytest.approx(60 ** -0.5)
    assert torch.equal(k_cache, before)  # recorded, not launched: the padded copy came back unchanged


def test_kvcache_paged_at_a_head_dim_without_a_paged_kernel(recording):
    """A paged cache at a head dim whose own kernel reads no pages runs on the next compiled one that does, or says
    that the build has none."""
    q, k_cache, v_cache = _cpu(1, 1, 2, 32), _cpu(4, 64, 2, 32), _cpu(4, 64, 2, 32)
    table = torch.tensor([[0, 2]], dtype=torch.int32)
    kernel = min((x for x in fa2.build_info()["fwd_head_dims"] if x >= 32 and x in PAGED_HEAD_DIMS), default=None)
    if kernel is None:
        with pytest.raises(ValueError, match="this build has none"):
            fa2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, block_table=table)
        return
    fa2.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, block_table=table)
    (_, fwd), = recording.calls
    assert fwd["plan"]["head_dim"] == kernel and fwd["head_dim"] == 32 and fwd["plan"]["paged"]


def test_packed_from_pages_gathers_each_sequences_rows():
    """Paged prefill's gather: sequence b's first len_b rows of its pages at rows [cu_seqlens_k[b], ...), as many
    rows as cu_seqlens_k[-1] says (the varlen call's check); gradients reach exactly the rows read; max_seqlen_k past
    the pages' rows is refused."""
    cache = torch.randn(5, 4, 2, 8, requires_grad=True)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    cu = torch.tensor([0, 6, 9], dtype=torch.int32)
    packed = fa2.kvcache.packed_from_pages(cache, table, cu, 6)
    assert packed.shape == (9, 2, 8)
    read = torch.zeros(5, 4, dtype=torch.bool)
    for b, (start, end) in enumerate(((0, 6), (6, 9))):
        rows = torch.arange(end - start)
        assert torch.equal(packed[start:end], cache[table[b].long()[rows // 4], rows % 4])
        read[table[b].long()[rows // 4], rows % 4] = True
    packed.sum().backward()
    assert torch.equal(cache.grad, read[:, :, None, None].float().expand_as(cache))
    with pytest.raises(ValueError, match=r"max_seqlen_k must be an int in \[0, 8\]"):
        fa2.kvcache.packed_from_pages(cache, table, cu, 9)
    with pytest.raises(TypeError, match="block_table must be an int32"):
        fa2.kvcache.packed_from_pages(cache, table.long(), cu, 6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_rotary_is_a_turn_of_each_pair(interleaved):
    """apply_rotary against the rotation written out as complex multiplication: pairs (j, j + rotary_dim / 2), or
    (2j, 2j + 1) interleaved, times exp(i angle) at each row's position; the rest untouched."""
    torch.manual_seed(1)
    x, angle = torch.randn(5, 3, 20, dtype=torch.float64), torch.rand(40, 6, dtype=torch.float64) * 6.3
    positions = torch.tensor([0, 7, 7, 39, 12])
    out = reference.apply_rotary(x, angle.cos(), angle.sin(), positions, interleaved=interleaved)
    turn = torch.polar(torch.ones_like(angle), angle)[positions][:, None, :]
    pairs = (x[..., 0:12:2], x[..., 1:12:2]) if interleaved else (x[..., :6], x[..., 6:12])
    turned = torch.complex(*pairs) * turn
    got = (out[..., 0:12:2], out[..., 1:12:2]) if interleaved else (out[..., :6], out[..., 6:12])
    torch.testing.assert_close(torch.complex(*got), turned)
    assert torch.equal(out[..., 12:], x[..., 12:])


def test_reference_kvcache_rotary_and_leftpad():
    """The specification's rotary and leftpad against attention_ref on rows laid out by hand: keys rotated at their
    cache rows, q at cache_seqlens (+ i when causal), the keys from the pad's end on."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    k_cache, v_cache = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    angle = torch.rand(32, 4) * 6.3
    cos, sin = angle.cos(), angle.sin()
    lens, pads = torch.tensor([5, 20]), torch.tensor([2, 0])
    for causal in (False, True):
        out, lse, k_new, _ = reference.attention_with_kvcache_ref(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, cache_leftpad=pads,
            causal=causal)
        for b, (n, pad) in enumerate(zip(lens.tolist(), pads.tolist())):
            rotated = reference.apply_rotary(k[b], cos, sin, torch.arange(n, n + 2))
            torch.testing.assert_close(k_new[b, n:n + 2], rotated)
            positions = n + (torch.arange(3) if causal else torch.zeros(3, dtype=torch.long))
            queries = reference.apply_rotary(q[b], cos, sin, positions)[None]
            keys = torch.cat([k_cache[b, pad:n], rotated])[None]
            values = torch.cat([v_cache[b, pad:n], v[b]])[None]
            expected, expected_lse = reference.attention_ref(queries, keys, values, causal=causal)
            torch.testing.assert_close(out[b:b + 1], expected)
            torch.testing.assert_close(lse[b:b + 1], expected_lse)


def test_flash_attn_with_kvcache_passes_rotary_and_leftpad(recording):
    """flash-attn's positional order (rotary_cos, rotary_sin after k, v; cache_leftpad after cache_batch_idx) and its
    default rotary_interleaved=True reach the append."""
    q, k_cache, v_cache = _cpu(2, 1, 4, 64), _cpu(2, 128, 2, 64), _cpu(2, 128, 2, 64)
    k, v = _cpu(2, 1, 2, 64), _cpu(2, 1, 2, 64)
    cos, sin = _cpu(128, 8), _cpu(128, 8)
    lens, pads = torch.tensor([3, 9], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lens, None, pads)
    (_, append), (_, fwd) = recording.calls
    assert (append["rotary_cos"], append["rotary_sin"], append["rotary_dim"]) == (cos.data_ptr(), sin.data_ptr(), 16)
    assert append["rotary_interleaved"] and fwd["cache_leftpad"] == pads.data_ptr()

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
from test_features import alibi_slopes, check_forward

gpu = pytest.mark.gpu

# (batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim, capacity, causal, window_size, softcap, sink, alibi)
CASES = [
    (3, 1, 1, 8, 2, 128, 1000, True, (-1, -1), 0.0, False, None),     # GQA decode step: packed, split
    (2, 1, 0, 4, 4, 64, 512, False, (-1, -1), 0.0, False, None),      # attend only, nothing appended
    (2, 6, 6, 8, 1, 96, 640, True, (-1, -1), 0.0, False, None),       # a chunk of prompt appended, MQA, causal
    (2, 1, 2, 8, 2, 256, 768, True, (-1, -1), 0.0, False, None),      # d256: the narrow tile (its kAll instance)
    (2, 1, 1, 8, 2, 128, 2048, True, (300, 0), 30.0, True, None),     # windowed softcapped decode with a sink
    (1, 70, 70, 4, 2, 64, 320, True, (-1, -1), 0.0, False, "bh"),     # past the decode tile: the main tile
]
CASE_IDS = ["b{}_q{}_new{}_h{}kv{}_d{}_cap{}_c{:d}_w{}_{}_cap{}_sink{:d}_alibi{}".format(*c[:8], *c[8], *c[9:])
            for c in CASES]
LAYOUTS = ["entries", "batch_idx", "paged64", "paged256"]
PAGED_HEAD_DIMS = (64, 128, 224, 256)  # the head dims with a 64-row forward tile (config.h: fwd_reads_pages)


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
    kernel_dim = min(x for x in fa2.build_info()["fwd_head_dims"] if x >= d)  # the kernel this head dim runs on
    if layout.startswith("paged") and kernel_dim not in PAGED_HEAD_DIMS:
        with pytest.raises(ValueError, match="a paged KV cache .* needs head_dim 64, 128, 224 or 256"):
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
    ("head dim", "allocate the caches with a head_dim zero-padded to 72"),
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
    elif case == "head dim":
        q, k_cache, v_cache = _cpu(2, 1, 4, 68), _cpu(2, 256, 2, 68), _cpu(2, 256, 2, 68)
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


def test_flash_attn_with_kvcache_rejects_what_it_lacks(recording):
    q, k_cache = _cpu(1, 1, 2, 64), _cpu(1, 64, 2, 64)
    for name in ("rotary_cos", "rotary_sin", "cache_leftpad"):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_with_kvcache(q, k_cache, k_cache, **{name: torch.zeros(1)})
    assert recording.calls == []


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

"""A few odd shapes through every kernel (padded and packed batches), small enough for compute-sanitizer:

    compute-sanitizer --tool memcheck python bench/sanitize.py
    compute-sanitizer --tool racecheck python bench/sanitize.py --quick

--quick: bf16 only and one packed batch, but every head dim of CASES (each has its own shared-memory schedule:
d256's backward double-buffers Q/dO on the H100, d96's adds dQ between dV and dK; d256's forward has two tiles).
Both modes then run every head dim again with a block limited to 99 KB (csrc/CONTRACT.md: set_test_overrides), the
configurations of consumer GPUs (csrc/sm80/config.h), padded and packed: d256's keeps P and dS in the bytes of V.
The last two cases are split (split-KV, fwd_combine.h). Last, the cases again with a sliding window (blocks skipped
on both sides, rows that see no key), softcap, ALiBi, dropout and sinks; --features runs only those, then once more
on 99 KB configurations. First, KV-cache calls (fa2.attention_with_kvcache), paged and not, with index values out of
range (--kvcache stops after them). Before them, the Hopper forward (csrc/sm90/), padded and packed, where the build
and GPU have it; --hopper runs only that.
"""
import sys

import torch

import fa2
import fa2._C

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal)
    (1, 77, 133, 4, 2, 40, True),
    (2, 130, 61, 2, 1, 64, True),
    (1, 1, 257, 2, 2, 128, False),
    (1, 200, 200, 2, 2, 256, True),
    (1, 1030, 100, 2, 2, 256, False),  # d256's forward takes its 128-row tile past 1024 (64-row below)
    (1, 65, 129, 2, 2, 96, False),
    (2, 1, 1500, 8, 2, 128, False),  # a GQA decode: packed and split (fwd_combine.h)
    (1, 3, 900, 4, 4, 64, True),     # a few rows against a cache: split
]
VARLEN = [  # (lengths_q, lengths_k, nheads, nheads_k, head_dim, causal): empty, single-token, cross lengths
    ([0, 1, 77, 130, 5], [3, 0, 64, 129, 5], 4, 2, 64, True),
    ([200, 1, 0, 63], [100, 257, 9, 63], 2, 2, 128, False),
]
quick = "--quick" in sys.argv
features_only = "--features" in sys.argv
built = fa2.build_info()["bwd_head_dims"]


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


SMALL_SMEM_CASES = [(1, 130, 75, 2, 1, d, d % 64 == 0) for d in (32, 64, 96, 128, 160, 192, 224, 256)]
SMALL_SMEM_VARLEN = [([0, 70, 1], [9, 64, 0], 2, 1, d, True) for d in (64, 96, 128, 192, 224, 256)]


def run_cases(cases, varlen_cases, dtypes, window=None):
    """window: then also softcap, ALiBi and dropout in both directions, and a sink in the forward (causal cases keep
    right 0). Returns how many cases ran (head dims the build lacks are skipped)."""
    ran = 0
    def options(h, causal):
        if window is None:
            return {}, {}
        both = dict(window_size=(window[0], 0 if causal else window[1]), softcap=20.0,
                    alibi_slopes=torch.full((h,), 0.25, device="cuda"), dropout_p=0.3,
                    rng_state=torch.tensor([12345, 6], device="cuda"))
        return both, dict(sink=torch.randn(h, device="cuda"))
    for lq, lk, h, hk, d, causal in varlen_cases:
        if not any(x >= d for x in built):
            continue
        q = torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sizes = (cu(lq), cu(lk), max(lq), max(lk))
        both, fwd_only = options(h, causal)
        out, lse = fa2.fwd_varlen(q, k, v, *sizes, causal=causal, **both, **fwd_only)
        for det in (False, True):
            grads = fa2.bwd_varlen(torch.randn_like(out), q, k, v, out, lse, *sizes, causal=causal, deterministic=det,
                                   **both)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        ran += 1
    for b, sq, sk, h, hk, d, causal in cases:
        if not any(x >= d for x in built):
            print(f"skipping head_dim {d}: not in this build ({built})")
            continue
        for dtype in dtypes:
            q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
            both, fwd_only = options(h, causal)
            out, lse = fa2.fwd(q, k, v, causal=causal, **both, **fwd_only)
            dout = torch.randn_like(out)
            for det in (False, True):
                grads = fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=det, **both)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
            ran += 1
    return ran


def run_kvcache():
    """fa2.attention_with_kvcache: appends (plain and rotary) and decodes against entries picked by cache_batch_idx
    and against pages (every head dim with pages, so both 64-row tiles), then index values out of range, which the
    kernels must clamp to the tensors (sanitizer: no access outside them)."""
    for d in (64, 128, 160, 224, 256):
        if d not in fa2.build_info()["fwd_head_dims"]:
            continue
        for paged in (False, True):
            k_cache, v_cache = (torch.randn(6, 256, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            q, k, v = (torch.randn(2, s, n, d, device="cuda", dtype=torch.bfloat16) for s, n in ((3, 4), (3, 2), (3, 2)))
            where = (dict(block_table=torch.tensor([[4, 1, 0], [2, 5, 3]], device="cuda", dtype=torch.int32))
                     if paged else dict(cache_batch_idx=torch.tensor([3, 0], device="cuda", dtype=torch.int32)))
            # A rotary table of the capacity's rows (positions past it clamp to its last), interleaved where paged.
            rows = k_cache.shape[1] * (where["block_table"].shape[1] if paged else 1)
            cos, sin = (torch.randn(rows, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for held in ([0, 250], [700, -9], [2 ** 31 - 3, 5]):  # in range, then past the capacity and negative
                lens = torch.tensor(held, device="cuda", dtype=torch.int32)
                fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, **where)
                fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, rotary_cos=cos,
                                           rotary_sin=sin, rotary_interleaved=paged, **where)
            bad = torch.tensor([[-4, 99, 1], [2, 10 ** 6, 3]] if paged else [-1, 9], device="cuda", dtype=torch.int32)
            where = {name: bad for name in where}
            out = fa2.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, num_splits=3, **where)
            torch.cuda.synchronize()
            assert out.shape == q.shape


# The Hopper forward (csrc/sm90/: TMA, mbarrier pipelines, wgmma) on every case it serves, each family forced in
# turn where the build has it, plain and then with a window, softcap and a sink: ragged tails in both sequence lengths, GQA, rows that see no key (causal, seqlen_q >
# seqlen_k), q, k, v as strided views of one packed tensor, and more tiles than SMs (a persistent CTA's second tile
# reuses the shared memory of its first; with empty tiles between).
HOPPER_CASES = [(1, 77, 133, 4, 2, 64, True), (2, 130, 61, 2, 1, 64, True), (1, 200, 200, 2, 2, 256, True),
                (1, 1030, 100, 2, 2, 256, False), (1, 129, 257, 8, 1, 128, False), (2, 300, 80, 2, 2, 128, True),
                (2, 1030, 300, 8, 2, 64, True), (1, 2100, 2100, 8, 8, 128, False), (2, 333, 161, 4, 1, 256, True),
                (2, 161, 200, 4, 2, 128, False),  # d128's 80-row backward tile: a last block of one row
                (3, 300, 700, 16, 4, 64, True)]  # 288 backward tiles: persistent CTAs take several each
# Packed batches on the Hopper forward and backward (more than 64 rows in the longest, so that the forward serves
# them): tiles past a sequence's end, sequences shorter than a tile, empty ones, each TMA store and dQ reduce-add cut
# at its sequence's end, dK/dV at each sequence's rows.
HOPPER_VARLEN = [([0, 1, 77, 300, 5], [3, 0, 64, 129, 500], 4, 2, 64, True),
                 ([200, 1, 0, 63, 130], [100, 257, 9, 63, 1], 2, 2, 128, False),
                 ([129, 3, 260], [70, 300, 260], 2, 1, 256, True),
                 ([70, 300, 0, 129], [70, 300, 5, 129], 4, 2, 128, True),
                 ([513, 2, 140], [1, 600, 140], 4, 1, 64, False)]


def run_hopper():
    """The Hopper family's cases; prints what ran, so that a sanitizer's clean summary over nothing cannot pass for
    one over these kernels."""
    if "sm90" not in fa2.build_info()["families"] or torch.cuda.get_device_capability() != (9, 0):
        print("sanitize.py: no Hopper cases (the build or the GPU has no sm_90a family)")
        return 0
    fa2._C.set_test_overrides(family="sm90")  # test-only (csrc/CONTRACT.md)
    ran = run_cases(HOPPER_CASES, HOPPER_VARLEN, (torch.bfloat16,))
    # GQA/MQA's backward tiles walking a K/V group's query heads (host/plan.cpp: walk_heads; these grids are too
    # small for the plan to pick it): the whole group (gcd with 64), then walks of 2 (float32 slices summed after).
    for walk in (64, 2):
        fa2._C.set_test_overrides(family="sm90", walk_heads=walk)
        ran += run_cases([c for c in HOPPER_CASES if c[3] != c[4]], [c for c in HOPPER_VARLEN if c[2] != c[3]],
                         (torch.bfloat16,))
    fa2._C.set_test_overrides(family="sm90")
    qkv = torch.randn(2, 257, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    out, _ = fa2.fwd(*qkv.unbind(2), causal=True)
    # The features it serves: a sliding window (blocks skipped on both sides, rows that see no key), softcap, a sink;
    # then dropout.
    for b, sq, sk, h, hk, d, causal in HOPPER_CASES:
        if d not in built:
            continue
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, _ = fa2.fwd(q, k, v, window_size=(100, 0 if causal else 30), softcap=20.0,
                         sink=torch.randn(h, device="cuda"))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        out, _ = fa2.fwd(q, k, v, causal=causal, dropout_p=0.3, rng_state=torch.tensor([5, 6], device="cuda"))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        ran += 1
    fa2._C.set_test_overrides()
    print(f"sanitize.py: {ran} Hopper cases ran (forward and backward, padded and packed, forced walks, features)")
    return ran


dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)
hopper_ran = run_hopper()
if "--hopper" in sys.argv:
    sys.exit(0 if hopper_ran else 2)
run_kvcache()
if "--kvcache" in sys.argv:
    sys.exit(0)
if not features_only:
    run_cases(CASES, VARLEN[:1] if quick else VARLEN, dtypes)
    fa2._C.set_test_overrides(smem_limit=99 * 1024)  # test-only (csrc/CONTRACT.md)
    run_cases(SMALL_SMEM_CASES, SMALL_SMEM_VARLEN, (torch.bfloat16,))
    fa2._C.set_test_overrides()
for window in ((40, 0), (30, 70)):
    run_cases(CASES, VARLEN, (torch.bfloat16,), window=window)
fa2._C.set_test_overrides(smem_limit=99 * 1024)  # 32-key tiles: dropout's other draw pattern (dropout.h)
run_cases(SMALL_SMEM_CASES, SMALL_SMEM_VARLEN, (torch.bfloat16,), window=(30, 70))
fa2._C.set_test_overrides()
print("sanitize cases done")

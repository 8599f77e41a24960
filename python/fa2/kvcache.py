"""Attention against a KV cache, for decoding: fa2.attention_with_kvcache. One call appends the step's new keys and
values to each sequence's cache (in place) and attends to everything the cache then holds; the cache may be one
entry per sequence, entries picked by cache_batch_idx, or pages named by block_table (a paged cache). Inference only:
no gradient flows through it. Nothing here reads tensor values on the host, so a decode step never waits for the
GPU and can be captured in a CUDA graph."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from fa2 import ops


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                           v: Optional[Tensor] = None, *, cache_seqlens: Union[int, Tensor, None] = None,
                           cache_batch_idx: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                           causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
                           softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, sink: Optional[Tensor] = None,
                           num_splits: int = 0, return_lse: bool = False, rotary_cos: Optional[Tensor] = None,
                           rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = False,
                           cache_leftpad: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of q (batch, seqlen_q, nheads, head_dim) to each sequence's KV cache.

    k_cache, v_cache: (batch_cache, capacity, nheads_k, head_dim), sequence b's rows in entry b (or
    cache_batch_idx[b], int32 (batch,)); or with block_table (int32 (batch, max_pages)), a paged cache
    (num_pages, page_size, nheads_k, head_dim) whose row r of sequence b is row r % page_size of page
    block_table[b, r // page_size]; page_size a multiple of 64.
    cache_seqlens: the rows each sequence's cache holds, an int or an int32 (batch,) tensor on q's device; None: all
    of them. k, v (batch, seqlen_new, nheads_k, head_dim), if given, are written to rows cache_seqlens[b] onwards
    (rows past the capacity are not written), and the queries then see cache_seqlens[b] + seqlen_new rows.
    causal is bottom-right aligned to those rows (query i sees rows up to i + seen - seqlen_q). window_size, softcap,
    alibi_slopes and sink as in fa2.attention. num_splits: split-KV's split count (0: chosen per call).
    Returns out, shaped like q, and with return_lse the float32 (batch, nheads, seqlen_q) lse.

    rotary_cos, rotary_sin ((seqlen_ro, rotary_dim / 2) in q's dtype, seqlen_ro >= the capacity, 2 <= rotary_dim <=
    head_dim, rotary_dim even; with k and v): a rotary embedding applied as the new keys are appended, as flash-attn's
    flash_attn_with_kvcache does. The first rotary_dim elements of each head of k's row s turn at position
    cache_seqlens[b] + s (its cache row), and q's row i at cache_seqlens[b] + i if causal or a window bound is in
    [0, capacity), else every row of q at cache_seqlens[b] (fa2.reference.rotary_q_per_row). Pairs are (j, j + rotary_dim / 2) (GPT-NeoX), or with rotary_interleaved
    (2j, 2j + 1) (GPT-J); fa2.reference.apply_rotary is the formula. One launch rotates q and the new keys and appends
    them, in fp32 with one rounding; the cache holds the rotated keys.
    cache_leftpad (int32 (batch,), unpaged caches): sequence b's cache starts at row cache_leftpad[b]; its keys are
    rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new), cache_seqlens counting the pad, and causal masks, windows
    and ALiBi count from the pad's end (rotary positions stay the cache rows).

    Any head_dim up to 256 works. One that is not a multiple of 8 is zero-padded to the next one, as flash-attn does:
    q and both caches are copied padded on every call, and with k and v the caches are copied back after the append,
    so such a call costs a few passes over the whole cache (allocate the caches with a padded head_dim, and pad q, k
    and v alike with softmax_scale for the true head_dim, to avoid it).

    Index values are not checked against the cache (that would make every step wait for the GPU): the kernels
    clamp them to its bounds, so a wrong value gives wrong numbers, never an access outside the tensors."""
    ops.check_tensors(q=q, k_cache=k_cache, v_cache=v_cache,
                      **{name: t for name, t in (("k", k), ("v", v)) if t is not None})
    if isinstance(cache_seqlens, Tensor) or cache_seqlens is None:
        seqlens, held = cache_seqlens, -1
    elif isinstance(cache_seqlens, bool) or not hasattr(cache_seqlens, "__index__") or cache_seqlens < 0:
        raise TypeError(f"cache_seqlens must be an int >= 0, an int32 (batch,) tensor or None, got {cache_seqlens!r}")
    else:
        seqlens, held = None, int(cache_seqlens)
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if torch.is_autocast_enabled("cuda"):  # q, k, v in the cache's dtype, as autocast would make them
        q, k, v = (t.to(k_cache.dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in (q, k, v))
    left, right = ops.window(window_size)
    head_dim = ops.unaligned_head_dim(*(t for t in (q, k_cache, v_cache, k, v) if t is not None))
    caches = k_cache, v_cache
    if head_dim:
        if rotary_cos is not None and rotary_cos.dim() == 2 and 2 * rotary_cos.shape[1] > head_dim:
            raise ValueError(f"rotary_cos must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= head_dim "
                             f"({head_dim}), got shape {tuple(rotary_cos.shape)}")
        softmax_scale = ops.true_scale(softmax_scale, head_dim)
        q, k_cache, v_cache = ops.pad_head_dim(q, k_cache, v_cache)
        if k is not None:
            k, v = ops.pad_head_dim(k, v)
    args = (q, k_cache, v_cache, k, v, seqlens, held, cache_batch_idx, block_table, softmax_scale, bool(causal), left,
            right, float(softcap), ops.slopes(alibi_slopes), ops.sink_logits(sink), int(num_splits), rotary_cos,
            rotary_sin, bool(rotary_interleaved), cache_leftpad)
    out, lse = (ops.call if ops.runs_eagerly(q) else ops.call_traced)(ops.FWD_KVCACHE, *args)
    if head_dim:
        out = out[..., :head_dim]
        if k is not None:  # the append went to the padded copies: back into the caller's caches
            caches[0].copy_(k_cache[..., :head_dim]), caches[1].copy_(v_cache[..., :head_dim])
    return (out, lse) if return_lse else out


def packed_from_pages(cache: Tensor, block_table: Tensor, cu_seqlens_k: Tensor, max_seqlen_k: int) -> Tensor:
    """The keys (or values) of packed sequences held in a paged cache, as the packed tensor fa2.attention_varlen
    reads: row r < cu_seqlens_k[b + 1] - cu_seqlens_k[b] of sequence b is row r % page_size of page
    block_table[b, r // page_size] of cache (num_pages, page_size, nheads_k, head_dim), and lands at row
    cu_seqlens_k[b] + r of the result, (cu_seqlens_k[-1], nheads_k, head_dim). Paged prefill (flash-attn's block_table
    in flash_attn_varlen_func) runs this gather and then the packed kernels: it copies each sequence's rows once (one
    gather), reads cu_seqlens_k[-1] on the host (a wait), and autograd carries gradients into
    the cache rows read. While a CUDA graph is
    captured or torch.compile traces, nothing is read back: the result then has batch * max_seqlen_k rows, those
    past cu_seqlens_k[-1] zero and unread. Page ids are clamped to the cache."""
    ops.check_tensors(cache=cache, block_table=block_table, cu_seqlens_k=cu_seqlens_k)
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be an int32 (batch, max_pages) tensor, got {ops.describe(block_table)}")
    if cache.dim() != 4:
        raise ValueError(f"with block_table, k and v must be paged caches (num_pages, page_size, nheads_k, head_dim), "
                         f"got shape {tuple(cache.shape)}")
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() != block_table.shape[0] + 1:
        raise ValueError(f"cu_seqlens_k must be (batch + 1,) with block_table's batch {block_table.shape[0]}, got "
                         f"{ops.describe(cu_seqlens_k)}")
    page_size, capacity = cache.shape[1], block_table.shape[1] * cache.shape[1]
    if isinstance(max_seqlen_k, bool) or not hasattr(max_seqlen_k, "__index__") or not 0 <= max_seqlen_k <= capacity:
        raise ValueError(f"max_seqlen_k must be an int in [0, {capacity}] (block_table's pages hold {capacity} rows "
                         f"a sequence), got {max_seqlen_k!r}")
    batch, max_pages = block_table.shape
    traced = torch.compiler.is_compiling() or (cache.is_cuda and torch.cuda.is_current_stream_capturing())
    total = batch * max_seqlen_k if traced else int(cu_seqlens_k[-1])
    # Each packed row t reads its own source: sequence b (the last whose start is <= t), row r = t - start of it.
    rows = torch.arange(total, device=cache.device)
    starts = cu_seqlens_k.long()
    seq = torch.searchsorted(starts[1:], rows, right=True).clamp(max=batch - 1)
    r = rows - starts[seq]
    pages = block_table.long()[seq, (r // page_size).clamp(0, max_pages - 1)].clamp(0, cache.shape[0] - 1)
    packed = cache[pages, r % page_size]
    if traced:  # rows past cu_seqlens_k[-1]: no value, no gradient
        packed = packed.masked_fill((rows >= starts[-1])[:, None, None], 0)
    return packed

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
                           num_splits: int = 0, return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
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
    if q.shape[-1] % 8 != 0:
        raise ValueError(f"head_dim {q.shape[-1]} is not a multiple of 8: allocate the caches with a head_dim zero-padded "
                         f"to {q.shape[-1] + (-q.shape[-1] % 8)} (and pad q, k and v alike, passing softmax_scale for "
                         "the true head_dim); padding them on every call would copy the whole cache")
    if torch.is_autocast_enabled("cuda"):  # q, k, v in the cache's dtype, as autocast would make them
        q, k, v = (t.to(k_cache.dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in (q, k, v))
    left, right = ops.window(window_size)
    args = (q, k_cache, v_cache, k, v, seqlens, held, cache_batch_idx, block_table, softmax_scale, bool(causal), left,
            right, float(softcap), ops.slopes(alibi_slopes), ops.sink_logits(sink), int(num_splits))
    out, lse = (ops.call if ops.runs_eagerly(q) else ops.call_traced)(ops.FWD_KVCACHE, *args)
    return (out, lse) if return_lse else out

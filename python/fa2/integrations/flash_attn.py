"""flash-attn 2.x's `flash_attn_func`, `flash_attn_varlen_func` and `flash_attn_with_kvcache` on fa2, for code written
against flash-attn:

    from fa2 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache   # was: from flash_attn import

Argument names, order, defaults and return values are those of flash-attn 2.8's flash_attn/flash_attn_interface.py.
Options fa2 does not implement raise NotImplementedError naming the option, before any other check.

return_attn_probs=True returns (out, softmax_lse, S_dmask), as flash-attn does, for tests: S_dmask holds the attention
probabilities (after softcap, ALiBi and masking, before dropout; flash-attn's docs allow them "with different
scaling", and fa2's are normalised) with the dropped ones negated, or is None without dropout. They are computed by
fa2.reference from q, k and the call's dropout state, not read out of the kernel: the GPU tests show the kernels
draw exactly fa2.reference's mask. The call syncs with the device (it reads the state) and holds seqlen_q x seqlen_k
fp32 per head."""
from __future__ import annotations

import torch

from fa2 import reference
from fa2.kvcache import attention_with_kvcache
from fa2.ops import (FWD, FWD_VARLEN, attend_with_lse, attention, attention_varlen, check_max_seqlens, check_tensors,
                     dropout_state, slopes, window)

# Each option fa2 lacks: (name, its "off" test, what it would have done).
_UNSUPPORTED = (
    ("block_table", lambda x: x is None, "a paged KV cache outside flash_attn_with_kvcache"),
    ("rotary_cos", lambda x: x is None, "rotary embedding inside the attention call (apply it to q and k first)"),
    ("rotary_sin", lambda x: x is None, "rotary embedding inside the attention call (apply it to q and k first)"),
    ("cache_leftpad", lambda x: x is None, "left-padded KV caches"),
)


def _reject_unsupported(**options) -> None:
    for name, off, what in _UNSUPPORTED:
        if name in options and not off(options[name]):
            raise NotImplementedError(f"fa2 does not implement {what}: {name}={options[name]!r} is not supported "
                                      f"(leave {name} at its default, or use the flash-attn package)")


def _window(window_size, causal):
    """flash-attn lets causal win over a right bound (its mha_fwd sets window_size_right = 0), where fa2.attention
    refuses the contradiction; code written for flash-attn (transformers passes (w, w) with causal) keeps working."""
    left, right = window(window_size)  # a malformed window gets fa2.attention's message
    return (left, 0) if causal else (left, right)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """fa2.attention under flash-attn's signature. q: (batch, seqlen_q, nheads, head_dim); k, v: (batch,
    seqlen_k, nheads_k, head_dim). causal is bottom-right aligned, as in flash-attn. Returns out; with
    return_attn_probs, (out, softmax_lse (batch, nheads, seqlen_q) fp32, S_dmask (batch, nheads, seqlen_q, seqlen_k)
    or None), as the module docstring says."""
    window_size = _window(window_size, causal)
    if not return_attn_probs:
        return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    check_tensors(q=q, k=k, v=v)
    state = dropout_state(dropout_p, q.device)
    out, lse = attend_with_lse(FWD, q, k, v, softmax_scale, bool(causal), bool(deterministic), *window_size,
                               float(softcap), slopes(alibi_slopes), float(dropout_p), state, None)
    if state is None:
        return out, lse, None
    sequences = [(q[b:b + 1], k[b:b + 1], _slopes_of(alibi_slopes, b)) for b in range(q.shape[0])]
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    return out, lse, _dropped_probs(sequences, options, dropout_p, state, q.shape[1], k.shape[1])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """fa2.attention_varlen under flash-attn's signature. q: (total_q, nheads, head_dim); k, v: (total_k,
    nheads_k, head_dim); cu_seqlens_*: int32 (batch + 1,). Returns out, (total_q, nheads, head_dim); with
    return_attn_probs, (out, softmax_lse (nheads, total_q) fp32, S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k)
    or None; sequence b fills its top-left corner of slice b, the rest is 0)."""
    _reject_unsupported(block_table=block_table)
    window_size = _window(window_size, causal)
    if not return_attn_probs:
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, deterministic=deterministic, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check_max_seqlens(max_seqlen_q, max_seqlen_k)
    state = dropout_state(dropout_p, q.device)
    out, lse = attend_with_lse(FWD_VARLEN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, bool(causal), bool(deterministic), *window_size, float(softcap),
                               slopes(alibi_slopes), float(dropout_p), state, None)
    if state is None:
        return out, lse, None
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    sequences = [(q[None, bq[b]:bq[b + 1]], k[None, bk[b]:bk[b + 1]], _slopes_of(alibi_slopes, b))
                 for b in range(len(bq) - 1)]
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    return out, lse, _dropped_probs(sequences, options, dropout_p, state, max_seqlen_q, max_seqlen_k)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """fa2.attention_with_kvcache under flash-attn's signature: k and v, if given, are appended to the caches in
    place at cache_seqlens, then q attends to each sequence's cache. Returns out, or (out, softmax_lse) with
    return_softmax_lse. Rotary embedding (rotary_cos/rotary_sin) and cache_leftpad raise NotImplementedError;
    paged caches take page sizes that are multiples of 64 (flash-attn's 256 among them)."""
    _reject_unsupported(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_leftpad=cache_leftpad)
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  cache_batch_idx=cache_batch_idx, block_table=block_table, causal=causal,
                                  softmax_scale=softmax_scale, window_size=_window(window_size, causal),
                                  softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
                                  return_lse=return_softmax_lse)


def _slopes_of(alibi_slopes, b):
    """Sequence b's ALiBi slopes, (nheads,), from (nheads,) or (batch, nheads) ones (or None)."""
    return alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


def _dropped_probs(sequences, options, dropout_p, state, seqlen_q, seqlen_k):
    """S_dmask: for each sequence (q (1, seqlen_q, nheads, d), k, its slopes), fa2.reference's probabilities with
    the ones dropout drops negated, in q's dtype, (len(sequences), nheads, seqlen_q, seqlen_k). The sign bit carries
    the mask: a dropped probability of 0 is -0.0 (read it with torch.signbit; `>= 0` takes it as kept, as for
    flash-attn's own S_dmask, harmlessly since it adds nothing)."""
    q0 = sequences[0][0]
    nheads = q0.shape[2]
    keep = reference.dropout_keep_mask(state.tolist(), len(sequences), nheads, seqlen_q, seqlen_k, dropout_p,
                                       device=q0.device)
    probs = torch.zeros(len(sequences), nheads, seqlen_q, seqlen_k, dtype=q0.dtype, device=q0.device)
    with torch.no_grad():
        for b, (q, k, alibi) in enumerate(sequences):
            p, _ = reference.attention_probs(q, k, alibi_slopes=alibi, dtype=torch.float32, **options)
            kept = keep[b, :, :q.shape[1], :k.shape[1]]
            probs[b, :, :q.shape[1], :k.shape[1]] = torch.where(kept, p[0], -p[0]).to(q.dtype)
    return probs

"""flash-attn 2.x's `flash_attn_func` and `flash_attn_varlen_func` on fa2, for code written against flash-attn:

    from fa2 import flash_attn_func, flash_attn_varlen_func   # was: from flash_attn import ...

Argument names, order, defaults and the return value (the output tensor) are those of flash-attn 2.8's
flash_attn/flash_attn_interface.py. Options fa2 does not implement raise NotImplementedError naming the
option, before any other check."""
from __future__ import annotations

from fa2.ops import attention, attention_varlen, window

# Each option fa2 lacks: (name, its "off" test, what it would have done).
_UNSUPPORTED = (
    ("return_attn_probs", lambda x: not x, "returning the softmax lse and attention probabilities"),
    ("block_table", lambda x: x is None, "a paged KV cache"),
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
    seqlen_k, nheads_k, head_dim). causal is bottom-right aligned, as in flash-attn. Returns out."""
    _reject_unsupported(return_attn_probs=return_attn_probs)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                     window_size=_window(window_size, causal), softcap=softcap, alibi_slopes=alibi_slopes,
                     dropout_p=dropout_p)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """fa2.attention_varlen under flash-attn's signature. q: (total_q, nheads, head_dim); k, v: (total_k,
    nheads_k, head_dim); cu_seqlens_*: int32 (batch + 1,). Returns out, (total_q, nheads, head_dim)."""
    _reject_unsupported(return_attn_probs=return_attn_probs, block_table=block_table)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                            softmax_scale=softmax_scale, deterministic=deterministic,
                            window_size=_window(window_size, causal), softcap=softcap, alibi_slopes=alibi_slopes,
                            dropout_p=dropout_p)

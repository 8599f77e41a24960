"""flash-attn 2.x's drop-ins on fa2, for code written against flash-attn:

    from fa2 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache   # was: from flash_attn import
    from fa2 import flash_attn_qkvpacked_func, flash_attn_kvpacked_func                # and their varlen forms

Argument names, order, defaults and return values are those of flash-attn 2.8's flash_attn/flash_attn_interface.py.
Every option of flash-attn 2.8's functions is served, paged prefill and the KV-cache call's rotary embedding and
left padding included. window_size takes what flash-attn takes: ints or integer 0-d tensors (its tests pass
torch.randint values), any negative entry meaning unbounded. The packed functions slice qkv / kv into views and call
the unpacked ones; autograd carries the gradients back into the packed tensor.

return_attn_probs=True returns (out, softmax_lse, S_dmask), as flash-attn does, for tests. Without dropout S_dmask is
flash-attn's empty tensor (shape (0,)). With dropout it is laid out and encoded as flash-attn's kernel writes it and
its tests (tests/test_flash_attn.py: convert_flash_attn_S_to_softmax, normalize_flash_attn_S) decode it:
(batch, nheads, seqlen_q, seqlen_k), both rounded up to multiples of 128, in q's dtype, entry (i, j) of key block n
(columns [n * block_n, (n + 1) * block_n), block_n = _get_block_size_n(...)) holding exp(s_ij - m_i,n), where s is
the score after scaling, softcap, ALiBi and masking and m_i,n the running max of row i over key blocks n onwards (the
kernel walks the key blocks from the last); a dropped entry is negated; 0 outside the sequence and the band (varlen:
sequence b in the top-left corner of slice b). The decoder multiplies block n by exp(m_i,n - lse_i) and gets the
probabilities. fa2's kernels do not write it: it is computed by fa2.reference from q, k and the call's dropout state
(the GPU tests show the kernels draw exactly fa2.reference's mask). The call syncs with the device (it reads the
state) and holds seqlen_q x seqlen_k fp64 per head."""
from __future__ import annotations

import torch

from fa2 import reference
from fa2.kvcache import attention_with_kvcache, packed_from_pages
from fa2.ops import (FWD, FWD_VARLEN, attend_with_lse, attention, attention_varlen, check_cu_seqlens_values,
                     check_max_seqlens, check_tensors, describe, dropout_state, slopes)

def _window(window_size, causal):
    """flash-attn's window_size as fa2's (left, right) ints. As in flash-attn: an entry may be an integer 0-d tensor
    (its tests pass torch.randint(0, seqlen, (2,)), a 1-d tensor whose entries are 0-d tensors), any negative entry
    means unbounded (fa2's own API refuses one below -1), and causal wins over a right bound (its mha_fwd sets
    window_size_right = 0, where fa2.attention refuses the contradiction; transformers passes (w, w) with causal)."""
    if type(window_size) is tuple and window_size == (-1, -1):  # the default, on every call
        return (-1, 0) if causal else (-1, -1)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints or integer 0-d tensors, negative for "
                        f"unbounded, got {describe(window_size)}") from None
    left, right = _window_bound("window_size[0] (left)", left), _window_bound("window_size[1] (right)", right)
    return (left, 0) if causal else (left, right)


def _window_bound(name, w) -> int:
    if isinstance(w, torch.Tensor):
        if w.dim() != 0 or w.dtype == torch.bool or w.is_floating_point() or w.is_complex():
            raise TypeError(f"{name} must be an int or an integer 0-d tensor, got {describe(w)}")
        # int() reads the value on the host: free for the CPU tensors flash-attn's tests pass; a CUDA one waits for
        # the GPU here, which the drop-in accepts (fa2's own API takes ints only and never syncs).
        w = int(w)
    elif isinstance(w, bool) or not hasattr(w, "__index__"):
        raise TypeError(f"{name} must be an int or an integer 0-d tensor, got {describe(w)}")
    return max(int(w), -1)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """fa2.attention under flash-attn's signature. q: (batch, seqlen_q, nheads, head_dim); k, v: (batch,
    seqlen_k, nheads_k, head_dim). causal is bottom-right aligned, as in flash-attn. Returns out; with
    return_attn_probs, (out, softmax_lse (batch, nheads, seqlen_q) fp32, S_dmask), S_dmask as the module docstring
    says."""
    window_size = _window(window_size, causal)
    if not return_attn_probs:
        return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    check_tensors(q=q, k=k, v=v)
    state = dropout_state(dropout_p, q.device)
    out, lse = attend_with_lse(FWD, q, k, v, softmax_scale, bool(causal), bool(deterministic), *window_size,
                               float(softcap), slopes(alibi_slopes), float(dropout_p), state, None)
    if state is None:
        return out, lse, q.new_empty((0,))
    sequences = [(q[b:b + 1], k[b:b + 1], _slopes_of(alibi_slopes, b)) for b in range(q.shape[0])]
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    return out, lse, _s_dmask(sequences, options, dropout_p, state, q.shape[1], k.shape[1])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """fa2.attention_varlen under flash-attn's signature. q: (total_q, nheads, head_dim); k, v: (total_k,
    nheads_k, head_dim); cu_seqlens_*: int32 (batch + 1,). Returns out, (total_q, nheads, head_dim); with
    return_attn_probs, (out, softmax_lse (nheads, total_q) fp32, S_dmask), S_dmask as the module docstring says
    (sequence b in the top-left corner of slice b). With block_table (int32 (batch, max_pages)), k and v are paged
    caches (num_pages, page_size, nheads_k, head_dim), sequence b's keys in rows [0, cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]) of its pages (paged prefill; fa2.kvcache.packed_from_pages gathers them first)."""
    window_size = _window(window_size, causal)
    if block_table is not None:
        check_tensors(k=k, v=v, block_table=block_table, cu_seqlens_k=cu_seqlens_k)
        check_max_seqlens(max_seqlen_q, max_seqlen_k)
        k, v = (packed_from_pages(t, block_table, cu_seqlens_k, max_seqlen_k) for t in (k, v))
    if not return_attn_probs:
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, deterministic=deterministic, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check_max_seqlens(max_seqlen_q, max_seqlen_k)
    check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    state = dropout_state(dropout_p, q.device)
    out, lse = attend_with_lse(FWD_VARLEN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, bool(causal), bool(deterministic), *window_size, float(softcap),
                               slopes(alibi_slopes), float(dropout_p), state, None)
    if state is None:
        return out, lse, q.new_empty((0,))
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    sequences = [(q[None, bq[b]:bq[b + 1]], k[None, bk[b]:bk[b + 1]], _slopes_of(alibi_slopes, b))
                 for b in range(len(bq) - 1)]
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    return out, lse, _s_dmask(sequences, options, dropout_p, state, max_seqlen_q, max_seqlen_k)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """fa2.attention_with_kvcache under flash-attn's signature: k and v, if given, are appended to the caches in
    place at cache_seqlens, then q attends to each sequence's cache. Returns out, or (out, softmax_lse) with
    return_softmax_lse. rotary_cos/rotary_sin (with k and v; rotary_interleaved, flash-attn's default True) rotate q
    and the new keys in the append's launch, and cache_leftpad starts each sequence's cache at a row, both with
    flash-attn's positions (fa2.attention_with_kvcache says which). Paged caches take page sizes that are
    multiples of 64 (flash-attn's 256 among them), at every head dim."""
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  cache_batch_idx=cache_batch_idx, block_table=block_table, causal=causal,
                                  softmax_scale=softmax_scale, window_size=_window(window_size, causal),
                                  softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
                                  return_lse=return_softmax_lse, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                  rotary_interleaved=rotary_interleaved, cache_leftpad=cache_leftpad)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on the views q, k, v = qkv.unbind(2) of qkv (batch, seqlen, 3, nheads, head_dim); the
    gradient reaches qkv through autograd. Returns what flash_attn_func returns."""
    q, k, v = _unpack("qkv", qkv, 3, "(batch, seqlen, 3, nheads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on q and the views k, v = kv.unbind(2) of kv (batch, seqlen_k, 2, nheads_k, head_dim)."""
    k, v = _unpack("kv", kv, 2, "(batch, seqlen_k, 2, nheads_k, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func on the views q, k, v = qkv.unbind(1) of qkv (total, 3, nheads, head_dim), with
    cu_seqlens and max_seqlen for both queries and keys."""
    q, k, v = _unpack("qkv", qkv, 3, "(total, 3, nheads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func on q and the views k, v = kv.unbind(1) of kv (total_k, 2, nheads_k, head_dim)."""
    k, v = _unpack("kv", kv, 2, "(total_k, 2, nheads_k, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def _unpack(name, packed, count, layout):
    """The count views of a packed tensor along its dim -3 (fa2 takes any strides but the last's). unbind's
    backward stacks the views' gradients into one tensor shaped like `packed`."""
    check_tensors(**{name: packed})
    if packed.dim() != layout.count(",") + 1 or packed.shape[-3] != count:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(-3)


def _slopes_of(alibi_slopes, b):
    """Sequence b's ALiBi slopes, (nheads,), from (nheads,) or (batch, nheads) ones (or None)."""
    return alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """flash-attn 2.8's flash_attn_interface._get_block_size_n, the key block size its tests decode S_dmask with
    (normalize_flash_attn_S). The GPU's capability matters only without dropout, where S_dmask is empty."""
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 128 if not is_dropout else 64
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        if is_dropout:
            return 32
        major, minor = torch.cuda.get_device_capability(device)
        return 64 if is_causal or not (major == 8 and minor > 0) else 32  # sm86/sm89: 32 unless causal
    return 64


def _s_dmask(sequences, options, dropout_p, state, seqlen_q, seqlen_k):
    """S_dmask in flash-attn's encoding (the module docstring): for each sequence (q (1, seqlen_q, nheads, d), k,
    its slopes), entry (i, j) of key block n is P_ij / max(P_ij' over the key blocks from n on), which is
    exp(s_ij - m_i,n) (the lse cancels), negated where the dropout mask drops it; (len(sequences), nheads,
    seqlen_q and seqlen_k rounded up to 128), q's dtype. A dropped 0 is -0.0, which flash-attn's tests (`>= 0`)
    read as kept, harmlessly since it adds nothing; its kernel does the same."""
    q0 = sequences[0][0]
    nheads, head_dim = q0.shape[2], q0.shape[3]
    block_n = _get_block_size_n(q0.device, head_dim, True, options["causal"])
    keep = reference.dropout_keep_mask(state.tolist(), len(sequences), nheads, seqlen_q, seqlen_k, dropout_p,
                                       device=q0.device)
    rounded = (-(-seqlen_q // 128) * 128, -(-seqlen_k // 128) * 128)
    s_dmask = torch.zeros(len(sequences), nheads, *rounded, dtype=q0.dtype, device=q0.device)
    with torch.no_grad():
        for b, (q, k, alibi) in enumerate(sequences):
            lq, lk = q.shape[1], k.shape[1]
            if lq == 0 or lk == 0:
                continue
            p = reference.attention_probs(q, k, alibi_slopes=alibi, dtype=torch.float64, **options)[0][0]
            block_max = torch.stack([blk.amax(-1) for blk in p.split(block_n, dim=-1)], dim=-1)
            running_max = block_max.flip(-1).cummax(-1).values.flip(-1).repeat_interleave(block_n, -1)[..., :lk]
            unnormalised = torch.where(running_max > 0, p / running_max, 0.0)  # 0 where no key is visible yet
            kept = keep[b, :, :lq, :lk]
            s_dmask[b, :, :lq, :lk] = torch.where(kept, unnormalised, -unnormalised).to(q.dtype)
    return s_dmask

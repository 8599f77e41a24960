"""The executable specification of fa2, in plain torch (any device, any float dtype).

attention_ref is attention as a formula. flash_fwd_tiled and flash_bwd_tiled are FlashAttention-2's
algorithms written tile by tile, with the names the CUDA kernels use for the same quantities:

    S    = Q K^T (unscaled scores)          m    running row max of S
    P    = softmax probabilities            l    running row sum of P
    acc  = running unnormalised O = sum P V lse  = log sum_j exp(S_ij * softmax_scale), natural log
    D    = rowsum(dO * O)                   dS   = P * (dP - D), the gradient w.r.t. the scaled scores

Layout everywhere: (batch, seqlen, nheads, head_dim); k and v may have fewer heads than q (GQA/MQA, one
K/V head per group of nheads // nheads_k consecutive query heads). Causal masking is aligned to the
bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q. A row that sees no key has output 0
and lse -inf, never NaN.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

LOG2E = math.log2(math.e)
NEG_INF = float("-inf")


def _scale(softmax_scale: Optional[float], q: torch.Tensor) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def _heads_first(*tensors):
    """(batch, seqlen, heads, d) -> (batch, heads, seqlen, d); K/V heads repeated to match q's (GQA/MQA)."""
    nheads = tensors[0].shape[2]
    return [t.repeat_interleave(nheads // t.shape[2], dim=2).transpose(1, 2) for t in tensors]


def visible(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """Causal mask of the score tile (rows x cols), as in mask.h: True where query i sees key j."""
    return window_visible(rows, cols, seqlen_q, seqlen_k, (-1, 0))


def window_visible(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int,
                   window_size: Tuple[int, int]) -> torch.Tensor:
    """Sliding-window (local) mask, flash-attn 2.8's: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, a side of -1 being unbounded.
    Bottom-right aligned like causal; causal is window_size (-1, 0)."""
    left, right = window_size
    diagonal = rows[:, None] + (seqlen_k - seqlen_q)  # the key a query is aligned with
    seen = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
    if left >= 0:
        seen &= cols[None, :] >= diagonal - left
    if right >= 0:
        seen &= cols[None, :] <= diagonal + right
    return seen


def alibi_bias(slopes: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int,
               seqlen_k: int) -> torch.Tensor:
    """flash-attn's ALiBi: -slope * |i + seqlen_k - seqlen_q - j|, added to the scaled score (causal or not).
    slopes: (nheads,) or (batch, nheads); returns (batch or 1, nheads, rows, cols)."""
    distance = (rows[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).abs()
    slopes = slopes if slopes.dim() == 2 else slopes[None]
    return -slopes[:, :, None, None] * distance


# Philox4x32 (Salmon et al., SC'11; torch's CUDA generator runs 10 rounds, flash-attn's dropout 7): constants of the
# round function and of the key schedule.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-`rounds` on int64 tensors holding uint32 values: counter (c0, c1, c2, c3) and key (k0, k1), each
    broadcastable; returns the four uint32 outputs. Pure integer arithmetic, so any device gives the same bits."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _U32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _U32 for k in key)
    for r in range(rounds):
        if r > 0:
            k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]  # < 2^64: exact in int64 bits (wraps, masked below)
        hi0, lo0 = (p0 >> 32) & _U32, p0 & _U32
        hi1, lo1 = (p1 >> 32) & _U32, p1 & _U32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_keep_mask(rng_state, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                      device=None) -> torch.Tensor:
    """The kept elements (bool, (batch, nheads, seqlen_q, seqlen_k)) of dropout drawn from rng_state = (seed,
    offset), as the kernels draw them. Eight scores share one Philox4x32-7 block (flash-attn's round count): rows
    i and i ^ 8 times columns j, j ^ 1, j ^ 32, j ^ 33, the scores one thread holds in both kernels' MMA tiles.
    The block's key is the seed's low and high 32 bits, its counter (j & ~33, i & ~8, b * nheads + h, offset's
    low 32 bits); score (b, h, i, j) takes 16 bits of it, output 2 * bit 5 of j + bit 3 of i, half bit 0 of j,
    and is kept iff they are below floor((1 - dropout_p) * 2^16). Rows and columns count within each sequence
    (packed batches: b is the sequence). The mask for attention_ref(dropout_keep=...)."""
    seed, offset = (int(x) for x in rng_state)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nheads, device=device).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    outs = philox4x32((j & ~33, i & ~8, b * nheads + h, offset & _U32), (seed & _U32, (seed >> 32) & _U32),
                      rounds=7)
    word = 2 * ((j >> 5) & 1) + ((i >> 3) & 1)
    shape = (batch, nheads, seqlen_q, seqlen_k)
    draw = torch.stack(torch.broadcast_tensors(*outs), dim=-1).gather(-1, word.expand(shape)[..., None])[..., 0]
    bits16 = (draw >> (16 * (j & 1))) & 0xFFFF
    return bits16 < math.floor((1.0 - dropout_p) * 2 ** 16)


def check_options(*, causal: bool, window_size, softcap: float, dropout_p: float) -> Tuple[int, int]:
    """The feature options that make sense, as flash-attn defines them; returns the effective window
    (causal folds into it as right = 0). Combinations that make no sense raise naming both arguments."""
    if len(window_size) != 2 or any(not isinstance(w, int) or isinstance(w, bool) or w < -1 for w in window_size):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1: unbounded), got {tuple(window_size)!r}")
    left, right = window_size
    if causal and right > 0:
        raise ValueError(f"causal=True with window_size={tuple(window_size)!r}: causal means no key to the right of "
                         f"the diagonal, window_size[1] = {right} asks for some; pass window_size=({left}, 0) "
                         f"without causal, or causal=True with window_size[1] in (-1, 0)")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap!r}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return (left, 0) if causal else (left, right)


def attention_ref(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None,
                  window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
                  dropout_p: float = 0.0, dropout_keep: Optional[torch.Tensor] = None, upcast: bool = True,
                  dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T * softmax_scale) V. upcast=True computes in `dtype` (float64 by default);
    upcast=False computes in the inputs' own precision, as plain PyTorch attention would. Returns out in
    the inputs' dtype and lse (batch, nheads, seqlen_q) in the compute dtype (at least float32).

    The variants, each off by default, in the order they apply to a score s = q.k * softmax_scale:
    - softcap > 0: s = softcap * tanh(s / softcap);
    - alibi_slopes (nheads,) or (batch, nheads): s += -slope * |i + seqlen_k - seqlen_q - j| (alibi_bias);
    - window_size (left, right) and causal: keys outside the band are masked (window_visible);
    - sink (nheads,): a per-head logit in every row's softmax denominator with no value attached,
      lse_i = log(exp(sink_h) + sum_j exp(s_ij)); differentiable (d sink_h = -sum_i exp(sink_h - lse_i) * D_i);
    - dropout_p with dropout_keep (bool, (batch, nheads, seqlen_q, seqlen_k)): the kept probabilities are scaled
      by 1 / (1 - dropout_p), the others dropped, after the softmax (lse is the undropped one). The kernels
      draw the mask from an RNG state as dropout_keep_mask does; here it is an argument."""
    check_options(causal=causal, window_size=window_size, softcap=softcap, dropout_p=dropout_p)
    if dropout_p > 0 and dropout_keep is None:
        raise ValueError(f"dropout_p={dropout_p!r} needs dropout_keep, the mask of kept probabilities")
    P, lse = attention_probs(q, k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, sink=sink, upcast=upcast, dtype=dtype)
    if dropout_keep is not None:
        P = P * dropout_keep / (1 - dropout_p)
    v_ = _heads_first(q, v)[1]
    return (P @ (v_.to(P.dtype))).transpose(1, 2).to(q.dtype), lse


def attention_probs(q, k, *, causal: bool = False, softmax_scale: Optional[float] = None,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
                    upcast: bool = True, dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """attention_ref's probabilities before dropout, P (batch, nheads, seqlen_q, seqlen_k) in the compute dtype
    (the sink's share is in each row's denominator, not a column), and lse; the options are attention_ref's."""
    left, right = check_options(causal=causal, window_size=window_size, softcap=softcap, dropout_p=0.0)
    scale = _scale(softmax_scale, q)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    q_, k_ = (t.to(dtype) if upcast else t for t in _heads_first(q, k))
    S = (q_ @ k_.transpose(-1, -2)) * scale  # here S is already scaled
    rows, cols = torch.arange(seqlen_q, device=q.device), torch.arange(seqlen_k, device=q.device)
    if softcap > 0:
        S = softcap * torch.tanh(S / softcap)
    if alibi_slopes is not None:
        S = S + alibi_bias(alibi_slopes.to(S.dtype), rows, cols, seqlen_q, seqlen_k)
    if (left, right) != (-1, -1):
        S = S.masked_fill(~window_visible(rows, cols, seqlen_q, seqlen_k, (left, right)), NEG_INF)
    if sink is not None:  # one more column: the sink's logit joins the softmax, its probability is dropped
        S = torch.cat([S, sink.to(S.dtype)[None, :, None, None].expand(*S.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(S.to(torch.promote_types(S.dtype, torch.float32)), dim=-1)
    P = torch.softmax(S, dim=-1).masked_fill(torch.isneginf(lse)[..., None], 0.0)  # no visible key: P = 0
    return (P[..., :-1] if sink is not None else P), lse


def _key_end(m0: int, block_m: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Query rows [m0, m0 + block_m) see keys [0, key_end) only (mask.h: key_blocks, causal); later K/V blocks
    lie entirely above the causal diagonal and are never visited."""
    if not causal:
        return seqlen_k
    return max(0, min(seqlen_k, m0 + block_m + seqlen_k - seqlen_q))


def flash_fwd_tiled(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None, block_m: int = 64,
                    block_n: int = 64, rescale_threshold: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward (Algorithm 1; fwd_kernel.h and softmax.h mirror it). Each Q block streams
    over the K/V blocks it can see, keeping the online-softmax state m, l, acc; the softmax runs in base 2
    with the scale folded in, as the kernel does (exp2 is one instruction). Returns (out, lse).

    rescale_threshold > 0 is the lazy rescale (softmax.h): m moves only once some row of the Q block
    has outgrown it by more than that many powers of 2 (the kernel decides per warp of rows). Until then P
    may reach 2**rescale_threshold, and l, acc and lse keep referring to the same stale m, so the softmax is
    unchanged; the rescale of acc is skipped. 0 rescales whenever the max moves (FA2)."""
    scale = _scale(softmax_scale, q)
    scale_log2 = scale * LOG2E  # exp(x * scale) == exp2(x * scale_log2)
    work = torch.promote_types(q.dtype, torch.float32)  # the kernel's accumulators are fp32
    q_, k_, v_ = (t.to(work) for t in _heads_first(q, k, v))
    batch, nheads, seqlen_q, head_dim = q_.shape
    seqlen_k = k_.shape[2]
    out = q_.new_empty(batch, nheads, seqlen_q, head_dim)
    lse = q_.new_empty(batch, nheads, seqlen_q)
    for m0 in range(0, seqlen_q, block_m):  # one thread block (CTA) per Q block
        rows = torch.arange(m0, min(m0 + block_m, seqlen_q), device=q.device)
        Q = q_[:, :, m0:m0 + block_m]
        m = Q.new_full((batch, nheads, len(rows), 1), NEG_INF)  # running row max of S
        l = Q.new_zeros((batch, nheads, len(rows), 1))  # running row sum of P (under the current m)
        acc = Q.new_zeros((batch, nheads, len(rows), head_dim))  # running unnormalised O
        for n0 in range(0, _key_end(m0, block_m, seqlen_q, seqlen_k, causal), block_n):
            K, V = k_[:, :, n0:n0 + block_n], v_[:, :, n0:n0 + block_n]
            S = Q @ K.transpose(-1, -2)
            if causal:
                cols = torch.arange(n0, n0 + K.shape[2], device=q.device)
                S = S.masked_fill(~visible(rows, cols, seqlen_q, seqlen_k), NEG_INF)
            m_new = torch.maximum(m, S.amax(dim=-1, keepdim=True))
            if rescale_threshold > 0:  # (m_new - m) is NaN, so False, while a row has seen only -inf
                grew = ((m_new - m) * scale_log2 > rescale_threshold).any(dim=-2, keepdim=True)
                m_new = torch.where(grew, m_new, m)
            # A row with every key so far masked has m = -inf: offset by 0 so exp2 gives 0, not NaN.
            m_scaled = torch.where(torch.isneginf(m_new), 0.0, m_new * scale_log2)
            P = torch.exp2(S * scale_log2 - m_scaled)
            correction = torch.exp2(m * scale_log2 - m_scaled)  # rescales l and acc from the old max
            l = l * correction + P.sum(dim=-1, keepdim=True)
            acc = acc * correction + P.to(q.dtype).to(work) @ V  # the PV MMA takes P in the input dtype
            m = m_new
        empty = l == 0  # rows that saw no key
        out[:, :, m0:m0 + block_m] = acc / torch.where(empty, 1.0, l)
        lse[:, :, m0:m0 + block_m] = torch.where(empty, NEG_INF, m * scale + torch.log(l)).squeeze(-1)
    return out.transpose(1, 2).to(q.dtype), lse


def flash_bwd_tiled(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: Optional[float] = None,
                    block_m: int = 64, block_n: int = 64) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward (bwd_kernel.h mirrors it). P is never stored: each K/V block walks the Q
    blocks that see it and recomputes P = exp(S * scale - lse) from the forward's lse. dK and dV are
    finished per K/V block; dQ collects a share from every K/V block. Returns (dq, dk, dv)."""
    scale = _scale(softmax_scale, q)
    work = torch.promote_types(q.dtype, torch.float32)
    q_, k_, v_, dout_, out_ = (t.to(work) for t in _heads_first(q, k, v, dout, out))
    batch, nheads, seqlen_q, head_dim = q_.shape
    seqlen_k, nheads_k = k_.shape[2], k.shape[2]
    D = (dout_ * out_).sum(dim=-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
    # Rows that saw no key (lse = -inf) get lse = +inf, so P = 0 there rather than NaN.
    lse = torch.where(torch.isneginf(lse), math.inf, lse).to(work).unsqueeze(-1)
    dq = torch.zeros_like(q_)  # the kernel's fp32 dq_accum
    dk = torch.zeros_like(k_)  # one slice per *query* head, summed over GQA groups at the end
    dv = torch.zeros_like(v_)
    for n0 in range(0, seqlen_k, block_n):  # one CTA per K/V block
        cols = torch.arange(n0, min(n0 + block_n, seqlen_k), device=q.device)
        K, V = k_[:, :, n0:n0 + block_n], v_[:, :, n0:n0 + block_n]
        # Causal: rows before n0 - (seqlen_k - seqlen_q) see none of these keys; start at their Q block.
        m_block_begin = max(0, n0 - (seqlen_k - seqlen_q)) // block_m if causal else 0
        for m0 in range(m_block_begin * block_m, seqlen_q, block_m):
            rows = torch.arange(m0, min(m0 + block_m, seqlen_q), device=q.device)
            Q, dO = q_[:, :, m0:m0 + block_m], dout_[:, :, m0:m0 + block_m]
            S = Q @ K.transpose(-1, -2)
            if causal:
                S = S.masked_fill(~visible(rows, cols, seqlen_q, seqlen_k), NEG_INF)
            P = torch.exp(S * scale - lse[:, :, m0:m0 + block_m])  # the forward's probabilities
            dv[:, :, n0:n0 + block_n] += P.to(q.dtype).to(work).transpose(-1, -2) @ dO
            dP = dO @ V.transpose(-1, -2)
            dS = (P * (dP - D[:, :, m0:m0 + block_m])).to(q.dtype).to(work)  # MMA operands: input dtype
            dk[:, :, n0:n0 + block_n] += dS.transpose(-1, -2) @ Q
            dq[:, :, m0:m0 + block_m] += dS @ K
    # d(S * scale) / dS = scale, applied once at the end as the kernel does.
    dq, dk = dq * scale, dk * scale
    # GQA/MQA: a K/V head's gradient is the sum over the query heads of its group.
    dk = dk.view(batch, nheads_k, nheads // nheads_k, seqlen_k, head_dim).sum(2)
    dv = dv.view(batch, nheads_k, nheads // nheads_k, seqlen_k, head_dim).sum(2)
    return dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


def kvcache_index(cache: torch.Tensor, b: int, rows: torch.Tensor, *, cache_batch_idx=None, block_table=None):
    """Where rows `rows` of sequence b's KV cache are, as an index into the cache tensor: entry cache_batch_idx[b] (or
    b) of a (batch_cache, capacity, nheads_k, head_dim) cache, or, paged, row r in page block_table[b, r // page_size]
    of a (num_pages, page_size, nheads_k, head_dim) one, at r % page_size."""
    if block_table is None:
        return b if cache_batch_idx is None else int(cache_batch_idx[b]), rows
    page_size = cache.shape[1]
    return block_table[b].to(cache.device).long()[rows // page_size], rows % page_size


def kvcache_rows(cache: torch.Tensor, b: int, count: int, *, cache_batch_idx=None, block_table=None) -> torch.Tensor:
    """Rows [0, count) of sequence b's KV cache, (count, nheads_k, head_dim) (kvcache_index's layout)."""
    rows = torch.arange(count, device=cache.device)
    return cache[kvcache_index(cache, b, rows, cache_batch_idx=cache_batch_idx, block_table=block_table)]


def apply_rotary(x, cos, sin, positions, *, interleaved: bool = False):
    """A rotary embedding (flash-attn's apply_rotary_emb) applied to x (seqlen, nheads, head_dim), computed in x's
    dtype: row i turns by the angles of row positions[i] of cos and sin ((seqlen_ro, rotary_dim / 2)). Element pairs
    (j, j + rotary_dim / 2) for j < rotary_dim / 2, or with interleaved (2j, 2j + 1), become
    (a cos_j - b sin_j, b cos_j + a sin_j); elements from rotary_dim on are unchanged."""
    half = cos.shape[-1]
    c = cos[positions.long()].to(x.dtype)[:, None, :]
    s = sin[positions.long()].to(x.dtype)[:, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        turned = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        turned = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([turned, x[..., 2 * half:]], dim=-1)


def rotary_q_per_row(capacity: int, *, causal: bool = False, window_size=(-1, -1)) -> bool:
    """Whether a KV-cache call with a rotary embedding turns q's row i at position cache_seqlens[b] + i (True) or every
    row at cache_seqlens[b] (False). flash-attn's rule: rows advance where the mask depends on the row, causal or a
    window bound in [0, capacity) (a bound of at least the capacity is unbounded there)."""
    return causal or any(0 <= w < capacity for w in window_size)


def attention_with_kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                               block_table=None, rotary_cos=None, rotary_sin=None, rotary_interleaved: bool = False,
                               cache_leftpad=None, **options):
    """fa2.attention_with_kvcache as a formula: the new rows k, v (batch, seqlen_new, nheads_k, head_dim), if any, are
    written to rows cache_seqlens[b] + s of each sequence's cache (kvcache_index's layout), then sequence b's queries
    attend to its first cache_seqlens[b] + seqlen_new rows as attention_ref (options: causal, softmax_scale, window,
    softcap, alibi_slopes, sink) would. cache_seqlens: an int for every sequence, a (batch,) tensor, or None (the
    whole capacity). Returns (out, lse, k_cache, v_cache): the caches as new tensors, the inputs unchanged.

    rotary_cos, rotary_sin ((seqlen_ro, rotary_dim / 2), with k): the new keys are turned by apply_rotary at their
    cache rows' positions, cache_seqlens[b] + s, in float64 and rounded once to the cache's dtype; q's row i at
    cache_seqlens[b] + i where rotary_q_per_row says so, else at cache_seqlens[b], in q's dtype (float64 for the
    reference). cache_leftpad ((batch,)): sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b] +
    seqlen_new) of its cache (cache_seqlens counts the pad rows), so causal masks, windows and ALiBi count from the
    pad's end; the rotary positions stay the cache rows'."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, seqlen_new = q.shape[0], 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if cache_seqlens is None:
        held = [capacity - seqlen_new] * batch
    elif isinstance(cache_seqlens, int):
        held = [cache_seqlens] * batch
    else:
        held = [int(n) for n in cache_seqlens]
    where = dict(cache_batch_idx=cache_batch_idx, block_table=block_table)
    if (rotary_cos is None) != (rotary_sin is None) or (rotary_cos is not None and k is None):
        raise ValueError("rotary_cos and rotary_sin go together, and need the new keys k")
    per_row = rotary_q_per_row(capacity, causal=options.get("causal", False),
                               window_size=options.get("window_size", (-1, -1)))
    outs, lses = [], []
    for b in range(batch):
        queries = q[b]
        if seqlen_new:
            rows = torch.arange(held[b], held[b] + seqlen_new, device=k_cache.device)
            where_rows = kvcache_index(k_cache, b, rows, **where)
            new_keys = k[b]
            if rotary_cos is not None:
                new_keys = apply_rotary(k[b].double(), rotary_cos, rotary_sin, rows, interleaved=rotary_interleaved)
            k_cache[where_rows], v_cache[where_rows] = new_keys.to(k_cache.dtype), v[b]
        if rotary_cos is not None:
            positions = held[b] + (torch.arange(q.shape[1], device=q.device) if per_row else
                                   torch.zeros(q.shape[1], dtype=torch.long, device=q.device))
            queries = apply_rotary(q[b], rotary_cos, rotary_sin, positions, interleaved=rotary_interleaved)
        count = held[b] + seqlen_new
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        keys = kvcache_rows(k_cache, b, count, **where)[None, start:]
        values = kvcache_rows(v_cache, b, count, **where)[None, start:]
        slopes = options.get("alibi_slopes")
        per_batch = dict(options, alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2 else slopes)
        out, lse = attention_ref(queries[None], keys, values, **per_batch)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache

"""Executable specification of fa2, in plain torch (any device, any float dtype).

attention_ref is attention as a formula. flash_fwd_tiled / flash_bwd_tiled are FlashAttention-2's
algorithms (forward: Algorithm 1; backward: recompute P from the log-sum-exp) written tile by tile with the
same names the CUDA kernels use: m (running row max), l (running row sum), acc (unnormalised output),
lse, D = rowsum(dO * O), dS. Layout everywhere: (batch, seqlen, nheads, head_dim).

Causal masking is aligned to the bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q. A row
that sees no key has output 0 and lse -inf (never NaN).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

LOG2E = math.log2(math.e)


def _heads_first(q, k, v):
    """(b, s, h, d) -> (b, h, s, d), with k/v heads repeated to match q (GQA/MQA)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """True where query i may NOT see key j."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j > i + seqlen_k - seqlen_q


def attention_ref(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None, upcast: bool = True,
                  dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention. upcast=True computes in `dtype` (float64 by default); upcast=False computes in
    the inputs' own precision, the way plain PyTorch attention would. Returns (out in q's dtype, lse float)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    in_dtype = q.dtype
    if upcast:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    qh, kh, vh = _heads_first(q, k, v)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(s.float() if not upcast else s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: all -inf -> 0, not NaN
    out = (p @ vh).transpose(1, 2)
    return out.to(in_dtype), lse


def _key_block_end(m0: int, block_m: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Keys [0, end) reach query rows [m0, m0 + block_m); later key blocks are skipped entirely."""
    if not causal:
        return seqlen_k
    return max(0, min(seqlen_k, m0 + block_m + seqlen_k - seqlen_q))


def flash_fwd_tiled(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None, block_m: int = 64,
                    block_n: int = 64) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward (fwd_kernel.h mirrors this): softmax in base 2 with the scale folded in."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scale_log2 = scale * LOG2E
    qh, kh, vh = _heads_first(q, k, v)
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    out = torch.zeros_like(qh)
    lse = torch.empty(b, h, sq, dtype=qh.dtype, device=q.device)
    for m0 in range(0, sq, block_m):
        qi = qh[:, :, m0:m0 + block_m]
        rows = qi.shape[2]
        m = torch.full((b, h, rows, 1), float("-inf"), dtype=qh.dtype, device=q.device)  # running max of S
        l = torch.zeros((b, h, rows, 1), dtype=qh.dtype, device=q.device)  # running sum of P
        acc = torch.zeros((b, h, rows, d), dtype=qh.dtype, device=q.device)  # unnormalised O
        for n0 in range(0, _key_block_end(m0, rows, sq, sk, causal), block_n):
            s = qi @ kh[:, :, n0:n0 + block_n].transpose(-1, -2)
            if causal:
                mask = causal_mask(sq, sk, q.device)[m0:m0 + rows, n0:n0 + block_n]
                s = s.masked_fill(mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_scaled = torch.where(m_new == float("-inf"), 0.0, m_new * scale_log2)  # all-masked row: no NaN
            correction = torch.exp2(m * scale_log2 - m_scaled)  # rescale of what was accumulated so far
            p = torch.exp2(s * scale_log2 - m_scaled)
            l = l * correction + p.sum(dim=-1, keepdim=True)
            acc = acc * correction + p.to(vh.dtype) @ vh[:, :, n0:n0 + block_n]
            m = m_new
        empty = l == 0
        out[:, :, m0:m0 + rows] = acc / torch.where(empty, 1.0, l)
        lse[:, :, m0:m0 + rows] = torch.where(empty, float("-inf"), m * scale + torch.log(l)).squeeze(-1)
    return out.transpose(1, 2).to(q.dtype), lse


def flash_bwd_tiled(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: Optional[float] = None,
                    block_m: int = 64, block_n: int = 64) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward (bwd_kernel.h mirrors this): per key block, walk the query blocks that see it,
    recompute P from lse, and accumulate dV, dK (per key block) and dQ (across key blocks)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = _heads_first(q, k, v)
    doh, oh = dout.transpose(1, 2), out.transpose(1, 2)
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    D = (doh * oh).sum(dim=-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse).unsqueeze(-1)  # empty rows: P = 0
    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kh)
    dv = torch.zeros_like(vh)
    for n0 in range(0, sk, block_n):
        kj, vj = kh[:, :, n0:n0 + block_n], vh[:, :, n0:n0 + block_n]
        first_row = max(0, n0 - (sk - sq)) if causal else 0  # earlier rows see none of these keys
        for m0 in range((first_row // block_m) * block_m, sq, block_m):
            qi, doi = qh[:, :, m0:m0 + block_m], doh[:, :, m0:m0 + block_m]
            s = qi @ kj.transpose(-1, -2)
            if causal:
                s = s.masked_fill(causal_mask(sq, sk, q.device)[m0:m0 + block_m, n0:n0 + block_n], float("-inf"))
            p = torch.exp(s * scale - lse_safe[:, :, m0:m0 + block_m])  # the forward's probabilities
            dv[:, :, n0:n0 + block_n] += p.transpose(-1, -2) @ doi
            dp = doi @ vj.transpose(-1, -2)
            dS = p * (dp - D[:, :, m0:m0 + block_m])  # gradient w.r.t. the scaled scores
            dk[:, :, n0:n0 + block_n] += scale * dS.transpose(-1, -2) @ qi
            dq[:, :, m0:m0 + block_m] += scale * dS @ kj
    # GQA/MQA: a K/V head's gradient is the sum over the query heads that share it.
    dk = dk.view(b, h // group, group, sk, d).sum(2)
    dv = dv.view(b, h // group, group, sk, d).sum(2)
    return dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)

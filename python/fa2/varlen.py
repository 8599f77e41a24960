"""Packed variable-length batches: sequences laid one after another along dim 0 of (total_tokens, nheads,
head_dim) tensors, sequence b owning tokens [cu_seqlens[b], cu_seqlens[b+1]). The kernels read the offsets
from cu_seqlens on the GPU, so nothing is padded or copied. Same kernels and checks as fa2.fwd / fa2.bwd."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from fa2.interface import (_check_buffer, _check_bwd_tensors, _check_device_and_build, _check_qkv, _dkv_per_query_head,
                           _launch, _loadable, _new, _sum_groups)


def _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Types and shapes always; the values (which live on the GPU) only where reading them is allowed: not
    while a CUDA graph is captured and not while torch.compile traces. The kernels clamp whatever they read
    to the tensors' bounds, so unchecked bad values give wrong numbers, never out-of-bounds accesses."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor, got {cu.dtype}: pass {name}.to(torch.int32)")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D (batch + 1,) with batch >= 1: [0, len_0, len_0 + len_1, ...], "
                             f"got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}: put it on q's device")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, (bool, torch.Tensor)) or not hasattr(m, "__index__") or m < 0:
            raise TypeError(f"{name} must be a non-negative Python int (the longest sequence), got {m!r}")
    if cu_seqlens_q.numel() - 1 > 65535:
        raise ValueError(f"at most 65535 sequences per call, got {cu_seqlens_q.numel() - 1}")
    if (q.is_cuda and torch.cuda.is_current_stream_capturing()) or torch.compiler.is_compiling():
        return
    both = torch.stack([cu_seqlens_q, cu_seqlens_k]).cpu()  # one small device-to-host copy
    for name, cu, total, max_name, max_len in ((("cu_seqlens_q", both[0], q.shape[0], "max_seqlen_q", max_seqlen_q)),
                                               (("cu_seqlens_k", both[1], k.shape[0], "max_seqlen_k", max_seqlen_k))):
        lengths = cu.diff()
        if cu[0] != 0 or (lengths < 0).any():
            raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()[:16]}"
                             f"{' ...' if cu.numel() > 16 else ''}")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] must equal the number of tokens ({total}), got {int(cu[-1])}")
        if int(lengths.max()) > max_len:
            raise ValueError(f"{max_name} ({max_len}) is shorter than the longest sequence ({int(lengths.max())})")


def _varlen_sizes(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> dict:
    """What _C needs beyond the pointers and strides: sequences, longest lengths (they size the grid), totals."""
    return dict(batch=cu_seqlens_q.numel() - 1, seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k),
                nheads=q.shape[1], nheads_k=k.shape[1], total_q=q.shape[0], total_k=k.shape[0])


def _batched(**tensors) -> dict:
    """(total, nheads, head_dim) tensors viewed as (1, total, nheads, head_dim) with a batch stride of 0: the
    kernels find each sequence through cu_seqlens, never through the batch stride."""
    return {name: t.as_strided((1, *t.shape), (0, *t.stride())) for name, t in tensors.items()}


def fwd_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: Optional[float] = None, causal: bool = False,
               out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward over packed sequences. q: (total_q, nheads, head_dim); k, v: (total_k, nheads_k,
    head_dim); cu_seqlens_q/k: int32 (batch + 1,) cumulative lengths on q's device; max_seqlen_q/k: the longest
    lengths (Python ints). causal is bottom-right aligned per sequence. Returns out (like q) and lse, float32
    (nheads, total_q)."""
    _check_qkv(q, k, v, softmax_scale, varlen=True)
    _check_buffer("out", out, q, "q")
    _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_device_and_build("fwd", q, k=k, v=v, out=out)
    out = _new(q) if out is None else out
    lse = _new(q, (q.shape[1], q.shape[0]), torch.float32)
    if q.shape[0] == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0 or max_seqlen_k == 0:  # no keys anywhere: every row is empty
        return out.zero_(), lse.fill_(-math.inf)
    _launch("fwd", q[None], k[None], softmax_scale, causal, _batched(q=q, k=k, v=v, out=out), dict(lse=lse),
            cu_seqlens_q=cu_seqlens_q.data_ptr(), cu_seqlens_k=cu_seqlens_k.data_ptr(),
            **_varlen_sizes(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k))
    return out, lse


def bwd_varlen(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, *, softmax_scale: Optional[float] = None, causal: bool = False,
               dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None,
               dv: Optional[torch.Tensor] = None, deterministic: bool = False
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward over packed sequences, from fwd_varlen's out and lse (see fa2.bwd)."""
    _check_qkv(q, k, v, softmax_scale, varlen=True)
    total_q, nheads, head_dim = q.shape
    total_k = k.shape[0]
    _check_bwd_tensors(dout, q, k, v, out, lse, dq, dk, dv, lse_shape=(nheads, total_q), fwd_name="fwd_varlen")
    _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_device_and_build("bwd", q, k=k, v=v, out=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv)
    dout = dout if _loadable(dout) else dout.contiguous()
    dq, dk, dv = (_new(t) if g is None else g for t, g in ((q, dq), (k, dk), (v, dv)))
    if total_q == 0 or total_k == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dk_heads, dv_heads, grouped = _dkv_per_query_head(q, dk, dv)
    dq_accum = _new(q, (nheads, total_q, head_dim), torch.float32)
    d_sum = _new(q, (nheads, total_q), torch.float32)
    _launch("bwd", q[None], k[None], softmax_scale, causal,
            _batched(dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk_heads, dv=dv_heads),
            dict(lse=lse, dq_accum=dq_accum, d_sum=d_sum), deterministic=bool(deterministic), dkv_fp32=grouped,
            cu_seqlens_q=cu_seqlens_q.data_ptr(), cu_seqlens_k=cu_seqlens_k.data_ptr(),
            **_varlen_sizes(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k))
    if grouped:
        _sum_groups(dk, dv, dk_heads, dv_heads)
    return dq, dk, dv

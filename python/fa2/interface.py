"""The low-level API: fa2.fwd / fa2.bwd and their packed (varlen) twins, each a thin call of an fa2 op (ops.py),
whose C++ implementation checks every argument, allocates the outputs and launches on the current CUDA stream.
Optional output buffers (out=, dq=, dk=, dv=) go to the ops that write into given tensors."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from fa2 import ops


def build_info() -> dict:
    """What this build compiled: version, cuda_version, archs, fwd_head_dims, bwd_head_dims, dtypes."""
    return ops.extension().build_info()


def _empty_like(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _check_out_missing(out, fwd_name: str) -> None:
    if out is None:
        raise TypeError(f"out must be the output tensor of {fwd_name}, got None")


def _unpad(t: Tensor, head_dim: int, name: str, buffer: Optional[Tensor]) -> Tensor:
    """The first head_dim columns of a result computed zero-padded (ops.pad_head_dim), written into `buffer`
    if one was given."""
    t = t[..., :head_dim]
    if buffer is None:
        return t
    ops.check_tensors(**{name: buffer})
    if buffer.shape != t.shape or buffer.dtype != t.dtype:
        raise ValueError(f"{name} must be a {t.dtype} tensor of shape {tuple(t.shape)}, got {buffer.dtype} "
                         f"{tuple(buffer.shape)}")
    return buffer.copy_(t)


def _features(window_size, softcap, alibi_slopes, dropout_p, rng_state) -> tuple:
    """The ops' trailing options (ops._SCHEMAS): window_left, window_right, softcap, alibi_slopes, dropout_p,
    rng_state."""
    return (*ops.window(window_size), float(softcap), ops.slopes(alibi_slopes), float(dropout_p), rng_state)


def fwd(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: Optional[float] = None, causal: bool = False,
        out: Optional[Tensor] = None, window_size=(-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None,
        sink: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention forward. q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k, head_dim),
    fp16 or bf16, last dim contiguous, other strides free. softmax_scale defaults to head_dim ** -0.5; causal
    lets query i see key j iff j <= i + seqlen_k - seqlen_q. Returns out (shaped like q; written into `out` if
    given) and lse, float32 (batch, nheads, seqlen_q), the natural-log softmax normaliser. A head_dim that is not a
    multiple of 8 runs zero-padded (a copy), softmax_scale defaulting to the true head_dim's. window_size, softcap,
    alibi_slopes and sink as in fa2.attention; lse includes the sink (fa2.ops.sink_grad gives its gradient from fwd's
    results). dropout_p > 0 needs rng_state, an int64 (seed, offset) tensor on q's device that fa2.bwd gets too
    (fa2.reference.dropout_keep_mask gives the mask it draws)."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        ops.check_tensors(q=q, k=k, v=v)
    features = (*_features(window_size, softcap, alibi_slopes, dropout_p, rng_state), ops.sink_logits(sink))
    head_dim = ops.unaligned_head_dim(q, k, v)
    if head_dim:
        scale = ops.true_scale(softmax_scale, head_dim)
        o, lse = fwd(*ops.pad_head_dim(q, k, v), softmax_scale=scale, causal=causal, window_size=window_size,
                     softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                     rng_state=rng_state, sink=sink)
        return _unpad(o, head_dim, "out", out), lse
    if out is None:
        return ops.call(ops.FWD, q, k, v, softmax_scale, bool(causal), False, *features)
    ops.check_tensors(out=out)
    return out, ops.call(ops.FWD_OUT, q, k, v, None, None, 0, 0, softmax_scale, bool(causal), out, *features)


def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
        softmax_scale: Optional[float] = None, causal: bool = False, dq: Optional[Tensor] = None,
        dk: Optional[Tensor] = None, dv: Optional[Tensor] = None, deterministic: bool = False,
        window_size=(-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
        rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Attention backward from fwd's out and lse (P is recomputed, never stored). dout may have any strides.
    Gradients are written into dq/dk/dv if given. deterministic=True computes dQ without atomics, so it is
    bit-for-bit repeatable (and slower). window_size, softcap, alibi_slopes, dropout_p and rng_state must be the
    forward's."""
    _check_out_missing(out, "fwd")
    ops.check_tensors(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    features = _features(window_size, softcap, alibi_slopes, dropout_p, rng_state)
    head_dim = ops.unaligned_head_dim(q, k, v, dout, out)
    if head_dim:
        grads = bwd(*ops.pad_head_dim(dout, q, k, v, out), lse, softmax_scale=ops.true_scale(softmax_scale, head_dim),
                    causal=causal, deterministic=deterministic, window_size=window_size, softcap=softcap,
                    alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state)
        return tuple(_unpad(g, head_dim, n, b) for g, n, b in zip(grads, ("dq", "dk", "dv"), (dq, dk, dv)))
    if dq is None and dk is None and dv is None:
        return ops.call(ops.BWD, dout, q, k, v, out, lse, softmax_scale, bool(causal), bool(deterministic), *features)
    ops.check_tensors(**{name: t for name, t in (("dq", dq), ("dk", dk), ("dv", dv)) if t is not None})
    dq, dk, dv = (_empty_like(t) if g is None else g for t, g in ((q, dq), (k, dk), (v, dv)))
    ops.call(ops.BWD_OUT, dout, q, k, v, out, lse, None, None, 0, 0, softmax_scale, bool(causal), bool(deterministic),
             dq, dk, dv, *features)
    return dq, dk, dv


def fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, *, softmax_scale: Optional[float] = None, causal: bool = False,
               out: Optional[Tensor] = None, window_size=(-1, -1), softcap: float = 0.0,
               alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None,
               sink: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention forward over packed sequences, sequence b owning tokens [cu_seqlens[b], cu_seqlens[b + 1]) of dim 0.
    q: (total_q, nheads, head_dim); k, v: (total_k, nheads_k, head_dim); cu_seqlens_q/k: int32 (batch + 1,)
    cumulative lengths on q's device; max_seqlen_q/k: the longest lengths (Python ints). causal is bottom-right
    aligned per sequence. The kernels read the offsets on the GPU: nothing is padded or copied. Returns out (like q)
    and lse, float32 (nheads, total_q). window_size, softcap, alibi_slopes, dropout (rows and columns counted per
    sequence, b the sequence) and sink as in fa2.fwd, per sequence."""
    ops.check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    ops.check_max_seqlens(max_seqlen_q, max_seqlen_k)
    ops.check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    features = (*_features(window_size, softcap, alibi_slopes, dropout_p, rng_state), ops.sink_logits(sink))
    head_dim = ops.unaligned_head_dim(q, k, v)
    if head_dim:
        o, lse = fwd_varlen(*ops.pad_head_dim(q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale=ops.true_scale(softmax_scale, head_dim), causal=causal,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            dropout_p=dropout_p, rng_state=rng_state, sink=sink)
        return _unpad(o, head_dim, "out", out), lse
    if out is None:
        return ops.call(ops.FWD_VARLEN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        bool(causal), False, *features)
    ops.check_tensors(out=out)
    return out, ops.call(ops.FWD_OUT, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                         bool(causal), out, *features)


def bwd_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: Optional[float] = None,
               causal: bool = False, dq: Optional[Tensor] = None, dk: Optional[Tensor] = None,
               dv: Optional[Tensor] = None, deterministic: bool = False, window_size=(-1, -1),
               softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
               rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Attention backward over packed sequences, from fwd_varlen's out and lse (see fa2.bwd)."""
    _check_out_missing(out, "fwd_varlen")
    ops.check_tensors(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    ops.check_max_seqlens(max_seqlen_q, max_seqlen_k)
    ops.check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    features = _features(window_size, softcap, alibi_slopes, dropout_p, rng_state)
    head_dim = ops.unaligned_head_dim(q, k, v, dout, out)
    if head_dim:
        grads = bwd_varlen(*ops.pad_head_dim(dout, q, k, v, out), lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale=ops.true_scale(softmax_scale, head_dim), causal=causal,
                           deterministic=deterministic, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state)
        return tuple(_unpad(g, head_dim, n, b) for g, n, b in zip(grads, ("dq", "dk", "dv"), (dq, dk, dv)))
    if dq is None and dk is None and dv is None:
        return ops.call(ops.BWD_VARLEN, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, bool(causal), bool(deterministic), *features)
    ops.check_tensors(**{name: t for name, t in (("dq", dq), ("dk", dk), ("dv", dv)) if t is not None})
    dq, dk, dv = (_empty_like(t) if g is None else g for t, g in ((q, dq), (k, dk), (v, dv)))
    ops.call(ops.BWD_OUT, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, bool(causal), bool(deterministic), dq, dk, dv, *features)
    return dq, dk, dv

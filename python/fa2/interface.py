"""The public API: argument checking (once, here), output allocation through torch, and the launch of
the compiled kernels in fa2._C on the current CUDA stream. The C++ side re-checks sizes, so a bad call
can never write out of bounds; the checks here exist to give a message that names the argument."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

try:
    from fa2 import _C
except ImportError as e:  # a source checkout without a build, or a broken install
    _C = None
    _IMPORT_ERROR = e

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def build_info() -> dict:
    """What this build compiled: CUDA version, GPU archs, head dims and dtypes."""
    return _ext().build_info()


def _ext():
    if _C is None:
        raise RuntimeError(f"fa2's CUDA extension is not built ({_IMPORT_ERROR}); install the package with `pip install .`")
    return _C


def _strides(t: torch.Tensor) -> Tuple[int, int, int]:
    return (t.stride(0), t.stride(1), t.stride(2))


def _check_layout(name: str, t: torch.Tensor) -> None:
    """Last dim contiguous and 16-byte aligned rows: the kernels move 16 bytes per thread (cp.async)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}: "
                         f"call {name}.contiguous()")
    misaligned = any(t.size(i) > 1 and t.stride(i) % 8 != 0 for i in range(3)) or t.data_ptr() % 16 != 0
    if t.numel() > 0 and misaligned:
        raise ValueError(f"{name} rows must start on 16-byte boundaries (strides multiple of 8 elements), got strides "
                         f"{tuple(t.stride())}: call {name}.contiguous()")


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}: cast it (e.g. {name}.to(torch.bfloat16))"
                            f" or run under torch.autocast")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, head_dim), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, _, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be (batch={b}, seqlen_k, nheads_k, head_dim={d}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)}, got {tuple(v.shape)}")
    hk = k.shape[2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"nheads of q ({h}) must be a multiple of nheads of k and v ({hk}) (GQA/MQA)")
    if d % 8 != 0 or d > 256 or d == 0:
        raise ValueError(f"head_dim must be a multiple of 8 between 8 and 256, got {d}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, t)


def _check_device(**tensors) -> None:
    """All on one CUDA device of an sm80+ GPU. Runs after the shape checks, so those work on CPU tensors too."""
    for name, t in tensors.items():
        if t is not None and t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}: move it with {name}.cuda()")
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on the same device, got {devices}")
    device = next(iter(devices.values()))
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise RuntimeError(f"fa2 needs an sm80+ GPU (Ampere or newer); {device} is sm{major}{minor}")


def _check_out(name: str, t: Optional[torch.Tensor], like: torch.Tensor, shape) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must be a {like.dtype} tensor of shape {tuple(shape)} on {like.device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    _check_layout(name, t)


def _scale(softmax_scale: Optional[float], head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return softmax_scale


def _launch_args(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> dict:
    b, sq, h, d = q.shape
    return dict(batch=b, seqlen_q=sq, seqlen_k=k.shape[1], nheads=h, nheads_k=k.shape[2], head_dim=d,
                softmax_scale=scale, causal=bool(causal), dtype=_DTYPES[q.dtype], device=q.device.index,
                stream=torch.cuda.current_stream(q.device).cuda_stream)


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float] = None,
        causal: bool = False, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k, head_dim).
    Returns out (like q) and lse (batch, nheads, seqlen_q) float32, the natural-log softmax normaliser.
    causal masks key j for query i when j > i + seqlen_k - seqlen_q (aligned to the bottom-right)."""
    _check_qkv(q, k, v)
    b, sq, h, d = q.shape
    _check_out("out", out, q, q.shape)
    scale = _scale(softmax_scale, d)
    _check_device(q=q, k=k, v=v, out=out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys at all: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    with torch.cuda.device(q.device):
        _ext().fwd(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr(),
                   q_stride=_strides(q), k_stride=_strides(k), v_stride=_strides(v), out_stride=_strides(out),
                   **_launch_args(q, k, scale, causal))
    return out, lse


def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, *, softmax_scale: Optional[float] = None, causal: bool = False,
        dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
        deterministic: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from the forward's out and lse (P is recomputed, never stored).
    deterministic=True computes dQ without atomics, so it is bit-for-bit repeatable (and slower)."""
    _check_qkv(q, k, v)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be a {q.dtype} tensor shaped like q {tuple(q.shape)} on {q.device}")
    _check_layout("out", out)
    if not isinstance(lse, torch.Tensor) or lse.shape != (b, h, sq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be the contiguous float32 (batch, nheads, seqlen_q) = {(b, h, sq)} tensor from fwd")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_out(name, t, like, like.shape)
    _check_device(q=q, k=k, v=v, out=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv)
    if dout.stride(-1) != 1 or any(dout.size(i) > 1 and dout.stride(i) % 8 for i in range(3)) or dout.data_ptr() % 16:
        dout = dout.contiguous()  # gradients often arrive broadcast or transposed
    scale = _scale(softmax_scale, d)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if q.numel() == 0 or sk == 0:
        for t in (dq, dk, dv):
            t.zero_()
        return dq, dk, dv
    # The kernels write one dK/dV slice per query head; GQA/MQA groups are summed below.
    grouped = hk != h
    dk_heads = torch.empty((b, sk, h, d), dtype=q.dtype, device=q.device) if grouped else dk
    dv_heads = torch.empty((b, sk, h, d), dtype=q.dtype, device=q.device) if grouped else dv
    dq_accum = torch.empty((b, h, sq, d), dtype=torch.float32, device=q.device)
    d_sum = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        _ext().bwd(dout=dout.data_ptr(), q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                   lse=lse.data_ptr(), dq=dq.data_ptr(), dk=dk_heads.data_ptr(), dv=dv_heads.data_ptr(),
                   dq_accum=dq_accum.data_ptr(), d_sum=d_sum.data_ptr(), dout_stride=_strides(dout),
                   q_stride=_strides(q), k_stride=_strides(k), v_stride=_strides(v), out_stride=_strides(out),
                   dq_stride=_strides(dq), dk_stride=_strides(dk_heads), dv_stride=_strides(dv_heads),
                   deterministic=bool(deterministic), **_launch_args(q, k, scale, causal))
    if grouped:
        torch.sum(dk_heads.view(b, sk, hk, h // hk, d), dim=3, out=dk)
        torch.sum(dv_heads.view(b, sk, hk, h // hk, d), dim=3, out=dv)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        out, lse = fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)  # O(N) memory: no N x N tensor is kept
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd(dout, q, k, v, out, lse, softmax_scale=ctx.softmax_scale, causal=ctx.causal)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        return (dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * softmax_scale [+ causal mask]) v, differentiable in q, k and v.
    Layout (batch, seqlen, nheads, head_dim); k/v may have fewer heads (GQA/MQA)."""
    return _Attention.apply(q, k, v, causal, softmax_scale)

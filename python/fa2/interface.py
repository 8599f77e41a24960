"""The public API: argument checks (once, here), allocation through torch, and the launch of fa2._C's
kernels on the current CUDA stream. The C++ side re-checks sizes so that a bad call can never write out of
bounds; the checks here exist to give a message that names the argument and the fix.

Nothing here reads tensor values on the host (no .item(), no branching on data), so fwd and bwd can be
wrapped as torch.library custom ops (ops.py, with autograd) and captured in CUDA graphs."""
from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Optional, Tuple

import torch

try:
    import fa2._C as _C
except ImportError as e:  # a source checkout without a build, or a broken install
    _C, _IMPORT_ERROR = None, e

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# FA2_NVTX=1: an NVTX range around every kernel launch (fa2.fwd / fa2.bwd), for Nsight timelines and
# `ncu --nvtx --nvtx-include "fa2.bwd/"`. Off by default: a range costs a few microseconds of host time.
_NVTX = os.environ.get("FA2_NVTX", "0") not in ("", "0")
_FLOAT_TINY = 2.0 ** -126  # the smallest normal float32


def _ext():
    if _C is None:
        raise RuntimeError(f"fa2's CUDA extension fa2._C is not built ({_IMPORT_ERROR}). Build and install it with "
                           "`pip install .` from the repository root (needs nvcc), and import fa2 from the "
                           "installed package rather than from the source tree.")
    return _C


def build_info() -> dict:
    """What this build compiled: version, cuda_version, archs, fwd_head_dims, bwd_head_dims, dtypes."""
    return _ext().build_info()


@functools.lru_cache(maxsize=None)
def _compiled() -> dict:
    return build_info()


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


# ----------------------------------------------------------------------------------------------- checks
def _check_tensor(name: str, t, *, dtype: torch.dtype, shape: tuple, what: str) -> None:
    """t is a tensor of this dtype and shape (`what` says where that requirement comes from)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor ({what}), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def _loadable(t: torch.Tensor) -> bool:
    """The kernels move 16-byte chunks (cp.async): last dim contiguous, every row 16-byte aligned."""
    aligned = t.data_ptr() % 16 == 0 and all(t.stride(i) % 8 == 0 for i in range(t.dim() - 1) if t.size(i) > 1)
    return t.stride(-1) == 1 and (aligned or t.numel() == 0)


def _check_loadable(name: str, t: torch.Tensor, fix: str = "") -> None:
    fix = fix or f"pass {name}.contiguous()"
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}: {fix}")
    if not _loadable(t):
        raise ValueError(f"{name} must start on a 16-byte boundary with strides that are multiples of 8 elements, "
                         f"got strides {t.stride()} (data_ptr % 16 = {t.data_ptr() % 16}): {fix}")


def _check_qkv(q, k, v, softmax_scale, varlen: bool = False) -> None:
    """q, k, v and the scale, before any device check (so CPU tensors reach every message). Padded batches
    are (batch, seqlen, nheads, head_dim); packed ones (varlen) (total_tokens, nheads, head_dim)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}: cast it (e.g. "
                            f"{name}.to(torch.bfloat16)), or call fa2.attention inside torch.autocast")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}: cast k and v to "
                        f"q's dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if varlen and t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, nheads, head_dim): the sequences packed one after "
                             f"another along dim 0, got shape {tuple(t.shape)}")
        if not varlen and t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, head_dim), got shape {tuple(t.shape)}; "
                             f"for a single sequence use {name}.unsqueeze(0)")
    nheads, head_dim = q.shape[-2:]
    if varlen and k.shape[-1] != head_dim:
        raise ValueError(f"k must be (total_k, nheads_k, head_dim={head_dim}) to match q of shape {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    if not varlen and (k.shape[0] != q.shape[0] or k.shape[3] != head_dim):
        raise ValueError(f"k must be (batch={q.shape[0]}, seqlen_k, nheads_k, head_dim={head_dim}) to match q of "
                         f"shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the same shape as k {tuple(k.shape)}, got {tuple(v.shape)}")
    nheads_k = k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"q's nheads ({nheads}) must be a multiple of k's and v's nheads_k ({nheads_k}) "
                         f"(GQA/MQA: each K/V head serves nheads // nheads_k query heads)")
    if head_dim % 8 != 0 or not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim (last dim of q, k, v) must be a multiple of 8 in [8, 256], got {head_dim}: "
                         f"zero-pad q, k and v to a multiple of 8 (and pass softmax_scale for the true head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_loadable(name, t)
    # The online softmax keeps the max of unscaled scores, which is only the max of scaled ones for scale > 0;
    # the kernels scale in float with denormals flushed, where a smaller scale is 0 and masked scores NaN.
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale >= _FLOAT_TINY):
        raise ValueError(f"softmax_scale must be a positive finite number (at least {_FLOAT_TINY:.3g}, float's "
                         f"smallest normal) or None (head_dim ** -0.5), got {softmax_scale}")


def _check_buffer(name: str, t, like: torch.Tensor, like_name: str) -> None:
    """An optional buffer (out, dq, dk, dv; or fwd's out in bwd): like `like` in dtype and shape, and loadable."""
    if t is None:
        return
    _check_tensor(name, t, dtype=like.dtype, shape=like.shape, what=f"like {like_name}")
    _check_loadable(name, t, fix=f"allocate it with torch.empty_like({like_name})")


def _check_device_and_build(kind: str, q: torch.Tensor, **tensors) -> None:
    """After the shape checks: every tensor on q's CUDA device, an sm80+ GPU, a kernel in this build."""
    for name, t in (("q", q), *tensors.items()):
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}: move it with {name}.cuda()")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: put every tensor on one GPU")
    major, minor = _capability(q.device.index)
    if major < 8:
        raise RuntimeError(f"fa2 needs an sm80+ GPU (Ampere or newer); {q.device} is sm{major}{minor}")
    info, head_dim, dtype = _compiled(), q.shape[-1], _DTYPE_NAMES[q.dtype]
    if dtype not in info["dtypes"]:
        raise ValueError(f"this build of fa2 has no {dtype} kernels (it has {info['dtypes']}): cast q, k and v, or "
                         f"rebuild with FA2_DTYPES including {dtype}")
    head_dims = info[f"{kind}_head_dims"]
    if not head_dims or head_dim > max(head_dims):
        raise ValueError(f"head_dim {head_dim} needs a {kind} kernel for a head dim >= {head_dim}, and this build has "
                         f"{head_dims}: rebuild with FA2_HEAD_DIMS including one")


def _remembered(check):
    """The checks are pure functions of tensor metadata (and of this build and GPU), and a training loop
    makes the same call over and over: metadata that passed once skips them next time. They were a third of
    fa2.fwd's host time (bench/host_overhead.py). Anything unusual (non-tensors, unhashable values) takes the
    full checks every time."""
    passed = set()

    @functools.wraps(check)
    def remembered(*args):
        try:
            key = tuple((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16) if isinstance(a, torch.Tensor)
                        else a for a in args)
            if key in passed:
                return
        except Exception:  # e.g. a list where a tensor belongs: the check itself says what is wrong
            return check(*args)
        check(*args)
        if len(passed) < 4096:
            passed.add(key)
    return remembered


@_remembered
def _check_fwd(q, k, v, out, softmax_scale) -> None:
    _check_qkv(q, k, v, softmax_scale)
    _check_buffer("out", out, q, "q")
    _check_device_and_build("fwd", q, k=k, v=v, out=out)


def _check_bwd_tensors(dout, q, k, v, out, lse, dq, dk, dv, *, lse_shape: tuple, fwd_name: str) -> None:
    """What the backward takes beyond q, k, v (padded and varlen alike): dout, fwd's out and lse, buffers."""
    _check_tensor("dout", dout, dtype=q.dtype, shape=q.shape, what="like q")  # any strides: copied if needed
    if out is None:
        raise TypeError(f"out must be the output tensor of {fwd_name}, got None")
    _check_buffer("out", out, q, "q")
    _check_tensor("lse", lse, dtype=torch.float32, shape=lse_shape, what=f"{fwd_name}'s lse")
    if not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous, got strides {lse.stride()}: pass lse.contiguous()")
    for name, t, like, like_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        _check_buffer(name, t, like, like_name)


@_remembered
def _check_bwd(dout, q, k, v, out, lse, softmax_scale, dq, dk, dv) -> None:
    _check_qkv(q, k, v, softmax_scale)
    batch, seqlen_q, nheads, _ = q.shape
    _check_bwd_tensors(dout, q, k, v, out, lse, dq, dk, dv, lse_shape=(batch, nheads, seqlen_q), fwd_name="fwd")
    _check_device_and_build("bwd", q, k=k, v=v, out=out, dout=dout, lse=lse, dq=dq, dk=dk, dv=dv)


# ----------------------------------------------------------------------------------------------- launch
def _launch(name: str, q, k, softmax_scale, causal, strided: dict, workspaces: dict, **flags) -> None:
    """Call _C.fwd / _C.bwd: pointers, (batch, row, head) strides in elements of the 4-D operands, sizes.
    `flags` are passed on and override the sizes read off q and k (varlen.py passes its own)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    softmax_scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    args = {name: t.data_ptr() for name, t in {**strided, **workspaces}.items()}
    args.update({f"{name}_stride": tuple(t.stride()[:3]) for name, t in strided.items()})
    args.update(batch=batch, seqlen_q=seqlen_q, seqlen_k=k.shape[1], nheads=nheads, nheads_k=k.shape[2],
                head_dim=head_dim, softmax_scale=softmax_scale, causal=bool(causal), dtype=_DTYPE_NAMES[q.dtype],
                device=q.device.index, stream=_current_stream(q.device.index))
    args.update(flags)
    nvtx = torch.cuda.nvtx.range(f"fa2.{name}") if _NVTX else contextlib.nullcontext()
    with _device_guard(q.device.index), nvtx:
        getattr(_ext(), name)(**args)


_device_guard = torch.cuda.device  # the launch's current-device guard (CPU tests replace it, never torch.cuda's own)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds of torch


def _current_stream(device_index: int) -> int:
    """The current CUDA stream as an integer (cudaStream_t), without building a torch.cuda.Stream object."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _new(like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    return torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)


def _dkv_per_query_head(q, dk, dv):
    """Where the kernels write dK and dV: one slice per query head. For GQA/MQA those slices are float32 and
    each group is summed (_sum_groups) before the one rounding to the input dtype (rounding each slice first
    loses accuracy); otherwise straight into dk and dv. Returns (dk_heads, dv_heads, grouped)."""
    if q.shape[-2] == dk.shape[-2]:
        return dk, dv, False
    shape = (*dk.shape[:-2], q.shape[-2], dk.shape[-1])
    return _new(q, shape, torch.float32), _new(q, shape, torch.float32), True


def _sum_groups(dk, dv, dk_heads, dv_heads) -> None:
    """dk, dv (..., nheads_k, head_dim) = the sums over each group of query-head slices in dk_heads, dv_heads."""
    nheads_k, head_dim = dk.shape[-2:]
    group = dk_heads.shape[-2] // nheads_k
    for grad, heads in ((dk, dk_heads), (dv, dv_heads)):
        grad.copy_(heads.view(*heads.shape[:-2], nheads_k, group, head_dim).sum(dim=-2))


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float] = None,
        causal: bool = False, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k, head_dim),
    fp16 or bf16, last dim contiguous, other strides free. softmax_scale defaults to head_dim ** -0.5; causal
    lets query i see key j iff j <= i + seqlen_k - seqlen_q. Returns out (shaped like q; written into `out` if
    given) and lse, float32 (batch, nheads, seqlen_q), the natural-log softmax normaliser."""
    _check_fwd(q, k, v, out, softmax_scale)
    batch, seqlen_q, nheads, head_dim = q.shape
    out = _new(q) if out is None else out
    lse = _new(q, (batch, nheads, seqlen_q), torch.float32)
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys: every row is empty
        return out.zero_(), lse.fill_(-math.inf)
    _launch("fwd", q, k, softmax_scale, causal, dict(q=q, k=k, v=v, out=out), dict(lse=lse))
    return out, lse


def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, *, softmax_scale: Optional[float] = None, causal: bool = False,
        dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
        deterministic: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward from fwd's out and lse (P is recomputed, never stored). dout may have any strides.
    Gradients are written into dq/dk/dv if given. deterministic=True computes dQ without atomics, so it is
    bit-for-bit repeatable (and slower)."""
    _check_bwd(dout, q, k, v, out, lse, softmax_scale, dq, dk, dv)
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    dout = dout if _loadable(dout) else dout.contiguous()  # gradients often arrive transposed or broadcast
    dq, dk, dv = (_new(t) if g is None else g for t, g in ((q, dq), (k, dk), (v, dv)))
    if q.numel() == 0 or seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dk_heads, dv_heads, grouped = _dkv_per_query_head(q, dk, dv)
    dq_accum = _new(q, (batch, nheads, seqlen_q, head_dim), torch.float32)
    d_sum = _new(q, (batch, nheads, seqlen_q), torch.float32)
    _launch("bwd", q, k, softmax_scale, causal,
            dict(dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk_heads, dv=dv_heads),
            dict(lse=lse, dq_accum=dq_accum, d_sum=d_sum), deterministic=bool(deterministic), dkv_fp32=grouped)
    if grouped:
        _sum_groups(dk, dv, dk_heads, dv_heads)
    return dq, dk, dv

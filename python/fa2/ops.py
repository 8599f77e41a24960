"""fa2's kernels as torch.library ops, and the autograd-aware entry points built on them.

The ops' schemas, fake implementations (shapes only, for torch.compile) and autograd formula are defined here;
their one implementation is C++ (csrc/host/ops.cpp, registered when fa2._C is imported): argument checks with
messages that name the argument and the fix, allocation, the current stream and the launch all happen there, so
an eager call spends its host time in C++ rather than in Python.

Two paths share those ops:
- Eager calls take `_Attention`, an autograd.Function that calls the ops below the autograd dispatch key (no
  Python autograd kernel per call).
- Anything else that sees the call (torch.compile, fake-tensor or other dispatch modes, tensor subclasses) takes
  the op itself, whose autograd is registered here: AOT autograd then puts fa2::fwd in the forward graph and
  fa2::bwd in the backward one, with only q, k, v, out and lse (and cu_seqlens) saved between them.

`deterministic` is an argument of the forward ops although the forward ignores it: setup_context sees only the
op's inputs, and that is how the flag reaches the backward. The ops never read tensor values on the host while a
CUDA graph is captured (the varlen checks of cu_seqlens values are skipped then), so a training step can be captured.
"""
from typing import Optional

import torch
from torch import Tensor

_LIB = torch.library.Library("fa2", "DEF")
_SCHEMAS = {
    "fwd": "fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal, bool deterministic=False) "
           "-> (Tensor, Tensor)",
    "bwd": "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? softmax_scale, bool causal, "
           "bool deterministic) -> (Tensor, Tensor, Tensor)",
    "fwd_varlen": "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                  "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
                  "bool deterministic=False) -> (Tensor, Tensor)",
    "bwd_varlen": "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                  "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
                  "bool deterministic) -> (Tensor, Tensor, Tensor)",
    # fa2.fwd / fa2.bwd (and the varlen pair) with caller-provided outputs; cu_seqlens None for padded batches.
    "fwd_out": "fwd_out(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
               "SymInt max_seqlen_k, float? softmax_scale, bool causal, Tensor(a!) out) -> Tensor",
    "bwd_out": "bwd_out(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
               "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
               "bool deterministic, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv) -> ()",
}
for _schema in _SCHEMAS.values():
    _LIB.define(_schema)

try:
    import fa2._C as _C  # registers the C++ implementations of the ops above
    _IMPORT_ERROR = None
except ImportError as e:  # a source checkout without a build, or a broken install
    _C, _IMPORT_ERROR = None, e


def not_built() -> RuntimeError:
    return RuntimeError(f"fa2's CUDA extension fa2._C is not built ({_IMPORT_ERROR}). Build and install it as the "
                        "README says (`python -m pip install --no-build-isolation .` from the repository root, with "
                        "torch and nvcc installed), and import fa2 from the installed package, not the source tree.")


def extension():
    """The compiled module fa2._C, or the error saying how to build it."""
    if _C is None:
        raise not_built()
    return _C


if _C is None:
    def _missing(*args, **kwargs):
        raise not_built()
    for _name in _SCHEMAS:
        _LIB.impl(_name, _missing, "CompositeExplicitAutograd")


# ----------------------------------------------------------------------------------------------- fakes
def _fwd_fake(q, k, v, *args):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _bwd_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_out_fake(q, k, v, *args):
    return _fwd_fake(q, k, v)[1]


for _name, _fake in (("fwd", _fwd_fake), ("fwd_varlen", _fwd_fake), ("bwd", _bwd_fake), ("bwd_varlen", _bwd_fake),
                     ("fwd_out", _fwd_out_fake), ("bwd_out", lambda *args: None)):
    torch.library.register_fake(f"fa2::{_name}", _fake, lib=_LIB)

FWD, BWD = torch.ops.fa2.fwd.default, torch.ops.fa2.bwd.default
FWD_VARLEN, BWD_VARLEN = torch.ops.fa2.fwd_varlen.default, torch.ops.fa2.bwd_varlen.default
FWD_OUT, BWD_OUT = torch.ops.fa2.fwd_out.default, torch.ops.fa2.bwd_out.default

_TYPE_ERROR = "TypeError: "  # csrc/host/ops.cpp's mark for a TypeError (C++ exceptions reach Python as ValueError)
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _typed(e: ValueError) -> Exception:
    """C++'s error as Python should see it: a TypeError where its message carries the mark."""
    message = str(e)
    return TypeError(message[len(_TYPE_ERROR):]) if message.startswith(_TYPE_ERROR) else e


def call(op, *args):
    """op(*args) below the autograd key (eager: the caller does autograd), with C++'s TypeErrors as TypeError."""
    try:
        with _below_autograd():
            return op(*args)
    except ValueError as e:
        error = _typed(e)
        if error is e:
            raise
        raise error from None


def check_tensors(**tensors) -> None:
    """Anything that is not a tensor where one belongs (the op's own message would not name the argument)."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_max_seqlens(max_seqlen_q, max_seqlen_k) -> None:
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, (bool, Tensor)) or not hasattr(m, "__index__") or m < 0:
            raise TypeError(f"{name} must be a non-negative Python int (the longest sequence), got {m!r}")


# ----------------------------------------------------------------------------------------------- head dims
def unaligned_head_dim(*tensors: Tensor) -> int:
    """The head dim of q, k, v (and friends) where the kernels cannot take it as it is but zero-padding can make
    it fit: the same last dim everywhere, not a multiple of 8 (the kernels move 16-byte chunks), below 256.
    0 otherwise, including every aligned head dim (those run as they are, with no copy) and anything the op's own
    checks should reject with their message (mismatched or too large head dims)."""
    head_dim = tensors[0].shape[-1]
    if head_dim % 8 == 0 or head_dim > 256 or any(t.shape[-1] != head_dim for t in tensors[1:]):
        return 0
    return head_dim


def true_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    """softmax_scale, defaulting to the true (unpadded) head dim's."""
    return head_dim ** -0.5 if softmax_scale is None else softmax_scale


def pad_head_dim(*tensors: Tensor):
    """Zero columns up to the next multiple of 8, as flash-attn pads: they add 0 to every score, and the output's
    and gradients' extra columns are sliced off (the caller passes softmax_scale for the true head dim)."""
    pad = -tensors[0].shape[-1] % 8
    return [torch.nn.functional.pad(t, (0, pad)) for t in tensors]


# ----------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    """Save q, k, v, out and lse (O(seqlen) memory: no seqlen_q x seqlen_k tensor) and, for varlen, the
    cu_seqlens; keep the other arguments. The bwd ops take them in this order: tensors, then the rest."""
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(a for a in rest if isinstance(a, Tensor)))
    ctx.args = [a for a in rest if not isinstance(a, Tensor)]
    ctx.mark_non_differentiable(lse)  # the kernels have no gradient for lse


def _backward(ctx, dout, _dlse):  # traced by AOT autograd: calls the bwd ops
    q, k, v, out, lse, *cu_seqlens = ctx.saved_tensors
    bwd = torch.ops.fa2.bwd_varlen if cu_seqlens else torch.ops.fa2.bwd
    grads = bwd(dout, q, k, v, out, lse, *cu_seqlens, *ctx.args)
    return (*grads, *(None,) * (len(ctx.needs_input_grad) - 3))


torch.library.register_autograd("fa2::fwd", _backward, setup_context=_setup_context, lib=_LIB)
torch.library.register_autograd("fa2::fwd_varlen", _backward, setup_context=_setup_context, lib=_LIB)


class _Attention(torch.autograd.Function):
    """The eager twin of the ops' autograd: the same formula, calling the C++ ops directly. (Old-style
    forward(ctx, ...): with a separate setup_context, apply() binds arguments through inspect.signature on every
    call, which costs more host time than the C++ op.)"""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        varlen = isinstance(args[0], Tensor)
        out, lse = call(FWD_VARLEN if varlen else FWD, q, k, v, *args)
        if varlen:
            ctx.save_for_backward(q, k, v, out, lse, args[0], args[1])
            ctx.args = args[2:]
        else:
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = args
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        grads = call(BWD_VARLEN if len(saved) == 7 else BWD, dout, *saved, *ctx.args)
        return (*grads, *(None,) * (len(ctx.needs_input_grad) - 3))


# Function.apply without its Python wrapper (which binds arguments and filters them on every call); what it does
# that matters here is kept: the functorch check, and unwrapping tensors that a finished torch.func transform left.
_apply = super(torch.autograd.Function, _Attention).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _attend(op, q, k, v, *args) -> Tensor:
    head_dim = unaligned_head_dim(q, k, v)
    if head_dim:  # zero-padded; softmax_scale (args[-3] of both ops) from the true head dim
        args = (*args[:-3], true_scale(args[-3], head_dim), *args[-2:])
        return _attend(op, *pad_head_dim(q, k, v), *args)[..., :head_dim]
    if torch.is_autocast_enabled("cuda"):  # floating inputs run in the autocast dtype, as for torch's own SDPA
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(dtype) if isinstance(t, Tensor) and t.is_cuda and t.is_floating_point() else t
                   for t in (q, k, v))
    if type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and not torch.compiler.is_compiling() \
            and torch._C._len_torch_dispatch_stack() == 0:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            if torch._C._are_functorch_transforms_active():
                return _Attention.apply(q, k, v, *args)
            return _apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), *args)
        return call(op, q, k, v, *args)[0]
    # torch.compile (one opaque node, traced through its fake), fake-tensor or other dispatch modes, subclasses:
    # the op with its registered autograd. In a compiled graph the op's checks run past this layer, so a TypeError
    # of theirs arrives as a ValueError whose message starts with "TypeError: ".
    try:
        return op(q, k, v, *args)[0]
    except ValueError as e:
        error = _typed(e)
        if error is e:
            raise
        raise error from None


# ----------------------------------------------------------------------------------------------- public
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
              deterministic: bool = False) -> Tensor:
    """softmax(q k^T * softmax_scale [causal mask]) v, differentiable in q, k and v. Layout
    (batch, seqlen, nheads, head_dim); k and v may have fewer heads (GQA/MQA). Any head_dim up to 256: one that is
    not a multiple of 8 runs zero-padded (a copy; softmax_scale defaults to the true head_dim ** -0.5). Returns out,
    shaped like q.
    deterministic=True makes the backward bit-for-bit repeatable (see fa2.bwd)."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        check_tensors(q=q, k=k, v=v)
    return _attend(FWD, q, k, v, softmax_scale, bool(causal), bool(deterministic))


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, softmax_scale: Optional[float] = None,
                     deterministic: bool = False) -> Tensor:
    """fa2.attention over packed sequences (layout as fa2.fwd_varlen): q (total_q, nheads, head_dim), k and v
    (total_k, nheads_k, head_dim), sequence b owning rows [cu_seqlens[b], cu_seqlens[b + 1])."""
    check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if not torch.compiler.is_compiling():
        check_max_seqlens(max_seqlen_q, max_seqlen_k)
    return _attend(FWD_VARLEN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   bool(causal), bool(deterministic))

"""fa2's kernels as torch.library custom ops, and the autograd-aware entry points built on them.

To torch.compile a custom op is one opaque node: it is traced through its fake implementation (output
shapes only, no data), so a model calling fa2.attention compiles without a graph break, and the real op
(with all of interface.py's checks) runs at run time. The backward is registered on the forward op, so AOT
autograd puts fa2::fwd in the forward graph and fa2::bwd in the backward one, with only q, k, v, out and lse
(and cu_seqlens) saved between them. No op reads tensor values on the host while a CUDA graph is captured
(varlen.py skips its cu_seqlens value checks then), so a whole training step can be captured.

`deterministic` is an argument of the forward ops although the forward ignores it: setup_context sees only
the op's inputs, and that is how the flag reaches the backward.

Host time matters for small attention calls (a training step of a small model is easily CPU-bound), and the
op machinery is not free: measured on the H100 box (bench/host_overhead.py), a torch.library.custom_op
call cost ~100 us more than the function it wraps and custom-op autograd ~4x an autograd.Function. So the
ops are defined with the plain torch.library.Library API (no per-call output checks), and eager calls (not
traced by torch.compile) take an autograd.Function straight to the same implementations."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from fa2 import interface, varlen

_LIB = torch.library.Library("fa2", "DEF")


# ----------------------------------------------------------------------------------------------- the ops
# The implementations take the ops' arguments positionally; trailing defaults may be left out by the caller.
def _fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
         deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    return interface.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)


def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: Optional[float],
         causal: bool, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return interface.bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic)


def _bwd_fake(dout, q, k, v, out, lse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    return varlen.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale=softmax_scale, causal=causal)


def _fwd_varlen_fake(q, k, v, *args):
    total_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((nheads, total_q), dtype=torch.float32)


def _bwd_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float],
                causal: bool, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return varlen.bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale=softmax_scale, causal=causal, deterministic=deterministic)


_OPS = {  # name: (schema, implementation, fake implementation)
    "fwd": ("fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal, bool deterministic=False) "
            "-> (Tensor, Tensor)", _fwd, _fwd_fake),
    "bwd": ("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? softmax_scale, "
            "bool causal, bool deterministic) -> (Tensor, Tensor, Tensor)", _bwd, _bwd_fake),
    "fwd_varlen": ("fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                   "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
                   "bool deterministic=False) -> (Tensor, Tensor)", _fwd_varlen, _fwd_varlen_fake),
    "bwd_varlen": ("bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
                   "float? softmax_scale, bool causal, bool deterministic) -> (Tensor, Tensor, Tensor)",
                   _bwd_varlen, _bwd_fake),
}
for _name, (_schema, _impl, _fake) in _OPS.items():
    _LIB.define(_schema)
    # One Python kernel for every device: interface.py's checks reject non-CUDA tensors with a clear message.
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fa2::{_name}", _fake, lib=_LIB)


# ----------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    """Save q, k, v, out and lse (O(seqlen) memory: no seqlen_q x seqlen_k tensor) and, for varlen, the
    cu_seqlens; keep the other arguments. The bwd ops take them in this order: tensors, then the rest."""
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(a for a in rest if isinstance(a, Tensor)))
    ctx.args = [a for a in rest if not isinstance(a, Tensor)]
    ctx.mark_non_differentiable(lse)  # the kernels have no gradient for lse


def _grads(ctx, dout, bwd, bwd_varlen):
    q, k, v, out, lse, *cu_seqlens = ctx.saved_tensors
    grads = (bwd_varlen if cu_seqlens else bwd)(dout, q, k, v, out, lse, *cu_seqlens, *ctx.args)
    # One gradient per forward input: q, k, v where wanted, None for the rest.
    return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad)),
            *(None,) * (len(ctx.needs_input_grad) - 3))


def _backward(ctx, dout, _dlse):  # traced by AOT autograd: calls the bwd ops
    return _grads(ctx, dout, torch.ops.fa2.bwd, torch.ops.fa2.bwd_varlen)


torch.library.register_autograd("fa2::fwd", _backward, setup_context=_setup_context, lib=_LIB)
torch.library.register_autograd("fa2::fwd_varlen", _backward, setup_context=_setup_context, lib=_LIB)


class _EagerAttention(torch.autograd.Function):
    """The eager twin of the ops' autograd: same setup and backward, calling the implementations directly.
    (Old-style forward(ctx, ...): with a separate setup_context, apply() binds arguments through
    inspect.signature on every call, which costs more host time than the rest of the call.)"""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        output = (_fwd_varlen if isinstance(args[0], Tensor) else _fwd)(q, k, v, *args)
        _setup_context(ctx, (q, k, v, *args), output)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _grads(ctx, dout, _bwd, _bwd_varlen)


def _attend(op, impl, q, k, v, *args) -> Tensor:
    # Through the op whenever something other than plain eager execution sees the call: torch.compile (one
    # opaque node, traced through its fake), fake-tensor or other dispatch modes, tensor subclasses.
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or not type(q) is type(k) is type(v) is Tensor):
        return op(q, k, v, *args)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, *args)[0]
    return impl(q, k, v, *args)[0]


# ----------------------------------------------------------------------------------------------- public
def _input(name: str, t):
    """A tensor argument as the op takes it. Under torch.autocast, floating inputs run in the autocast dtype
    (as for torch's own SDPA); outside it fp32 reaches interface.py's checks and its message."""
    if not isinstance(t, Tensor):  # checked here: the op's schema would reject it with a less helpful error
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_cuda and t.is_floating_point() and torch.is_autocast_enabled("cuda"):
        return t.to(torch.get_autocast_dtype("cuda"))
    return t


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
              deterministic: bool = False) -> Tensor:
    """softmax(q k^T * softmax_scale [causal mask]) v, differentiable in q, k and v. Layout
    (batch, seqlen, nheads, head_dim); k and v may have fewer heads (GQA/MQA). Returns out, shaped like q.
    deterministic=True makes the backward bit-for-bit repeatable (see fa2.bwd)."""
    q, k, v = _input("q", q), _input("k", k), _input("v", v)
    return _attend(torch.ops.fa2.fwd, _fwd, q, k, v, softmax_scale, causal, deterministic)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, softmax_scale: Optional[float] = None,
                     deterministic: bool = False) -> Tensor:
    """fa2.attention over packed sequences (layout as fa2.fwd_varlen): q (total_q, nheads, head_dim), k and v
    (total_k, nheads_k, head_dim), sequence b owning rows [cu_seqlens[b], cu_seqlens[b + 1])."""
    q, k, v = _input("q", q), _input("k", k), _input("v", v)
    return _attend(torch.ops.fa2.fwd_varlen, _fwd_varlen, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, softmax_scale, causal, deterministic)

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
op's inputs, and that is how the flag reaches the backward. The ops never read GPU tensor values on the host (the
Python layer reads cu_seqlens once per tensor pair, not while a CUDA graph is captured), so a training step can be
captured.
"""
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

_LIB = torch.library.Library("fa2", "DEF")
# The options beyond plain attention, last in every schema (fa2.reference has their meaning): the band of visible
# keys, softcap, ALiBi slopes (fp32), dropout with the (seed, offset) it draws from (int64, on the device), and in the
# forward the per-head sink logits (fp32). The backward needs no sink: lse includes it.
_FEATURES = ("int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
             "float dropout_p=0.0, Tensor? rng_state=None")
_SINK = "Tensor? sink=None"
_D_SUM = "Tensor(a!)? d_sum=None"
_SCHEMAS = {
    "fwd": "fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal, bool deterministic=False, "
           f"{_FEATURES}, {_SINK}) -> (Tensor, Tensor)",
    # d_sum, where given: D = rowsum(dO * O) laid out like lse, written by the backward (the sink's gradient needs it).
    "bwd": "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? softmax_scale, bool causal, "
           f"bool deterministic, {_FEATURES}, {_D_SUM}) -> (Tensor, Tensor, Tensor)",
    "fwd_varlen": "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                  "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
                  f"bool deterministic=False, {_FEATURES}, {_SINK}) -> (Tensor, Tensor)",
    "bwd_varlen": "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                  "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
                  f"bool deterministic, {_FEATURES}, {_D_SUM}) -> (Tensor, Tensor, Tensor)",
    # fa2.fwd / fa2.bwd (and the varlen pair) with caller-provided outputs; cu_seqlens None for padded batches.
    "fwd_out": "fwd_out(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
               "SymInt max_seqlen_k, float? softmax_scale, bool causal, Tensor(a!) out, "
               f"{_FEATURES}, {_SINK}) -> Tensor",
    "bwd_out": "bwd_out(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
               "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
               f"bool deterministic, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, {_FEATURES}) -> ()",
    # cu_seqlens' checks with their values read from the GPU (a host wait): check_cu_seqlens_values.
    "check_varlen": "check_varlen(Tensor q, Tensor k, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
                    "SymInt max_seqlen_k) -> ()",
    # fa2.attention_with_kvcache: k and v (the new rows, or None) are written into the caches at cache_seqlens first.
    # cache_seqlens None: cache_seqlen rows for every sequence (-1: the whole capacity less the new rows).
    "fwd_kvcache": "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
                   "Tensor? cache_seqlens, int cache_seqlen, Tensor? cache_batch_idx, Tensor? block_table, "
                   "float? softmax_scale, bool causal, int window_left=-1, int window_right=-1, float softcap=0.0, "
                   "Tensor? alibi_slopes=None, Tensor? sink=None, int num_splits=0, Tensor? rotary_cos=None, "
                   "Tensor? rotary_sin=None, bool rotary_interleaved=False, Tensor? cache_leftpad=None) "
                   "-> (Tensor, Tensor)",
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
                     ("fwd_out", _fwd_out_fake), ("bwd_out", lambda *args: None), ("fwd_kvcache", _fwd_fake),
                     ("check_varlen", lambda *args: None)):
    torch.library.register_fake(f"fa2::{_name}", _fake, lib=_LIB)

FWD, BWD = torch.ops.fa2.fwd.default, torch.ops.fa2.bwd.default
FWD_VARLEN, BWD_VARLEN = torch.ops.fa2.fwd_varlen.default, torch.ops.fa2.bwd_varlen.default
FWD_OUT, BWD_OUT = torch.ops.fa2.fwd_out.default, torch.ops.fa2.bwd_out.default
CHECK_VARLEN = torch.ops.fa2.check_varlen.default
FWD_KVCACHE = torch.ops.fa2.fwd_kvcache.default

_TYPE_ERROR = "TypeError: "  # csrc/host/ops.cpp's mark for a TypeError (C++ exceptions reach Python as ValueError)
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _typed(e: ValueError) -> Exception:
    """C++'s error as Python should see it: a TypeError where its message carries the mark."""
    message = str(e)
    return TypeError(message[len(_TYPE_ERROR):]) if message.startswith(_TYPE_ERROR) else e


def call_traced(op, *args):
    """op(*args) through the dispatcher as it is (torch.compile, fake-tensor or other dispatch modes, subclasses),
    with its checks' TypeErrors as TypeError: in a compiled graph they arrive as ValueErrors whose message starts with
    "TypeError: "."""
    try:
        return op(*args)
    except ValueError as e:
        error = _typed(e)
        if error is e:
            raise
        raise error from None


def call(op, *args):
    """op(*args) below the autograd key (eager: the caller does autograd), with C++'s TypeErrors as TypeError."""
    with _below_autograd():
        return call_traced(op, *args)


def describe(x) -> str:
    """x for an error message: a tensor by its shape and dtype (never its values, which can be millions), a tuple
    or list element by element, anything else by its repr, cut short."""
    if isinstance(x, Tensor):
        return f"a {x.device.type} tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, (tuple, list)) and len(x) <= 8:
        inner = ", ".join(describe(e) for e in x)
        return f"({inner}{',' if len(x) == 1 else ''})" if isinstance(x, tuple) else f"[{inner}]"
    text = repr(x)
    return text if len(text) <= 200 else f"{text[:200]}... ({type(x).__name__})"


def check_tensors(**tensors) -> None:
    """Anything that is not a tensor where one belongs (the op's own message would not name the argument)."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_max_seqlens(max_seqlen_q, max_seqlen_k) -> None:
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, (bool, Tensor)) or not hasattr(m, "__index__") or m < 0:
            raise TypeError(f"{name} must be a non-negative Python int (the longest sequence), got {describe(m)}")


# The pairs of GPU cu_seqlens whose values were read: id pair -> (weak references, versions, what they were checked
# against). A training step that passes one pair to every layer's forward and backward waits once.
_CHECKED_CU_SEQLENS = {}


def check_cu_seqlens_values(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                            max_seqlen_k: int) -> None:
    """cu_seqlens' values on the GPU (start at 0, never decrease, end at q's and k's token counts, within max_seqlen),
    read by the op fa2::check_varlen with a copy and a host wait, once per pair of tensors and version: an in-place
    write (which bumps a tensor's version) is seen, a write the version counter misses (through .data, another
    library's kernel, or any write to an inference-mode tensor, which has no version) is not. The varlen ops never
    wait for them (CPU cu_seqlens they check on every call); under torch.compile and CUDA-graph capture nothing is
    read. Unchecked bad values give wrong numbers, never out-of-bounds accesses: the kernels clamp what they read.
    cu_seqlens' errors come before the op's checks of q, k and v; q or k of another rank are left to those."""
    cus = (cu_seqlens_q, cu_seqlens_k)
    if not all(type(t) is Tensor and t.is_cuda for t in cus) or not runs_eagerly(q, k) or q.dim() != 3 or k.dim() != 3:
        return
    key = (id(cu_seqlens_q), id(cu_seqlens_k))
    state = (*(None if t.is_inference() else t._version for t in cus), q.shape[0], k.shape[0], max_seqlen_q,
             max_seqlen_k)
    seen = _CHECKED_CU_SEQLENS.get(key)
    if seen is not None and seen[0]() is cu_seqlens_q and seen[1]() is cu_seqlens_k and seen[2] == state:
        return
    with torch.cuda.device(cu_seqlens_q.device):  # the op reads on this device's stream: no read while it captures
        if torch.cuda.is_current_stream_capturing():
            return
    call_traced(CHECK_VARLEN, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if len(_CHECKED_CU_SEQLENS) >= 64:
        _CHECKED_CU_SEQLENS.clear()
    _CHECKED_CU_SEQLENS[key] = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k), state)


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


def window(window_size) -> tuple:
    """flash-attn's window_size=(left, right) as two ints, -1 meaning unbounded, with a clear error otherwise."""
    if type(window_size) is tuple and window_size == (-1, -1):  # the default, on every call
        return -1, -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 for unbounded, "
                        f"got {describe(window_size)}") from None
    for name, w in (("window_size[0] (left)", left), ("window_size[1] (right)", right)):
        if isinstance(w, (bool, Tensor)) or not hasattr(w, "__index__"):
            raise TypeError(f"{name} must be an int (-1 for unbounded), got {describe(w)}")
    return int(left), int(right)


def sink_logits(sink: Optional[Tensor]) -> Optional[Tensor]:
    """The sink logits as the kernels read them (fp32, contiguous); differentiable back to the caller's tensor."""
    if sink is None:
        return None
    check_tensors(sink=sink)
    return sink.float().contiguous()


def dropout_state(dropout_p: float, device) -> Optional[Tensor]:
    """A fresh (seed, offset) for one call's dropout mask, drawn from torch's generator for `device` (so
    torch.manual_seed reproduces it, and a captured CUDA graph draws anew at each replay); None without dropout."""
    if not dropout_p:
        return None
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (2,), dtype=torch.int64, device=device)


def slopes(alibi_slopes: Optional[Tensor]) -> Optional[Tensor]:
    """ALiBi slopes as the kernels read them (fp32, contiguous, no gradient: flash-attn gives them none)."""
    if alibi_slopes is None:
        return None
    check_tensors(alibi_slopes=alibi_slopes)
    return alibi_slopes.detach().float().contiguous()


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor, cu_seqlens_q: Optional[Tensor] = None,
              d_sum: Optional[Tensor] = None) -> Tensor:
    """d sink_h = -sum_i exp(sink_h - lse_i) * D_i with D = rowsum(dO * O): the sink's probability times its
    (zero) value's dP minus D, summed over the rows of head h (fa2.reference derives it). d_sum: D laid out like lse,
    as the bwd ops write it when given one (then dout and out are not read); None: computed here."""
    if d_sum is None:
        d = (dout.float() * out.float()).sum(-1)  # (batch, seqlen, nheads) or (total, nheads)
        d_sum = d.transpose(1, 2) if cu_seqlens_q is None else d.t()
    if cu_seqlens_q is None:
        return -(torch.exp(sink[None, :, None] - lse) * d_sum).sum((0, 2))  # (batch, nheads, seqlen)
    # Packed rows outside every sequence were never written: they count for nothing.
    rows = torch.arange(lse.shape[1], device=lse.device)
    inside = (rows >= cu_seqlens_q[0]) & (rows < cu_seqlens_q[-1])
    return -torch.where(inside, torch.exp(sink[:, None] - lse) * d_sum, 0.0).sum(1)  # (nheads, total)


def pad_head_dim(*tensors: Tensor):
    """Zero columns up to the next multiple of 8, as flash-attn pads: they add 0 to every score, and the output's
    and gradients' extra columns are sliced off (the caller passes softmax_scale for the true head dim)."""
    pad = -tensors[0].shape[-1] % 8
    return [torch.nn.functional.pad(t, (0, pad)) for t in tensors]


# ----------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    """Save q, k, v, out and lse (O(seqlen) memory: no seqlen_q x seqlen_k tensor), the ALiBi slopes, the dropout
    state and the sink (each or None) and, for varlen, the cu_seqlens; keep the other arguments. The bwd ops take
    them in this order: tensors, the rest, then the slopes, dropout_p and the dropout state (the forward's last four
    inputs are the slopes, dropout_p, the state and the sink)."""
    q, k, v, *rest, alibi_slopes, dropout_p, rng_state, sink = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, sink,
                          *(a for a in rest if isinstance(a, Tensor)))
    ctx.args = [a for a in rest if not isinstance(a, Tensor)]
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(lse)  # the kernels have no gradient for lse


def _grads(ctx, bwd, dout, saved):
    """The gradients of every forward input: dq, dk, dv from the bwd op, None for the options (ALiBi slopes
    included, as in flash-attn), dsink last."""
    q, k, v, out, lse, alibi_slopes, rng_state, sink, *cu_seqlens = saved
    # The sink's gradient takes D = rowsum(dO * O) from the backward's preprocess, which computes it anyway.
    d_sum = torch.empty_like(lse) if sink is not None and ctx.needs_input_grad[-1] else None
    grads = bwd(dout, q, k, v, out, lse, *cu_seqlens, *ctx.args, alibi_slopes, ctx.dropout_p, rng_state, d_sum)
    dsink = None
    if d_sum is not None:
        dsink = sink_grad(dout, out, lse, sink, cu_seqlens[0] if cu_seqlens else None, d_sum=d_sum)
    return (*grads, *(None,) * (len(ctx.needs_input_grad) - 4), dsink)


def _backward(ctx, dout, _dlse):  # traced by AOT autograd: calls the bwd ops
    varlen = len(ctx.saved_tensors) > 8
    return _grads(ctx, torch.ops.fa2.bwd_varlen if varlen else torch.ops.fa2.bwd, dout, ctx.saved_tensors)


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
        alibi_slopes, ctx.dropout_p, rng_state, sink = args[-4:]
        if varlen:
            ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, sink, args[0], args[1])
            ctx.args = args[2:-4]
        else:
            ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, sink)
            ctx.args = args[:-4]
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        return _grads(ctx, lambda *a: call(BWD_VARLEN if len(saved) > 8 else BWD, *a), dout, saved)


# Function.apply without its Python wrapper (which binds arguments and filters them on every call); what it does
# that matters here is kept: the functorch check, and unwrapping tensors that a finished torch.func transform left.
_apply = super(torch.autograd.Function, _Attention).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def runs_eagerly(*tensors) -> bool:
    """Whether a call on these tensors can take the eager path (call, or the Python autograd Function): plain
    tensors, outside torch.compile's tracing and any dispatch mode. Else the op goes through the dispatcher
    (call_traced), traced through its fake."""
    return (all(type(t) is Tensor for t in tensors) and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def _attend(op, q, k, v, *args) -> Tensor:
    head_dim = unaligned_head_dim(q, k, v)
    if head_dim:  # zero-padded; softmax_scale (args[-10] of both ops) from the true head dim
        args = (*args[:-10], true_scale(args[-10], head_dim), *args[-9:])
        return _attend(op, *pad_head_dim(q, k, v), *args)[..., :head_dim]
    if torch.is_autocast_enabled("cuda"):  # floating inputs run in the autocast dtype, as for torch's own SDPA
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(dtype) if isinstance(t, Tensor) and t.is_cuda and t.is_floating_point() else t
                   for t in (q, k, v))
    sink = args[-1]
    if runs_eagerly(q, k, v):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sink is not None and sink.requires_grad)):
            if torch._C._are_functorch_transforms_active():
                return _Attention.apply(q, k, v, *args)
            return _apply(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), *args)
        return call(op, q, k, v, *args)[0]
    # torch.compile (one opaque node, traced through its fake), fake-tensor or other dispatch modes, subclasses:
    # the op with its registered autograd.
    return call_traced(op, q, k, v, *args)[0]


def attend_with_lse(op, q, k, v, *args) -> Tuple[Tensor, Tensor]:
    """_attend's call returning (out, lse), through the op and its registered autograd: out is differentiable, lse
    is not. For flash_attn_func's return_attn_probs, a testing path whose host time does not matter."""
    head_dim = unaligned_head_dim(q, k, v)
    if head_dim:
        args = (*args[:-10], true_scale(args[-10], head_dim), *args[-9:])
        out, lse = attend_with_lse(op, *pad_head_dim(q, k, v), *args)
        return out[..., :head_dim], lse
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(dtype) if t.is_cuda and t.is_floating_point() else t for t in (q, k, v))
    out, lse = call_traced(op, q, k, v, *args)
    return out, lse.detach()


# ----------------------------------------------------------------------------------------------- public
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
              deterministic: bool = False, window_size=(-1, -1), softcap: float = 0.0,
              alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, sink: Optional[Tensor] = None) -> Tensor:
    """softmax(q k^T * softmax_scale [causal mask]) v, differentiable in q, k and v. Layout
    (batch, seqlen, nheads, head_dim); k and v may have fewer heads (GQA/MQA). Any head_dim up to 256: one that is
    not a multiple of 8 runs zero-padded (a copy; softmax_scale defaults to the true head_dim ** -0.5). Returns out,
    shaped like q.
    deterministic=True makes the backward bit-for-bit repeatable (see fa2.bwd).
    As in flash-attn: window_size=(left, right) lets query i see keys i + seqlen_k - seqlen_q - left through
    i + seqlen_k - seqlen_q + right (-1: unbounded; causal is right = 0); softcap > 0 turns scores s into
    softcap * tanh(s / softcap); alibi_slopes, fp32 (nheads,) or (batch, nheads), add
    -slope * |i + seqlen_k - seqlen_q - j| to score (i, j). dropout_p > 0 drops probabilities after the softmax
    (a fresh mask per call from torch's generator; the backward regenerates it). sink: (nheads,) logits that join
    each row's softmax denominator with no value (gpt-oss), differentiable."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        check_tensors(q=q, k=k, v=v)
    left, right = window(window_size)
    return _attend(FWD, q, k, v, softmax_scale, bool(causal), bool(deterministic), left, right, float(softcap),
                   slopes(alibi_slopes), float(dropout_p), dropout_state(dropout_p, q.device), sink_logits(sink))


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, softmax_scale: Optional[float] = None,
                     deterministic: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                     sink: Optional[Tensor] = None, block_table: Optional[Tensor] = None) -> Tensor:
    """fa2.attention over packed sequences (layout as fa2.fwd_varlen): q (total_q, nheads, head_dim), k and v
    (total_k, nheads_k, head_dim), sequence b owning rows [cu_seqlens[b], cu_seqlens[b + 1]). The options are
    fa2.attention's, per sequence. With block_table (int32 (batch, max_pages)), k and v are paged caches
    (num_pages, page_size, nheads_k, head_dim) holding sequence b's keys in rows [0, cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]) of its pages (paged prefill): they are gathered into packed tensors first
    (fa2.kvcache.packed_from_pages says what that costs)."""
    check_tensors(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if block_table is not None:
        from fa2.kvcache import packed_from_pages  # kvcache imports this module
        k, v = (packed_from_pages(t, block_table, cu_seqlens_k, max_seqlen_k) for t in (k, v))
    if not torch.compiler.is_compiling():
        check_max_seqlens(max_seqlen_q, max_seqlen_k)
        check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    left, right = window(window_size)
    return _attend(FWD_VARLEN, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   bool(causal), bool(deterministic), left, right, float(softcap), slopes(alibi_slopes),
                   float(dropout_p), dropout_state(dropout_p, q.device), sink_logits(sink))

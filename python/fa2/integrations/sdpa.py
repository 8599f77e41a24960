"""fa2 behind torch's scaled_dot_product_attention (PyTorch >= 2.11).

    import fa2
    fa2.sdpa.activate()        # or torch.nn.attention.activate_flash_attention_impl("fa2")
    ...                        # F.scaled_dot_product_attention calls that pick the FLASH backend run fa2's kernels
    fa2.sdpa.restore()         # or torch.nn.attention.restore_flash_attention_impl()

torch's flash-attention registry (the way it plugs in FA3 and FA4) swaps the CUDA kernels of aten's flash ops for
fa2's, forward and backward, for eager code, torch.compile (compiled graphs call these ops at run time) and CUDA
graphs (activate before capturing). SDPA still decides when the FLASH backend applies; fa2 then computes it. What
fa2 does not implement (dropout, sliding windows, ALiBi, a paged cache, ...) raises an error naming the argument:
never a silent fallback, since torch's own kernel is shadowed while fa2 is active.
"""
from __future__ import annotations

import torch

from fa2 import ops

NAME = "fa2"


def _unsupported(what: str, value) -> RuntimeError:
    return RuntimeError(f"fa2 (active as SDPA's flash attention) does not implement {what}={ops.describe(value)}: "
                        "leave it at its default, or call fa2.sdpa.restore() to get torch's own flash kernel back")


def _check_options(dropout_p=0.0, return_debug_mask=False, window_size_left=None, window_size_right=None,
                   seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, **unknown) -> None:
    if dropout_p != 0.0:
        raise _unsupported("dropout_p", dropout_p)
    if return_debug_mask:
        raise _unsupported("return_debug_mask", return_debug_mask)
    for name, value in (("window_size_left", window_size_left), ("window_size_right", window_size_right)):
        if value is not None and value != -1:
            raise _unsupported(name, value)
    for name, value in (("seqused_k", seqused_k), ("alibi_slopes", alibi_slopes), ("block_table", block_table),
                        ("num_splits", num_splits)):
        if value is not None:
            raise _unsupported(name, value)
    for name, value in unknown.items():  # an argument of a newer torch: refused unless it is unset
        if value is not None:
            raise _unsupported(name, value)


def _bshd(t: torch.Tensor) -> torch.Tensor:  # SDPA's (batch, nheads, seqlen, head_dim) as fa2's layout, a view
    return t.transpose(1, 2)


def _rng_outputs(query: torch.Tensor):
    # Without dropout there is no RNG state; aten's meta functions still promise these shapes.
    return (torch.zeros((2,), dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device))


def _check_causal(query, key, is_causal) -> None:
    # SDPA's causal mask is aligned top-left and fa2's (like flash-attn's) bottom-right: they agree only for
    # seqlen_q == seqlen_k, the one case SDPA's flash backend accepts.
    if is_causal and query.shape[2] != key.shape[2]:
        raise RuntimeError(f"fa2 (active as SDPA's flash attention) does not implement is_causal with seqlen_q "
                           f"{query.shape[2]} != seqlen_k {key.shape[2]} (SDPA aligns that mask top-left, fa2 "
                           f"bottom-right): call fa2.attention, or pass an explicit mask")


def _sdpa_fwd(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None, **kwargs):
    _check_options(dropout_p, return_debug_mask, **kwargs)
    _check_causal(query, key, is_causal)
    out = torch.empty_like(query)
    lse = ops.call(ops.FWD_OUT, _bshd(query), _bshd(key), _bshd(value), None, None, 0, 0, scale, is_causal, _bshd(out))
    rng_state, unused = _rng_outputs(query)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug


def _sdpa_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
              philox_seed, philox_offset, *, scale=None, **kwargs):
    _check_options(dropout_p, **kwargs)
    _check_causal(query, key, is_causal)
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    # fa2's backward takes a contiguous lse; callers such as PyTorch's context-parallel ring pass slices of the saved
    # one (its ring copies them today): copied here only where it is not contiguous, rather than refused.
    logsumexp = logsumexp.contiguous()
    ops.call(ops.BWD_OUT, _bshd(grad_out), _bshd(query), _bshd(key), _bshd(value), _bshd(out), logsumexp, None, None,
             0, 0, scale, is_causal, False, _bshd(dq), _bshd(dk), _bshd(dv))
    return dq, dk, dv


def _flash_fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
               scale=None, **kwargs):
    """aten::_flash_attention_forward: (batch, seqlen, nheads, head_dim), or packed with cum_seq_q/k."""
    _check_options(dropout_p, return_debug_mask, **kwargs)
    out = torch.empty_like(query)
    lse = _flash_fwd_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale)
    rng_state, unused = _rng_outputs(query)
    return out, lse, rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


def _flash_fwd_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale):
    packed = cum_seq_q is not None
    return ops.call(ops.FWD_OUT, query, key, value, cum_seq_q, cum_seq_k, max_q if packed else 0,
                    max_k if packed else 0, scale, is_causal, out)


def _flash_fwd_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       return_debug_mask, *, scale=None, **kwargs):
    """aten::_flash_attention_forward_no_dropout_inplace (torch >= 2.13): writes out, returns the lse."""
    _check_options(dropout_p, return_debug_mask, **kwargs)
    return _flash_fwd_into(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale)


def _flash_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
               rng_state, unused, *, scale=None, **kwargs):
    _check_options(dropout_p, **kwargs)
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    packed = cum_seq_q is not None and cum_seq_q.numel() > 0
    ops.call(ops.BWD_OUT, grad_out, query, key, value, out, logsumexp, cum_seq_q if packed else None,
             cum_seq_k if packed else None, max_q if packed else 0, max_k if packed else 0, scale, is_causal, False,
             dq, dk, dv)
    return dq, dk, dv


_KERNELS = {
    "_scaled_dot_product_flash_attention": _sdpa_fwd,
    "_scaled_dot_product_flash_attention_backward": _sdpa_bwd,
    "_flash_attention_forward": _flash_fwd,
    "_flash_attention_backward": _flash_bwd,
    "_flash_attention_forward_no_dropout_inplace": _flash_fwd_inplace,  # torch >= 2.13
}


class _Handle:
    """What the registry keeps while fa2 is active; remove() gives aten its own kernels back."""

    def __init__(self, lib: torch.library.Library):
        self._lib = lib

    def remove(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


def _register_kernels() -> _Handle:
    ops.extension()  # fa2's kernels must be there before aten's are shadowed
    lib = torch.library.Library("aten", "IMPL", "CUDA")
    for name, kernel in _KERNELS.items():
        if hasattr(torch.ops.aten, name):
            lib.impl(name, kernel, "CUDA")
    return _Handle(lib)


def available() -> bool:
    """Whether this torch has the flash-attention registry (2.11 and later)."""
    return hasattr(torch.nn.attention, "register_flash_attention_impl")


def activate() -> None:
    """Route SDPA's FLASH backend to fa2 (torch.nn.attention.activate_flash_attention_impl("fa2"))."""
    if not available():
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention registry "
                           "(torch.nn.attention.register_flash_attention_impl): fa2.sdpa needs torch >= 2.11; call "
                           "fa2.attention directly instead")
    torch.nn.attention.activate_flash_attention_impl(NAME)


def restore() -> None:
    """torch's own flash kernels again (torch.nn.attention.restore_flash_attention_impl())."""
    if active():
        torch.nn.attention.restore_flash_attention_impl()


def active() -> bool:
    return available() and torch.nn.attention.current_flash_attention_impl() == NAME


if available():
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=_register_kernels)

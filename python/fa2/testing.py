"""FlashAttention's correctness rule, for fa2's own tests and benchmarks and for checking an integration of fa2.

The rule: against a float64 reference, fa2's error may be at most `factor` (2) times the error of plain PyTorch
attention computed in the same low precision (fp16/bf16), plus a slack that scales with the tensor and stays small
next to that bound: 1/64 of the low precision's epsilon times the largest reference magnitude (the rounding of the
largest elements alone costs the low-precision result about eps/4 of them). NaN never passes, and an inf passes only
where the reference has the same inf. The float32 lse is held to float32 attention's error the same way.

    import fa2, fa2.testing
    out, lse = fa2.fwd(q, k, v, causal=True)
    fa2.testing.check_attention(out, q, k, v, lse=lse, causal=True)   # raises AssertionError with the worst element

check_attention builds both references with fa2.reference.attention_ref; assert_close_to_ref and assert_lse_close
apply the rule to references you computed yourself (gradients, a model's output). Pure torch, any device; it works
without the compiled fa2._C (a source checkout, a CPU-only torch). Failures raise AssertionError explicitly, so the
checks also run under `python -O`.
"""
import torch

__all__ = ["LSE_SLACK_ULPS", "SLACK_EPS_FRACTION", "assert_close_to_ref", "assert_lse_close", "assert_written",
           "check_attention", "poison"]

SLACK_EPS_FRACTION = 1 / 64
LSE_SLACK_ULPS = 8  # float32 epsilons of the largest |lse|: the fp32 rounding of m * scale and log(l) alone


def _first(mask: torch.Tensor) -> tuple:
    """Index of the first True element of a boolean tensor."""
    return tuple(mask.nonzero()[0].tolist())


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN before a kernel writes it, so an unwritten element cannot pass."""
    return t.fill_(float("nan"))


def assert_written(t: torch.Tensor, *, name: str) -> None:
    """Every element of a poisoned buffer was overwritten (no NaN left)."""
    nan = torch.isnan(t)
    if nan.any():
        raise AssertionError(f"{name}: {int(nan.sum())} of {t.numel()} elements not written (NaN), first at "
                             f"{_first(nan)}")


def _same_nonfinite_pattern(ours, ref64, name):
    """NaN anywhere fails; an inf must sit where the reference has the same inf."""
    mismatch = torch.isnan(ours) | torch.isnan(ref64) | ((torch.isinf(ours) | torch.isinf(ref64)) & (ours != ref64))
    if mismatch.any():
        where = _first(mismatch)
        raise AssertionError(f"{name}: {int(mismatch.sum())} NaN/inf elements differ from the reference, first at "
                             f"{where}: ours {ours[where].item()}, reference {ref64[where].item()}")


def assert_close_to_ref(ours, ref64, ref_low, *, name, factor=2.0, scale=None):
    """max|ours - ref64| <= factor * max|ref_low - ref64| + slack, with NaN/inf patterns matching. ours: the result
    under test; ref64: the same computation in float64; ref_low: plain PyTorch in the low precision (its dtype sets the
    slack's epsilon). The slack scales with max|ref64|, or with `scale` where given: the magnitude of the tensors this
    one is computed with, for a tensor that may be exactly zero (a single key's dQ: P = 1, so dS = dP - D = 0 up to
    float32 rounding). Raises AssertionError naming `name`, the worst element and the bound."""
    if ours.shape != ref64.shape:
        raise AssertionError(f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}")
    eps_low = torch.finfo(ref_low.dtype).eps
    ours, ref64, ref_low = ours.double(), ref64.double(), ref_low.double()
    _same_nonfinite_pattern(ours, ref64, name)
    if ours.numel() == 0:
        return
    finite = torch.isfinite(ref64)
    err = torch.where(finite, ours - ref64, 0.0).abs()
    # Where the low-precision result overflowed (inf or NaN at a finite reference), it has no error to scale the rule
    # by: those elements are left out of the scale, not allowed an infinite one. Ours are held to the bound there too.
    low = torch.where(finite & torch.isfinite(ref_low), ref_low - ref64, 0.0).abs().max().item()
    magnitude = torch.where(finite, ref64, 0.0).abs().max().item() if scale is None else scale
    slack = SLACK_EPS_FRACTION * eps_low * magnitude
    worst = _first(err == err.max())
    bound = factor * low + slack
    if not err.max().item() <= bound:
        raise AssertionError(
            f"{name}: max error {err.max().item():.3e} at {worst} (ours {ours[worst].item():.6g}, reference "
            f"{ref64[worst].item():.6g}) exceeds {factor} x low-precision torch error {low:.3e} + slack {slack:.2e} "
            f"= {bound:.3e}")


def assert_lse_close(lse, lse64, lse32, *, name, factor=2.0):
    """The kernels' float32 lse against the fp64 reference: at most `factor` times the error of the same attention
    computed in float32 (lse32), plus LSE_SLACK_ULPS float32 epsilons of the largest |lse|; exactly -inf where the
    reference is -inf (rows that see no key)."""
    if not lse.shape == lse64.shape == lse32.shape:
        raise AssertionError(f"{name}: shapes {tuple(lse.shape)}, reference {tuple(lse64.shape)}, float32 "
                             f"{tuple(lse32.shape)}")
    lse, lse64, lse32 = lse.double(), lse64.double(), lse32.double()
    if torch.isnan(lse).any():
        raise AssertionError(f"{name}: NaN in lse, first at {_first(torch.isnan(lse))}")
    empty = torch.isneginf(lse64)
    differ = torch.isneginf(lse) != empty
    if differ.any():
        raise AssertionError(f"{name}: lse is -inf where the reference is not (or vice versa), first at "
                             f"{_first(differ)}")
    if lse.numel() == 0 or empty.all():
        return
    err = torch.where(empty, 0.0, lse - lse64).abs()
    ref_err = torch.where(empty | ~torch.isfinite(lse32), 0.0, lse32 - lse64).abs().max().item()
    slack = LSE_SLACK_ULPS * torch.finfo(torch.float32).eps * torch.where(empty, 0.0, lse64).abs().max().item()
    bound = factor * ref_err + slack
    if err.max().item() > bound:
        worst = _first(err == err.max())
        raise AssertionError(f"{name}: lse error {err[worst].item():.3e} at {worst} exceeds {factor} x float32 "
                             f"attention's error {ref_err:.3e} + slack {slack:.2e} = {bound:.3e}")


def check_attention(out, q, k, v, *, lse=None, name="out", factor=2.0, **options) -> None:
    """Hold `out` (and `lse`, if given) to the rule against attention of q, k, v: the float64 reference and plain
    PyTorch attention in q's dtype, both from fa2.reference.attention_ref, which `options` are passed to (causal,
    softmax_scale, window_size, softcap, alibi_slopes, sink; dropout only with its dropout_keep mask). Layout
    (batch, seqlen, nheads, head_dim), k and v may have fewer heads (GQA/MQA); lse is (batch, nheads, seqlen_q),
    float32, as fa2.fwd returns it. Raises AssertionError naming `name` ("lse <name>" for the lse)."""
    from fa2.reference import attention_ref  # pure torch as well; imported here so this module loads on its own

    ref64, lse64 = attention_ref(q.double(), k.double(), v.double(), **options)
    ref_low, _ = attention_ref(q, k, v, upcast=False, **options)
    assert_close_to_ref(out, ref64, ref_low, name=name, factor=factor)
    if lse is not None:
        _, lse32 = attention_ref(q, k, v, dtype=torch.float32, **options)
        assert_lse_close(lse, lse64, lse32, name=f"lse {name}", factor=factor)

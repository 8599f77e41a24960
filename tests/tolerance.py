"""FlashAttention's accuracy rule: our error against the fp64 reference may be at most `factor` times the
error of plain PyTorch attention computed in the same low precision, plus a small absolute slack.
NaN never passes, and an inf passes only where the reference has the same inf."""
import torch


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


def assert_close_to_ref(ours, ref64, ref_low, *, name, factor=2.0, atol=1e-4):
    """max|ours - ref64| <= factor * max|ref_low - ref64| + atol, with NaN/inf patterns matching."""
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}"
    ours, ref64, ref_low = ours.double(), ref64.double(), ref_low.double()
    # NaN anywhere fails; an inf must sit where the reference has the same inf.
    mismatch = torch.isnan(ours) | torch.isnan(ref64) | ((torch.isinf(ours) | torch.isinf(ref64)) & (ours != ref64))
    if mismatch.any():
        where = _first(mismatch)
        raise AssertionError(f"{name}: {int(mismatch.sum())} NaN/inf elements differ from the reference, first at "
                             f"{where}: ours {ours[where].item()}, reference {ref64[where].item()}")
    if ours.numel() == 0:
        return
    finite = torch.isfinite(ref64)
    err = torch.where(finite, ours - ref64, 0.0).abs()
    low = torch.where(finite, ref_low - ref64, 0.0).abs().nan_to_num(0.0).max().item()
    worst = _first(err == err.max())
    bound = factor * low + atol
    assert err.max().item() <= bound, (
        f"{name}: max error {err.max().item():.3e} at {worst} (ours {ours[worst].item():.6g}, reference "
        f"{ref64[worst].item():.6g}) exceeds {factor} x low-precision torch error {low:.3e} + {atol:g} = {bound:.3e}")


def assert_lse_close(lse, lse64, *, name, atol=1e-3, rtol=4e-6):
    """lse within atol + rtol * |lse64| where the reference is finite, exactly -inf where it is -inf.
    lse is float32: rtol allows the rounding of fp32 dot products (~head_dim * 2^-24 relative)."""
    assert lse.shape == lse64.shape, f"{name}: shape {tuple(lse.shape)} != reference {tuple(lse64.shape)}"
    lse, lse64 = lse.double(), lse64.double()
    assert not torch.isnan(lse).any(), f"{name}: NaN in lse, first at {_first(torch.isnan(lse))}"
    empty = torch.isneginf(lse64)
    differ = torch.isneginf(lse) != empty
    assert not differ.any(), f"{name}: lse is -inf where the reference is not (or vice versa), first at " \
                             f"{_first(differ)}"
    err = torch.where(empty, 0.0, lse - lse64).abs()
    bound = atol + rtol * torch.where(empty, 0.0, lse64).abs()
    if (err > bound).any():
        worst = _first(err - bound == (err - bound).max())
        raise AssertionError(f"{name}: lse error {err[worst].item():.3e} at {worst} exceeds {atol:g} + {rtol:g} * "
                             f"|lse| = {bound[worst].item():.3e}")

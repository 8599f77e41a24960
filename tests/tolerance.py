"""FlashAttention's accuracy rule: our error against the fp64 reference may be at most `factor` times the
error of plain PyTorch attention computed in the same low precision, plus a small absolute slack.
NaN never passes."""
import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN before a kernel writes it, so an unwritten element cannot pass."""
    return t.fill_(float("nan"))


def assert_close_to_ref(ours, ref64, ref_low, *, name, factor=2.0, atol=1e-4):
    ours, ref64, ref_low = ours.double(), ref64.double(), ref_low.double()
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}"
    bad = torch.isnan(ours) | (torch.isinf(ours) & ~torch.isinf(ref64))
    assert not bad.any(), f"{name}: {int(bad.sum())} NaN/inf elements (e.g. at {tuple(bad.nonzero()[0].tolist())})"
    if ours.numel() == 0:
        return
    diff = (ours - ref64).abs().nan_to_num(0.0)
    err = diff.max().item()
    low = (ref_low - ref64).abs().nan_to_num(0.0).max().item()
    worst = tuple(torch.nonzero(diff == diff.max())[0].tolist())
    assert err <= factor * low + atol, (
        f"{name}: max error {err:.3e} at {worst} exceeds {factor} x torch low-precision error {low:.3e} + {atol}")


def assert_lse_close(lse, lse64, *, name, atol=1e-3, rtol=4e-6):
    """lse is float32: beyond atol, allow the rounding of fp32 dot products (~head_dim * 2^-24 relative)."""
    assert not torch.isnan(lse).any(), f"{name}: NaN in lse"
    empty = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse), empty), f"{name}: -inf pattern of lse differs from the reference"
    if (~empty).any():
        ref = lse64.double()[~empty]
        excess = ((lse.double()[~empty] - ref).abs() - (atol + rtol * ref.abs())).max().item()
        assert excess <= 0, f"{name}: lse error exceeds {atol} + {rtol}*|lse| by {excess:.3e}"

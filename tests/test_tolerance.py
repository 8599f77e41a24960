"""The test helpers themselves (CPU): the tolerance rule fails on NaN and misplaced inf, and on an error
beyond factor x the low-precision error; a poisoned buffer must be written completely."""
import pytest
import torch

from tolerance import assert_close_to_ref, assert_lse_close, assert_written, poison


def test_rule_allows_factor_times_low_precision_error():
    ref = torch.zeros(4, 4, dtype=torch.float64)
    low = ref.clone()
    low[1, 2] = 0.01
    ours = ref.clone()
    ours[3, 0] = 0.02
    assert_close_to_ref(ours, ref, low, name="ok", atol=0)
    ours[3, 0] = 0.021
    with pytest.raises(AssertionError, match=r"bad: max error 2.100e-02 at \(3, 0\)"):
        assert_close_to_ref(ours, ref, low, name="bad", atol=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_rule_never_passes_nan_or_unexpected_inf(value):
    ref = torch.zeros(3)
    low = torch.full((3,), 1e6)  # even a huge allowed error does not excuse NaN or inf
    ours = torch.tensor([0.0, value, 0.0])
    with pytest.raises(AssertionError, match=r"NaN/inf elements differ from the reference, first at \(1,\)"):
        assert_close_to_ref(ours, ref, low, name="x")


def test_lse_must_match_the_neg_inf_pattern():
    lse64 = torch.tensor([[1.0, float("-inf")]], dtype=torch.float64)
    assert_lse_close(torch.tensor([[1.0005, float("-inf")]]), lse64, name="ok")
    with pytest.raises(AssertionError, match="-inf"):
        assert_lse_close(torch.tensor([[1.0, -1e30]]), lse64, name="finite for an empty row")
    with pytest.raises(AssertionError, match="lse error"):
        assert_lse_close(torch.tensor([[1.01, float("-inf")]]), lse64, name="too far")


def test_poisoned_buffer_must_be_fully_written():
    buf = poison(torch.empty(2, 3))
    buf[0] = 1.0
    with pytest.raises(AssertionError, match=r"3 of 6 elements not written \(NaN\), first at \(1, 0\)"):
        assert_written(buf, name="buf")
    buf[1] = 2.0
    assert_written(buf, name="buf")

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
    assert_close_to_ref(ours, ref, low, name="ok")
    ours[3, 0] = 0.021
    with pytest.raises(AssertionError, match=r"bad: max error 2.100e-02 at \(3, 0\)"):
        assert_close_to_ref(ours, ref, low, name="bad")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_slack_scales_with_the_tensor_and_stays_small_next_to_the_bound(dtype):
    """The slack is eps/64 of the largest reference magnitude: with a low-precision error of at least half an ulp of
    the largest elements, it is a small part of the bound (at most an eighth)."""
    ref = torch.randn(64, 64, dtype=torch.float64) * 1000
    low = ref.to(dtype)  # only the rounding to the low precision
    low_err = (low.double() - ref).abs().max().item()
    bound = 2 * low_err + torch.finfo(dtype).eps / 64 * ref.abs().max().item()
    assert bound - 2 * low_err <= bound / 8
    ours = ref.clone()
    ours[5, 5] += 0.99 * bound
    assert_close_to_ref(ours, ref, low, name="ok")
    ours[5, 5] = ref[5, 5] + 1.01 * bound
    with pytest.raises(AssertionError, match=r"max error .* at \(5, 5\)"):
        assert_close_to_ref(ours, ref, low, name="scaled")


def test_an_overflowed_low_precision_element_does_not_make_the_bound_infinite():
    ref = torch.zeros(3, dtype=torch.float64)
    ours = torch.ones(3)
    low = torch.tensor([0.0, float("inf"), 0.0])
    with pytest.raises(AssertionError, match=r"max error 1.000e\+00"):
        assert_close_to_ref(ours, ref, low, name="inf in the low-precision reference")
    low = torch.tensor([0.0, float("nan"), 0.5])  # the other elements still set the scale
    assert_close_to_ref(ours, ref, low, name="scale from the finite elements")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_rule_never_passes_nan_or_unexpected_inf(value):
    ref = torch.zeros(3)
    low = torch.full((3,), 1e6)  # even a huge allowed error does not excuse NaN or inf
    ours = torch.tensor([0.0, value, 0.0])
    with pytest.raises(AssertionError, match=r"NaN/inf elements differ from the reference, first at \(1,\)"):
        assert_close_to_ref(ours, ref, low, name="x")


def test_lse_rule_is_twice_float32_attention_and_must_match_the_neg_inf_pattern():
    lse64 = torch.tensor([[10.0, float("-inf")]], dtype=torch.float64)
    lse32 = torch.tensor([[10.0 + 1e-6, float("-inf")]])  # float32 attention's error: 1e-6
    slack = 8 * torch.finfo(torch.float32).eps * 10.0  # 9.5e-6
    assert_lse_close(torch.tensor([[10.0 + 2e-6 + 0.9 * slack, float("-inf")]], dtype=torch.float64), lse64, lse32,
                     name="ok")
    with pytest.raises(AssertionError, match="-inf"):
        assert_lse_close(torch.tensor([[10.0, -1e30]]), lse64, lse32, name="finite for an empty row")
    with pytest.raises(AssertionError, match="lse error"):
        assert_lse_close(torch.tensor([[10.0 + 2e-6 + 1.1 * slack, float("-inf")]], dtype=torch.float64), lse64,
                         lse32, name="too far")


def test_poisoned_buffer_must_be_fully_written():
    buf = poison(torch.empty(2, 3))
    buf[0] = 1.0
    with pytest.raises(AssertionError, match=r"3 of 6 elements not written \(NaN\), first at \(1, 0\)"):
        assert_written(buf, name="buf")
    buf[1] = 2.0
    assert_written(buf, name="buf")

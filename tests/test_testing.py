"""fa2.testing, the correctness rule (CPU): it fails on NaN and misplaced inf, and on an error beyond factor x the
low-precision error; a poisoned buffer must be written completely; check_attention applies the rule to an attention
output against fa2.reference; the module loads without the compiled fa2._C."""
import os
import subprocess
import sys

import pytest
import torch

from fa2.reference import attention_ref
from fa2.testing import assert_close_to_ref, assert_lse_close, assert_written, check_attention, poison


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_check_attention_passes_low_precision_torch_and_fails_a_wrong_output(dtype):
    """Plain attention in the low precision passes: its error is the one the rule scales. An output off by three
    times that error, one computed without the mask asked for, or a shifted lse does not."""
    q, k, v = (torch.randn(2, 37, h, 32, dtype=torch.float64).to(dtype) for h in (4, 2, 2))
    out, _ = attention_ref(q, k, v, causal=True, upcast=False)
    _, lse = attention_ref(q, k, v, causal=True, dtype=torch.float32)
    check_attention(out, q, k, v, lse=lse, causal=True, name="torch")
    ref64, _ = attention_ref(q.double(), k.double(), v.double(), causal=True)
    far = ref64 + 3 * (out.double() - ref64).abs().max() * torch.sign(torch.randn_like(ref64))
    with pytest.raises(AssertionError, match=r"^far: max error"):
        check_attention(far, q, k, v, causal=True, name="far")
    with pytest.raises(AssertionError, match=r"^not causal: max error"):
        check_attention(out, q, k, v, name="not causal")
    with pytest.raises(AssertionError, match=r"^lse shifted: lse error"):
        check_attention(out, q, k, v, lse=lse + 1e-3, causal=True, name="shifted")


def test_the_rule_works_without_the_extension():
    """fa2.testing is pure torch: with fa2._C unimportable (sys.modules[name] = None makes its import fail), the rule
    still imports and runs, so a CPU-only install can check results brought from elsewhere."""
    code = ("import sys; sys.modules['fa2._C'] = None\n"
            "import torch, fa2.testing\n"
            "q = torch.randn(1, 5, 2, 8).half()\n"
            "fa2.testing.check_attention(fa2.reference.attention_ref(q, q, q)[0], q, q, q, name='cpu')")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

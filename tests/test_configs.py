"""Head dims whose backward has two configurations: a deeper pipeline where a block may use more shared memory
than an A100 gives (H100), and the A100's (csrc/fa2/bwd_launch.h: kStagesBigSmem). The launch picks one from the
device, so on one GPU only `smem_limit` (csrc/CONTRACT.md) reaches the other. Both must launch what they say
and agree bit for bit: the stages change when tiles are loaded, not what is computed (GPU)."""
import re

import pytest
import torch

import fa2
from test_bwd import check_grads
from tolerance import assert_written, poison

pytestmark = pytest.mark.gpu

A100_SMEM = 163 * 1024  # bytes a block may use on an A100 (sm80)


def _run_profiled(fn):
    """fn()'s result and the names of the backward kernels it launched that depend on the configuration."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {e.name for e in prof.events() if re.search(r"bwd(_dq)?_kernel<", e.name)}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [256, 248], ids=["d256", "d248"])
def test_big_smem_configuration_matches_the_a100_one(d, causal, force_ext_keywords, require_kernel):
    require_kernel("bwd", d, torch.bfloat16)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if (optin <= A100_SMEM) if optin is not None else props.major < 9:
        pytest.skip("this GPU gives a block no more shared memory than an A100: only one configuration runs")
    q, k, v = (torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16) for s, h in ((700, 6), (900, 2), (900, 2)))
    dout = torch.randn_like(q)
    out, lse = fa2.fwd(q, k, v, causal=causal)

    def run():  # deterministic: dQ without atomics, so the two configurations can agree bit for bit
        return fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True, dq=poison(torch.empty_like(q)),
                       dk=poison(torch.empty_like(k)), dv=poison(torch.empty_like(v)))

    big, big_kernels = _run_profiled(run)
    check_grads(big, q, k, v, dout, causal, f"d{d} causal={causal}, the device's configuration")
    force_ext_keywords(bwd={"smem_limit": A100_SMEM})
    small, small_kernels = _run_profiled(run)
    force_ext_keywords()
    # dK/dV and the deterministic dQ kernel, each in the other configuration.
    assert len(big_kernels) == 2 and len(small_kernels) == 2 and not big_kernels & small_kernels, \
        (big_kernels, small_kernels)
    for name, a, b in zip(("dq", "dk", "dv"), big, small):
        assert_written(a, name=f"{name}, the device's configuration")
        assert_written(b, name=f"{name}, the A100's configuration")
        assert torch.equal(a, b), f"{name}: the two configurations differ"

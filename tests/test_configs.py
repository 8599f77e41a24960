"""Kernels with more than one configuration (GPU). The d256 backward has a deeper pipeline where a block may use
more shared memory than an A100 gives (H100), and the A100's (csrc/fa2/bwd_launch.h: kStagesBigSmem). The launch
picks one from the device, so on one GPU only `smem_limit` (csrc/CONTRACT.md) reaches the other. Both must launch
what they say and agree bit for bit: the stages change when tiles are loaded, not what is computed. The d256
forward picks its tile from the sequence lengths (csrc/fa2/fwd_launch.h: FwdShortConfig): each side of each
threshold must launch the tile it says and match the reference."""
import re

import pytest
import torch

import fa2
from test_bwd import check_grads
from test_fwd import check_fwd
from tolerance import assert_written, poison

pytestmark = pytest.mark.gpu

A100_SMEM = 163 * 1024  # bytes a block may use on an A100 (sm80)


def _run_profiled(fn, pattern=r"bwd(_dq)?_kernel<"):
    """fn()'s result and the names of the kernels matching `pattern` (by default the backward kernels that depend
    on the configuration) that it launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {e.name for e in prof.events() if re.search(pattern, e.name)}


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


# (causal, seqlen_q, seqlen_k, the tile as (kBlockM, kBlockN, warps)): the 64-row tile up to max(seqlen_q, seqlen_k)
# = 1024 (2048 causal), the 128-row one past it.
FWD_D256_CASES = [(False, 1000, 1024, (64, 64, 4)), (False, 1025, 1000, (128, 64, 8)),
                  (True, 2048, 1500, (64, 64, 4)), (True, 1900, 2049, (128, 64, 8))]


@pytest.mark.parametrize("causal,sq,sk,tile", FWD_D256_CASES,
                         ids=[f"{'causal' if c else 'full'}_{sq}x{sk}" for c, sq, sk, _ in FWD_D256_CASES])
def test_d256_forward_tile_follows_the_sequence_lengths(causal, sq, sk, tile, require_kernel):
    require_kernel("fwd", 256, torch.bfloat16)
    q = torch.randn(1, sq, 4, 256, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, sk, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _, kernels = _run_profiled(lambda: check_fwd(q, k, v, causal=causal, tag=f"d256 {sq}x{sk} causal={causal}"),
                               pattern=r"fwd_kernel<")
    tiles = {tuple(map(int, re.search(r"FwdTraits<256, (\d+), (\d+), (\d+),", name).groups())) for name in kernels}
    assert tiles == {tile}, kernels

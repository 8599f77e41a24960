"""Kernels with more than one configuration (GPU; csrc/sm80/config.h). The launch picks a configuration from the
sequence lengths and from the shared memory a block may use, so on one GPU the test-only override of
csrc/CONTRACT.md (`smem_limit`) reaches the others: the A100's (163 KB) and the consumer GPUs' (99 KB: RTX 30xx,
40xx, 50xx). Each configuration must launch what it says, fit the limit it was chosen for, and match the fp64
reference; configurations that differ only in when tiles load must agree bit for bit. The shared memory each
launch asks for must follow the device code that runs (sm80 code on an H100 in an sm80-only build), not the GPU."""
import json
import re

import pytest
import torch

import fa2
from fa2.testing import assert_written, poison
from test_bwd import check_grads
from test_fwd import check_fwd, check_out

pytestmark = pytest.mark.gpu

A100_SMEM = 163 * 1024  # bytes a block may use on an A100 (sm80)
CONSUMER_SMEM = 99 * 1024  # sm86, sm89, sm120
HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256]


# This file's configurations are the mma.sync family's (csrc/sm80/config.h): conftest pins its calls there.
FAMILY = "sm80"


def _launches(fn, pattern=r"fa2::(fwd_kernel|bwd_kernel|bwd_dq_kernel)<", tmp_path=None):
    """fn()'s result and the (kernel name, shared memory per block in bytes) of each launch matching `pattern`,
    from the profiler's trace."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    launches = [(e["name"], e["args"]["shared memory"]) for e in events
                if e.get("cat", "").lower() == "kernel" and re.search(pattern, e["name"])]
    return result, launches


def _code_arch() -> int:
    """The arch of the device code that runs here: the build's newest arch the GPU can run (its own major's SASS,
    or an older arch's PTX, compiled by the driver)."""
    major, minor = torch.cuda.get_device_capability()
    return max(a for a in fa2.build_info()["archs"] if a <= 10 * major + minor)


def _grad_inputs(q, k, v):
    return [t.detach().clone().requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [256, 248], ids=["d256", "d248"])
def test_big_smem_configuration_matches_the_a100_one(d, causal, launch_overrides, require_kernel, tmp_path):
    """d256's backward double-buffers Q/dO where a block may use 208 KB (H100), not on an A100."""
    require_kernel("bwd", d, torch.bfloat16)
    if torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin <= A100_SMEM:
        pytest.skip("this GPU gives a block no more shared memory than an A100: only one configuration runs")
    q, k, v = (torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16) for s, h in ((700, 6), (900, 2), (900, 2)))
    dout = torch.randn_like(q)
    out, lse = fa2.fwd(q, k, v, causal=causal)

    def run():  # deterministic: dQ without atomics, so the two configurations can agree bit for bit
        return fa2.bwd(dout, q, k, v, out, lse, causal=causal, deterministic=True, dq=poison(torch.empty_like(q)),
                       dk=poison(torch.empty_like(k)), dv=poison(torch.empty_like(v)))

    big, big_launches = _launches(run, r"bwd(_dq)?_kernel<", tmp_path)
    check_grads(big, q, k, v, dout, causal, f"d{d} causal={causal}, the device's configuration")
    launch_overrides(smem_limit=A100_SMEM)
    small, small_launches = _launches(run, r"bwd(_dq)?_kernel<", tmp_path)
    launch_overrides()
    big_kernels, small_kernels = {n for n, _ in big_launches}, {n for n, _ in small_launches}
    # dK/dV and the deterministic dQ kernel, each in the other configuration, within the limit.
    assert len(big_kernels) == 2 and len(small_kernels) == 2 and not big_kernels & small_kernels, \
        (big_kernels, small_kernels)
    assert all(smem <= A100_SMEM for _, smem in small_launches), small_launches
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
def test_d256_forward_tile_follows_the_sequence_lengths(causal, sq, sk, tile, require_kernel, tmp_path):
    require_kernel("fwd", 256, torch.bfloat16)
    q = torch.randn(1, sq, 4, 256, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, sk, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _, launches = _launches(lambda: check_fwd(q, k, v, causal=causal, tag=f"d256 {sq}x{sk} causal={causal}"),
                            r"fwd_kernel<", tmp_path)
    tiles = {tuple(map(int, re.search(r"FwdTraits<256, (\d+), (\d+), (\d+),", name).groups())) for name, _ in launches}
    assert tiles == {tile}, launches


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("layout", ["padded", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_consumer_gpu_configurations_fit_99kb_and_match_reference(d, dtype, causal, layout, launch_overrides,
                                                                  require_kernel, tmp_path):
    """With a block limited to 99 KB, as on sm86/sm89/sm120, every head dim's forward and backward (both dQ paths)
    launch kernels that fit, and their results meet the tolerance rule."""
    require_kernel("fwd", d, dtype)
    require_kernel("bwd", d, dtype)
    h, hk = 4, 2
    if layout == "padded":
        lengths_q, lengths_k = [300, 300], [517, 517]
    else:  # empty, single-token and unequal sequences
        lengths_q, lengths_k = [0, 1, 130, 300], [3, 0, 200, 257]
    q = torch.randn(sum(lengths_q), h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lengths_k), hk, d, device="cuda", dtype=dtype) for _ in range(2))
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    launch_overrides(smem_limit=CONSUMER_SMEM)

    def attend(q, k, v, deterministic):
        if layout == "padded":
            b = len(lengths_q)
            return fa2.attention(q.view(b, -1, h, d), k.view(b, -1, hk, d), v.view(b, -1, hk, d), causal=causal,
                                 deterministic=deterministic).view(q.shape)
        return fa2.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                    deterministic=deterministic)

    dout = torch.randn_like(q)
    for deterministic in (False, True):
        tag = f"99 KB d{d} {layout} causal={causal} {dtype} deterministic={deterministic}"
        leaves = _grad_inputs(q, k, v)

        def step():
            out = attend(*leaves, deterministic)
            return out, torch.autograd.grad(out, leaves, dout)

        (out, grads), launches = _launches(step, tmp_path=tmp_path)
        kinds = {re.search(r"fa2::(\w+)<", n).group(1) for n, _ in launches}
        assert kinds == {"fwd_kernel", "bwd_kernel"} | ({"bwd_dq_kernel"} if deterministic else set()), launches
        too_big = [(n, smem) for n, smem in launches if smem > CONSUMER_SMEM]
        assert not too_big, f"{tag}: kernels over 99 KB: {too_big}"
        for i in range(len(lengths_q)):
            rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            if rows.start == rows.stop:
                continue
            qi, ki, vi = (t[None, s] for t, s in ((q, rows), (k, keys), (v, keys)))
            check_out(out[None, rows], qi, ki, vi, causal=causal, tag=f"{tag} sequence {i}")
            check_grads([g[None, s] for g, s in zip(grads, (rows, keys, keys))], qi, ki, vi, dout[None, rows], causal,
                        f"{tag} sequence {i}")


@pytest.mark.parametrize("d,smem", [(64, 160 * 1024), (128, 160 * 1024)], ids=["d64", "d128"])
def test_backward_shared_memory_follows_the_code_that_runs(d, smem, require_kernel, tmp_path):
    """The d64 and d128 backward give each warp its own 32 KB of dQ staging in sm90 device code only (csrc/sm80/
    dq_accum.h: dq_path). The launch must ask for those bytes exactly where that code runs: in an sm90 build on an
    H100, not in an sm80-only build on the same GPU (PTX JIT), whatever the GPU's compute capability."""
    require_kernel("bwd", d, torch.bfloat16)
    q, k, v = (torch.randn(1, 512, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fa2.fwd(q, k, v)
    dout = torch.randn_like(q)
    grads, launches = _launches(lambda: fa2.bwd(dout, q, k, v, out, lse), r"bwd_kernel<", tmp_path)
    expected = smem + (32 * 1024 if _code_arch() >= 90 else 0)
    assert [s for _, s in launches] == [expected], (launches, fa2.build_info()["archs"])
    check_grads(grads, q, k, v, dout, False, f"d{d}, code for sm{_code_arch()}")


def test_a_limit_no_configuration_fits_is_a_clear_error(launch_overrides, require_kernel):
    require_kernel("bwd", 256, torch.bfloat16)
    q, k, v = (torch.randn(1, 64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    launch_overrides(smem_limit=48 * 1024)
    with pytest.raises(RuntimeError, match=r"the forward for head_dim 256 needs \d+ bytes .* a block may use 49152"):
        fa2.attention(q, k, v)
    launch_overrides()
    out = fa2.attention(q, k, v)
    launch_overrides(smem_limit=80 * 1024)
    with pytest.raises(RuntimeError, match=r"the backward for head_dim 256 needs \d+ bytes .* a block may use 81920"):
        out.sum().backward()
    launch_overrides()
    torch.cuda.synchronize()  # the process stays healthy
    assert torch.isfinite(fa2.attention(q.detach(), k.detach(), v.detach())).all()

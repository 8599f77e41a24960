"""fa2 behind F.scaled_dot_product_attention (fa2.sdpa): activation through torch's flash-attention registry, the
FLASH backend then running fa2's kernels forward and backward (eager, compiled, CUDA graphs), results held to the
fp64 reference and to SDPA's own flash kernel, clear errors for what fa2 does not implement, and restore."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa2
from fa2.reference import attention_ref
from fa2.testing import assert_close_to_ref

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not fa2.sdpa.available(), reason="torch has no flash-attention registry (< 2.11)")


@contextlib.contextmanager
def fa2_active():
    fa2.sdpa.activate()
    try:
        yield
    finally:
        fa2.sdpa.restore()


@contextlib.contextmanager
def recorded(launches):
    """fa2's launches recorded (not made) inside the block; appended to `launches` as kinds."""
    fa2._C.set_test_overrides(record=True)
    try:
        yield
    finally:
        launches += [launch["kind"] for launch in fa2._C.take_recorded_launches()]
        fa2._C.set_test_overrides()


def bhsd(b=2, h=4, hk=4, sq=100, sk=100, d=64, requires_grad=True, dtype=BF16):
    """q, k, v as SDPA takes them, (batch, nheads, seqlen, head_dim), as models make them: views of
    (batch, seqlen, nheads, head_dim) tensors."""
    return tuple(torch.randn(b, s, n, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_(requires_grad)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def sdpa(q, k, v, causal, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], **kwargs)


# ------------------------------------------------------------------------------------------------ CPU
def test_activate_and_restore_through_torchs_registry():
    assert "fa2" in torch.nn.attention.list_flash_attention_impls()
    with fa2_active():
        assert torch.nn.attention.current_flash_attention_impl() == "fa2" and fa2.sdpa.active()
    assert torch.nn.attention.current_flash_attention_impl() is None and not fa2.sdpa.active()
    torch.nn.attention.activate_flash_attention_impl("fa2")  # torch's own spelling works the same
    assert fa2.sdpa.active()
    torch.nn.attention.restore_flash_attention_impl()
    assert not fa2.sdpa.active()


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flash_backend_runs_fa2_forward_and_backward_until_restored(compiled, require_kernel):
    require_kernel("bwd", 64, BF16)
    q, k, v = bhsd()
    attend = sdpa
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(sdpa, fullgraph=True)
    launches = []
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), fa2_active(), recorded(launches):
        out = attend(q, k, v, True)
        out.backward(torch.randn_like(out))
    assert launches == ["fwd", "bwd"]
    launches.clear()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), recorded(launches):  # restored: torch's own kernel
        attend(q, k, v, True).sum().backward()
    assert launches == []


def _reference(q, k, v, causal, dout):
    """fp64 and low-precision references in fa2's layout, with their gradients (fp64 leaves for the fp64 one)."""
    refs = []
    for upcast in (True, False):
        leaves = [t.detach().transpose(1, 2).to(torch.float64 if upcast else t.dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, causal=causal, upcast=upcast)
        grads = torch.autograd.grad(ref, leaves, dout.transpose(1, 2).to(ref.dtype))
        refs.append([t.transpose(1, 2) for t in (ref, *grads)])
    return refs


# SDPA's is_causal is top-left aligned and its flash backend takes it only for seqlen_q == seqlen_k (fa2, like
# flash-attn, aligns bottom-right): uneven lengths run without the mask.
SHAPES = [(dict(), False), (dict(), True), (dict(sq=77, sk=130, hk=2), False), (dict(d=128, h=2, hk=1, sq=300, sk=300), True)]


@gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape, causal", SHAPES, ids=["mha", "mha-causal", "gqa-uneven", "mqa-d128-causal"])
def test_fa2_through_sdpa_matches_fp64_and_sdpas_own_flash(shape, causal, compiled, require_kernel):
    require_kernel("bwd", shape.get("d", 64), BF16)
    q, k, v = bhsd(**shape)
    dout = torch.randn(q.shape, device="cuda", dtype=BF16)
    attend = sdpa
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(sdpa, fullgraph=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        native = [attend(q, k, v, causal)]  # SDPA's own flash kernel, called the same way (eager or compiled)
        native += torch.autograd.grad(native[0], (q, k, v), dout)
        with fa2_active():
            ours = [attend(q, k, v, causal)]
            ours += torch.autograd.grad(ours[0], (q, k, v), dout)
    ref64, ref_low = _reference(q, k, v, causal, dout)
    grad_scale = max(r.abs().max().item() for r in ref64[1:])  # the slack of a gradient: the call's largest
    for name, o, r64, rl, nat in zip(("out", "dq", "dk", "dv"), ours, ref64, ref_low, native):
        assert o.shape == nat.shape and o.stride() == nat.stride(), name  # aten's layout promises
        scale = None if name == "out" else grad_scale
        assert_close_to_ref(o, r64, rl, name=name, scale=scale)  # the rule: 2x plain bf16 attention's error
        assert_close_to_ref(o, r64, nat, name=f"{name} vs SDPA flash", scale=scale)  # and 2x SDPA-flash's


@gpu
def test_cuda_graph_of_sdpa_with_fa2_replays_the_eager_result(require_kernel):
    require_kernel("bwd", 64, BF16)
    q, k, v = bhsd(requires_grad=False)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), fa2_active():
        eager = sdpa(q, k, v, True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sdpa(q, k, v, True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = sdpa(q, k, v, True)
        fresh = [torch.randn_like(t) for t in (q, k, v)]
        for t, f in zip((q, k, v), fresh):
            t.copy_(f)
        graph.replay()
        again = sdpa(q, k, v, True)
    torch.cuda.synchronize()
    assert not torch.equal(static, eager) and torch.equal(static, again)


@gpu
def test_what_fa2_does_not_implement_is_an_error_naming_it(require_kernel):
    require_kernel("fwd", 64, BF16)
    q, k, v = bhsd(requires_grad=False)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), fa2_active():
        with pytest.raises(RuntimeError, match="fa2 .* does not implement dropout_p=0.1"):
            sdpa(q, k, v, False, dropout_p=0.1)
        # aten's op called directly with a causal mask SDPA's flash backend never takes (top-left, uneven lengths)
        with pytest.raises(RuntimeError, match="is_causal with seqlen_q 100 != seqlen_k 50"):
            torch.ops.aten._scaled_dot_product_flash_attention(q, k[:, :, :50], v[:, :, :50], is_causal=True)
        assert torch.isfinite(sdpa(q, k, v, False, scale=0.3)).all()  # what it does implement still runs

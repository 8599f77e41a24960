"""fa2's torch.library custom ops: schemas, fake (shape-only) implementations, autograd registration, and
what they are for: torch.compile without graph breaks, CUDA-graph capture of a whole training step, autocast.
CPU tests run the ops in fake mode or with the kernels replaced by a recorder; GPU tests run the kernels."""
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fa2
from fa2.reference import attention_ref
from fa2.testing import assert_close_to_ref

gpu = pytest.mark.gpu
BF16 = torch.bfloat16

FEATURES = ("int window_left=-1, int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
            "float dropout_p=0., Tensor? rng_state=None")
SCHEMAS = {
    "fwd": "fa2::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale, bool causal, bool deterministic=False, "
           f"{FEATURES}, Tensor? sink=None) -> (Tensor, Tensor)",
    "bwd": "fa2::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float? softmax_scale, "
           f"bool causal, bool deterministic, {FEATURES}, Tensor(a!)? d_sum=None) -> (Tensor, Tensor, Tensor)",
    "fwd_varlen": "fa2::fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                  "SymInt max_seqlen_q, SymInt max_seqlen_k, float? softmax_scale, bool causal, "
                  f"bool deterministic=False, {FEATURES}, Tensor? sink=None) -> (Tensor, Tensor)",
    "bwd_varlen": "fa2::bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                  "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
                  f"float? softmax_scale, bool causal, bool deterministic, {FEATURES}, Tensor(a!)? d_sum=None) "
                  "-> (Tensor, Tensor, Tensor)",
}
LENGTHS = [3, 7, 7]  # the packed batch of the varlen tests: cu_seqlens [0, 3, 10, 17]


def padded(device="cuda", b=2, sq=37, sk=50, h=4, hk=2, d=64, requires_grad=False):
    """Random q, k, v (batch, seqlen, nheads, head_dim), GQA 2:1 by default."""
    return tuple(torch.randn(b, s, n, d, device=device, dtype=BF16, requires_grad=requires_grad)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def packed(device="cuda", h=4, hk=2, d=64, requires_grad=False):
    """Random q, k, v (total, nheads, head_dim) for LENGTHS, their cu_seqlens and the longest length."""
    total = sum(LENGTHS)
    cu = torch.tensor([0, 3, 10, 17], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(total, n, d, device=device, dtype=BF16, requires_grad=requires_grad) for n in (h, hk, hk))
    return q, k, v, cu, max(LENGTHS)


def meta(t):
    return t.shape, t.dtype, t.device, t.stride()


# ------------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("name", SCHEMAS)
def test_ops_are_registered_with_these_schemas(name):
    assert str(getattr(torch.ops.fa2, name).default._schema) == SCHEMAS[name]


def test_fake_tensors_propagate_through_the_padded_ops():
    with FakeTensorMode():
        q, k, v = padded()
        out, lse = torch.ops.fa2.fwd(q, k, v, None, True)
        assert meta(out) == meta(torch.empty_like(q, memory_format=torch.contiguous_format))
        assert meta(lse) == meta(torch.empty(2, 4, 37, device="cuda"))
        dout = torch.randn(2, 4, 37, 64, device="cuda", dtype=BF16).transpose(1, 2)  # strided, as gradients come
        grads = torch.ops.fa2.bwd(dout, q, k, v, out, lse, 0.5, True, False)
        for g, t in zip(grads, (q, k, v)):
            assert meta(g) == meta(torch.empty(t.shape, device="cuda", dtype=BF16))
        assert meta(fa2.attention(q, k, v)) == meta(out)


def test_fake_tensors_propagate_through_the_varlen_ops():
    with FakeTensorMode():
        q, k, v, cu, max_len = packed()
        out, lse = torch.ops.fa2.fwd_varlen(q, k, v, cu, cu, max_len, max_len, None, False)
        assert meta(out) == meta(q) and meta(lse) == meta(torch.empty(4, 17, device="cuda"))
        grads = torch.ops.fa2.bwd_varlen(torch.randn_like(q), q, k, v, out, lse, cu, cu, max_len, max_len, None,
                                         False, True)
        assert [meta(g) for g in grads] == [meta(t) for t in (q, k, v)]
        assert meta(fa2.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True)) == meta(out)


@pytest.mark.parametrize("wants", ["qkv", "q", "kv", "v"])
def test_fake_backward_gives_gradients_to_exactly_the_inputs_that_want_them(wants):
    # Fake CPU tensors: a CPU-only torch cannot run autograd on fake CUDA tensors.
    with FakeTensorMode():
        q, k, v = padded("cpu")
        for name, t in zip("qkv", (q, k, v)):
            t.requires_grad_(name in wants)
        fa2.attention(q, k, v, causal=True).sum().backward()
        for t in (q, k, v):
            assert (t.grad is None) != t.requires_grad and (t.grad is None or t.grad.shape == t.shape)


def test_lse_is_not_differentiable():
    with FakeTensorMode():
        q, k, v = padded("cpu", requires_grad=True)
        out, lse = torch.ops.fa2.fwd(q, k, v, None, False)
        assert out.requires_grad and not lse.requires_grad


CPU_OPCHECK = ("test_schema", "test_autograd_registration", "test_faketensor")  # no value comparisons


def test_opcheck_with_recorded_kernels(recording):
    # The real ops run on CPU tensors with the launches recorded (outputs unwritten), so opcheck can hold the
    # fake implementations to the real ones' output metadata and check schemas and autograd registration.
    q, k, v = padded("cpu", requires_grad=True)
    torch.library.opcheck(torch.ops.fa2.fwd.default, (q, k, v, None, True), test_utils=CPU_OPCHECK)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = fa2.fwd(q, k, v)
    torch.library.opcheck(torch.ops.fa2.bwd.default, (torch.randn_like(q), q, k, v, out, lse, 0.5, False, True),
                          test_utils=CPU_OPCHECK)
    q, k, v, cu, max_len = packed("cpu", requires_grad=True)
    torch.library.opcheck(torch.ops.fa2.fwd_varlen.default, (q, k, v, cu, cu, max_len, max_len, None, True),
                          test_utils=CPU_OPCHECK)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = fa2.fwd_varlen(q, k, v, cu, cu, max_len, max_len)
    torch.library.opcheck(torch.ops.fa2.bwd_varlen.default,
                          (torch.randn_like(q), q, k, v, out, lse, cu, cu, max_len, max_len, None, False, False),
                          test_utils=CPU_OPCHECK)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_backward_gets_the_forward_arguments(recording, layout, compiled):
    # Through autograd (and AOT autograd under torch.compile) the backward launch must see the forward's
    # causal, softmax_scale and deterministic. One graph, no graph break: fullgraph=True would raise.
    if layout == "padded":
        q, k, v = padded("cpu", requires_grad=True)
        attend = functools.partial(fa2.attention, causal=True, softmax_scale=0.25, deterministic=True)
    else:
        q, k, v, cu, max_len = packed("cpu", requires_grad=True)
        attend = functools.partial(fa2.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                   max_seqlen_k=max_len, causal=True, softmax_scale=0.25, deterministic=True)
    if compiled:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(attend)(q, k, v)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        recording.calls.clear()
        attend = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out = attend(q, k, v)
    torch.autograd.grad(out, (q, v), torch.randn_like(out))
    assert [kind for kind, _ in recording.calls] == ["fwd", "bwd"]
    for kind, args in recording.calls:
        assert args["causal"] is True and args["softmax_scale"] == 0.25, kind
    assert recording.calls[1][1]["deterministic"] is True


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_outside_autocast_asks_for_a_cast_or_autocast(compiled):
    attend = fa2.attention
    # Compiled, the op is traced through its fake implementation and its C++ checks run when the graph runs, past
    # fa2's Python layer: the same message, as a ValueError marked "TypeError: " (C++ exceptions have no TypeError).
    error, mark = TypeError, ""
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(attend, fullgraph=True, backend="aot_eager")
        error, mark = ValueError, "TypeError: "
    q, k, v = (torch.randn(1, 16, 4, 64, requires_grad=True) for _ in range(3))
    with pytest.raises(error, match=rf"^{mark}q must be float16 or bfloat16, got torch.float32: cast it \(e.g. "
                                    r"q.to\(torch.bfloat16\)\), or call fa2.attention inside torch.autocast"):
        attend(q, k, v)


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hk", [4, 1], ids=["mha", "mqa"])
def test_opcheck_padded(hk, causal, require_kernel):
    require_kernel("bwd", 64, BF16)
    q, k, v = padded(hk=hk, requires_grad=True)
    # deterministic=True: test_aot_dispatch_dynamic compares eager and compiled gradients.
    torch.library.opcheck(torch.ops.fa2.fwd.default, (q, k, v, None, causal, True))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = fa2.fwd(q, k, v, causal=causal)
    torch.library.opcheck(torch.ops.fa2.bwd.default, (torch.randn_like(q), q, k, v, out, lse, 0.5, causal, True))


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opcheck_varlen(causal, require_kernel):
    require_kernel("bwd", 64, BF16)
    q, k, v, cu, max_len = packed(requires_grad=True)
    torch.library.opcheck(torch.ops.fa2.fwd_varlen.default, (q, k, v, cu, cu, max_len, max_len, None, causal, True))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = fa2.fwd_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal)
    torch.library.opcheck(torch.ops.fa2.bwd_varlen.default,
                          (torch.randn_like(q), q, k, v, out, lse, cu, cu, max_len, max_len, 0.5, causal, True))


class SelfAttention(nn.Module):
    """Pre-norm causal self-attention with nheads_k key/value heads (GQA where fewer than nheads), residual."""

    def __init__(self, dim, nheads, nheads_k, attend, head_dim=64):
        super().__init__()
        self.attend, self.q_heads, self.kv_heads = attend, (nheads, head_dim), (2, nheads_k, head_dim)
        self.norm = nn.LayerNorm(dim)
        self.q, self.kv = nn.Linear(dim, nheads * head_dim), nn.Linear(dim, 2 * nheads_k * head_dim)
        self.proj = nn.Linear(nheads * head_dim, dim)

    def forward(self, x):
        h = self.norm(x)
        q = self.q(h).unflatten(-1, self.q_heads)
        k, v = self.kv(h).unflatten(-1, self.kv_heads).unbind(-3)  # strided slices of one projection
        return x + self.proj(self.attend(q, k, v).flatten(-2))


def tiny_model(attend, dim=128):
    """An MHA layer and a GQA 2:1 layer, head_dim 64, in bf16 on the GPU."""
    return nn.Sequential(SelfAttention(dim, 4, 4, attend), SelfAttention(dim, 4, 2, attend)).to("cuda", BF16)


def with_attention(model, attend, dtype):
    model = copy.deepcopy(model).to(dtype)
    for layer in model:
        layer.attend = attend
    return model


def output_and_grads(model, x, dy):
    x = x.detach().requires_grad_()
    y = model(x)
    return (y, *torch.autograd.grad(y, (x, *model.parameters()), dy))


def ref_causal(q, k, v, upcast=True):
    return attention_ref(q, k, v, causal=True, upcast=upcast)[0]


@gpu
def test_compiled_model_is_one_graph_and_meets_the_tolerance_rule(require_kernel):
    require_kernel("bwd", 64, BF16)
    model = tiny_model(functools.partial(fa2.attention, causal=True))
    x = torch.randn(2, 300, 128, device="cuda", dtype=BF16)
    dy = torch.randn_like(x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    # The same model with attention_ref: all in fp64, and all in bf16 (plain torch's low-precision error).
    ref64 = output_and_grads(with_attention(model, ref_causal, torch.float64), x.double(), dy.double())
    ref_low = output_and_grads(with_attention(model, functools.partial(ref_causal, upcast=False), BF16), x, dy)
    names = ["out", "dx", *(f"d {name}" for name, _ in model.named_parameters())]
    for tag, run in (("eager", model), ("compiled", compiled)):
        for name, ours, r64, rl in zip(names, output_and_grads(run, x, dy), ref64, ref_low):
            assert_close_to_ref(ours, r64, rl, name=f"{tag} {name}")


@gpu
@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_compiled_attention_is_bit_identical_to_eager(layout, require_kernel):
    # The compiled graph is the op itself (forward and backward): the same kernels on the same values.
    require_kernel("bwd", 64, BF16)
    if layout == "padded":
        q, k, v = padded(requires_grad=True)
        attend = functools.partial(fa2.attention, causal=True, deterministic=True)
    else:
        q, k, v, cu, max_len = packed(requires_grad=True)
        attend = functools.partial(fa2.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                   max_seqlen_k=max_len, causal=True, deterministic=True)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    dout = torch.randn(q.shape, device="cuda", dtype=BF16)
    results = []
    for run in (attend, compiled):
        out = run(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for name, eager, comp in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(eager).all() and torch.equal(eager, comp), name


@gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_runs_fp32_inputs_in_bf16_and_gradients_reach_fp32_leaves(compiled, require_kernel):
    require_kernel("bwd", 64, BF16)
    q, k, v = (t.float().detach().requires_grad_() for t in padded())
    attend = functools.partial(fa2.attention, causal=True)
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(attend, fullgraph=True)
    with torch.autocast("cuda", dtype=BF16):
        out = attend(q, k, v)
    assert out.dtype == BF16
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert all(g.dtype == torch.float32 for g in grads)
    # The reference runs on what autocast computes on: the inputs rounded to bf16 (then in fp64 for the fp64
    # reference, whose output and gradients must not come back rounded to bf16).
    refs = []
    for upcast in (True, False):
        cast = (lambda t: t.to(BF16).double()) if upcast else (lambda t: t.to(BF16))
        qb, kb, vb = (cast(t.detach()).requires_grad_() for t in (q, k, v))
        ref = ref_causal(qb, kb, vb, upcast=upcast)
        refs.append((ref, *torch.autograd.grad(ref, (qb, kb, vb), dout.to(ref.dtype))))
    for name, ours, r64, rl in zip(("out", "dq", "dk", "dv"), (out, *grads), *refs):
        assert_close_to_ref(ours, r64, rl, name=name)


@gpu
def test_cuda_graph_of_a_training_step_replays_the_eager_steps_bit_for_bit(require_kernel):
    # deterministic=True: the default dQ sums with fp32 atomics in a varying order, so two runs of the same
    # step (eager or replayed) differ in the last bits. With it, every kernel of the step is deterministic.
    require_kernel("bwd", 64, BF16)
    warmup, replays = 3, 5
    model = tiny_model(functools.partial(fa2.attention, causal=True, deterministic=True))
    eager = copy.deepcopy(model)
    # capturable=True keeps Adam's step count on the GPU; both optimizers take that same code path. lr 1e-2:
    # the parameters are bf16, in which a step of 1e-3 would not move a LayerNorm weight of 1.0 at all.
    opt, eager_opt = (torch.optim.Adam(m.parameters(), lr=1e-2, capturable=True) for m in (model, eager))
    xs = torch.randn(warmup + replays, 2, 200, 128, device="cuda", dtype=BF16)
    ys = torch.randn_like(xs)

    def step(m, o, x, y):
        o.zero_grad(set_to_none=True)
        loss = (m(x).float() - y.float()).square().mean()
        loss.backward()
        o.step()
        return loss.detach()

    eager_losses = [step(eager, eager_opt, x, y) for x, y in zip(xs, ys)]

    # Warm up on a side stream (lazy optimizer state, cuBLAS handles), then capture one step.
    static_x, static_y = xs[0].clone(), ys[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in zip(xs[:warmup], ys[:warmup]):
            static_x.copy_(x)
            static_y.copy_(y)
            step(model, opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    after_warmup = [p.detach().clone() for p in model.parameters()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x, static_y)
    losses = []
    for x, y in zip(xs[warmup:], ys[warmup:]):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.clone())
    torch.cuda.synchronize()

    for i, (ours, theirs) in enumerate(zip(losses, eager_losses[warmup:])):
        assert torch.isfinite(ours) and torch.equal(ours, theirs), f"step {warmup + i}: {ours} vs {theirs}"
    for (name, p), p_eager, p_warm in zip(model.named_parameters(), eager.parameters(), after_warmup):
        assert not torch.equal(p, p_warm), f"{name} did not change in the replays"
        assert torch.equal(p, p_eager), f"{name} differs from the eager run after {warmup + replays} steps"


@pytest.mark.gpu
def test_an_unaligned_head_dim_compiles_into_one_graph(require_kernel):
    """The zero-padding of a head dim that is not a multiple of 8 is traced with the op: no graph break, the same
    numbers as eager."""
    require_kernel("bwd", 24, torch.bfloat16)
    q, k, v = (torch.randn(2, 100, 4, 20, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    attend = functools.partial(fa2.attention, causal=True, deterministic=True)  # dQ without atomics: repeatable
    compiled = torch.compile(attend, fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    out_eager = attend(q, k, v)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), torch.ones_like(out))
    assert out.shape == q.shape
    torch.testing.assert_close(out, out_eager, rtol=0, atol=0)
    for g, ge in zip(grads, grads_eager):
        torch.testing.assert_close(g, ge, rtol=0, atol=0)

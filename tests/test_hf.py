"""fa2.hf, fa2 as a transformers attention implementation. CPU: registration, and the adapter's layout, padding
and packing logic on a tiny Llama with fa2's kernels stood in for by the fp64 reference, against the same
model with SDPA; a NotImplementedError for each thing fa2 lacks. GPU: the tiny Llama (MHA and GQA) in bf16
with fa2 against the same weights with SDPA, logits and every parameter gradient, both measured against an
fp32 SDPA model: fa2's error may be at most twice SDPA's own bf16 error."""
import copy
import os
import re
import subprocess
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fa2  # noqa: E402
from fa2.reference import attention_ref  # noqa: E402

gpu = pytest.mark.gpu


def llama_config(kv_heads: int, **overrides):
    return transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=64,
                                    max_position_embeddings=1024, **overrides)


def models(config, impls, device="cpu", dtype=torch.float32):
    """One model per attn_implementation in impls, all with the same random weights."""
    fa2.hf.register()
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).state_dict()
    built = []
    for impl in impls:  # each its own config: from_config records the implementation in it
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        model.load_state_dict(weights)
        assert model.config._attn_implementation == impl
        built.append(model.to(device, dtype))
    return built


@pytest.fixture
def calls(monkeypatch):
    """Records which fa2 entry point ran; on a CPU the kernels are replaced by the fp64 reference."""
    record = []
    real = {name: getattr(fa2.hf, name) for name in ("attention", "attention_varlen")}

    def attention(q, k, v, *, deterministic=False, **options):
        record.append("attention")
        if q.is_cuda:
            return real["attention"](q, k, v, deterministic=deterministic, **options)
        if options.get("dropout_p"):  # the stand-in draws its own mask
            record.append(f"dropout_p={options['dropout_p']}")
            options["dropout_keep"] = torch.rand(q.shape[0], q.shape[2], q.shape[1], k.shape[1]) >= options["dropout_p"]
        return attention_ref(q, k, v, **options)[0]

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, deterministic=False, **options):
        record.append("attention_varlen")
        assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
        if q.is_cuda:
            return real["attention_varlen"](q, k, v, cu_q, cu_k, max_q, max_k, deterministic=deterministic,
                                            **options)
        bounds = zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:])
        return torch.cat([attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **options)[0][0]
                          for q0, q1, k0, k1 in bounds])

    monkeypatch.setattr(fa2.hf, "attention", attention)
    monkeypatch.setattr(fa2.hf, "attention_varlen", attention_varlen)
    return record


# ------------------------------------------------------------------------------------------------ CPU
def test_register_makes_fa2_an_attention_and_a_mask_implementation():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert fa2.hf.register() == "fa2"
    assert ALL_ATTENTION_FUNCTIONS["fa2"] is fa2.hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["fa2"] is fa2.hf.build_mask


def test_importing_fa2_does_not_import_transformers():
    code = "import sys, fa2, fa2.integrations.hf; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.stdout.strip() == "False", result.stdout + result.stderr


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_no_mask_runs_fa2_attention_as_sdpa_does(kv_heads, calls):
    ours, sdpa = models(llama_config(kv_heads), ["fa2", "sdpa"])
    ids = torch.randint(0, 256, (2, 37))
    torch.testing.assert_close(ours(ids).logits, sdpa(ids).logits, rtol=1e-4, atol=1e-4)
    assert calls == ["attention"] * 2  # one call per layer, no mask built


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_padding_mask_runs_varlen_as_sdpa_does(kv_heads, calls):
    ours, sdpa = models(llama_config(kv_heads), ["fa2", "sdpa"])
    ids, mask = torch.randint(0, 256, (3, 37)), torch.ones(3, 37, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 30:] = 0  # right padding
    keep = mask.bool()
    got, want = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)  # padding positions: anything
    assert calls == ["attention_varlen"] * 2


def test_sequences_packed_in_one_row_do_not_attend_across(calls):
    ours, sdpa = models(llama_config(2), ["fa2", "sdpa"])
    ids, lengths = torch.randint(0, 256, (1, 37)), (10, 20, 7)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    want = torch.cat([sdpa(part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(ours(ids, position_ids=position_ids).logits, want, rtol=1e-4, atol=1e-4)
    assert calls == ["attention_varlen"] * 2


def test_greedy_generation_with_left_padding_matches_sdpa(calls):
    ours, sdpa = models(llama_config(2), ["fa2", "sdpa"])
    ids, mask = torch.randint(0, 256, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def test_attention_dropout_reaches_fa2_in_training_only(calls):
    (model,) = models(llama_config(2, attention_dropout=0.1), ["fa2"])
    model.train()(torch.randint(0, 256, (1, 8)))
    assert calls == ["attention", "dropout_p=0.1"] * 2
    model.eval()(torch.randint(0, 256, (1, 8)))
    assert calls[4:] == ["attention"] * 2


UNSUPPORTED_KWARGS = [("position_bias", torch.zeros(1, 4, 8, 8))]


@pytest.mark.parametrize("name, value", UNSUPPORTED_KWARGS, ids=[n for n, _ in UNSUPPORTED_KWARGS])
def test_unsupported_model_option_raises_naming_it(name, value, calls):
    q, k, v = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    with pytest.raises(NotImplementedError, match=name):
        fa2.hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None, **{name: value})
    with pytest.raises(NotImplementedError, match="padding mask"):
        fa2.hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, torch.ones(1, 1, 8, 8).bool())
    assert calls == []


def test_chunked_attention_raises(calls):
    q, k, v = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace(attention_chunk_size=4))
    with pytest.raises(NotImplementedError, match="attention_chunk_size"):
        fa2.hf.attention_forward(module, q, k, v, None)
    assert calls == []


def test_model_options_reach_fa2(monkeypatch):
    """sliding_window, softcap and s_aux as the models pass them, in fa2's terms."""
    seen = []
    monkeypatch.setattr(fa2.hf, "attention", lambda q, k, v, **options: seen.append(options) or q)
    q, k, v = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    sinks = torch.randn(4)
    module = types.SimpleNamespace(is_causal=True)
    fa2.hf.attention_forward(module, q, k, v, None, scaling=0.1, sliding_window=16, softcap=50.0, s_aux=sinks)
    fa2.hf.attention_forward(module, q, k, v, None, is_causal=False, sliding_window=16, softcap=None)
    fa2.hf.attention_forward(module, q, k, v, None)
    assert seen[0] == dict(causal=True, softmax_scale=0.1, deterministic=False, softcap=50.0, sink=sinks,
                           window_size=(15, 0))
    assert seen[1]["window_size"] == (15, 15) and seen[1]["softcap"] == 0.0 and seen[1]["sink"] is None
    assert "window_size" not in seen[2]


def test_masks_fa2_cannot_express_raise():
    from transformers.masking_utils import blockwise_overlay, causal_mask_function, or_masks

    # A sliding layer's mask is the padding mask alone: its window goes to the attention call.
    assert fa2.hf.build_mask(batch_size=1, q_length=8, kv_length=8, local_size=4) is None
    with pytest.raises(NotImplementedError, match="overlay"):
        fa2.hf.build_mask(batch_size=1, q_length=8, kv_length=8, use_vmap=True)
    bidirectional_blocks = or_masks(causal_mask_function, blockwise_overlay(torch.tensor([[0, 0, 0, -1]])))
    with pytest.raises(NotImplementedError, match="overlay"):
        fa2.hf.build_mask(batch_size=1, q_length=4, kv_length=4, mask_function=bidirectional_blocks)
    assert fa2.hf.build_mask(batch_size=1, q_length=8, kv_length=8, attention_mask=torch.ones(1, 8).bool()) is None


# ------------------------------------------------------------------------------------------------ GPU
def relative_error(t, ref):
    return ((t.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_as_close_as_sdpa(ours, sdpa, ref, *, name, factor=2.0, floor=1e-3):
    """ours (bf16, fa2) is at most factor x as far from ref (fp32, SDPA) as the bf16 SDPA model is, in relative
    Frobenius norm, plus a floor: the two bf16 models share weights and every layer but attention, so SDPA's
    error is what bf16 itself costs."""
    assert torch.isfinite(ours).all() and torch.isfinite(sdpa).all(), f"{name}: NaN or inf"
    ours_err, sdpa_err = relative_error(ours, ref), relative_error(sdpa, ref)
    assert ours_err <= factor * sdpa_err + floor, (f"{name}: fa2's relative error {ours_err:.2e} exceeds {factor} x "
                                                    f"SDPA's {sdpa_err:.2e} + {floor:g}")


def run(model, ids, mask, labels, compile=False):
    """Logits and parameter gradients of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = (torch.compile(model, fullgraph=True) if compile else model)(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits, {name: p.grad for name, p in model.named_parameters()}


def compare_to_sdpa(config, ids, mask=None, compile=False, impl="sdpa"):
    """fa2 against `impl` (eager where the model's options are beyond SDPA: softcap, sinks)."""
    (ref,) = models(config, [impl], device="cuda")
    sdpa, ours = models(config, [impl, "fa2"], device="cuda", dtype=torch.bfloat16)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)  # padding takes no part in the loss
    keep = slice(None) if mask is None else mask.bool()
    (ref_logits, ref_grads), (sdpa_logits, sdpa_grads) = run(ref, ids, mask, labels), run(sdpa, ids, mask, labels)
    logits, grads = run(ours, ids, mask, labels, compile=compile)
    assert_as_close_as_sdpa(logits[keep], sdpa_logits[keep], ref_logits[keep], name="logits")
    for group, names in gradient_groups(ref_grads).items():
        pick = lambda g: torch.cat([g[name].flatten() for name in names])  # noqa: E731
        assert_as_close_as_sdpa(pick(grads), pick(sdpa_grads), pick(ref_grads), name=f"grad {group}")


def gradient_groups(names):
    """The gradients compare_to_sdpa judges: group name -> the parameters whose gradients it judges as one tensor.
    Each parameter alone, but every MoE router's weight and bias together (all layers'), as affine maps
    [weight | bias] (the bias is the weight of a constant input): a bias's error then counts in proportion to its
    gradient's size.

    A ratio of two models' errors says which is more accurate only where the error norm averages over many entries.
    gpt-oss's router bias gradient, with 2 experts both routed to, is [x, -x]: one number, a sum over tokens that
    cancels ~20x (median), so its relative error is one heavy-tailed draw. On a CPU, with fa2's kernels replaced by the
    fp64 reference rounded to bf16 (a perfect bf16 kernel), gpt_oss_config's router bias alone failed the 2x test in
    one layer or the other for ~35% of random ids (300 draws, with and without padding), at up to ~300x eager's error;
    eager failed it as often against the perfect kernel. One layer's router weight and bias together still failed in
    8 of 2800 draws (with gpt_oss_config's 16 heads); both layers' routers together in none of 1600 (the worst at
    0.998 of the bound: rare false failures remain possible), and an attention rounding P to 4 significant bits
    (bf16: 8) fails them as often as the weights alone. The price: an error confined to one layer's router is
    averaged with the other layer's."""
    groups = {}
    for name in names:
        groups.setdefault(re.sub(r"^model\.layers\.\d+\.mlp\.router\.(weight|bias)$", "model.layers.*.mlp.router.*",
                                 name), []).append(name)
    return groups


@gpu
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_tiny_llama_bf16_matches_sdpa(kv_heads, calls, require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    compare_to_sdpa(llama_config(kv_heads), torch.randint(0, 256, (2, 512), device="cuda"))
    assert calls == ["attention"] * 2


@gpu
def test_tiny_llama_bf16_with_padding_matches_sdpa(calls, require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    mask = torch.ones(3, 300, dtype=torch.long, device="cuda")
    mask[1, 200:], mask[2, 17:] = 0, 0  # right padding: SDPA's reference has no fully masked rows
    compare_to_sdpa(llama_config(2), torch.randint(0, 256, (3, 300), device="cuda"), mask)
    assert calls == ["attention_varlen"] * 2


@gpu
def test_tiny_llama_compiles_with_fullgraph(require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    compare_to_sdpa(llama_config(2), torch.randint(0, 256, (2, 256), device="cuda"), compile=True)


# Models whose attention goes beyond causal: tiny random-weight configs, seqlen past the sliding window.
def mistral_config():  # sliding window on every layer
    return transformers.MistralConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, sliding_window=96)


def gemma2_config():  # softcapped scores, sliding and full layers alternating
    return transformers.Gemma2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     max_position_embeddings=1024, sliding_window=96, query_pre_attn_scalar=64,
                                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def gpt_oss_config():  # learned sinks, sliding and full layers alternating
    # Every token routed to every expert: with top-k < experts, a bf16 rounding difference anywhere upstream flips
    # some token's expert choice, and the router's gradient (through a discrete top-k) then differs between any two
    # bf16 models by more than attention's error.
    # 16 heads: a layer's sink gradient has one entry per head, and the 2x rule compares error norms, which need
    # entries to average over. With 4 heads a perfect bf16 kernel (the fp64 reference rounded, on a CPU) failed a
    # layer's sinks for 8.5-12% of random ids, as a ratio of two 4-entry norms does; with 16, in none of 1600 draws
    # (the worst at 0.86 of the bound), while a sink gradient scaled by 0.98 fails in 96% of them.
    return transformers.GptOssConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                     max_position_embeddings=1024, sliding_window=96, num_local_experts=2,
                                     num_experts_per_tok=2)


FEATURE_MODELS = [("mistral", mistral_config), ("gemma2", gemma2_config), ("gpt_oss", gpt_oss_config)]


@pytest.mark.parametrize("name, config", FEATURE_MODELS, ids=[n for n, _ in FEATURE_MODELS])
def test_feature_models_run_fa2_as_eager_does(name, config, calls):
    """The window, softcap and sinks reach fa2 with the models' meaning (the kernels stood in for by the reference):
    fp32 logits as eager attention's, with and without padding."""
    ours, eager = models(config(), ["fa2", "eager"])
    ids, mask = torch.randint(0, 256, (2, 200)), torch.ones(2, 200, dtype=torch.long)
    torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)
    mask[1, 150:] = 0
    keep = mask.bool()
    got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert calls == ["attention"] * 2 + ["attention_varlen"] * 2


def test_gradient_groups_judge_every_parameter_once_and_only_routers_together():
    (model,) = models(gpt_oss_config(), ["eager"])
    names = [name for name, _ in model.named_parameters()]
    groups = gradient_groups(names)
    assert sorted(name for members in groups.values() for name in members) == sorted(names)
    together = {group: members for group, members in groups.items() if len(members) > 1}
    assert together == {"model.layers.*.mlp.router.*": [f"model.layers.{i}.mlp.router.{p}" for i in range(2)
                                                        for p in ("weight", "bias")]}


@gpu
@pytest.mark.parametrize("name, config", FEATURE_MODELS, ids=[n for n, _ in FEATURE_MODELS])
def test_feature_models_bf16_match_eager(name, config, calls, require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    compare_to_sdpa(config(), torch.randint(0, 256, (2, 300), device="cuda"), impl="eager")
    assert calls == ["attention"] * 2


@gpu
def test_sliding_window_model_with_padding_matches_eager(calls, require_kernel):
    require_kernel("bwd", 64, torch.bfloat16)
    mask = torch.ones(3, 300, dtype=torch.long, device="cuda")
    mask[1, 200:], mask[2, 17:] = 0, 0
    compare_to_sdpa(gpt_oss_config(), torch.randint(0, 256, (3, 300), device="cuda"), mask, impl="eager")
    assert calls == ["attention_varlen"] * 2

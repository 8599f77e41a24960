"""examples/train_gpt.py: its GPT with fa2 attention compiles with torch.compile(fullgraph=True) into one graph,
forward and backward, and meets the tolerance rule against the same model in fp64 (GPU); the script end to end
with SDPA (CPU smoke test)."""
import importlib.util
import json
import pathlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

pytest.importorskip("tqdm")

_spec = importlib.util.spec_from_file_location(
    "train_gpt", pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py")
train_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_gpt)


def relative_error(t, ref):
    return ((t.double() - ref.double()).norm() / ref.double().norm()).item()


def loss_and_grads(model, module, idx, targets, autocast):
    module.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, targets)
    loss.backward()
    return [loss.detach()] + [p.grad for p in module.parameters()]


@pytest.mark.gpu
def test_compiled_gpt_with_fa2_is_one_graph_and_meets_the_tolerance_rule(require_kernel):
    """The rule of the kernel tests, on a whole model: the loss and every parameter gradient of the compiled fa2
    model (bf16 autocast) are at most twice as far from the fp64 model as those of the same model with plain
    PyTorch attention (SDPA's math backend) under the same autocast, in relative norm."""
    require_kernel("bwd", 64, torch.bfloat16)
    sizes = dict(dim=128, nheads=2, layers=2, seqlen=256)
    torch.manual_seed(0)
    model = train_gpt.GPT(64, attention="fa2", **sizes).cuda()
    plain = train_gpt.GPT(64, attention="sdpa", **sizes).cuda()
    plain.load_state_dict(model.state_dict())
    reference = train_gpt.GPT(64, attention="sdpa", **sizes).cuda().double()
    reference.load_state_dict(model.state_dict())
    idx, targets = torch.randint(0, 64, (2, 4, 256), device="cuda")

    with torch.autocast("cuda", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(model)(idx, targets)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons

    compiled = torch.compile(model, fullgraph=True)  # a graph break would raise here
    with sdpa_kernel(SDPBackend.MATH):
        ref = loss_and_grads(reference, reference, idx, targets, autocast=False)
        low = loss_and_grads(plain, plain, idx, targets, autocast=True)
    for name, run in (("eager", model), ("compiled", compiled)):
        got = loss_and_grads(run, model, idx, targets, autocast=True)
        for i, (r, lo, g) in enumerate(zip(ref, low, got)):
            assert torch.isfinite(g).all(), f"{name} tensor {i}: NaN or inf"
            ours, plain_err = relative_error(g, r), relative_error(lo, r)
            assert ours <= 2 * plain_err + 1e-4, \
                f"{name} tensor {i} (0 = loss, then parameters): relative error {ours:.2e} > 2 x {plain_err:.2e}"


def test_example_runs_end_to_end_with_sdpa_on_cpu(tmp_path):
    pytest.importorskip("matplotlib")
    record = train_gpt.main(["--attn", "sdpa", "--device", "cpu", "--steps", "4", "--warmup-steps", "1",
                             "--batch", "2", "--seqlen", "32", "--dim", "32", "--nheads", "2", "--layers", "1",
                             "--val-batches", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "train_gpt.json").read_text())
    assert saved["results"].keys() == {"sdpa"} and len(saved["results"]["sdpa"]["loss"]) == 4
    assert saved["results"]["sdpa"]["tokens_per_s"] > 0 and record["vocab"] == saved["vocab"]
    assert (tmp_path / "train_gpt.png").stat().st_size > 0

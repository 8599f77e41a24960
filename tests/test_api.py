"""The public API without a GPU: import, build_info, and a clear error for every kind of bad input.
Shapes, dtypes and strides are checked before the device, so CPU tensors reach every message."""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest
import torch

import fa2

BF16 = torch.bfloat16


def _qkv(b=1, sq=16, sk=16, h=4, hk=4, d=64, dtype=BF16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def _is_built():
    try:
        import fa2._C  # noqa: F401
    except ImportError:
        return False
    return True


def test_public_api_is_exactly_this():
    assert sorted(fa2.__all__) == ["__version__", "attention", "attention_varlen", "attention_with_kvcache",
                                   "build_info", "bwd", "bwd_varlen", "flash_attn_func", "flash_attn_kvpacked_func",
                                   "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                                   "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                                   "flash_attn_with_kvcache", "fwd", "fwd_varlen", "hf", "reference", "sdpa"]
    assert callable(fa2.reference.attention_ref) and isinstance(fa2.__version__, str)


# The source tree, not the installed package: an installed directory can hold files another distribution left.
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "fa2")


def _package_modules():
    root = SOURCE
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        yield os.path.relpath(path, root), ast.parse(open(path).read())


def test_modules_use_each_others_public_names_only():
    """No fa2 module reaches into another's private names (`ops._C`, `from fa2.x import _y`)."""
    modules = {name.split(".")[0] for name, _ in _package_modules()} | {"integrations", "fa2"}
    found = []
    for path, tree in _package_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in modules:
                found.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fa2"):
                found += [f"{path}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "_C"]
    assert not found, found


def test_integrations_import_the_core_not_the_package_root():
    """fa2/__init__ imports the integrations, so an integration that imported the root would be a cycle."""
    found = []
    for path, tree in _package_modules():
        if not path.startswith("integrations"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{path}:{node.lineno} import {a.name}" for a in node.names if a.name == "fa2"]
            if isinstance(node, ast.ImportFrom) and node.module == "fa2":
                found += [f"{path}:{node.lineno} from fa2 import {a.name}" for a in node.names
                          if a.name not in ("ops", "interface", "reference")]
    assert not found, found


def test_import_without_extension_fails_only_when_a_kernel_is_needed():
    # A fresh interpreter where fa2._C cannot be imported (as in a source checkout without a build).
    code = ("import sys; sys.modules['fa2._C'] = None\n"
            "import fa2\n"
            "try:\n    fa2.build_info()\nexcept RuntimeError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "not built" in result.stdout and "pip install" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("shared", [True, False])
def test_import_warns_when_another_fa2_distribution_shares_the_directory(tmp_path, shared):
    # A copy of the package, with (shared) or without a distribution named fa2 that claims fa2/__init__.py.
    import shutil
    shutil.copytree(SOURCE, tmp_path / "pkg" / "fa2",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    info = tmp_path / ("pkg" if shared else "other") / "fa2-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fa2\nVersion: 0.0.1\n")
    (info / "RECORD").write_text("fa2/__init__.py,,\n")
    code = "import sys; sys.modules['fa2._C'] = None\nimport fa2\n"
    path = [str(tmp_path / "pkg"), str(tmp_path / "other")] + sys.path
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    assert ("pip uninstall fa2 fa2-cute" in result.stderr) == shared, result.stderr


@pytest.mark.skipif(not _is_built(), reason="fa2._C is not built")
def test_build_info_has_the_documented_keys():
    info = fa2.build_info()
    assert set(info) >= {"version", "cuda_version", "archs", "fwd_head_dims", "bwd_head_dims", "dtypes"}
    assert info["version"] == fa2.__version__
    assert info["fwd_head_dims"] == sorted(info["fwd_head_dims"]) and info["fwd_head_dims"]
    assert all(d % 8 == 0 and d <= 256 for d in info["fwd_head_dims"] + info["bwd_head_dims"])
    assert set(info["dtypes"]) <= {"fp16", "bf16"} and all(isinstance(a, int) for a in info["archs"])


BAD_QKV = [  # (id, make (q, k, v) from good ones, exception, message pattern naming the argument)
    ("not_a_tensor", lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
    ("fp32", lambda q, k, v: (q.float(), k, v), TypeError, "q must be float16 or bfloat16, got torch.float32"),
    ("int", lambda q, k, v: (q, k, v.to(torch.int32)), TypeError, "v must be float16 or bfloat16"),
    ("mixed_dtypes", lambda q, k, v: (q, k.half(), v), TypeError, "q, k and v must have one dtype"),
    ("rank3", lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
    ("rank5", lambda q, k, v: (q, k, v[None]), ValueError, "v must be 4-D"),
    ("batch", lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, "k must be \\(batch=1"),
    ("head_dim", lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "k must be .*head_dim=64"),
    ("v_shape", lambda q, k, v: (q, k, v[:, :8]), ValueError, "v must have the same shape as k"),
    ("nheads", lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), ValueError, "nheads \\(4\\) must be a multiple"),
    ("head_dim_264", lambda q, k, v: tuple(torch.randn(1, 4, 1, 264, dtype=BF16) for _ in range(3)), ValueError,
     "head_dim .* must be a multiple of 8 in \\[8, 256\\], got 264"),
    ("last_dim_strided", lambda q, k, v: (q, k.transpose(1, 3).contiguous().transpose(1, 3), v), ValueError,
     "k must have a contiguous last dimension"),
    ("misaligned", lambda q, k, v: (torch.randn(1, 16, 4, 72, dtype=BF16)[..., 4:68], k, v), ValueError,
     "q must start on a 16-byte boundary"),
    ("cpu", lambda q, k, v: (q, k, v), ValueError, "q must be a CUDA tensor"),
]


@pytest.mark.parametrize("make,exc,pattern", [b[1:] for b in BAD_QKV], ids=[b[0] for b in BAD_QKV])
def test_fwd_rejects_bad_inputs(make, exc, pattern):
    q, k, v = make(*_qkv())
    with pytest.raises(exc, match=pattern):
        fa2.fwd(q, k, v)


@pytest.mark.parametrize("make,exc,pattern", [b[1:] for b in BAD_QKV], ids=[b[0] for b in BAD_QKV])
def test_attention_and_bwd_reject_the_same_inputs(make, exc, pattern):
    q, k, v = make(*_qkv())
    with pytest.raises(exc, match=pattern):
        fa2.attention(q, k, v)
    good = _qkv()[0]
    with pytest.raises(exc, match=pattern):
        fa2.bwd(good, q, k, v, good, torch.empty(1, 4, 16))


BAD_OUT = [  # (id, out buffer for q of shape (1, 16, 4, 64) bf16, exception, pattern)
    ("not_a_tensor", [0.0], TypeError, "out must be a torch.Tensor"),
    ("dtype", torch.empty(1, 16, 4, 64, dtype=torch.float16), TypeError, "out must be a torch.bfloat16 tensor"),
    ("shape", torch.empty(1, 16, 4, 32, dtype=BF16), ValueError, "out must have shape \\(1, 16, 4, 64\\)"),
    ("last_dim_strided", torch.empty(1, 16, 64, 4, dtype=BF16).transpose(2, 3), ValueError,
     "out must have a contiguous last dimension"),
]


@pytest.mark.parametrize("out,exc,pattern", [b[1:] for b in BAD_OUT], ids=[b[0] for b in BAD_OUT])
def test_fwd_rejects_bad_out(out, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fa2.fwd(*_qkv(), out=out)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), 1e-46])
def test_fwd_rejects_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
        fa2.fwd(*_qkv(), softmax_scale=scale)


def _bwd_args(**change):
    q, k, v = _qkv(hk=2)  # GQA: dk/dv are shaped like k, with 2 heads
    args = dict(dout=torch.randn_like(q), q=q, k=k, v=v, out=torch.randn_like(q), lse=torch.empty(1, 4, 16))
    args.update(change)
    return args


BAD_BWD = [  # (id, changed arguments, exception, pattern)
    ("dout_dtype", dict(dout=torch.empty(1, 16, 4, 64)), TypeError, "dout must be a torch.bfloat16 tensor"),
    ("dout_shape", dict(dout=torch.empty(1, 8, 4, 64, dtype=BF16)), ValueError, "dout must have shape"),
    ("out_missing", dict(out=None), TypeError, "out must be"),
    ("out_shape", dict(out=torch.empty(1, 16, 2, 64, dtype=BF16)), ValueError, "out must have shape"),
    ("lse_dtype", dict(lse=torch.empty(1, 4, 16, dtype=BF16)), TypeError, "lse must be a torch.float32 tensor"),
    ("lse_shape", dict(lse=torch.empty(1, 16, 4)), ValueError, "lse must have shape \\(1, 4, 16\\)"),
    ("lse_strided", dict(lse=torch.empty(1, 16, 4).transpose(1, 2)), ValueError, "lse must be contiguous"),
    ("dq_dtype", dict(dq=torch.empty(1, 16, 4, 64, dtype=torch.float16)), TypeError, "dq must be a torch.bfloat16"),
    ("dk_shape_of_q", dict(dk=torch.empty(1, 16, 4, 64, dtype=BF16)), ValueError,
     "dk must have shape \\(1, 16, 2, 64\\)"),
    ("dv_strided", dict(dv=torch.empty(1, 16, 64, 2, dtype=BF16).transpose(2, 3)), ValueError,
     "dv must have a contiguous last dimension"),
    ("cpu", dict(), ValueError, "q must be a CUDA tensor"),
]


@pytest.mark.parametrize("change,exc,pattern", [b[1:] for b in BAD_BWD], ids=[b[0] for b in BAD_BWD])
def test_bwd_rejects_bad_arguments(change, exc, pattern):
    args = _bwd_args(**change)
    positional = [args.pop(name) for name in ("dout", "q", "k", "v", "out", "lse")]
    with pytest.raises(exc, match=pattern):
        fa2.bwd(*positional, **args)


def test_bwd_accepts_any_dout_strides_before_the_device_check():
    # A transposed or broadcast dout is copied, not rejected: the first complaint is the CPU device.
    args = _bwd_args(dout=torch.randn(1, 4, 16, 64, dtype=BF16).transpose(1, 2))
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        fa2.bwd(*args.values())
    args = _bwd_args(dout=torch.ones(1, 1, 1, 1, dtype=BF16).expand(1, 16, 4, 64))
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        fa2.bwd(*args.values())


def test_fwd_passes_pointers_strides_and_sizes(recording):
    q, k, v = torch.randn(2, 40, 3, 4, 64, dtype=BF16).unbind(2)  # strided slices of a packed qkv
    k, v = k[:, :30, :2], v[:, :30, :2]  # GQA 2:1, seqlen_k 30
    out, lse = fa2.fwd(q, k, v, causal=True)
    (kind, args), = recording.calls
    assert kind == "fwd" and args["q"] == q.data_ptr() and args["out"] == out.data_ptr()
    assert args["q_stride"] == (40 * 3 * 4 * 64, 3 * 4 * 64, 64) and args["k_stride"] == args["q_stride"]
    assert args["out_stride"] == (40 * 4 * 64, 4 * 64, 64) and lse.shape == (2, 4, 40) and lse.is_contiguous()
    assert (args["batch"], args["seqlen_q"], args["seqlen_k"], args["nheads"], args["nheads_k"], args["head_dim"]) \
        == (2, 40, 30, 4, 2, 64)
    assert args["softmax_scale"] == 64 ** -0.5 and args["causal"] is True and args["dtype"] == "bf16"
    assert args["cu_seqlens_q"] == 0 and args["total_q"] == 0  # a padded batch


def test_bwd_gives_the_kernels_per_query_head_dk_dv(recording):
    q, k, v = _qkv(h=8, hk=2)
    out, lse = torch.randn_like(q), torch.zeros(1, 8, 16)
    dout = torch.randn(1, 16, 64, 8, dtype=BF16).transpose(2, 3)  # last dim not contiguous: copied
    dq, dk, dv = fa2.bwd(dout, q, k, v, out, lse, softmax_scale=0.5, deterministic=True)
    (kind, args), = recording.calls
    assert kind == "bwd" and args["dq"] == dq.data_ptr() and dk.shape == k.shape and dv.shape == v.shape
    assert args["dk"] != dk.data_ptr() and args["dk_stride"] == (16 * 8 * 64, 8 * 64, 64)  # 8 heads, not 2
    assert args["dout"] != dout.data_ptr() and args["dout_stride"] == (16 * 8 * 64, 8 * 64, 64)
    assert args["softmax_scale"] == 0.5 and args["deterministic"] is True and args["causal"] is False
    assert {"lse", "dq_accum", "d_sum"} <= set(args)


def test_bwd_reads_a_heads_first_dout_in_place(recording):
    q, k, v = _qkv()
    dout = torch.randn(1, 4, 16, 64, dtype=BF16).transpose(1, 2)  # strided, but rows are contiguous
    fa2.bwd(dout, q, k, v, torch.randn_like(q), torch.zeros(1, 4, 16))
    (_, args), = recording.calls
    assert args["dout"] == dout.data_ptr() and args["dout_stride"] == (4 * 16 * 64, 64, 16 * 64)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 16), (16, 0)])
def test_empty_inputs_launch_no_kernel(recording, seqlen_q, seqlen_k):
    q, k, v = _qkv(sq=seqlen_q, sk=seqlen_k)
    out, lse = fa2.fwd(q, k, v)
    assert out.shape == q.shape and lse.shape == (1, 4, seqlen_q)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = fa2.bwd(torch.randn_like(q), q, k, v, out, lse)
    assert all(torch.equal(g, torch.zeros_like(t)) for g, t in zip(grads, (q, k, v)))
    assert recording.calls == []


def test_varlen_launches_pass_offsets_and_totals(recording):
    q, k, v = (t[0] for t in _qkv(sq=12, sk=10, hk=2))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    out, lse = fa2.fwd_varlen(q, k, v, cu_q, cu_k, 7, 6, causal=True)
    assert lse.shape == (4, 12)
    dq, dk, dv = fa2.bwd_varlen(torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, 7, 6)
    (kind, fwd_args), (bwd_kind, bwd_args) = recording.calls
    assert (kind, bwd_kind) == ("fwd", "bwd") and dk.shape == k.shape
    for args in (fwd_args, bwd_args):
        assert args["cu_seqlens_q"] == cu_q.data_ptr() and args["cu_seqlens_k"] == cu_k.data_ptr()
        assert (args["batch"], args["seqlen_q"], args["seqlen_k"], args["total_q"], args["total_k"]) == (2, 7, 6, 12, 10)
        assert args["q_stride"] == (0, 4 * 64, 64) and args["k_stride"] == (0, 2 * 64, 64)
    assert bwd_args["dkv_fp32"] is True and bwd_args["dk_stride"] == (0, 4 * 64, 64)  # per query head, float32


# ------------------------------------------------------------------------- window, softcap, sink
def test_features_reach_the_kernels(recording):
    q, k, v = _qkv(sq=16, sk=40)
    sink, slopes = torch.randn(4, dtype=BF16), torch.rand(1, 4, dtype=torch.float64)
    options = dict(softmax_scale=0.5, window_size=(8, 2), softcap=20.0, alibi_slopes=slopes)
    out, lse = fa2.fwd(q, k, v, sink=sink, **options)
    fa2.bwd(torch.randn_like(q), q, k, v, out, lse, **options)
    (kind, f), (bwd_kind, b) = recording.calls
    for args in (f, b):
        assert (args["window_left"], args["window_right"], args["causal"]) == (8, 2, False)
        assert args["softcap_in"] == _f32(0.5 / 20.0) and args["score_scale"] == 20.0
        assert args["alibi_slopes"] not in (0, slopes.data_ptr()) and args["alibi_batch_stride"] == 4  # fp32 copy
    assert f["sink"] != 0 and f["sink"] != sink.data_ptr() and b["sink"] == 0  # an fp32 copy; the bwd needs none


@pytest.mark.parametrize("causal, window, expected", [
    (True, (-1, -1), (-1, 0, True)), (True, (32, 0), (32, 0, True)), (False, (-1, 0), (-1, 0, True)),
    (False, (100, 100), (-1, -1, False)),  # wider than seqlen_q + seqlen_k: no bound at all
    (False, (0, 0), (0, 0, True)),
])
def test_window_bounds_as_the_kernels_take_them(recording, causal, window, expected):
    fa2.fwd(*_qkv(sq=16, sk=40), causal=causal, window_size=window)
    (_, args), = recording.calls
    assert (args["window_left"], args["window_right"], args["causal"]) == expected
    assert args["softcap_in"] == 0.0 and args["score_scale"] == _f32(64 ** -0.5) and args["sink"] == 0
    assert args["alibi_slopes"] == 0 and args["alibi_batch_stride"] == 0


BAD_FEATURES = [
    ("window_size=(1, 2, 3)", dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
    ("window_size float", dict(window_size=(1.5, 0)), TypeError, "window_size\\[0\\] \\(left\\) must be an int"),
    ("window_size < -1", dict(window_size=(-2, 0)), ValueError, "window_size\\[0\\] \\(left\\) must be -1"),
    ("causal and right > 0", dict(causal=True, window_size=(4, 4)), ValueError, "causal=True .* window_size\\[1\\]"),
    ("softcap < 0", dict(softcap=-1.0), ValueError, "softcap must be 0 \\(off\\) or a positive"),
    ("softcap nan", dict(softcap=float("nan")), ValueError, "softcap must be"),
    ("sink shape", dict(sink=torch.zeros(3)), ValueError, "sink must be a contiguous \\(nheads=4,\\)"),
    ("sink not a tensor", dict(sink=[0.0] * 4), TypeError, "sink must be a torch.Tensor"),
    ("alibi_slopes shape", dict(alibi_slopes=torch.ones(2, 4)), ValueError,
     "alibi_slopes must be a contiguous \\(nheads=4,\\) or \\(batch=1, nheads=4\\)"),
    ("alibi_slopes not a tensor", dict(alibi_slopes=1.0), TypeError, "alibi_slopes must be a torch.Tensor"),
    ("dropout_p 1", dict(dropout_p=1.0), ValueError, "dropout_p must be in \\[0, 1\\)"),
]


@pytest.mark.parametrize("change,exc,pattern", [b[1:] for b in BAD_FEATURES], ids=[b[0] for b in BAD_FEATURES])
@pytest.mark.parametrize("entry", ["fwd", "attention"])
def test_bad_options_are_refused_before_any_launch(recording, entry, change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        getattr(fa2, entry)(*_qkv(), **change)
    assert recording.calls == []


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "packed"])
def test_sink_gets_a_gradient_through_autograd(recording, varlen):
    """The eager autograd path saves the sink and returns its gradient in the sink's own dtype; the backward launch
    carries the forward's options."""
    q, k, v = (t.requires_grad_() for t in _qkv(sq=16, sk=24, h=4, hk=2))
    sink = torch.randn(4, dtype=BF16, requires_grad=True)
    options = dict(causal=True, window_size=(5, 0), softcap=10.0, sink=sink)
    if varlen:
        cu = torch.tensor([0, 16], dtype=torch.int32)
        out = fa2.attention_varlen(q[0], k[0], v[0], cu, torch.tensor([0, 24], dtype=torch.int32), 16, 24, **options)
    else:
        out = fa2.attention(q, k, v, **options)
    out.float().sum().backward()
    (_, f), (kind, b) = recording.calls
    assert kind == "bwd" and (b["window_left"], b["window_right"], b["softcap_in"]) == (5, 0, _f32(64 ** -0.5 / 10))
    assert sink.grad is not None and sink.grad.shape == (4,) and sink.grad.dtype == BF16
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_bwd_writes_d_into_a_given_d_sum(recording):
    """The bwd ops take d_sum, a float32 buffer laid out like lse, for D = rowsum(dO * O) (the sink's gradient reads
    it); anything else is refused before a launch."""
    q, k, v = _qkv(sq=16, sk=24, h=4, hk=2)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 16)
    d_sum = torch.empty_like(lse)
    torch.ops.fa2.bwd(torch.randn_like(q), q, k, v, out, lse, None, True, False, d_sum=d_sum)
    (kind, b), = recording.calls
    assert kind == "bwd" and b["d_sum"] == d_sum.data_ptr()
    bads = (torch.empty(1, 4, 15), torch.empty(1, 4, 16, dtype=torch.float64), torch.empty(1, 16, 4).transpose(1, 2))
    for bad in bads:
        with pytest.raises(ValueError, match="d_sum must be a contiguous float32 tensor laid out like lse"):
            torch.ops.fa2.bwd(torch.randn_like(q), q, k, v, out, lse, None, True, False, d_sum=bad)
    assert len(recording.calls) == 1


def test_dropout_reaches_the_kernels_with_its_state(recording):
    """The forward and the backward get the same (seed, offset) tensor, the reference's threshold and 1 / (1 - p)."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    fa2.attention(q, k, v, dropout_p=0.25).float().sum().backward()
    (_, f), (_, b) = recording.calls
    assert f["rng_state"] != 0 and f["rng_state"] == b["rng_state"]
    for args in (f, b):
        assert args["dropout_threshold"] == 3 * 2 ** 14 and args["dropout_scale"] == _f32(1 / 0.75)
    state = torch.tensor([5, 6])
    out, lse = fa2.fwd(*_qkv(), dropout_p=0.5, rng_state=state)
    assert recording.calls[-1][1]["rng_state"] == state.data_ptr()
    with pytest.raises(ValueError, match="dropout_p=0.5 needs rng_state"):
        fa2.fwd(*_qkv(), dropout_p=0.5)
    with pytest.raises(ValueError, match="rng_state must be a contiguous int64 tensor of shape \\(2,\\)"):
        fa2.fwd(*_qkv(), dropout_p=0.5, rng_state=torch.tensor([1.0, 2.0]))


def test_a_dropout_too_small_to_move_the_threshold_launches_without_dropout(recording):
    """dropout_p <= 2^-54: 1 - p rounds to 1 and the reference keeps every score at scale 1; the kernels, whose compare
    needs the threshold below 2^16, get no RNG state. Just above it the threshold is 2^16 - 1 and dropout is on."""
    state = torch.tensor([5, 6])
    fa2.fwd(*_qkv(), dropout_p=1e-20, rng_state=state)
    args = recording.calls[-1][1]
    assert args["rng_state"] == 0 and args["dropout_scale"] == 1.0
    fa2.fwd(*_qkv(), dropout_p=2.0 ** -17, rng_state=state)
    args = recording.calls[-1][1]
    assert args["rng_state"] == state.data_ptr() and args["dropout_threshold"] == 2 ** 16 - 1


def test_dropout_state_follows_torch_manual_seed():
    from fa2 import ops
    torch.manual_seed(3)
    a = ops.dropout_state(0.1, "cpu")
    torch.manual_seed(3)
    assert torch.equal(a, ops.dropout_state(0.1, "cpu")) and a.dtype == torch.int64 and a.shape == (2,)
    assert ops.dropout_state(0.0, "cpu") is None


def test_sink_gradient_is_the_reference_formula():
    """ops.sink_grad against autograd through fa2.reference (CPU, float64)."""
    from fa2 import ops
    from fa2.reference import attention_ref
    q, k, v = (torch.randn(2, 5, 3, 8, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out, lse = attention_ref(q, k, v, sink=sink)
    dout = torch.randn_like(out)
    expected, = torch.autograd.grad(out, sink, dout)
    got = ops.sink_grad(dout, out.detach(), lse.detach(), sink.detach())
    torch.testing.assert_close(got.double(), expected)
    # Packed: rows past the last sequence hold garbage and count for nothing.
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    out_p, lse_p, dout_p = out.reshape(10, 3, 8), lse.transpose(0, 1).reshape(3, 10), dout.reshape(10, 3, 8)
    pad = lambda t, dim: torch.cat([t, torch.full_like(t.narrow(dim, 0, 2), 1e4)], dim)  # noqa: E731
    got = ops.sink_grad(pad(dout_p, 0), pad(out_p, 0), pad(lse_p, 1), sink.detach(), cu)
    torch.testing.assert_close(got.double(), expected)


# ------------------------------------------------------------------------- head dims that are not a multiple of 8
def test_the_ops_themselves_take_only_multiples_of_8():
    """Zero-padding is the Python layer's (below); a direct op call gets the op's own message."""
    q, k, v = (t[..., :60] for t in _qkv())
    with pytest.raises(ValueError, match="head_dim .* must be a multiple of 8 in \\[8, 256\\], got 60: zero-pad"):
        torch.ops.fa2.fwd(q, k, v, None, False)


def _f32(x: float) -> float:  # the kernels' parameters hold float32
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.parametrize("head_dim", [1, 7, 60])  # the trimmed CI build has d64 kernels only
def test_an_unaligned_head_dim_runs_zero_padded_with_its_own_scale(head_dim, recording):
    q, k, v = _qkv(h=4, hk=2, d=head_dim)
    out, lse = fa2.fwd(q, k, v, causal=True)
    (kind, args), = recording.calls
    assert kind == "fwd" and args["head_dim"] == head_dim + (-head_dim % 8)
    assert args["softmax_scale"] == _f32(head_dim ** -0.5) and args["q"] != q.data_ptr()  # a padded copy
    assert out.shape == q.shape and lse.shape == (1, 4, 16)
    dq, dk, dv = fa2.bwd(torch.randn_like(out), q, k, v, out, lse, causal=True)
    (kind, args), = recording.calls[1:]
    assert kind == "bwd" and args["head_dim"] == head_dim + (-head_dim % 8)
    assert args["softmax_scale"] == _f32(head_dim ** -0.5)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_an_aligned_head_dim_is_not_copied(recording):
    q, k, v = _qkv(d=64)
    fa2.fwd(q, k, v)
    (kind, args), = recording.calls
    assert args["q"] == q.data_ptr() and args["k"] == k.data_ptr() and args["v"] == v.data_ptr()


def test_unaligned_head_dims_in_every_entry_point(recording):
    """fa2.attention and the varlen pair pad too; a given out= / dq= buffer receives the true columns."""
    q, k, v = _qkv(d=20)
    out = fa2.attention(q, k, v, softmax_scale=0.3)
    assert out.shape == q.shape and recording.calls[-1][1]["softmax_scale"] == _f32(0.3)
    buf = torch.empty_like(q)
    assert fa2.fwd(q, k, v, out=buf)[0] is buf
    with pytest.raises(ValueError, match="out must be a torch.bfloat16 tensor of shape \\(1, 16, 4, 20\\)"):
        fa2.fwd(q, k, v, out=torch.empty(1, 16, 4, 24, dtype=BF16))
    qp, kp, vp = (t[0] for t in (q, k, v))
    cu = torch.tensor([0, 16], dtype=torch.int32)
    out, lse = fa2.fwd_varlen(qp, kp, vp, cu, cu, 16, 16)
    assert out.shape == qp.shape and recording.calls[-1][1]["head_dim"] == 24
    grads = fa2.bwd_varlen(torch.randn_like(out), qp, kp, vp, out, lse, cu, cu, 16, 16, dq=torch.empty_like(qp))
    assert [g.shape for g in grads] == [qp.shape, kp.shape, vp.shape] and recording.calls[-1][0] == "bwd"
    assert fa2.attention_varlen(qp, kp, vp, cu, cu, 16, 16).shape == qp.shape


def test_head_dims_that_differ_are_not_padded_but_refused():
    q, k, v = _qkv(d=20)
    with pytest.raises(ValueError, match="k must be"):
        fa2.fwd(q, k[..., :12], v[..., :12])

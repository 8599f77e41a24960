"""Bad input gets a clear Python error naming the argument (CPU: shapes and dtypes are checked first)."""
import pytest
import torch

import fa2


def _qkv(b=1, sq=16, sk=16, h=4, hk=4, d=64, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def test_import_without_gpu_exposes_api():
    for name in ("fwd", "bwd", "attention", "build_info", "reference", "__version__"):
        assert hasattr(fa2, name)


def test_build_info_keys():
    try:
        import fa2._C  # noqa: F401
    except ImportError:
        pytest.skip("fa2._C not built")
    info = fa2.build_info()
    assert set(info) >= {"version", "cuda_version", "archs", "fwd_head_dims", "bwd_head_dims", "dtypes"}
    assert info["fwd_head_dims"] and set(info["dtypes"]) <= {"fp16", "bf16"}


def test_kernel_without_gpu_raises_clearly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        fa2.fwd(q, k, v)


BAD = [  # (description, mutate(q, k, v) -> (q, k, v), exception, message fragment)
    ("fp32", lambda q, k, v: (q.float(), k, v), TypeError, "q must be float16 or bfloat16"),
    ("mixed", lambda q, k, v: (q, k.half(), v), TypeError, "k must be float16 or bfloat16|same dtype"),
    ("not tensor", lambda q, k, v: (q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
    ("rank", lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dims"),
    ("batch", lambda q, k, v: (q, k[:0], v), ValueError, "k must be"),
    ("head_dim", lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "k must be"),
    ("v shape", lambda q, k, v: (q, k, v[:, :8]), ValueError, "v must have the same shape"),
    ("nheads", lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]), ValueError, "multiple of nheads"),
    ("head_dim%8", lambda q, k, v: (q[..., :60], k[..., :60], v[..., :60]), ValueError, "last dimension|multiple of 8"),
    ("head_dim>256", lambda q, k, v: tuple(torch.randn(1, 4, 1, 264, dtype=torch.bfloat16) for _ in range(3)),
     ValueError, "head_dim must be a multiple of 8"),
    ("last dim stride", lambda q, k, v: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v), ValueError,
     "q must have a contiguous last dimension"),
    ("cpu", lambda q, k, v: (q, k, v), ValueError, "must be a CUDA tensor"),
]


@pytest.mark.parametrize("desc,mutate,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_fwd_rejects_bad_input(desc, mutate, exc, msg):
    q, k, v = mutate(*_qkv())
    with pytest.raises(exc, match=msg):
        fa2.fwd(q, k, v)


def test_fwd_rejects_bad_out_and_scale():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="out must be"):
        fa2.fwd(q, k, v, out=torch.empty(1, 16, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        fa2.fwd(q, k, v, out=torch.empty(1, 16, 4, 64, dtype=torch.float16))


def test_bwd_rejects_bad_lse_and_grads():
    q, k, v = _qkv()
    out, dout = torch.randn_like(q), torch.randn_like(q)
    with pytest.raises(ValueError, match="lse must be"):
        fa2.bwd(dout, q, k, v, out, torch.empty(1, 4, 15))
    with pytest.raises(ValueError, match="dk must be"):
        fa2.bwd(dout, q, k, v, out, torch.empty(1, 4, 16), dk=torch.empty_like(q[:, :, :2]))
    with pytest.raises(ValueError, match="dout must be"):
        fa2.bwd(dout[:, :8], q, k, v, out, torch.empty(1, 4, 16))

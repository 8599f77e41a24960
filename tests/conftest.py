"""Test setup: the `gpu` marker (skipped, with the reason, where there is no GPU or no built extension), a
fresh, reproducible seed per test, and a stand-in for the kernels that lets CPU tests run fwd/bwd."""
import contextlib
import functools
import zlib

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled fa2._C (skipped otherwise)")


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import fa2._C  # noqa: F401
    except ImportError as e:
        return f"fa2._C is not built ({e}); run `pip install .`"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is not None:
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed(request):
    """Each test draws its own random inputs (never zeros), from a seed derived from its name: a failure
    reproduces when the test is re-run alone."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def require_kernel():
    """require_kernel(kind, head_dim, dtype) skips the test unless this build has a `kind` ("fwd"/"bwd")
    kernel that serves head_dim (the smallest compiled head dim >= head_dim) for dtype."""
    import fa2

    def require(kind, head_dim, dtype):
        info = fa2.build_info()
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        if name not in info["dtypes"] or not any(d >= head_dim for d in info[f"{kind}_head_dims"]):
            pytest.skip(f"this build has no {kind} kernel for head_dim {head_dim} / {name} "
                        f"({info[f'{kind}_head_dims']}, {info['dtypes']})")

    return require


class _RecordingExtension:
    """Stands in for fa2._C: records the keyword arguments of each kernel call instead of launching."""

    def __init__(self):
        self.calls = []

    def fwd(self, **kwargs):
        self.calls.append(("fwd", kwargs))

    def bwd(self, **kwargs):
        self.calls.append(("bwd", kwargs))


@pytest.fixture
def recording(monkeypatch):
    """Run fwd/bwd (and the varlen pair) on CPU tensors past the device checks, with the kernels replaced by
    a recorder. Outputs are left unwritten (torch.empty)."""
    import fa2

    ext = _RecordingExtension()
    monkeypatch.setattr(fa2.interface, "_C", ext)
    for module in (fa2.interface, fa2.varlen):  # varlen.py imports the check by name
        monkeypatch.setattr(module, "_check_device_and_build", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(fa2.interface, "_current_stream", lambda device_index: 1234)
    return ext


class _ForcedKeywords:
    """fa2._C with fixed keywords added to some of its functions."""

    def __init__(self, ext, fixed):
        self._ext, self._fixed = ext, fixed

    def __getattr__(self, name):
        fn = getattr(self._ext, name)
        return functools.partial(fn, **self._fixed[name]) if name in self._fixed else fn


@pytest.fixture
def force_ext_keywords(monkeypatch):
    """force_ext_keywords(fwd={"head_group": 2}) makes fa2's Python layer call fa2._C.fwd with head_group=2 added:
    the test-only launch parameters of csrc/CONTRACT.md, which reach configurations the launch would not pick on
    this GPU. force_ext_keywords() goes back to the plain module."""
    from fa2 import interface

    ext = interface._ext()

    def force(**fixed):
        monkeypatch.setattr(interface, "_ext", (lambda: _ForcedKeywords(ext, fixed)) if fixed else (lambda: ext))

    return force

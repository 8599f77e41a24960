"""Test setup: the `gpu` marker (skipped, with the reason, where there is no GPU or no built extension), a
fresh, reproducible seed per test, and a stand-in for the kernels that lets CPU tests run fwd/bwd."""
import os
import zlib

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled fa2._C (skipped otherwise)")
    config.addinivalue_line("markers", "gpus(n): a gpu test that needs n GPUs of one host (skipped with fewer; under "
                                       "FA2_REQUIRE_GPU=1 deselected there, as no run on that machine can meet it)")


# FA2_REQUIRE_GPU=1 (the GPU landing run, bench/verify.sh): a GPU test that would skip fails instead, and so does
# any other skip. Where a missing extension, kernel or GPU would otherwise read as "skipped", it is a failure.
REQUIRE_GPU = os.environ.get("FA2_REQUIRE_GPU", "") == "1"


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
    if reason is not None and REQUIRE_GPU and any("gpu" in item.keywords for item in items):
        raise pytest.UsageError(f"FA2_REQUIRE_GPU=1, but the GPU tests cannot run: {reason}")
    if reason is not None:
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
        return
    count = torch.cuda.device_count()
    needs = {item: item.get_closest_marker("gpus").args[0] for item in items if item.get_closest_marker("gpus")}
    short = [item for item, needed in needs.items() if needed > count]
    if short and REQUIRE_GPU:
        config.hook.pytest_deselected(items=short)
        items[:] = [item for item in items if item not in short]
    elif short:
        for item in short:
            item.add_marker(pytest.mark.skip(reason=f"needs {needs[item]} GPUs, this machine has {count}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped under FA2_REQUIRE_GPU=1: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped:  # a module that skips itself (pytest.importorskip) is a failure too
        report.outcome = "failed"


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


class _Recording:
    """The launches fa2._C recorded instead of making them, as (kind, parameters) pairs; `calls` collects them."""

    def __init__(self, ext):
        self._ext, self._calls = ext, []

    @property
    def calls(self):
        self._calls += [(launch.pop("kind"), launch) for launch in self._ext.take_recorded_launches()]
        return self._calls


@pytest.fixture
def recording():
    """Run fwd/bwd (and the varlen pair) on CPU tensors through fa2._C's checks and allocation, with each launch's
    parameters recorded instead of launched (csrc/CONTRACT.md: set_test_overrides(record=True)). Outputs are left
    unwritten (torch.empty)."""
    from fa2 import ops

    if ops._C is None:
        pytest.skip("fa2._C is not built")
    ops._C.set_test_overrides(record=True)
    yield _Recording(ops._C)
    ops._C.set_test_overrides()


@pytest.fixture
def launch_overrides(request):
    """launch_overrides(smem_limit=101376) makes every later kernel launch act as if a block could use only that
    much shared memory (another GPU's configurations); launch_overrides(head_group=2) forces the causal grids'
    head groups, launch_overrides(family="sm80") a kernel family. The test-only entry point of csrc/CONTRACT.md;
    reset when the test ends, or by launch_overrides(). In a test file that sets FAMILY, every call pins it."""
    from fa2 import ops

    if ops._C is None:
        raise ops.not_built()
    family = getattr(request.module, "FAMILY", None)
    if family is None:
        yield ops._C.set_test_overrides
    else:
        yield lambda **overrides: ops._C.set_test_overrides(**{"family": family, **overrides})
    ops._C.set_test_overrides()


@pytest.fixture(autouse=True)
def _pinned_family(request):
    """A test file whose tests are about one kernel family's configurations sets FAMILY = "sm80" (or "sm90"): its
    calls run on that family, whatever FA2_FAMILY or the launch plan would pick."""
    from fa2 import ops

    family = getattr(request.module, "FAMILY", None)
    if family is None or ops._C is None:
        yield
        return
    ops._C.set_test_overrides(family=family)
    yield
    ops._C.set_test_overrides()

"""The test suite's own guarantees (CPU): under FA2_REQUIRE_GPU=1, the setting of the GPU landing run, a GPU test
that cannot run and any skipped test fail the run instead of passing it by as "skipped"."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
GPU_TEST = "import pytest\n\n@pytest.mark.gpu\ndef test_needs_the_gpu():\n    pass\n"
SKIPPING_TEST = "import pytest\n\ndef test_skips():\n    pytest.skip('not here')\n"


def _run_suite(tmp_path, source, require):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(source)
    env = {**os.environ, "FA2_REQUIRE_GPU": "1" if require else "", "CUDA_VISIBLE_DEVICES": ""}  # as without a GPU
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env=env,
                          capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.parametrize("require", [False, True], ids=["default", "FA2_REQUIRE_GPU=1"])
def test_gpu_tests_that_cannot_run_skip_or_fail(tmp_path, require):
    result = _run_suite(tmp_path, GPU_TEST, require)
    if require:
        assert result.returncode != 0 and "FA2_REQUIRE_GPU=1, but the GPU tests cannot run" in result.stderr, result
    else:
        assert result.returncode == 0 and "1 skipped" in result.stdout, result


@pytest.mark.parametrize("require", [False, True], ids=["default", "FA2_REQUIRE_GPU=1"])
def test_any_skip_is_a_failure_when_the_gpu_is_required(tmp_path, require):
    result = _run_suite(tmp_path, SKIPPING_TEST, require)
    if require:
        assert result.returncode == 1 and "1 failed" in result.stdout and "not here" in result.stdout, result
    else:
        assert result.returncode == 0 and "1 skipped" in result.stdout, result

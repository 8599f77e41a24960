"""The README works as written. CPU: its Python compiles, every `fa2.<name>` it mentions exists, and CI runs its test
command verbatim. GPU: the quickstart runs as pasted, in a fresh interpreter."""
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import fa2

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def section(title):
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_python_blocks_compile():
    assert python_blocks(), "README has no python block"
    for block in python_blocks():
        compile(block, "README.md", "exec")


def test_every_fa2_name_it_mentions_exists():
    names = sorted(set(re.findall(r"\bfa2(?:\.[A-Za-z_]\w*)+", README)))
    assert "fa2.attention" in names and "fa2.sdpa.activate" in names
    missing = []
    for name in names:
        obj, path = fa2, "fa2"
        for part in name.split(".")[1:]:
            path += "." + part
            if not hasattr(obj, part):  # a submodule the README imports itself (`import fa2.testing`)
                try:
                    importlib.import_module(path)
                except ImportError:
                    pass
            if not hasattr(obj, part):
                missing.append(name)
                break
            obj = getattr(obj, part)
    assert not missing, f"README mentions names fa2 does not have: {missing}"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^    (python -m pip install .*)$", section("Install"), flags=re.M)
    assert len(commands) == 2, commands  # 1. the main job, 2. the tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert any(line.strip() == commands[1] for line in ci.splitlines()), "`.ci/run` must run the README's test command"


@pytest.mark.gpu
def test_quickstart_runs_as_pasted(require_kernel):
    require_kernel("bwd", 128, torch.bfloat16)
    (code,) = re.findall(r"```python\n(.*?)```", section("Quickstart"), flags=re.S)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stdout + result.stderr
    error = float(re.search(r"max \|out - fp64 reference\| = (\S+)", result.stdout).group(1))
    assert 0 < error < float("inf"), result.stdout  # nonzero: bf16 output; finite: no NaN or inf

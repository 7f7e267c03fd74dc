"""ruff (lint + format) and mypy on the runtime run in the suite, so style and types hold."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUNTIME = ["op_builder", "accelerator", "ops", "deepspeed_ext"]


def _tool(name: str) -> list[str]:
    if shutil.which(name) is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return [name]


def test_ruff_check():
    r = subprocess.run([*_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = subprocess.run(
        [*_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_runtime():
    _tool("mypy")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", *RUNTIME],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]

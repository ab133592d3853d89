"""`make lint` fails on a planted violation: ruff on a style error, mypy on a type error, with the project's config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    exe = BIN / name if (BIN / name).exists() else shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_flags_unused_import_and_import_order(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import sys\nimport os\n\n\ndef f() -> int:\n    return 1\n")
    result = run_tool("ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(planted))
    assert result.returncode != 0
    assert "F401" in result.stdout and "I001" in result.stdout


def test_mypy_flags_a_type_error(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('def f(x: int) -> int:\n    return x + "a"\n')
    result = run_tool("mypy", "--config-file", str(ROOT / "pyproject.toml"), str(planted))
    assert result.returncode != 0
    assert "Unsupported operand types" in result.stdout


def test_clean_module_passes(tmp_path):
    clean = tmp_path / "clean.py"
    clean.write_text('def f(x: int) -> int:\n    return x + 1\n')
    assert run_tool("ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(clean)).returncode == 0
    assert run_tool("mypy", "--config-file", str(ROOT / "pyproject.toml"), str(clean)).returncode == 0

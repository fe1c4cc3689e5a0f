"""The tree is clean under the linter and formatter configured in pyproject.toml (ruff, pinned)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
  "args", [["check", "--output-format", "concise"], ["format", "--check"]], ids=["lint", "format"]
)
def test_ruff_is_clean(args):
  ruff = Path(sys.executable).with_name("ruff")
  if not ruff.exists():
    pytest.fail(f"ruff is not installed beside {sys.executable}; install the test extra: pip install -e '.[test]'")
  out = subprocess.run([str(ruff), *args, "."], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, (
    f"ruff {' '.join(args)} found problems (fix: ruff check --fix . && ruff format .):\n{out.stdout}{out.stderr}"
  )

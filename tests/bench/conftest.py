"""Fixtures of the benchmark tests: the registry tests' rollback-state file, so no test writes the user's, and an
executable stand-in for llama.cpp's llama-server (tests/bench/stub_llama_server.py)."""

import sys
from pathlib import Path

import pytest

from tests.registry.conftest import trust_state  # noqa: F401  (autouse, session scope)


@pytest.fixture
def stub_llama_server(tmp_path) -> Path:
  """An executable ``llama-server`` that streams fixed tokens (what the benchmarks pass as ``--llama-server``)."""
  stub = tmp_path / "bin" / "llama-server"
  stub.parent.mkdir()
  stub.write_text(f"#!{sys.executable}\n" + (Path(__file__).parent / "stub_llama_server.py").read_text())
  stub.chmod(0o755)
  return stub

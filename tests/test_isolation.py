"""A test run leaves the user's files alone (issue 21): run a few tests that write every kind of per-user
state thoughtjax keeps (learned latency corrections, trust state, exported programs, the XLA compilation
cache, a matplotlib plot) in a child pytest whose home directory is read-only and holds a user's cache, and
check that every byte, mode and mtime there is as before and that nothing was added."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from tests import isolation

REPO = Path(__file__).resolve().parents[1]
# Tests that write through the default locations (none of them points THOUGHTJAX_* elsewhere itself).
WRITERS = (
  "tests/synthesis/test_synthesize.py::test_the_latency_model_learns_and_a_warm_path_predicts_no_restore_or_compile",
  "tests/synthesis/test_cli_synthesis.py::test_paths_prints_the_front_and_plots",
)


def _user_home(home: Path) -> None:
  """A home as a user of thoughtjax has it: a cache with corrections, trust state, programs, config files."""
  cache = home / ".cache" / "thoughtjax"
  for sub in ("xla", "exported", "registry", "models"):
    (cache / sub).mkdir(parents=True)
  (cache / "latency-corrections.json").write_text(json.dumps({"format": "thoughtjax.latency-corrections"}))
  (cache / "trust-state.json").write_text(json.dumps({"sequences": {}}))
  (cache / "xla" / "jit_f-0123-cache").write_bytes(b"\x00program")
  (cache / "exported" / "sentinel.jaxexp").write_bytes(b"thoughtjax-exported 1\n")
  (home / ".config").mkdir()
  (home / ".config" / "sentinel").write_text("user settings")


def _state(home: Path) -> dict:
  out = {}
  for p in sorted(home.rglob("*")):
    st = p.lstat()
    out[str(p.relative_to(home))] = (stat.S_IMODE(st.st_mode), st.st_mtime_ns, p.read_bytes() if p.is_file() else None)
  return out


def _read_only(home: Path, on: bool) -> None:
  for p in [home, *home.rglob("*")]:
    if p.is_dir():
      p.chmod(0o555 if on else 0o755)
    else:
      p.chmod(0o444 if on else 0o644)


def test_a_run_leaves_the_users_home_and_cache_byte_identical(tmp_path):
  home = tmp_path / "home"
  _user_home(home)
  _read_only(home, True)
  before = _state(home)
  drop = ("THOUGHTJAX_", "XDG_", "PYTEST_XDIST", "JUPYTER_")
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in isolation.TOOL_DIRS}
  env.update(HOME=str(home), PYTHONPATH=str(REPO))
  try:
    r = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *WRITERS],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
    )
    after = _state(home)
  finally:
    _read_only(home, False)
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  assert f"{len(WRITERS)} passed" in r.stdout
  assert after == before


def test_this_run_uses_a_cache_of_its_own_outside_the_home_directory(monkeypatch):
  from thoughtjax.decode.program import configure_compilation_cache
  from thoughtjax.fetch import cache_dir
  from thoughtjax.synthesis.corrections import ENV, corrections_path

  monkeypatch.delenv(ENV, raising=False)  # the tiny synthesis tests turn learning off for their worker

  home = Path(os.path.expanduser("~")).resolve()
  run = Path(os.environ[isolation.RUN_ENV]).resolve()
  for p in (cache_dir(), corrections_path(), Path(configure_compilation_cache())):
    assert home not in p.resolve().parents and p.resolve() != home
  assert run in cache_dir().resolve().parents or os.environ.get(isolation.KEEP_ENV)
  for name in isolation.OVERRIDES:  # unset by the run; a test module may name a file of its own, never home's
    v = os.environ.get(name)
    assert v is None or v == "off" or home not in Path(v).resolve().parents, (name, v)
  for name in isolation.TOOL_DIRS:
    assert Path(os.environ[name]).resolve().is_relative_to(run)

"""The test run's own cache: every test runs with ``THOUGHTJAX_CACHE`` (and every other place a library or
tool writes per-user state) pointing into one directory outside the user's home, made for the run.

* **Once per run, shared by xdist workers.** The first process of a run (the xdist controller, or pytest
  alone) makes ``<tmp>/thoughtjax-tests-XXXX`` and names it in ``THOUGHTJAX_TEST_RUN_DIR``; workers inherit the
  environment and use the same directory, so the default model is copied, and the default registry built and
  latency-measured, once per run (``ensure_default`` holds a lock while it builds, so two workers wait for one
  build). The first process removes the directory at the end. ``THOUGHTJAX_TEST_CACHE=DIR`` names a cache to
  keep between runs instead (e.g. a CI cache), never removed.
* **The user's downloaded model, read only.** When the user's cache (``$THOUGHTJAX_CACHE``, else
  ``$XDG_CACHE_HOME/thoughtjax``, else ``~/.cache/thoughtjax``) holds the default model's GGUF at its known size,
  it is copied (not linked: a test that damages its cached copy must not reach the user's) into the run's cache,
  so the run does not download it again. Nothing is ever written there.
* **Everything else per user, redirected.** ``XDG_CACHE_HOME`` (pip, torch), ``MPLCONFIGDIR``, ``HF_HOME``,
  ``IPYTHONDIR`` and the Jupyter directories, ``TRITON_CACHE_DIR``; thoughtjax's own overrides
  (``THOUGHTJAX_TRUST_STATE``, ``THOUGHTJAX_LATENCY_CORRECTIONS``, ``THOUGHTJAX_EXPORT_CACHE``,
  ``THOUGHTJAX_COMPILE_CACHE``) are removed so each defaults to the run's cache, and ``THOUGHTJAX_PROGRAM_LEDGER``
  is ``off`` (a plan does not depend on which programs earlier tests compiled). The suite then runs with a
  read-only home (``tests/test_isolation.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

RUN_ENV = "THOUGHTJAX_TEST_RUN_DIR"
NO_SERVER_ENV = (
  "THOUGHTJAX_NO_SERVER"  # thoughtjax.local_server's; not imported: this runs before any thoughtjax import
)
KEEP_ENV = "THOUGHTJAX_TEST_CACHE"
LEDGER_ENV = "THOUGHTJAX_PROGRAM_LEDGER"  # thoughtjax.settings.PROGRAM_LEDGER (not imported: see NO_SERVER_ENV)
# thoughtjax's own per-user paths: unset, so each falls back to <THOUGHTJAX_CACHE>/...
OVERRIDES = (
  "THOUGHTJAX_TRUST_STATE",
  "THOUGHTJAX_LATENCY_CORRECTIONS",
  "THOUGHTJAX_EXPORT_CACHE",
  "THOUGHTJAX_COMPILE_CACHE",
)
# Other tools' per-user directories -> a folder of the run.
TOOL_DIRS = {
  "XDG_CACHE_HOME": "xdg-cache",
  "XDG_CONFIG_HOME": "xdg-config",
  "XDG_DATA_HOME": "xdg-data",
  "MPLCONFIGDIR": "matplotlib",
  "HF_HOME": "huggingface",
  "TORCH_HOME": "torch",
  "TRITON_CACHE_DIR": "triton",
  "IPYTHONDIR": "ipython",
  "JUPYTER_CONFIG_DIR": "jupyter/config",
  "JUPYTER_DATA_DIR": "jupyter/data",
  "JUPYTER_RUNTIME_DIR": "jupyter/runtime",
}


@dataclasses.dataclass(frozen=True)
class Run:
  root: Path  # the run's folder (tool directories)
  cache: Path  # THOUGHTJAX_CACHE of every test
  owner: bool  # this process made root and removes it at the end
  user_cache: Path  # the user's cache the model may be copied from (read only)


def user_cache_dir(environ=os.environ) -> Path:
  """The cache thoughtjax would use for this user outside the tests (fetch.cache_dir's rule, not created)."""
  if environ.get("THOUGHTJAX_CACHE"):
    return Path(environ["THOUGHTJAX_CACHE"])
  xdg = environ.get("XDG_CACHE_HOME")
  return (Path(xdg) if xdg else Path(os.path.expanduser("~")) / ".cache") / "thoughtjax"


def enter_run() -> Run:
  """Point this process at the run's cache (making it when this is the run's first process)."""
  user_cache = Path(os.environ.get("THOUGHTJAX_TEST_USER_CACHE") or user_cache_dir())
  os.environ["THOUGHTJAX_TEST_USER_CACHE"] = str(user_cache)  # workers see the user's, not the run's
  root_env = os.environ.get(RUN_ENV)
  owner = not root_env
  if owner:
    root_env = tempfile.mkdtemp(prefix="thoughtjax-tests-")
    os.environ[RUN_ENV] = root_env
  root = Path(root_env)
  keep = os.environ.get(KEEP_ENV)
  cache = Path(keep) if keep else root / "cache"
  cache.mkdir(parents=True, exist_ok=True)
  os.environ["THOUGHTJAX_CACHE"] = str(cache)
  for name in OVERRIDES:
    os.environ.pop(name, None)
  # A command a test runs starts in-process, as the test expects, even while another test's `thoughtjax serve` of
  # the same registry runs: tests/server/test_cli_local_server.py lifts this for its own commands.
  os.environ[NO_SERVER_ENV] = "1"
  # A plan prices compiles from the calibration alone, whichever programs earlier tests of the run compiled into the
  # shared compilation cache: tests/synthesis/test_program_ledger.py turns the ledger on for its own synthesizers.
  os.environ[LEDGER_ENV] = "off"
  for name, sub in TOOL_DIRS.items():
    os.environ[name] = str(root / sub)
    (root / sub).mkdir(parents=True, exist_ok=True)
  if owner:
    _seed_model(user_cache, cache)
  return Run(root, cache, owner, user_cache)


def _seed_model(user_cache: Path, cache: Path) -> None:
  """Copy the user's downloaded default model into the run's cache (read only there; skipped when absent or
  not the known size: then the run fetches it like a first use)."""
  from thoughtjax.fetch import DEFAULT_MODEL, KNOWN_MODELS

  known = KNOWN_MODELS[DEFAULT_MODEL]
  rel = Path("models") / known.name / Path(known.member).name
  src, dst = user_cache / rel, cache / rel
  try:
    if dst.exists() or src.resolve() == dst.resolve() or src.stat().st_size != known.size:
      return
  except OSError:
    return
  dst.parent.mkdir(parents=True, exist_ok=True)
  tmp = dst.with_name(f".{dst.name}.seed-{os.getpid()}")
  try:
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)  # fetch() verifies it (size, then sha256 against the known digest) on first use
  except OSError:
    tmp.unlink(missing_ok=True)


def leave_run(run: Run) -> None:
  if run.owner and os.environ.get("PYTEST_XDIST_WORKER") is None:
    shutil.rmtree(run.root, ignore_errors=True)

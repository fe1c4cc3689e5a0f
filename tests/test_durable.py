"""The writers' lock of :mod:`thoughtjax.durable`: what a dead writer staged is removed by the next one, what a
live writer stages is never touched, and nothing but this module's own temporaries is removed (links are not
followed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from thoughtjax import durable

REPO = Path(__file__).resolve().parents[1]


def _stage(directory: Path) -> tuple[Path, Path]:
  """A partial file and a partial directory (with a file inside), as a writer leaves them."""
  f = directory / f"{durable.TEMP_PREFIX}index.json-abc"
  f.write_bytes(b"half")
  d = directory / f"{durable.STAGING_PREFIX}xyz"
  d.mkdir()
  (d / "weights.safetensors").write_bytes(b"half")
  return f, d


def test_a_dead_writers_temporaries_are_removed_and_nothing_else(tmp_path):
  directory = tmp_path / "cache"
  directory.mkdir()
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep").write_bytes(b"keep")
  mtime = (outside / "keep").stat().st_mtime_ns
  _stage(directory)
  (directory / f"{durable.STAGING_PREFIX}link").symlink_to(outside)  # a link: removed itself, never followed
  for name in ("index.json", ".staging-old", ".tmp-old.jaxexp"):  # real files and an older version's temporaries
    (directory / name).write_bytes(b"stays")
  # The writer that staged them died: a process that held the lock and was killed.
  script = f"import os, signal, sys; sys.path.insert(0, {str(REPO)!r})\n" + (
    "from pathlib import Path\nfrom thoughtjax import durable\n"
    f"with durable.writing(Path({str(directory)!r})):\n  os.kill(os.getpid(), signal.SIGKILL)\n"
  )
  assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == -9
  with durable.writing(directory):
    pass
  assert sorted(p.name for p in directory.iterdir()) == [
    ".staging-old",
    ".tmp-old.jaxexp",
    ".writers.lock",
    "index.json",
  ]
  assert (outside / "keep").read_bytes() == b"keep" and (outside / "keep").stat().st_mtime_ns == mtime


def test_a_live_writers_temporaries_are_not_touched(tmp_path):
  with durable.writing(tmp_path):  # this writer is staging
    f, d = _stage(tmp_path)
    with durable.writing(tmp_path):  # another writer (its own lock descriptor) arrives meanwhile
      pass
    assert f.read_bytes() == b"half" and (d / "weights.safetensors").read_bytes() == b"half"
  with durable.writing(tmp_path):  # the first has finished without cleaning up: now they go
    pass
  assert not f.exists() and not d.exists()


def test_write_atomic_leaves_the_whole_file_mode_0600_and_no_temporary(tmp_path):
  target = tmp_path / "index.json"
  target.write_bytes(b"old")
  durable.write_atomic(target, b"new contents")
  assert target.read_bytes() == b"new contents" and (target.stat().st_mode & 0o777) == 0o600
  assert sorted(os.listdir(tmp_path)) == ["index.json"]

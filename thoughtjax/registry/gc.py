"""Garbage collection of version directories that are neither current nor recent."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from thoughtjax.registry.layout import _read_index, _writer_lock, dir_name


def collect_garbage(root: str | os.PathLike, *, keep: int = 2, dry_run: bool = False) -> list[Path]:
  """Remove version directories that are not among the last ``keep`` published versions of
  their thoughtlet (the current one always stays), and directories of versions that never
  became current (left by a writer that died before switching the index).

  Readers that opened the registry before an update may still restore an old version; run
  this only when no such reader needs versions older than ``keep``.
  """
  if keep < 1:
    raise ValueError(f"keep must be >= 1 (the current version always stays), got {keep}")
  root = Path(root).absolute()
  removed = []
  with _writer_lock(root):
    body, _ = _read_index(root)
    live = set()
    for name, hist in body["history"].items():
      live.update((dir_name(name), v) for v in hist[-keep:])
      live.add((dir_name(name), body["current"][name]["version"]))
    for vdir in sorted((root / "thoughtlets").glob("*/*")):
      if (vdir.parent.name, vdir.name) not in live:
        removed.append(vdir)
        if not dry_run:
          # Rename first so a half-deleted directory is never mistaken for a version.
          doomed = root / ".staging" / f"gc-{uuid.uuid4().hex}"
          doomed.parent.mkdir(exist_ok=True)
          os.rename(vdir, doomed)
          shutil.rmtree(doomed)
  return removed

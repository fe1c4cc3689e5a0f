"""Durable, atomic writes of cache files: after a kill or a crash a reader finds the old file or the whole new
one, never a torn one.

POSIX leaves durability to the writer: a file renamed into place without an fsync of its data can come back
after a power loss under its new name with no or partial content, and a rename whose directory was not synced
can come back undone. So a file is written under a temporary name in its final directory, fsynced, renamed
over the final name, and the directory is fsynced (:func:`write_atomic`, :func:`replace`); a directory built
beside its final name is synced file by file before its rename (:func:`fsync_tree`).

A writer killed half-way leaves its temporary behind. Writers hold :func:`writing` on the directory they stage
in (a shared ``flock`` on ``.writers.lock``); whoever finds no other writer there removes what dead writers
left (names starting with ``.partial-``), so a crash costs disk space only until the next write. The prefix is
this module's own: temporaries of writers that do not take the lock (older thoughtjax versions sharing the
cache) are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

PARTIAL_PREFIX = ".partial-"  # every temporary below; what remove_abandoned removes
STAGING_PREFIX = ".partial-dir-"  # a directory being built, renamed into place when whole
TEMP_PREFIX = ".partial-file-"  # a file being written by write_atomic
LOCK_NAME = ".writers.lock"


def fsync_path(path: str | os.PathLike) -> None:
  """fsync a file or a directory (not following a final symlink)."""
  fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(root: Path) -> None:
  """fsync every file and directory under ``root`` and ``root`` itself, children first, so that a rename of
  ``root`` made afterwards cannot outlive a crash with part of its content missing."""
  for p in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
    if not p.is_symlink():
      fsync_path(p)
  fsync_path(root)


def replace(src: Path, dst: Path) -> None:
  """Rename ``src`` (already synced) over ``dst`` and sync ``dst``'s directory so the rename lasts."""
  os.replace(src, dst)
  fsync_path(dst.parent)


def write_atomic(path: Path, data: bytes) -> None:
  """Write ``data`` as ``path`` (mode 0600): a temporary file beside it, fsync, rename, fsync the directory."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}-")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    replace(Path(tmp), path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


@contextlib.contextmanager
def writing(directory: Path) -> Iterator[None]:
  """Held while this process stages files or directories in ``directory`` (``.partial-*``).

  On entry, when no other writer holds it, the temporaries of writers that died are removed. The lock is an
  ``flock`` on ``directory/.writers.lock``: the kernel drops it when its holder dies, so nothing is stale.
  """
  fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another writer is staging here; its temporaries are alive
      pass
    else:
      remove_abandoned(directory)
    fcntl.flock(fd, fcntl.LOCK_SH)  # from here on no other process removes what this one stages
    yield
  finally:
    os.close(fd)


def remove_abandoned(directory: Path) -> list[str]:
  """Remove the temporaries in ``directory`` (call with :func:`writing`'s exclusive lock); returns their names."""
  removed = []
  for entry in os.scandir(directory):
    if not entry.name.startswith(PARTIAL_PREFIX):
      continue
    mode = entry.stat(follow_symlinks=False).st_mode
    if stat.S_ISDIR(mode):
      shutil.rmtree(entry.path, ignore_errors=True)  # rmtree never follows a link out of the directory
    else:
      Path(entry.path).unlink(missing_ok=True)
    removed.append(entry.name)
  return removed

"""Reader leases: an open :class:`~thoughtjax.registry.Registry` holds the versions its index names,
so ``gc`` (in any process) never removes a version a live reader may still restore.

A lease is two files under ``DIR/.readers/``: ``<id>.lock``, on which the reader holds an exclusive
``flock`` for as long as it is open, and ``<id>.json``, the versions it holds (replaced atomically on
every refresh). The kernel drops the lock when the reader closes or its process dies, so a lease whose
lock can be taken is stale and is removed. A live lease whose version list cannot be read (being
written) holds everything.

Nothing here follows a link: a reader takes no lease when ``DIR/.readers`` is a symbolic link (and gc refuses to
run, see :mod:`.gc`), lease files are created new with ``O_NOFOLLOW``, and only regular files in the real
directory are read or removed as stale.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import uuid
import weakref
from pathlib import Path

from thoughtjax.registry.layout import UnsafeFile, read_regular

LEASE_DIR = ".readers"
HOLDS_ALL = "*"


def _release(fd: int, paths: tuple[Path, ...]) -> None:
  for p in paths:
    try:
      p.unlink()
    except OSError:
      pass
  try:
    os.close(fd)  # drops the flock
  except OSError:
    pass


class ReaderLease:
  """The lease of one open reader (see the module docstring)."""

  def __init__(self, root: Path, fd: int, lock: Path):
    self.root, self.lock, self.data = root, lock, lock.with_suffix(".json")
    self._finalizer = weakref.finalize(self, _release, fd, (self.data, lock))

  @classmethod
  def acquire(cls, root: Path) -> ReaderLease | None:
    """A new lease, or None where the reader may not write the registry (a read-only copy: nobody can
    collect garbage there either)."""
    d = Path(root) / LEASE_DIR
    lock = d / f"{os.getpid()}-{uuid.uuid4().hex[:12]}.lock"
    if not (Path(root) / "index.json").is_file():
      return None  # not a registry (the open fails next): leave the directory as it was
    if d.is_symlink():
      return None  # never through a link out of the registry (gc refuses to run meanwhile)
    try:
      d.mkdir(exist_ok=True)
      fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError:
      return None
    fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: nobody else holds it
    return cls(Path(root), fd, lock)

  def hold(self, versions: set[tuple[str, str]]) -> None:
    """Replace the held versions ((thoughtlet directory name, version) pairs)."""
    tmp = self.data.with_name(self.data.name + ".tmp")
    try:
      tmp.unlink(missing_ok=True)  # whatever is there (a planted link too) is replaced, never written through
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
      with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "versions": sorted(map(list, versions))}))
      os.replace(tmp, self.data)
    except OSError:
      pass  # the lock alone still marks a live reader, which then holds everything

  def release(self) -> None:
    self._finalizer()

  @property
  def alive(self) -> bool:
    return self._finalizer.alive


def held_versions(root: Path) -> dict:
  """(dir name, version) -> a description of the live reader holding it; HOLDS_ALL maps to a
  description when a live reader's list is unreadable. Stale leases are removed."""
  held: dict = {}
  d = Path(root) / LEASE_DIR
  for lock in sorted(d.glob("*.lock")) if d.is_dir() and not d.is_symlink() else []:
    try:
      fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
      if e.errno == errno.ELOOP:
        lock.unlink(missing_ok=True)  # a link planted among the leases: the link goes, not its target
      continue
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      os.close(fd)
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a live reader
      who = f"an open reader (lease {lock}, pid {lock.name.split('-')[0]})"
      try:
        data = read_regular(Path(root), Path(LEASE_DIR) / lock.with_suffix(".json").name, 16 << 20)
        versions = json.loads(data)["versions"]
        for dname, version in versions:
          held.setdefault((str(dname), str(version)), who)
      except (OSError, ValueError, KeyError, TypeError, UnsafeFile, RecursionError):
        held[HOLDS_ALL] = who
      os.close(fd)
      continue
    _release(fd, (lock.with_suffix(".json"), lock))  # stale: its reader is gone
  return held

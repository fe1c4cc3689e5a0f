"""Orbax checkpoints of thoughtlet weights: save, and restore into dtype and sharding targets."""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

from thoughtjax.registry.errors import RegistryError, ScratchSpaceError
from thoughtjax.registry.layout import UnsafeFile, open_regular, read_chunks
from thoughtjax.registry.manifest import check_files


def checkpointer():
  """A synchronous Orbax PyTree checkpointer (OCDBT). Uncompressed: weights barely compress,
  and zstd decoding made restores 2-3x slower than reading the bytes (BENCHMARKS.md)."""
  import orbax.checkpoint as ocp  # deferred for start-up: orbax loads when a checkpoint is read or written

  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def restore_checkpoint(ckptr, path: Path, target):
  """Restore straight into ``target``'s dtypes and shardings (``jax.ShapeDtypeStruct`` leaves)."""
  import orbax.checkpoint as ocp  # deferred for start-up: orbax loads when a checkpoint is read or written

  return ckptr.restore(
    path, args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  )


def save_checkpoint(path: Path, params: Mapping) -> None:
  import orbax.checkpoint as ocp  # deferred for start-up: orbax loads when a checkpoint is read or written

  tree = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), dict(params))
  checkpointer().save(path, args=ocp.args.PyTreeSave(tree))


SCRATCH_PREFIX = "thoughtjax-restore-"  # + the pid of the process that made it + "-" + a random suffix
_SHM = Path("/dev/shm")


def _scratch_dirs(nbytes: int) -> list[str | None]:
  """Where a verified copy may go, in order: memory-backed /dev/shm when it has room for twice the copy and
  64 MiB to spare (another restore may be copying beside it), then the temp dir (None)."""
  try:
    if _SHM.is_dir() and os.access(_SHM, os.W_OK) and shutil.disk_usage(_SHM).free > 2 * nbytes + (64 << 20):
      return [str(_SHM), None]
  except OSError:
    pass
  return [None]


def remove_stale_scratch(dirs: list[str | Path] | None = None) -> list[Path]:
  """Remove the verified copies a killed process left (``thoughtjax-restore-<pid>-*`` in /dev/shm and the temp
  dir, this user's, whose process is gone); returns what was removed. A copy of a live process is never touched:
  a process removes its own when its restore ends."""
  removed = []
  for d in dirs if dirs is not None else [_SHM, tempfile.gettempdir()]:
    try:
      entries = list(Path(d).glob(SCRATCH_PREFIX + "*"))
    except OSError:
      continue
    for entry in entries:
      pid = entry.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
      try:
        if not pid.isdigit() or entry.is_symlink() or entry.stat().st_uid != os.getuid() or _alive(int(pid)):
          continue
      except OSError:
        continue
      shutil.rmtree(entry, ignore_errors=True)
      removed.append(entry)
  return removed


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process holds the pid
    return True
  return True


_stale_checked = False


def _write(dst: Path, src: int, limit: int) -> tuple[str, int]:
  """Copy at most ``limit`` + 1 bytes of ``src`` into a new file ``dst``: (sha256 of what was written, bytes)."""
  h, n = hashlib.sha256(), 0
  out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
  with os.fdopen(out, "wb") as g:
    for block in read_chunks(src, limit):
      h.update(block)
      n += len(block)
      g.write(block)
  return h.hexdigest(), n


def verified_copy(
  vdir: Path,
  files: Mapping[str, Mapping],
  fail: Callable[[str, str], Exception],
  workers: int = 8,
  *,
  root: Path | None = None,
) -> Path:
  """Copy the ``files`` (relative path -> {sha256, bytes}) of ``vdir`` into a private temporary directory,
  hashing exactly the bytes written there, and return that directory.

  Orbax then restores from the copy, so what is restored is what was checked: a file changed in
  ``vdir`` after its check is never read (check-then-read closed). ``fail(rel, reason)`` builds the
  exception raised on a missing, mismatching or unsafe file; the copy is removed then. The caller removes
  the directory after the restore.

  Hostile manifests: the whole file list is checked (:func:`~.manifest.check_files`: normalised relative
  paths below ``checkpoint/``) before anything is written; a source is read only as a regular file reached
  from ``root`` (default ``vdir``) without following a link, never more than its listed size plus one byte;
  a destination is created new (``O_EXCL | O_NOFOLLOW``) inside the private directory.
  """
  try:
    files = check_files(files)
  except RegistryError as e:
    raise fail("manifest.json", str(e)) from None
  global _stale_checked
  if not _stale_checked:  # once per process: what a killed one left behind goes before this one adds its own
    _stale_checked = True
    remove_stale_scratch()
  base = Path(root) if root is not None else Path(vdir)
  prefix = Path(vdir).relative_to(base)
  total = sum(spec["bytes"] for spec in files.values())
  tried = []
  for where in _scratch_dirs(total):
    tmp = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=where))  # mode 0700
    try:
      _copy_checked(tmp, base, prefix, files, fail, workers)
      return tmp
    except OSError as e:
      shutil.rmtree(tmp, ignore_errors=True)
      if e.errno != errno.ENOSPC:
        raise
      tried.append(where or tempfile.gettempdir())
  raise ScratchSpaceError(
    f"no space left to copy the {total} bytes of {Path(vdir).name} for a verified restore (tried "
    f"{', '.join(map(str, tried))}); free space there, or point TMPDIR at a larger disk, and restore again"
  )


def _copy_checked(tmp: Path, base: Path, prefix: Path, files: Mapping[str, Mapping], fail, workers: int) -> None:
  """Copy ``files`` into ``tmp``, hashing what is written; raises ``fail(...)`` on a missing, unsafe, oversized
  or mismatching file (``tmp`` removed)."""

  def copy(rel: str) -> tuple[str, str | None]:
    limit = files[rel]["bytes"]
    dst = tmp / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
      src = open_regular(base, prefix / rel)
    except FileNotFoundError:
      return rel, None
    except UnsafeFile as e:
      return rel, f"unsafe: {e}"
    try:
      digest, n = _write(dst, src, limit)
    finally:
      os.close(src)
    if n > limit:
      return rel, f"size: holds more than the {limit} bytes the manifest lists"
    return rel, digest

  try:
    with concurrent.futures.ThreadPoolExecutor(min(workers, max(1, len(files)))) as pool:
      results = dict(pool.map(copy, sorted(files)))
    for rel in sorted(files):
      got, want = results[rel], files[rel]["sha256"]
      if got is None:
        raise fail(rel, "the file is missing")
      if got.startswith("unsafe: "):
        raise fail(rel, f"{got[8:]}; a checkpoint file is a plain file inside the version directory")
      if got.startswith("size: "):
        raise fail(rel, got[6:])
      if got != want:
        raise fail(rel, f"sha256 {got[:16]}... does not match the manifest's {want[:16]}...")
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise

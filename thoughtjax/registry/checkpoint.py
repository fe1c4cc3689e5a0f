"""Orbax checkpoints of thoughtlet weights: save, and restore into dtype and sharding targets."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

from thoughtjax.registry.errors import RegistryError
from thoughtjax.registry.layout import UnsafeFile, _open_regular, _read_chunks
from thoughtjax.registry.manifest import check_files


def _checkpointer():
  """A synchronous Orbax PyTree checkpointer (OCDBT). Uncompressed: weights barely compress,
  and zstd decoding made restores 2-3x slower than reading the bytes (BENCHMARKS.md)."""
  import orbax.checkpoint as ocp  # deferred for start-up: orbax loads when a checkpoint is read or written

  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _restore_checkpoint(ckptr, path: Path, target):
  """Restore straight into ``target``'s dtypes and shardings (``jax.ShapeDtypeStruct`` leaves)."""
  import orbax.checkpoint as ocp  # deferred for start-up: orbax loads when a checkpoint is read or written

  return ckptr.restore(
    path, args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  )


def _save_checkpoint(path: Path, params: Mapping) -> None:
  import orbax.checkpoint as ocp  # deferred for start-up: orbax loads when a checkpoint is read or written

  tree = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), dict(params))
  _checkpointer().save(path, args=ocp.args.PyTreeSave(tree))


def _scratch_dir(nbytes: int) -> str | None:
  """Where a verified copy goes: memory-backed /dev/shm when it has room, else the temp dir."""
  shm = Path("/dev/shm")
  try:
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * nbytes + (64 << 20):
      return str(shm)
  except OSError:
    pass
  return None


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
  base = Path(root) if root is not None else Path(vdir)
  prefix = Path(vdir).relative_to(base)
  total = sum(spec["bytes"] for spec in files.values())
  tmp = Path(tempfile.mkdtemp(prefix="thoughtjax-restore-", dir=_scratch_dir(total)))  # mode 0700

  def copy(rel: str) -> tuple[str, str | None]:
    limit = files[rel]["bytes"]
    dst = tmp / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    h, n = hashlib.sha256(), 0
    try:
      src = _open_regular(base, prefix / rel)
    except FileNotFoundError:
      return rel, None
    except UnsafeFile as e:
      return rel, f"unsafe: {e}"
    try:
      out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
      with os.fdopen(out, "wb") as g:
        for block in _read_chunks(src, limit):
          h.update(block)
          n += len(block)
          g.write(block)
    finally:
      os.close(src)
    if n > limit:
      return rel, f"size: holds more than the {limit} bytes the manifest lists"
    return rel, h.hexdigest()

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
  return tmp

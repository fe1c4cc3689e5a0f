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


def _checkpointer():
  """A synchronous Orbax PyTree checkpointer (OCDBT). Uncompressed: weights barely compress,
  and zstd decoding made restores 2-3x slower than reading the bytes (BENCHMARKS.md)."""
  import orbax.checkpoint as ocp

  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _restore_checkpoint(ckptr, path: Path, target):
  """Restore straight into ``target``'s dtypes and shardings (``jax.ShapeDtypeStruct`` leaves)."""
  import orbax.checkpoint as ocp

  return ckptr.restore(
    path, args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  )


def _save_checkpoint(path: Path, params: Mapping) -> None:
  import orbax.checkpoint as ocp

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
  vdir: Path, files: Mapping[str, Mapping], fail: Callable[[str, str], Exception], workers: int = 8
) -> Path:
  """Copy the ``files`` (relative path -> {sha256}) of ``vdir`` into a private temporary directory,
  hashing exactly the bytes written there, and return that directory.

  Orbax then restores from the copy, so what is restored is what was checked: a file changed in
  ``vdir`` after its check is never read (check-then-read closed). ``fail(rel, reason)`` builds the
  exception raised on a missing or mismatching file; the copy is removed then. The caller removes
  the directory after the restore.
  """
  total = sum(int(spec.get("bytes", 0)) for spec in files.values())
  tmp = Path(tempfile.mkdtemp(prefix="thoughtjax-restore-", dir=_scratch_dir(total)))  # mode 0700

  def copy(rel: str) -> tuple[str, str | None]:
    src, dst = vdir / rel, tmp / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    try:
      with open(src, "rb") as f, open(dst, "wb") as g:
        while block := f.read(1 << 22):
          h.update(block)
          g.write(block)
    except FileNotFoundError:
      return rel, None
    return rel, h.hexdigest()

  try:
    with concurrent.futures.ThreadPoolExecutor(min(workers, max(1, len(files)))) as pool:
      results = dict(pool.map(copy, sorted(files)))
    for rel in sorted(files):
      got, want = results[rel], files[rel]["sha256"]
      if got is None:
        raise fail(rel, "the file is missing")
      if got != want:
        raise fail(rel, f"sha256 {got[:16]}... does not match the manifest's {want[:16]}...")
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return tmp

"""Restores read what was checked, and report failures as what they are."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.registry.helpers import largest_data_file
from thoughtjax.registry import IntegrityError, Registry, RestoreError
from thoughtjax.registry import store as store_mod


def test_a_file_swapped_after_its_check_is_never_read(registry_copy, built, monkeypatch):
  """Check-then-read: the file is changed between hashing and Orbax's read (a hook in between)."""
  expected = Registry.open(built).restore("blocks[2:3)")
  reg = Registry.open(registry_copy)
  vdir = reg.version_dir("blocks[2:3)", reg.current["blocks[2:3)"])
  victim = largest_data_file(vdir)
  real_restore = store_mod.restore_checkpoint
  read_from = []

  def swap_then_restore(ckptr, path, target):
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))  # after the digests were taken, before Orbax reads
    read_from.append(path)
    return real_restore(ckptr, path, target)

  monkeypatch.setattr(store_mod, "restore_checkpoint", swap_then_restore)
  got = reg.restore("blocks[2:3)")
  # Orbax read the private copy whose bytes were hashed, not the swapped file.
  assert len(read_from) == 1 and not read_from[0].is_relative_to(registry_copy)
  assert not read_from[0].exists()  # the copy is removed after the restore
  for a, b in zip(*(map(np.asarray, __import__("jax").tree.leaves(t)) for t in (got, expected))):
    np.testing.assert_array_equal(a, b)
  monkeypatch.setattr(store_mod, "restore_checkpoint", real_restore)
  with pytest.raises(IntegrityError, match=str(victim)):  # and the swap is caught by the next reader
    Registry.open(registry_copy).restore("blocks[2:3)")


@pytest.mark.parametrize("error", [MemoryError("out of host memory"), OSError(5, "Input/output error")])
def test_an_orbax_failure_that_is_not_tampering_says_what_it_is(built, monkeypatch, error):
  def failing_restore(ckptr, path, target):
    raise error

  monkeypatch.setattr(store_mod, "restore_checkpoint", failing_restore)
  reg = Registry.open(built, mapped=False)  # what Orbax's failure looks like (a mapped form would skip Orbax)
  with pytest.raises(
    RestoreError,
    match=rf"restoring head@\w+ from .*checkpoint failed with {type(error).__name__}"
    r".*every file matched its signed sha256 digest, so this is not tampering",
  ) as info:
    reg.restore("head")
  assert not isinstance(info.value, IntegrityError) and info.value.__cause__ is error
  s = reg.stats()
  assert (s.restore_failures, s.integrity_failures) == (1, 0) and s.failures[0]["kind"] == "restore"
  assert "head" not in " ".join(s.resident)


def _full_disk(monkeypatch, full: set[Path]):
  """Writing a copied file under any of ``full`` fails as a full disk does (ENOSPC)."""
  from thoughtjax.registry import checkpoint

  real_write = checkpoint._write

  def write(dst, src, limit):
    if any(Path(dst).is_relative_to(d) for d in full):
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(dst, src, limit)

  monkeypatch.setattr(checkpoint, "_write", write)


def test_a_full_scratch_falls_back_and_two_full_ones_are_a_named_refusal(built, tmp_path, monkeypatch):
  """The memory-backed scratch fills up mid-copy: the restore copies to the next place instead; when every place
  is full it is ScratchSpaceError (RESOURCE_EXHAUSTED over the wire, never INTERNAL), nothing left behind."""
  from thoughtjax.registry import ScratchSpaceError, checkpoint
  from thoughtjax.server.messages import status_of

  # The copy a checkpoint restore makes (a mapped form, kept after the first restore, is not a copy).
  shm, other = tmp_path / "shm", tmp_path / "tmp"
  shm.mkdir(), other.mkdir()
  expected = Registry.open(built, mapped=False).restore("head")
  monkeypatch.setattr(checkpoint, "_scratch_dirs", lambda nbytes: [str(shm), str(other)])
  _full_disk(monkeypatch, {shm})
  got = Registry.open(built, mapped=False).restore("head")
  for a, b in zip(*(map(np.asarray, __import__("jax").tree.leaves(t)) for t in (got, expected))):
    np.testing.assert_array_equal(a, b)
  _full_disk(monkeypatch, {shm, other})
  reg = Registry.open(built, mapped=False)
  with pytest.raises(ScratchSpaceError, match=r"no space left to copy the \d+ bytes of .* for a verified restore") as e:
    reg.restore("head")
  assert isinstance(e.value, RestoreError) and status_of(e.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert not list(shm.iterdir()) and not list(other.iterdir())  # every partial copy removed


def test_copies_a_killed_process_left_are_removed_and_a_live_ones_kept(tmp_path):
  """SIGKILL skips the cleanup of a restore's private copy: the next process's first restore removes the copies of
  processes that are gone, and never one of a process still running."""
  import signal
  import subprocess
  import sys

  from thoughtjax.registry.checkpoint import SCRATCH_PREFIX, remove_stale_scratch

  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  dead = tmp_path / f"{SCRATCH_PREFIX}{child.pid}-abc"
  (dead / "checkpoint").mkdir(parents=True)
  (dead / "checkpoint" / "data").write_bytes(b"\0" * 4096)
  child.send_signal(signal.SIGKILL)
  child.wait()
  live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
  live.mkdir()
  other = tmp_path / "unrelated-dir"
  other.mkdir()
  assert remove_stale_scratch([tmp_path]) == [dead]
  assert not dead.exists() and live.exists() and other.exists()

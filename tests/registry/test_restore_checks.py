"""Restores read what was checked, and report failures as what they are."""

from __future__ import annotations

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
  real_restore = store_mod._restore_checkpoint
  read_from = []

  def swap_then_restore(ckptr, path, target):
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))  # after the digests were taken, before Orbax reads
    read_from.append(path)
    return real_restore(ckptr, path, target)

  monkeypatch.setattr(store_mod, "_restore_checkpoint", swap_then_restore)
  got = reg.restore("blocks[2:3)")
  # Orbax read the private copy whose bytes were hashed, not the swapped file.
  assert len(read_from) == 1 and not read_from[0].is_relative_to(registry_copy)
  assert not read_from[0].exists()  # the copy is removed after the restore
  for a, b in zip(*(map(np.asarray, __import__("jax").tree.leaves(t)) for t in (got, expected))):
    np.testing.assert_array_equal(a, b)
  monkeypatch.setattr(store_mod, "_restore_checkpoint", real_restore)
  with pytest.raises(IntegrityError, match=str(victim)):  # and the swap is caught by the next reader
    Registry.open(registry_copy).restore("blocks[2:3)")


@pytest.mark.parametrize("error", [MemoryError("out of host memory"), OSError(5, "Input/output error")])
def test_an_orbax_failure_that_is_not_tampering_says_what_it_is(built, monkeypatch, error):
  def failing_restore(ckptr, path, target):
    raise error

  monkeypatch.setattr(store_mod, "_restore_checkpoint", failing_restore)
  reg = Registry.open(built)
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

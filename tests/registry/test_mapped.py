"""Mapped restores: the second restore of a version maps its verified mapped form; a changed mapped file, a changed
checkpoint file and a planted file are each refused by name, and nothing wrong is ever returned."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.registry.helpers import largest_data_file
from thoughtjax.registry import IntegrityError, Registry
from thoughtjax.registry.mapped import SUFFIX, MappedStore

NAME = "blocks[2:3)"


def _equal(a, b) -> None:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) and la
  for x, y in zip(la, lb, strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _entries(d) -> list:
  return sorted(p for p in d.iterdir() if p.suffix == SUFFIX)


@pytest.fixture
def mapped_dir(tmp_path):
  return tmp_path / "mapped"


def _open(root, mapped_dir, **kw) -> Registry:
  mapped_dir.mkdir(mode=0o700, exist_ok=True)
  return Registry.open(root, mapped=mapped_dir, **kw)


def test_the_second_restore_maps_what_the_first_checked(built, mapped_dir):
  want = Registry.open(built, mapped=False).restore(NAME)
  first = _open(built, mapped_dir)
  _equal(first.restore(NAME), want)
  assert first.stats().mapped_restores == 0 and len(_entries(mapped_dir)) == 1
  second = _open(built, mapped_dir)
  got = second.restore(NAME)
  _equal(got, want)
  assert second.stats().mapped_restores == 1 and second.stats().restores == 1
  # On the CPU the arrays alias the mapped file's pages: no copy was made.
  (data,) = _entries(mapped_dir)
  if jax.default_backend() == "cpu":
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    leaf = jax.tree.leaves(got)[0]
    regions = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps.splitlines() if str(data) in line]
    assert any(lo <= leaf.unsafe_buffer_pointer() < hi for lo, hi in regions)


def test_a_mapped_file_changed_after_its_verification_is_refused(built, mapped_dir):
  want = Registry.open(built, mapped=False).restore(NAME)
  _open(built, mapped_dir).restore(NAME)
  (data,) = _entries(mapped_dir)
  os.chmod(data, 0o600)
  raw = bytearray(data.read_bytes())
  raw[-4096 - 1] ^= 0x01  # inside the last array's page
  st = os.stat(data)
  data.write_bytes(bytes(raw))
  os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time set back: the change time tells
  reg = _open(built, mapped_dir)
  got = reg.restore(NAME)
  _equal(got, want)  # restored from the signed checkpoint, not from the changed file
  s = reg.stats()
  assert s.mapped_refusals == 1 and s.mapped_restores == 0 and s.integrity_failures == 0
  assert s.failures[-1]["kind"] == "mapped" and "changed before it was mapped" in s.failures[-1]["reason"]
  # The refused file was replaced by a new verified one, which the next restore maps.
  again = _open(built, mapped_dir)
  _equal(again.restore(NAME), want)
  assert again.stats().mapped_restores == 1 and again.stats().mapped_refusals == 0


def test_a_mapped_file_swapped_for_another_is_refused(built, mapped_dir, tmp_path):
  want = Registry.open(built, mapped=False).restore("blocks[0:2)")
  reg = _open(built, mapped_dir)
  reg.restore("blocks[0:2)")
  (mine,) = _entries(mapped_dir)
  reg.restore("blocks[3:5)")
  (other,) = set(_entries(mapped_dir)) - {mine}
  shutil.copy(other, tmp_path / "swap")
  os.replace(tmp_path / "swap", mine)  # a whole, well-formed mapped file, of other weights
  fresh = _open(built, mapped_dir)
  _equal(fresh.restore("blocks[0:2)"), want)
  assert fresh.stats().mapped_refusals == 1 and "ino" in fresh.stats().failures[-1]["reason"]


def test_a_checkpoint_file_changed_after_a_mapped_restore_is_still_an_integrity_error(registry_copy, mapped_dir):
  _open(registry_copy, mapped_dir).restore(NAME)
  assert _open(registry_copy, mapped_dir).restore(NAME) and len(_entries(mapped_dir)) == 1
  reg = _open(registry_copy, mapped_dir)
  victim = largest_data_file(reg.version_dir(NAME, reg.current[NAME]))
  raw = bytearray(victim.read_bytes())
  raw[len(raw) // 2] ^= 0x01
  victim.write_bytes(bytes(raw))
  with pytest.raises(IntegrityError, match=str(victim)):
    reg.restore(NAME)
  assert reg.stats().integrity_failures == 1 and reg.stats().mapped_restores == 0


def test_a_file_planted_in_a_checkpoint_after_a_mapped_restore_is_refused(registry_copy, mapped_dir):
  _open(registry_copy, mapped_dir).restore(NAME)
  reg = _open(registry_copy, mapped_dir)
  (reg.version_dir(NAME, reg.current[NAME]) / "checkpoint" / "planted").write_bytes(b"x")
  with pytest.raises(IntegrityError, match="not listed in the signed manifest"):
    reg.restore(NAME)


def test_a_copied_registry_checks_its_own_files_before_mapping(built, registry_copy, mapped_dir):
  """The same content in two places: one mapped form, used by the copy only once the copy's files were checked."""
  _open(built, mapped_dir).restore(NAME)
  copy = _open(registry_copy, mapped_dir)
  copy.restore(NAME)
  assert copy.stats().mapped_restores == 0  # read and checked: its files were never checked before
  assert len(_entries(mapped_dir)) == 1  # the content's one file, now vouched for by both
  again = _open(registry_copy, mapped_dir)
  again.restore(NAME)
  assert again.stats().mapped_restores == 1


def test_unchecked_restores_keep_nothing_mapped(built, mapped_dir):
  _open(built, mapped_dir, verify_files=False).restore(NAME)
  assert not _entries(mapped_dir)


def test_entries_past_the_byte_bound_go_least_recently_restored_first(built, mapped_dir):
  reg = _open(built, mapped_dir)
  reg.restore("blocks[0:2)")
  reg.restore("blocks[2:3)")
  sizes = sorted(p.stat().st_size for p in _entries(mapped_dir))
  store = MappedStore(mapped_dir, max_bytes=sizes[-1] + sizes[0] - 1)
  assert len(store.prune()) == 1 and len(_entries(mapped_dir)) == 1

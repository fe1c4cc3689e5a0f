"""A registry that lies: each test plants the attack (an escaping manifest key, a link, a FIFO, a huge file, a
linked directory for gc or the reader leases) and asserts a loud, named refusal with nothing outside touched.

The registries are unsigned (the default registry is unsigned): an attacker needs no key to edit them, and
rewrites the index's digest of the manifest it edits (``rewrite_manifest``).
"""

from __future__ import annotations

import os
import re
import shutil
import threading

import pytest

from tests.registry.helpers import rewrite_manifest
from thoughtjax.registry import (
  IntegrityError,
  Registry,
  RegistryError,
  UnknownThoughtletError,
  collect_garbage,
  dir_name,
)

NAME = "blocks[2:3)"


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory, tiny, tiny_mapping):
  """An unsigned, unprofiled registry of the tiny model. Read-only: copy it to change it."""
  from thoughtjax.registry import build

  _, model, codec = tiny
  out = tmp_path_factory.mktemp("unsigned") / "registry"
  build(out, tiny_mapping, model, codec=codec, settings=None, source="tiny-seed7").close()
  return out


@pytest.fixture
def reg_dir(unsigned, tmp_path):
  dst = tmp_path / "registry"
  shutil.copytree(unsigned, dst)
  return dst


class Sentinel:
  """A file outside the registry; :meth:`check` asserts its bytes and mtime are as they were and that nothing
  appeared beside it."""

  def __init__(self, outside):
    outside.mkdir()
    self.path = outside / "sentinel"
    self.path.write_bytes(b"keep me")
    self.mtime = self.path.stat().st_mtime_ns

  def check(self):
    assert self.path.read_bytes() == b"keep me" and self.path.stat().st_mtime_ns == self.mtime
    assert sorted(p.name for p in self.path.parent.iterdir()) == ["sentinel"]


@pytest.fixture
def sentinel(tmp_path):
  return Sentinel(tmp_path / "outside")


def _vdir(root, name=NAME):
  reg = Registry.open(root)
  try:
    return reg.version_dir(name, reg.current[name])
  finally:
    reg.close()


def _data_file(vdir):
  return max((p for p in (vdir / "checkpoint").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _bounded(fn):
  """Run ``fn`` on a thread and return what it raised; a call blocked for good (a FIFO opened for reading)
  fails the test instead of hanging the run."""
  out = {}

  def run():
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test
      out["error"] = e

  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(120)
  assert not t.is_alive(), "the registry read blocked (FIFO or endless file)"
  return out.get("error")


# ---- 1. manifest file keys that escape ----------------------------------------------------------------------


@pytest.mark.parametrize(
  "key",
  [
    "ABS",  # the sentinel's absolute path: a restore used to truncate it
    "checkpoint/../../../../../../SENTINEL_REL",
    "checkpoint/./d/x",
    "checkpoint//d",
    "manifest.json",
    "checkpoint",
    "checkpoint/d\\..\\x",
  ],
)
def test_manifest_file_keys_that_escape_are_refused_before_any_write(reg_dir, sentinel, key):
  vdir = _vdir(reg_dir)
  if key == "ABS":
    key = str(sentinel.path)
  key = key.replace("SENTINEL_REL", str(sentinel.path).lstrip("/"))

  def plant(raw):  # listed first in the sorted file list, with the sentinel's current digest
    import hashlib

    raw["files"][key] = {"sha256": hashlib.sha256(b"evil").hexdigest(), "bytes": 4}

  rewrite_manifest(vdir, plant, None, reg_dir)
  reg = Registry.open(reg_dir)
  with pytest.raises(IntegrityError, match=r"not a manifest .*(file key|files)"):
    reg.restore(NAME)
  with pytest.raises(IntegrityError):
    reg.verify(deep=False)
  assert reg.stats().integrity_failures == 2
  sentinel.check()


def test_verified_copy_checks_the_whole_list_before_writing(tmp_path, sentinel):
  """The copy itself (not only the manifest parser) refuses a bad key anywhere in the list before it writes."""
  from thoughtjax.registry.checkpoint import verified_copy

  vdir = tmp_path / "v"
  (vdir / "checkpoint").mkdir(parents=True)
  (vdir / "checkpoint" / "a").write_bytes(b"x")
  files = {
    "checkpoint/a": {"sha256": "0" * 64, "bytes": 1},
    str(sentinel.path): {"sha256": "0" * 64, "bytes": 1},
  }
  before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
  with pytest.raises(IntegrityError, match="file key"):
    verified_copy(vdir, files, lambda rel, why: IntegrityError("t", None, rel, why))
  after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
  assert not {n for n in after - before if n.startswith("thoughtjax-restore-")}  # no scratch directory made
  sentinel.check()


def test_a_symlink_in_the_version_directory_is_refused(reg_dir, sentinel):
  """A checkpoint file replaced by a link to a file outside: neither read nor written through."""
  vdir = _vdir(reg_dir)
  victim = _data_file(vdir)
  victim.unlink()
  victim.symlink_to(sentinel.path)
  reg = Registry.open(reg_dir)
  with pytest.raises(IntegrityError, match=r"symbolic link; a checkpoint holds plain files only"):
    reg.restore(NAME)
  with pytest.raises(IntegrityError, match="symbolic link"):
    reg.verify(deep=False)  # verify's file check too
  assert reg.stats().integrity_failures == 2 and not reg.stats().resident
  sentinel.check()


def test_a_linked_checkpoint_or_thoughtlet_directory_is_refused(reg_dir, sentinel):
  vdir = _vdir(reg_dir)
  outside = sentinel.path.parent
  # The whole checkpoint directory moved out and linked back.
  moved = outside.parent / "moved-checkpoint"
  shutil.move(vdir / "checkpoint", moved)
  (vdir / "checkpoint").symlink_to(moved)
  reg = Registry.open(reg_dir)
  with pytest.raises(IntegrityError, match="is a symbolic link or not a directory"):
    reg.restore(NAME)
  # A thoughtlet's directory linked elsewhere: its manifest is not read through the link.
  (vdir / "checkpoint").unlink()
  shutil.move(moved, vdir / "checkpoint")
  tdir = vdir.parent
  shutil.move(tdir, outside.parent / "moved-thoughtlet")
  tdir.symlink_to(outside.parent / "moved-thoughtlet")
  with pytest.raises(IntegrityError, match="symbolic link"):
    Registry.open(reg_dir).manifest(NAME)
  sentinel.check()


# ---- 4. reads without limits ---------------------------------------------------------------------------------


def test_a_link_to_dev_zero_is_refused_without_reading_it(reg_dir):
  victim = _data_file(_vdir(reg_dir))
  victim.unlink()
  victim.symlink_to("/dev/zero")
  reg = Registry.open(reg_dir)
  err = _bounded(lambda: reg.restore(NAME))
  assert isinstance(err, IntegrityError) and "symbolic link" in str(err)
  err = _bounded(lambda: reg.check_files(reg.manifest(NAME), victim.parents[1]))
  assert isinstance(err, IntegrityError)


@pytest.mark.parametrize("where", ["checkpoint", "manifest.json", "manifest.sig", "index.json", "codec"])
def test_a_fifo_never_hangs_a_read(reg_dir, where):
  vdir = _vdir(reg_dir)
  target = {
    "checkpoint": _data_file(vdir),
    "manifest.json": vdir / "manifest.json",
    "manifest.sig": vdir / "manifest.sig",
    "index.json": reg_dir / "index.json",
    "codec": next((reg_dir / "codec").glob("*/tokenizer.json")),
  }[where]
  target.unlink(missing_ok=True)
  os.mkfifo(target)

  def read():
    with Registry.open(reg_dir) as reg:
      _ = reg.codec
      reg.restore(NAME)

  err = _bounded(read)
  assert isinstance(err, RegistryError), err
  assert "not a regular file" in str(err) or "symbolic link or not a regular file" in str(err), err


def test_a_file_larger_than_listed_is_read_only_to_its_size_plus_one(reg_dir, monkeypatch):
  victim = _data_file(_vdir(reg_dir))
  listed = victim.stat().st_size
  with open(victim, "ab") as f:
    f.write(b"\0" * (8 << 20))  # 8 MiB more than the manifest lists
  read = []
  real_read = os.read

  def counting_read(fd, n):
    block = real_read(fd, n)
    if os.readlink(f"/proc/self/fd/{fd}") == str(victim):
      read.append(len(block))
    return block

  monkeypatch.setattr(os, "read", counting_read)
  reg = Registry.open(reg_dir)
  with pytest.raises(IntegrityError, match=f"holds more than the {listed} bytes the manifest lists"):
    reg.restore(NAME)
  assert sum(read) == listed + 1


# ---- 3. gc and reader leases never follow a link out of the registry ----------------------------------------


def test_gc_never_follows_a_linked_thoughtlet_directory(reg_dir, tmp_path):
  outside = tmp_path / "victim"
  (outside / "0123456789abcdef").mkdir(parents=True)
  (outside / "0123456789abcdef" / "precious").write_bytes(b"data")
  (outside / "notes.txt").write_bytes(b"notes")
  link = reg_dir / "thoughtlets" / "evil"
  link.symlink_to(outside)
  # A link in place of a version directory too.
  (reg_dir / "thoughtlets" / dir_name(NAME) / "fedcba9876543210").symlink_to(outside)
  report = collect_garbage(reg_dir)
  assert report.removed == []
  skipped = {p: why for p, why in report.skipped}
  assert "symbolic link" in skipped[link]
  assert "symbolic link" in skipped[reg_dir / "thoughtlets" / dir_name(NAME) / "fedcba9876543210"]
  assert (outside / "0123456789abcdef" / "precious").read_bytes() == b"data"
  assert (outside / "notes.txt").read_bytes() == b"notes"
  Registry.open(reg_dir).verify(deep=False)  # the registry itself is intact


def test_a_linked_readers_directory_is_neither_used_nor_cleaned(reg_dir, tmp_path):
  outside = tmp_path / "locks"
  outside.mkdir()
  stale = outside / "123-abc.lock"  # looks like a stale lease: gc used to delete it
  stale.write_bytes(b"")
  (outside / "123-abc.json").write_bytes(b"{}")
  shutil.rmtree(reg_dir / ".readers", ignore_errors=True)
  (reg_dir / ".readers").symlink_to(outside)
  with Registry.open(reg_dir) as reg:  # takes no lease through the link
    assert reg._lease is None
  assert sorted(p.name for p in outside.iterdir()) == ["123-abc.json", "123-abc.lock"]
  with pytest.raises(RegistryError, match=r"\.readers is a symbolic link.*never follows"):
    collect_garbage(reg_dir)
  assert sorted(p.name for p in outside.iterdir()) == ["123-abc.json", "123-abc.lock"]


def test_a_planted_link_in_the_readers_directory_is_not_written_through(reg_dir, sentinel):
  with Registry.open(reg_dir) as reg:
    tmp = reg._lease.data.with_name(reg._lease.data.name + ".tmp")
    tmp.symlink_to(sentinel.path)  # the lease's next write would follow it
    reg._hold_lease(("x", "0123456789abcdef"))
    assert reg._lease.data.is_file() and not reg._lease.data.is_symlink()
  sentinel.check()


def test_writer_lock_refuses_a_linked_lock_file(reg_dir, sentinel):
  (reg_dir / ".lock").unlink(missing_ok=True)
  (reg_dir / ".lock").symlink_to(sentinel.path)
  with pytest.raises(RegistryError, match=r"\.lock is a symbolic link"):
    collect_garbage(reg_dir)
  sentinel.check()


# ---- 5. version prefixes and the failure record ----------------------------------------------------------------


def test_a_short_version_prefix_is_refused_with_the_rule(reg_dir):
  from thoughtjax.assembly import resolve
  from thoughtjax.registry import UnknownThoughtletError

  reg = Registry.open(reg_dir)
  v = reg.current[NAME]
  for bad in (v[:1], v[:11], v.upper(), "../" + v, v + "0", "é" * 12):
    with pytest.raises(UnknownThoughtletError, match=r"16 lowercase hex digits or a prefix of at least 12"):
      reg.resolve(NAME, bad)
  assert resolve(f"embed, {NAME}@{v[:12]}, head", reg)[1].units == ((NAME, v),)
  assert reg.stats().failures == []  # a bad name is the caller's error, not a registry failure


def test_a_version_gc_removed_is_unknown_not_an_integrity_failure(reg_dir):
  import jax

  reg = Registry.open(reg_dir)
  old = reg.current[NAME]
  base = reg.thoughtlet(NAME)
  new = reg.publish([base.with_params(jax.tree.map(lambda x: x * 1.01, dict(base.params)))], settings=None)[NAME]
  reg.close()
  assert [p.name for p in collect_garbage(reg_dir, keep=1).removed] == [old]
  reg = Registry.open(reg_dir)
  for _ in range(3):  # every request names it: refused the same way, nothing counted
    with pytest.raises(
      UnknownThoughtletError, match=rf"{re.escape(NAME)}@{old} was removed .* gc.*current version {new}"
    ):
      reg.manifest(NAME, old)
  s = reg.stats()
  assert s.integrity_failures == 0 and s.failures == []


def test_the_failure_record_keeps_counts_and_the_last_details(reg_dir):
  from thoughtjax.registry.resident import FAILURE_DETAILS

  victim = _data_file(_vdir(reg_dir))
  data = bytearray(victim.read_bytes())
  data[-1] ^= 0xFF
  victim.write_bytes(bytes(data))
  reg = Registry.open(reg_dir)
  n = FAILURE_DETAILS + 50
  for _ in range(n):
    with pytest.raises(IntegrityError):
      reg.restore(NAME)
  s = reg.stats()
  assert s.integrity_failures == n
  assert len(s.failures) == FAILURE_DETAILS and s.failures_dropped == n - FAILURE_DETAILS
  assert len(str(s.to_json())) < 100 * FAILURE_DETAILS * 10


# ---- 10. checked manifests are cached ---------------------------------------------------------------------------


def test_a_path_of_many_repeated_pieces_checks_each_manifest_once(reg_dir, monkeypatch):
  from thoughtjax.assembly import resolve
  from thoughtjax.registry import trust

  calls = []
  real = trust.Verifier.check_manifest

  def counting(self, name, *a, **kw):
    calls.append(name)
    return real(self, name, *a, **kw)

  monkeypatch.setattr(trust.Verifier, "check_manifest", counting)
  reg = Registry.open(reg_dir)
  links = resolve("embed, " + ", ".join([NAME, "blocks[3:5)"] * 2000) + ", head", reg)
  assert len(links) == 4002
  assert sorted(calls) == sorted(["embed", NAME, "blocks[3:5)", "head"])
  # A manifest changed in place (same size, mtime put back) is read and checked again, and refused.
  path = _vdir(reg_dir) / "manifest.json"
  st = path.stat()
  text = path.read_text()
  path.write_text(text.replace('"kind"', '"kinD"', 1))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  with pytest.raises(IntegrityError, match="does not match"):
    reg.manifest(NAME)
  assert calls.count(NAME) == 2


def test_a_fifo_in_place_of_a_calibration_is_refused(reg_dir):
  from thoughtjax.synthesis.calibration_store import calibration_path, read_calibration

  reg = Registry.open(reg_dir)
  path = calibration_path(reg_dir, reg.sequence)
  path.parent.mkdir()
  os.mkfifo(path)
  err = _bounded(lambda: read_calibration(reg))
  assert isinstance(err, IntegrityError) and "not a regular file" in str(err)
  assert reg.stats().integrity_failures == 1


def test_a_linked_staging_directory_is_not_written_through(reg_dir, tmp_path):
  import jax

  outside = tmp_path / "elsewhere"
  outside.mkdir()
  (reg_dir / ".staging").symlink_to(outside)
  with Registry.open(reg_dir) as reg:
    base = reg.thoughtlet(NAME)
    reg.publish([base.with_params(jax.tree.map(lambda x: x * 1.01, dict(base.params)))], settings=None)
  assert list(outside.iterdir()) == []
  Registry.open(reg_dir).verify(deep=False)

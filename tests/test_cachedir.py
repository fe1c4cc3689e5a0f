"""The cache directory is this user's alone: made 0700, and refused (named, with the fix) when another user owns
it, when others may write it or a directory above it, before anything in it is read or written. The cache
secret is a 0600 regular file of this user's, or refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from thoughtjax import cachedir, durable, fetch
from thoughtjax.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _mode(path) -> int:
  return stat.S_IMODE(os.stat(path).st_mode)


def _planted(directory):
  """A file an attacker left in ``directory``: (path, bytes, mtime) to check it is never touched."""
  path = directory / "planted"
  path.write_bytes(b"attacker bytes")
  return path, path.read_bytes(), path.stat().st_mtime_ns


def _untouched(planted) -> None:
  path, data, mtime = planted
  assert path.read_bytes() == data and path.stat().st_mtime_ns == mtime


def test_a_missing_cache_is_made_0700_with_its_missing_parents(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "a" / "b" / "cache"))
  old = os.umask(0)  # the mode is explicit, not the umask's
  try:
    root = cachedir.cache_dir()
    sub = cachedir.cache_subdir("xla")
  finally:
    os.umask(old)
  assert root == tmp_path / "a" / "b" / "cache" and sub == root / "xla"
  for d in (tmp_path / "a", tmp_path / "a" / "b", root, sub):
    assert _mode(d) == 0o700, d


def test_an_existing_private_cache_is_used_as_it_is(tmp_path, monkeypatch):
  root = tmp_path / "cache"
  root.mkdir(mode=0o755)  # readable by others is not a risk to this user; writable would be
  os.chmod(root, 0o755)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(root))
  assert cachedir.cache_dir() == root and _mode(root) == 0o755


@pytest.mark.parametrize("mode, who", [(0o770, "its group"), (0o703, "others"), (0o777, "its group and others")])
def test_a_cache_others_may_write_is_refused_with_the_fix(tmp_path, monkeypatch, mode, who):
  root = tmp_path / "cache"
  root.mkdir()
  planted = _planted(root)
  os.chmod(root, mode)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(root))
  for use in (
    cachedir.cache_dir,
    lambda: cachedir.cache_subdir("weights"),
    lambda: fetch.model_path(fetch.DEFAULT_MODEL),
  ):
    with pytest.raises(cachedir.UnsafeCacheError) as err:
      use()
    message = str(err.value)
    assert isinstance(err.value, UserError)
    assert f"{root} is writable by {who} (mode {mode:04o})" in message and f"chmod 700 '{root}'" in message
  assert not (root / "weights").exists() and sorted(root.iterdir()) == [planted[0]]
  _untouched(planted)


def test_a_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch):
  root = tmp_path / "cache"
  root.mkdir(mode=0o700)
  planted = _planted(root)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(root))
  monkeypatch.setattr(os, "getuid", lambda: root.stat().st_uid + 1)  # the directory as another user sees it
  with pytest.raises(cachedir.UnsafeCacheError, match=r"is owned by uid \d+, not by you \(uid \d+\).*chown"):
    cachedir.cache_dir()
  with pytest.raises(cachedir.UnsafeCacheError):
    cachedir.secret()
  assert sorted(root.iterdir()) == [planted[0]]
  _untouched(planted)


def test_a_cache_under_a_directory_others_may_write_is_refused(tmp_path, monkeypatch):
  shared = tmp_path / "shared"
  shared.mkdir()
  root = shared / "cache"
  root.mkdir(mode=0o700)
  os.chmod(shared, 0o777)  # anyone could rename the cache away and put their own in its place
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(root))
  with pytest.raises(cachedir.UnsafeCacheError, match=rf"the directory above it, {shared}, is writable by others"):
    cachedir.cache_dir()
  os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot rename what they do not own
  assert cachedir.cache_dir() == root


def test_nothing_is_created_under_a_directory_others_may_write(tmp_path, monkeypatch):
  shared = tmp_path / "shared"
  shared.mkdir()
  os.chmod(shared, 0o777)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(shared / "a" / "cache"))
  with pytest.raises(cachedir.UnsafeCacheError, match=rf"the directory above it, {shared}, is writable by others"):
    cachedir.cache_dir()
  assert not list(shared.iterdir())


def test_a_cache_that_is_a_file_is_refused(tmp_path, monkeypatch):
  (tmp_path / "cache").write_text("not a directory")
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  with pytest.raises(cachedir.UnsafeCacheError, match="is not a directory"):
    cachedir.cache_dir()


def test_a_linked_cache_is_judged_by_the_directory_it_names(tmp_path, monkeypatch):
  real = tmp_path / "disk" / "cache"
  real.mkdir(parents=True)
  (tmp_path / "link").symlink_to(real)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "link"))
  os.chmod(real, 0o700)
  assert cachedir.cache_dir() == tmp_path / "link"
  os.chmod(real, 0o777)
  with pytest.raises(cachedir.UnsafeCacheError, match="is writable by its group and others"):
    cachedir.cache_dir()


# ---- the cache secret ------------------------------------------------------------------------------------------


def test_the_secret_is_made_once_0600_and_kept(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(cachedir, "_secrets", {})
  key = cachedir.secret()
  path = tmp_path / "cache" / cachedir.SECRET_NAME
  assert len(key) == cachedir.SECRET_BYTES and path.read_bytes() == key and _mode(path) == 0o600
  monkeypatch.setattr(cachedir, "_secrets", {})  # a new process reads the same secret
  assert cachedir.secret() == key
  # A second creator that lost the race keeps the first one's secret.
  os.close(cachedir._create_secret(tmp_path / "cache", path))
  assert path.read_bytes() == key and not [
    p for p in path.parent.iterdir() if p.name.startswith(durable.PARTIAL_PREFIX)
  ]


@pytest.mark.parametrize("damage", ["readable_by_others", "link", "short", "fifo"])
def test_a_secret_others_could_read_or_swap_is_refused(tmp_path, monkeypatch, damage):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(cachedir, "_secrets", {})
  path = cachedir.cache_dir() / cachedir.SECRET_NAME
  outside = tmp_path / "attacker.key"
  outside.write_bytes(b"k" * cachedir.SECRET_BYTES)
  if damage == "readable_by_others":
    cachedir.secret()
    monkeypatch.setattr(cachedir, "_secrets", {})
    os.chmod(path, 0o644)
    match = "may be read or written by others"
  elif damage == "link":
    path.symlink_to(outside)  # a key the attacker knows
    match = "cannot be opened as a plain file"
  elif damage == "short":
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    match = "holds 5 bytes, expected 32"
  else:
    os.mkfifo(path, 0o600)
    match = "is not a regular file"
  with pytest.raises(cachedir.UnsafeCacheError, match=match) as err:
    cachedir.secret()
  assert f"rm '{path}'" in str(err.value) or "delete it" in str(err.value)
  assert outside.read_bytes() == b"k" * cachedir.SECRET_BYTES


def test_the_command_line_refuses_an_unsafe_cache_in_one_line_before_any_download(tmp_path):
  root = tmp_path / "cache"
  root.mkdir()
  os.chmod(root, 0o777)
  env = {**os.environ, "THOUGHTJAX_CACHE": str(root), "PYTHONPATH": str(REPO), "PIP_INDEX_URL": "http://127.0.0.1:9/"}
  r = subprocess.run(
    [sys.executable, "-m", "thoughtjax.cli", "fetch"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
  )
  assert r.returncode == 2, r.stderr
  assert "is writable by its group and others (mode 0777)" in r.stderr and f"chmod 700 '{root}'" in r.stderr
  assert "Traceback" not in r.stderr and not list(root.iterdir())

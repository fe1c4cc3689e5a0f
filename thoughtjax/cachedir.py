"""The user cache directory, and who may write it.

``$THOUGHTJAX_CACHE``, else ``$XDG_CACHE_HOME/thoughtjax``, else ``~/.cache/thoughtjax``. It holds the fetched
model (``models/``), the derived weight cache (``weights/``), the default registry (``registry/``), XLA's
persistent compilation cache (``xla/``: compiled native code that JAX loads and runs without any check) and the
exported programs (``exported/``).

Trust boundary. Whoever can write into these directories can make this user's processes compute with their
weights or run their code, so each must be writable by this user alone. :func:`private_dir` creates a missing
directory (and missing parents) with mode 0700 and refuses an existing one with :class:`UnsafeCacheError`, which
says how to fix it, when

- it is not a directory, or is owned by another user (root included, for a non-root user);
- its group or others may write it (mode ``g+w`` or ``o+w``);
- a directory above it lets others replace it: writable by group or others without the sticky bit (``/tmp`` is
  fine: 1777).

Within that boundary the files are trusted as the user's own: JAX's compilation cache is used as found. What can
be checked is: exported programs carry an HMAC-SHA256 under a per-user secret (:func:`secret`:
``<cache>/secret.key``, 32 random bytes, mode 0600, created on first use), so an artifact copied in from another
user, machine or restored CI cache, or written by anyone who can write artifacts but not read the secret (an
export directory named with ``THOUGHTJAX_EXPORT_CACHE``), is refused and rebuilt. ACLs and the root user are
outside what is checked.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from thoughtjax import durable, settings
from thoughtjax.errors import UserError

# The other way out of every refusal below.
ELSEWHERE = (
  "or point THOUGHTJAX_CACHE (and THOUGHTJAX_COMPILE_CACHE / THOUGHTJAX_EXPORT_CACHE if set) at a directory of your own"
)
SECRET_NAME = "secret.key"
SECRET_BYTES = 32
_secrets: dict[str, bytes] = {}


class UnsafeCacheError(UserError, PermissionError):
  """A cache directory or the cache secret could be written (or read) by someone other than this user."""


def cache_root() -> Path:
  """Where the cache directory is (not created, not checked)."""
  root = settings.current().cache
  if root:
    return root
  xdg = os.environ.get("XDG_CACHE_HOME")
  return (Path(xdg) if xdg else Path.home() / ".cache") / "thoughtjax"


def cache_dir() -> Path:
  """The cache directory, created with mode 0700 or checked (:func:`private_dir`)."""
  return private_dir(cache_root(), "the thoughtjax cache directory")


def default_registry_dir() -> Path:
  """Where the default model's registry lives (built and calibrated on first use)."""
  return cache_dir() / "registry" / "default"


def cache_subdir(name: str) -> Path:
  """``<cache>/<name>``, created with mode 0700 or checked."""
  return private_dir(cache_dir() / name, f"the thoughtjax cache's {name}/")


def private_dir(path: str | os.PathLike, what: str = "a cache directory") -> Path:
  """``path``, created with mode 0700 when missing (missing parents too); else checked to be writable by this
  user alone (see the module docstring). Raises :class:`UnsafeCacheError` naming the directory and the fix."""
  path = Path(path).expanduser().absolute()
  missing = []
  p = path
  while not os.path.lexists(p):
    missing.append(p)
    p = p.parent
  if missing:  # nothing is created under a directory others could swap
    existing = p.resolve()
    _check_above([existing, *existing.parents], what, path)
  for d in reversed(missing):
    try:
      d.mkdir(mode=0o700)  # the umask only removes bits, so this is 0700 or less
    except FileExistsError:  # another process made it: checked below like any existing one
      continue
  real = path.resolve()
  uid = os.getuid()
  try:
    st = os.stat(real)
  except OSError as e:
    raise UnsafeCacheError(f"{what} {path} cannot be used ({e}); {ELSEWHERE}") from None
  if not stat.S_ISDIR(st.st_mode):
    raise UnsafeCacheError(f"{what} {path} is not a directory; remove it, {ELSEWHERE}")
  if st.st_uid != uid:
    raise UnsafeCacheError(
      f"{what} {path} is owned by uid {st.st_uid}, not by you (uid {uid}); a cache holds weights and compiled "
      f"programs this process runs, so only its owner may write it. Use a directory you own: "
      f"`chown -R {uid} '{real}' && chmod 700 '{real}'`, {ELSEWHERE}"
    )
  if st.st_mode & 0o022:
    who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if st.st_mode & bit)
    raise UnsafeCacheError(
      f"{what} {path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); a cache holds weights and "
      f"compiled programs this process runs, so only its owner may write it. Run `chmod 700 '{real}'` "
      f"(and remove what you did not put there), {ELSEWHERE}"
    )
  _check_above(real.parents, what, path)
  return path


def _check_above(parents, what: str, path: Path) -> None:
  """Refuse when one of ``parents`` lets others rename what is in it: writable by group or others, no sticky bit."""
  for parent in parents:
    pst = os.stat(parent)
    if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
      raise UnsafeCacheError(
        f"{what} {path}: the directory above it, {parent}, is writable by others (mode "
        f"{stat.S_IMODE(pst.st_mode):04o}, no sticky bit), who could replace the cache. Run "
        f"`chmod go-w '{parent}'` (or `chmod +t '{parent}'`), {ELSEWHERE}"
      )


def secret() -> bytes:
  """This user's cache secret (``<cache>/secret.key``): 32 random bytes, created on first use with mode 0600.

  Refused with :class:`UnsafeCacheError` when the file is a link or not a regular file, is owned by someone
  else, may be read or written by others, or has the wrong size.
  """
  root = cache_dir()
  path = root / SECRET_NAME
  key = str(path)
  if key in _secrets:
    return _secrets[key]
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
  except FileNotFoundError:
    fd = _create_secret(root, path)
  except OSError as e:  # ELOOP: a symbolic link
    raise UnsafeCacheError(
      f"cache secret {path} cannot be opened as a plain file ({e}); delete it (every exported program is then "
      f"rebuilt once)"
    ) from None
  try:
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
      problem = "is not a regular file"
    elif st.st_uid != os.getuid():
      problem = f"is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    elif st.st_mode & 0o077:
      problem = f"may be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}, expected 0600)"
    elif st.st_size != SECRET_BYTES:
      problem = f"holds {st.st_size} bytes, expected {SECRET_BYTES}"
    if problem:
      raise UnsafeCacheError(
        f"cache secret {path} {problem}; it keys the integrity check of exported programs. Delete it "
        f"(`rm '{path}'`: a new one is made and every exported program is rebuilt once)"
      )
    data = os.read(fd, SECRET_BYTES + 1)
  finally:
    os.close(fd)
  if len(data) != SECRET_BYTES:
    raise UnsafeCacheError(f"cache secret {path}: read {len(data)} bytes, expected {SECRET_BYTES}; delete it")
  _secrets[key] = data
  return data


def _create_secret(root: Path, path: Path) -> int:
  """Write a new secret whole under a temporary name and link it into place; the first of racing processes
  wins and every one reads the winner's. Returns an open descriptor of the secret."""
  fd, tmp = tempfile.mkstemp(dir=root, prefix=durable.TEMP_PREFIX)  # mode 0600
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(secrets.token_bytes(SECRET_BYTES))
      f.flush()
      os.fsync(f.fileno())
    try:
      os.link(tmp, path)  # fails when it exists: never replaces a secret another process already uses
    except FileExistsError:
      pass
    durable.fsync_path(root)
  finally:
    os.unlink(tmp)
  return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)

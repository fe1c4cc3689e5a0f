"""On-disk layout of a registry and its file I/O: names, digests, durable writes, the index file,
the writer lock.

Layout::

    DIR/index.json                          {"index": {...}, "signature": {...} | null}
    DIR/thoughtlets/<name>/<version>/checkpoint/   one Orbax checkpoint (the weights)
    DIR/thoughtlets/<name>/<version>/manifest.json signature, profile, hashes, file digests
    DIR/thoughtlets/<name>/<version>/manifest.sig  detached Ed25519 signature (if signed)
    DIR/codec/<digest>/                     tokenizer.json + codec.json (chat template, ids)
    DIR/keys/<key id>.pub                   public keys that signed something here
    DIR/.staging/, DIR/.lock                writer scratch space and lock
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from thoughtjax.registry.errors import IntegrityError, RegistryError, RegistryFormatError

# 2: a quantized GGUF's matrices stored packed (thoughtjax.thoughtlet.stored), hashed over the packed bytes.
FORMAT_VERSION = 2
FORMAT = f"thoughtjax.registry/{FORMAT_VERSION}"
MANIFEST_FORMAT = f"thoughtjax.manifest/{FORMAT_VERSION}"
VERSION_LEN = 16
# A version (and a codec digest) as the index names it: hex only, so it can never escape its directory.
VERSION_RE = re.compile(f"[0-9a-f]{{{VERSION_LEN}}}")


# Upper bounds of the registry's JSON files (index, manifest, codec files, calibration) and of a signature
# record: a read stops one byte past them, so a huge or endless file cannot fill memory.
MAX_JSON_BYTES = 64 << 20
MAX_SIG_BYTES = 64 << 10
_CHUNK = 1 << 22


class UnsafeFile(Exception):
  """A registry file that is not a regular file reached without links, or larger than its bound.
  Internal: every reader of registry files turns it into a named :class:`RegistryError` with its context."""


def open_regular(root: Path, rel: str | os.PathLike) -> int:
  """A read-only descriptor of the regular file ``root/rel``, opened one component at a time without following
  a symbolic link below ``root`` (``O_NOFOLLOW``) and without blocking on a FIFO (``O_NONBLOCK``); the type is
  checked on the open descriptor, so nothing can be swapped in between. Raises ``FileNotFoundError`` when a
  component is missing and :class:`UnsafeFile` for a link, a FIFO, a device or any other special file."""
  parts = Path(rel).parts
  if not parts or Path(rel).is_absolute() or any(p in ("", ".", "..") for p in parts):
    raise UnsafeFile(f"{rel!s} is not a relative path inside {root}")
  dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  try:
    for i, part in enumerate(parts[:-1]):
      try:
        nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
          raise UnsafeFile(f"{Path(*parts[: i + 1])} is a symbolic link or not a directory") from None
        raise
      os.close(dfd)
      dfd = nfd
    try:
      fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dfd)
    except OSError as e:
      if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
        raise UnsafeFile(f"{rel!s} is a symbolic link or not a regular file") from None
      raise
  finally:
    os.close(dfd)
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    os.close(fd)
    raise UnsafeFile(f"{rel!s} is not a regular file (mode {stat.filemode(mode)})")
  return fd


def read_chunks(fd: int, limit: int) -> Iterator[bytes]:
  """The bytes of ``fd`` in chunks, at most ``limit`` + 1 of them (the caller sees an oversized file)."""
  left = limit + 1
  while left > 0:
    block = os.read(fd, min(_CHUNK, left))
    if not block:
      return
    left -= len(block)
    yield block


def read_regular(root: Path, rel: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> bytes:
  """The bytes of the regular file ``root/rel`` (see :func:`open_regular`); :class:`UnsafeFile` when it holds
  more than ``limit`` bytes (at most ``limit`` + 1 are read)."""
  fd = open_regular(root, rel)
  try:
    data = b"".join(read_chunks(fd, limit))
  finally:
    os.close(fd)
  if len(data) > limit:
    raise UnsafeFile(f"{rel!s} holds more than {limit} bytes")
  return data


def sha256_regular(root: Path, rel: str | os.PathLike, limit: int) -> tuple[str, int]:
  """SHA-256 and size of the regular file ``root/rel``, reading at most ``limit`` + 1 bytes (a size above
  ``limit`` is reported as such by the caller, whose digest then cannot match)."""
  fd = open_regular(root, rel)
  h, n = hashlib.sha256(), 0
  try:
    for block in read_chunks(fd, limit):
      h.update(block)
      n += len(block)
  finally:
    os.close(fd)
  return h.hexdigest(), n


def _open_dir(root: Path, rel: str | os.PathLike) -> int:
  """A descriptor of the directory ``root/rel``, every component below ``root`` opened without following a
  link (``FileNotFoundError`` when missing, :class:`UnsafeFile` for a link or a non-directory)."""
  dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  for i, part in enumerate(Path(rel).parts):
    try:
      nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError as e:
      os.close(dfd)
      if e.errno in (errno.ELOOP, errno.ENOTDIR):
        raise UnsafeFile(f"{Path(*Path(rel).parts[: i + 1])} is a symbolic link or not a directory") from None
      raise
    os.close(dfd)
    dfd = nfd
  return dfd


def file_tree(root: Path, rel: str | os.PathLike) -> dict[str, str]:
  """Every entry below the directory ``root/rel`` (reached without links), never following a link:
  path relative to ``root/rel`` -> ``"file"`` (regular), ``"dir"``, ``"link"`` or ``"special"``."""
  dfd = _open_dir(root, rel)
  out: dict[str, str] = {}
  try:
    for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=dfd, follow_symlinks=False):
      for name in dirnames + filenames:
        mode = os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode
        kind = (
          "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "special"
        )
        out[os.path.normpath(os.path.join(dirpath, name))] = kind
  finally:
    os.close(dfd)
  return out


def sha256_of_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
  return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def fsync_entry(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_file(path: Path, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def fsync_dir_tree(root: Path) -> None:
  """fsync every file and directory under ``root`` (and ``root``), children before parents, so that
  a rename of ``root`` made after this cannot outlive a crash with any of its content missing."""
  for p in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
    if not p.is_symlink():
      fsync_entry(p)
  fsync_entry(root)


def mkdir_durable(path: Path) -> None:
  """Create ``path`` and any missing parents, fsyncing each new directory's parent."""
  missing = []
  p = path
  while not p.exists():
    missing.append(p)
    p = p.parent
  for d in reversed(missing):
    try:
      d.mkdir()
    except FileExistsError:
      continue
    fsync_entry(d.parent)


def files_under(root: Path) -> list[Path]:
  return sorted(p for p in root.rglob("*") if p.is_file())


def dir_name(name: str) -> str:
  """File-system name of a thoughtlet: ``blocks[0:2)`` -> ``blocks_0_2``."""
  m = re.fullmatch(r"blocks\[(\d+):(\d+)\)", name)
  if m:
    return f"blocks_{m.group(1)}_{m.group(2)}"
  if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
    return name
  return "x" + hashlib.sha3_256(name.encode()).hexdigest()[:16]


def utc_now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def nest_flat(flat: Mapping[str, Any]) -> dict:
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    parts = path.split("/")
    for key in parts[:-1]:
      node = node.setdefault(key, {})
    node[parts[-1]] = leaf
  return out


def read_index(root: Path) -> tuple[dict, dict | None]:
  path = root / "index.json"
  try:
    doc = json.loads(read_regular(root, "index.json"))
  except FileNotFoundError:
    raise RegistryError(
      f"{root} is not a thoughtlet registry (no index.json); create one with `thoughtjax registry build`"
    ) from None
  except NotADirectoryError:
    raise RegistryError(f"{root} is not a thoughtlet registry (not a directory)") from None
  except UnsafeFile as e:
    raise IntegrityError("index", None, str(path), f"{e}; an index is a plain file") from None
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    raise IntegrityError("index", None, str(path), f"not valid JSON ({type(e).__name__}: {e})") from None
  body = doc.get("index") if isinstance(doc, dict) else None
  if not isinstance(body, dict):
    raise RegistryError(f"{path}: not a {FORMAT} index")
  check_format(body.get("format"), root)
  return body, doc.get("signature")


def _format_version(fmt) -> int | None:
  prefix = "thoughtjax.registry/"
  if isinstance(fmt, str) and fmt.startswith(prefix) and fmt[len(prefix) :].isdigit():
    return int(fmt[len(prefix) :])
  return None


def index_format(root: str | os.PathLike) -> str | None:
  """The ``format`` an existing ``root/index.json`` declares (None: no index, or not one)."""
  try:
    doc = json.loads(read_regular(Path(root), "index.json"))
  except (OSError, ValueError, UnsafeFile, RecursionError):
    return None
  body = doc.get("index") if isinstance(doc, dict) else None
  return body.get("format") if isinstance(body, dict) else None


def is_older_format(root: str | os.PathLike) -> bool:
  """Whether ``root`` holds a registry of an older format than this thoughtjax writes (rebuild it)."""
  version = _format_version(index_format(root))
  return version is not None and version < FORMAT_VERSION


def check_format(fmt, root: Path) -> None:
  """Refuse an index of another format, with the way out (:class:`RegistryFormatError`)."""
  if fmt == FORMAT:
    return
  version = _format_version(fmt)
  if version is None:
    raise RegistryError(f"{Path(root) / 'index.json'}: not a {FORMAT} index (format {fmt!r})")
  if version < FORMAT_VERSION:
    raise RegistryFormatError(
      f"{root} is a registry of format {fmt}; this thoughtjax reads {FORMAT} only (since format "
      f"{FORMAT_VERSION} a quantized model's weights are stored packed and hashed over the packed bytes, so "
      f"every version changed). Rebuild it: `thoughtjax registry build --out {root} --replace-old-format "
      f"[--model ...] [--mapping ...] [--sign-key ...]` (its old thoughtlets are removed), or build into a new "
      f"directory"
    )
  raise RegistryFormatError(
    f"{root} is a registry of format {fmt}, newer than the {FORMAT} this thoughtjax reads; upgrade thoughtjax"
  )


@contextlib.contextmanager
def writer_lock(root: Path):
  root.mkdir(parents=True, exist_ok=True)
  try:  # never through a link: a planted DIR/.lock must not create or lock a file elsewhere
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
  except OSError as e:
    if e.errno != errno.ELOOP:
      raise
    raise RegistryError(
      f"{root / '.lock'} is a symbolic link; the writer lock is a plain file of the registry. Remove the link "
      f"(rm {root / '.lock'}) and try again"
    ) from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # drops the lock


def is_registry(path: str | os.PathLike) -> bool:
  return (Path(path) / "index.json").is_file()

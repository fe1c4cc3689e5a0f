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
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Mapping
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


def _sha256_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
  return h.hexdigest()


def _sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _fsync(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
  """fsync every file and directory under ``root`` (and ``root``), children before parents, so that
  a rename of ``root`` made after this cannot outlive a crash with any of its content missing."""
  for p in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
    if not p.is_symlink():
      _fsync(p)
  _fsync(root)


def _mkdir_durable(path: Path) -> None:
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
    _fsync(d.parent)


def _files_under(root: Path) -> list[Path]:
  return sorted(p for p in root.rglob("*") if p.is_file())


def dir_name(name: str) -> str:
  """File-system name of a thoughtlet: ``blocks[0:2)`` -> ``blocks_0_2``."""
  m = re.fullmatch(r"blocks\[(\d+):(\d+)\)", name)
  if m:
    return f"blocks_{m.group(1)}_{m.group(2)}"
  if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
    return name
  return "x" + hashlib.sha3_256(name.encode()).hexdigest()[:16]


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _nest(flat: Mapping[str, Any]) -> dict:
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    parts = path.split("/")
    for key in parts[:-1]:
      node = node.setdefault(key, {})
    node[parts[-1]] = leaf
  return out


def _read_index(root: Path) -> tuple[dict, dict | None]:
  path = root / "index.json"
  try:
    doc = json.loads(path.read_bytes())
  except FileNotFoundError:
    raise RegistryError(
      f"{root} is not a thoughtlet registry (no index.json); create one with `thoughtjax registry build`"
    ) from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise IntegrityError("index", None, str(path), f"not valid JSON ({e})") from None
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
    doc = json.loads((Path(root) / "index.json").read_bytes())
  except (OSError, ValueError):
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
def _writer_lock(root: Path):
  root.mkdir(parents=True, exist_ok=True)
  with open(root / ".lock", "a+") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def is_registry(path: str | os.PathLike) -> bool:
  return (Path(path) / "index.json").is_file()

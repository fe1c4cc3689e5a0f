"""Restore by mapping: a thoughtlet version's arrays, kept in the form a restore returns them, as one page-aligned
file that later restores memory-map instead of reading through Orbax.

The registry's Orbax checkpoints stay the signed, canonical storage. The first verified restore of a version (its
files hashed against the signed manifest on the very bytes Orbax read) writes what it returned, in the requested
weight form and dtype, to ``<cache>/mapped/<key>.tjm``; ``key`` is a SHA-256 over what determines those arrays
(the manifest's file digests, array specs, kind and model config, the form, the dtype and this file format), so
the same content maps to one file whichever registry holds it. The file's own SHA-256 is computed while it is
written and recorded beside it (``<key>.json``) with its identity (device, inode, size, modification and change
time; the change time cannot be set back by a writer) and with the identities of the checkpoint files whose
digests were checked for it (``sources``). That is the one verification per content:

* the mapped form is used for a registry's version only while that version's checkpoint files are the very files
  recorded as checked (a ``stat`` each); a file of it changed or copied elsewhere since is read and checked again
  in full, so tampering with a registry is still detected and named as before, and a checked copy adds its files;
* the mapped file's identity is compared with its record before it is mapped and again after the arrays were taken
  from it, and a file changed in any way (written in place, replaced, truncated) is refused: counted as a
  ``mapped`` refusal in :meth:`Registry.stats <thoughtjax.registry.Registry.stats>`, logged, removed, and the
  version restored from its checkpoint, which writes the file again.

On the CPU backend the restored arrays alias the mapped pages (JAX takes aligned host buffers without a copy), so
a warm restore costs the mapping, not a read, and the pages are the page cache's: dropping the arrays unmaps them.
The mapping is read-only; a change made to the file after a restore mapped it reaches the arrays that alias it, as
any change to a cache directory only its owner can write (it is checked 0700) would reach this process anyway.
Entries are kept under a byte bound (:data:`MAX_BYTES`), least recently restored removed first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from thoughtjax import durable
from thoughtjax.quantized import BlockQuant

log = logging.getLogger(__name__)

FORMAT = 1  # of the file below; part of every key, so a new format never reads an old file
MAGIC = b"TJMAP\x00\x01\n"
PAGE = 4096
SUFFIX, RECORD = ".tjm", ".json"
MAX_BYTES = 8 << 30  # the mapped entries kept in one cache, least recently restored removed first
MAPPED = "mapped"  # the refusal kind RegistryStats counts (``mapped_refusals``)
MAX_SOURCES = 64  # checked file sets recorded per entry (registries holding the same content), newest kept
_BLOCK_FIELDS = ("q", "scale", "min")


class NotMappable(ValueError):
  """A restored tree holds a leaf this format does not keep (it is then restored through Orbax each time)."""


class MappedFileChanged(RuntimeError):
  """A mapped file is not the one its record describes: changed after its verification."""


def content_key(manifest, form: str, dtype) -> str:
  """The key of a version's arrays in ``form`` and ``dtype``: what determines them, hashed."""
  what = {
    "format": FORMAT,
    "files": {rel: spec["sha256"] for rel, spec in sorted(manifest.files.items())},
    "params": manifest.params,
    "kind": manifest.kind.value,
    "config": manifest.config.to_json() if hasattr(manifest.config, "to_json") else repr(manifest.config),
    "form": form,
    "dtype": None if dtype is None else np.dtype(dtype).name,
  }
  return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _identity(st: os.stat_result) -> dict:
  return {
    "dev": st.st_dev,
    "ino": st.st_ino,
    "bytes": st.st_size,
    "mtime_ns": st.st_mtime_ns,
    "ctime_ns": st.st_ctime_ns,
  }


def source_identities(paths) -> dict[str, dict] | None:
  """Path -> identity of each file (not following a link), or None when one cannot be stat'ed."""
  out = {}
  for p in paths:
    try:
      out[str(p)] = _identity(os.stat(p, follow_symlinks=False))
    except OSError:
      return None
  return out


def _leaves(tree: Mapping, prefix: tuple = ()):
  """(path, leaf) of a nested dict whose leaves are arrays or :class:`BlockQuant`, in sorted key order."""
  for k in sorted(tree):
    v = tree[k]
    if not isinstance(k, str):
      raise NotMappable(f"key {k!r} at {'/'.join(prefix)} is not a string")
    if isinstance(v, Mapping):
      yield from _leaves(v, (*prefix, k))
    elif isinstance(v, BlockQuant | jax.Array | np.ndarray):
      yield (*prefix, k), v
    else:
      raise NotMappable(f"{'/'.join((*prefix, k))} is a {type(v).__name__}")


def _layout(params: Mapping) -> tuple[dict, list[np.ndarray], int]:
  """(header, host arrays in file order, file size) of ``params``: each array at a page-aligned offset."""
  entries, arrays = [], []
  offset = 0  # relative to the first data page; fixed up once the header's size is known

  def place(a) -> dict:
    nonlocal offset
    host = np.ascontiguousarray(np.asarray(a))
    spec = {"offset": offset, "dtype": host.dtype.name, "shape": list(host.shape)}
    arrays.append(host)
    offset += -(-host.nbytes // PAGE) * PAGE
    return spec

  for path, leaf in _leaves(params):
    if isinstance(leaf, BlockQuant):
      fields = {f: None if getattr(leaf, f) is None else place(getattr(leaf, f)) for f in _BLOCK_FIELDS}
      entries.append({"path": list(path), "block": leaf.kind, "arrays": fields})
    else:
      entries.append({"path": list(path), "array": place(leaf)})
  header = {"format": FORMAT, "leaves": entries}
  head = len(json.dumps(header, sort_keys=True).encode())
  data_start = -(-(len(MAGIC) + 8 + head + 64) // PAGE) * PAGE  # room for the offsets' digits to grow
  for e in entries:
    for spec in e["arrays"].values() if "block" in e else [e["array"]]:
      if spec is not None:
        spec["offset"] += data_start
  header["data_start"] = data_start
  return header, arrays, data_start + offset


def _nest(entries: list[tuple[list[str], object]]) -> dict:
  out: dict = {}
  for path, leaf in entries:
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf
  return out


class MappedStore:
  """The mapped forms in one directory (``<cache>/mapped``, mode 0700): :meth:`load` and :meth:`save` by key."""

  def __init__(self, directory: str | os.PathLike, max_bytes: int = MAX_BYTES):
    self.dir = Path(directory)
    self.max_bytes = max_bytes

  def _paths(self, key: str) -> tuple[Path, Path]:
    return self.dir / f"{key}{SUFFIX}", self.dir / f"{key}{RECORD}"

  def load(self, key: str, sources: Mapping[str, dict], device=None) -> dict | None:
    """The arrays saved under ``key``, mapped (``device``: where they go; default JAX's first device), or None
    when there is no entry or ``sources`` (:func:`source_identities` of the checkpoint files the caller would
    read) are not files recorded as checked for it. Raises :class:`MappedFileChanged` (the entry removed) when
    the mapped file is not the one its record describes, before or after the arrays were taken from it."""
    data, record = self._paths(key)
    try:
      rec = json.loads(record.read_bytes())
      checked = rec.get("sources", {})
    except FileNotFoundError:
      return None
    except (OSError, ValueError, AttributeError) as e:
      self.remove(key)
      raise MappedFileChanged(f"{record}: unreadable record ({e})") from None
    if not sources or any(checked.get(p) != ident for p, ident in sources.items()):
      return None
    try:
      fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
      self.remove(key)
      raise MappedFileChanged(f"{data}: missing beside its record") from None
    except OSError as e:
      self.remove(key)
      raise MappedFileChanged(f"{data}: cannot be opened as a plain file ({e})") from None
    try:
      self._check(fd, data, rec, "before it was mapped")
      mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
      tree = self._arrays(mm, data, rec, device)
      self._check(fd, data, rec, "while it was mapped")
    except MappedFileChanged:
      self.remove(key)
      raise
    finally:
      os.close(fd)
    with contextlib.suppress(OSError):
      os.utime(record)  # least recently restored goes first (prune)
    return tree

  @staticmethod
  def _check(fd: int, data: Path, rec: dict, when: str) -> None:
    got = _identity(os.fstat(fd))
    want = {k: rec.get(k) for k in got}
    if got != want:
      changed = ", ".join(k for k in got if got[k] != want[k])
      raise MappedFileChanged(f"{data}: changed {when} ({changed} differ from the record made at its verification)")

  @staticmethod
  def _arrays(mm: mmap.mmap, data: Path, rec: dict, device) -> dict:
    if mm[: len(MAGIC)] != MAGIC:
      raise MappedFileChanged(f"{data}: not a mapped-form file")
    (n,) = struct.unpack_from("<Q", mm, len(MAGIC))
    try:
      header = json.loads(mm[len(MAGIC) + 8 : len(MAGIC) + 8 + n])
    except ValueError:
      raise MappedFileChanged(f"{data}: unreadable header") from None
    size = len(mm)

    hosts: list[np.ndarray] = []

    def take(spec):
      if spec is None:
        return None
      dt, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
      count = int(np.prod(shape, dtype=np.int64))
      if spec["offset"] % PAGE or spec["offset"] + count * dt.itemsize > size:
        raise MappedFileChanged(f"{data}: an array lies outside the file")
      hosts.append(np.frombuffer(mm, dt, count, spec["offset"]).reshape(shape))
      return len(hosts) - 1

    leaves = []
    for e in header["leaves"]:
      if "block" in e:
        f = {k: take(s) for k, s in e["arrays"].items()}
        leaves.append((e["path"], e["block"], f))
      else:
        leaves.append((e["path"], None, take(e["array"])))
    on = jax.device_put(hosts, device or jax.devices()[0])  # one call; on the CPU the arrays alias the pages

    def get(i):
      return None if i is None else on[i]

    leaves = [
      (path, BlockQuant(get(f["q"]), get(f["scale"]), get(f["min"]), kind) if kind else get(f))
      for path, kind, f in leaves
    ]
    return _nest(leaves)

  def save(self, key: str, params: Mapping, sources: Mapping[str, dict]) -> bool:
    """Keep ``params`` under ``key``, checked from the files ``sources`` describes: an entry whose file is intact
    gets those files added to its record; otherwise the file is written (its SHA-256 and identity recorded).
    False when the tree holds a leaf this format does not keep or the disk refused (logged; restores then go
    through the checkpoint)."""
    data, record = self._paths(key)
    try:
      with self._locked(), durable.writing(self.dir):
        rec = self._intact(data, record)
        if rec is None:
          try:
            header, arrays, total = _layout(params)
          except NotMappable as e:
            log.debug("not kept mapped: %s", e)
            return False
          tmp = self.dir / f"{durable.TEMP_PREFIX}{key}{SUFFIX}"
          digest = self._write(tmp, header, arrays, total)
          durable.replace(tmp, data)
          rec = {"format": FORMAT, "sha256": digest, **_identity(os.stat(data, follow_symlinks=False))}
        merged = {p: i for p, i in rec.get("sources", {}).items() if p not in sources}
        rec["sources"] = dict([*list(merged.items())[-(MAX_SOURCES - len(sources)) :], *sources.items()])
        durable.write_atomic(record, json.dumps(rec, sort_keys=True).encode())
        self.prune(keep=key)
    except OSError as e:
      log.warning("could not keep the mapped form %s (%s); restores read the checkpoint instead", data, e)
      with contextlib.suppress(OSError):
        (self.dir / f"{durable.TEMP_PREFIX}{key}{SUFFIX}").unlink()
      return False
    return True

  @staticmethod
  def _intact(data: Path, record: Path) -> dict | None:
    """The record of an entry whose file is the one it describes, else None."""
    try:
      rec = json.loads(record.read_bytes())
      st = os.stat(data, follow_symlinks=False)
    except (OSError, ValueError):
      return None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
      return None
    return rec if all(rec.get(k) == v for k, v in _identity(st).items()) else None

  @staticmethod
  def _write(tmp: Path, header: dict, arrays: list[np.ndarray], total: int) -> str:
    h = hashlib.sha256()
    head = json.dumps(header, sort_keys=True).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    with os.fdopen(fd, "wb") as f:

      def put(b) -> None:
        h.update(b)
        f.write(b)

      put(MAGIC + struct.pack("<Q", len(head)) + head)
      pos = len(MAGIC) + 8 + len(head)
      for a, spec in zip(arrays, (s for s in _specs(header)), strict=True):
        put(bytes(spec["offset"] - pos))
        put(memoryview(a).cast("B") if a.nbytes else b"")
        pos = spec["offset"] + a.nbytes
      put(bytes(total - pos))
      f.flush()
      os.fsync(f.fileno())
    return h.hexdigest()

  @contextlib.contextmanager
  def _locked(self):
    fd = os.open(self.dir / ".save.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)

  def remove(self, key: str) -> None:
    for p in self._paths(key):
      with contextlib.suppress(FileNotFoundError):
        p.unlink()

  def prune(self, keep: str | None = None) -> list[str]:
    """Remove the least recently restored entries until the rest fit :attr:`max_bytes` (``keep`` stays)."""
    entries = []
    for rec in self.dir.glob(f"*{RECORD}"):
      key = rec.name[: -len(RECORD)]
      try:
        entries.append((rec.stat().st_mtime_ns, key, (self.dir / f"{key}{SUFFIX}").stat().st_size))
      except FileNotFoundError:
        continue
    total, removed = sum(e[2] for e in entries), []
    for _, key, size in sorted(entries):
      if total <= self.max_bytes:
        break
      if key != keep:
        self.remove(key)  # a process mapping it keeps its pages until it unmaps them
        total -= size
        removed.append(key)
    return removed


def _specs(header: dict):
  """The array specs of ``header`` in file order (the order :func:`_layout` placed them)."""
  for e in header["leaves"]:
    if "block" in e:
      yield from (e["arrays"][f] for f in _BLOCK_FIELDS if e["arrays"][f] is not None)
    else:
      yield e["array"]

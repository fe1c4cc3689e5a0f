"""The thoughtlet registry: a directory of Orbax checkpoints, signed manifests and one index.

Layout::

    DIR/index.json                          {"index": {...}, "signature": {...} | null}
    DIR/thoughtlets/<name>/<version>/checkpoint/   one Orbax checkpoint (the weights)
    DIR/thoughtlets/<name>/<version>/manifest.json signature, profile, hashes, file digests
    DIR/thoughtlets/<name>/<version>/manifest.sig  detached Ed25519 signature (if signed)
    DIR/codec/<digest>/                     tokenizer.json + codec.json (chat template, ids)
    DIR/keys/<key id>.pub                   public keys that signed something here
    DIR/.staging/, DIR/.lock                writer scratch space and lock

A version is the first 16 hex digits of the thoughtlet's ``versioned_hash`` (SHA3-512 over
its canonical signature and weights), so versions are content-addressed and immutable:
a version directory, once in place, never changes. The index names the current version of
each thoughtlet; it is the only file that is ever replaced.

**Atomic updates.** :meth:`Registry.publish` takes the writer lock, writes every new version
under ``.staging/``, verifies what it wrote (file digests, signature, and the versioned hash
recomputed from a restore), renames each version directory into place (new, unreferenced
directories: invisible to readers), then writes the new index beside the old one and swaps it
in with one ``os.replace``. A process killed at any point leaves either the old index (and
possibly unreferenced new directories, reused or collected later) or the new one; readers read
the index once per :meth:`Registry.open`/:meth:`Registry.refresh`, so they see the old or the
new set of versions, never a mix.

**Loud failures.** Every file a restore reads is checked against the SHA-256 digest its signed
manifest lists (SHA-256 rather than SHA3 here because it runs at memory speed with CPU
support; the versioned hash stays SHA3-512). A mismatch raises :class:`IntegrityError` naming
the thoughtlet, version and file, counts it in :meth:`Registry.stats`, and nothing falls back
to another version.

**Lazy restore and residency.** :meth:`Registry.restore` reads one thoughtlet version, straight
into the requested dtype and sharding (Orbax restores into ``jax.ShapeDtypeStruct`` targets that
carry both). Restored weights stay in a resident set, an LRU under an optional byte budget,
with hit/miss/eviction counts.

**Multi-host.** With ``jax.distributed.initialize()`` called first in every process, pass a
``Mesh`` spanning all processes' devices to :meth:`restore` / :func:`thoughtjax.compose.compose`:
Orbax then restores on each process only the shards its devices hold (the SHA-256 file checks
still read each thoughtlet's files whole), the registry directory must be on storage every host
can read (a shared file system: the checks read plain files), and every process must make the
same restore and compose calls in the same order, as with any SPMD program. Publishing is a
single-writer operation (the writer lock is a local ``flock``): run it from one process only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax import signing
from thoughtjax.config import ModelConfig
from thoughtjax.mapping import Mapping as SemanticMapping
from thoughtjax.mapping import load_mapping
from thoughtjax.thoughtlet import (Kind, ProfileSettings, ResourceProfile, SemanticSignature, Thoughtlet,
                                   canonical_json, cut, measure_profile, param_spec, signature_for,
                                   versioned_hash)

FORMAT = "thoughtjax.registry/1"
MANIFEST_FORMAT = "thoughtjax.manifest/1"
VERSION_LEN = 16

StepHook = Callable[[str, "str | None"], None]


# ------------------------------------------------------------------------------ errors
class RegistryError(RuntimeError):
  """A registry cannot be opened, read or updated as asked."""


class IntegrityError(RegistryError):
  """A registry file does not match its signed digest (corruption or tampering)."""

  def __init__(self, thoughtlet: str, version: str | None, file: str, reason: str):
    who = thoughtlet if version is None else f"{thoughtlet}@{version}"
    super().__init__(f"integrity check failed for {who}: file {file}: {reason}. The file was changed "
                     f"after it was published; nothing was loaded from it and no other version is "
                     f"used in its place. Republish the thoughtlet or restore the file from a backup.")
    self.thoughtlet, self.version, self.file, self.reason = thoughtlet, version, file, reason


class UnknownThoughtletError(RegistryError, LookupError):
  """A ref names a thoughtlet or version the registry does not hold."""


class MemoryBudgetError(RegistryError):
  """The thoughtlets one path needs do not fit the resident set's byte budget."""


@dataclasses.dataclass(frozen=True)
class Mismatch:
  thoughtlet: str
  field: str
  declared: float
  measured: float
  tolerance: str

  def __str__(self) -> str:
    return (f"{self.thoughtlet}: {self.field} declared {self.declared:.6g}, measured "
            f"{self.measured:.6g} (tolerance {self.tolerance})")


class ResourceProfileMismatch(RegistryError):
  """Re-measured resource profiles disagree with the declared ones beyond tolerance."""

  def __init__(self, mismatches: Sequence[Mismatch], fingerprint_note: str = ""):
    lines = "\n  ".join(str(m) for m in mismatches)
    super().__init__(f"{len(mismatches)} resource profile value(s) disagree with the manifest:\n  {lines}"
                     + (f"\n{fingerprint_note}" if fingerprint_note else ""))
    self.mismatches = list(mismatches)


# ---------------------------------------------------------------------------- helpers
def _sha256_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      h.update(block)
  return h.hexdigest()


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


def codec_digest(codec) -> str:
  """Hash of everything that fixes token ids: vocabulary, merges, specials, chat template."""
  return hashlib.sha3_256(canonical_json({
      "tokenizer": codec.tokenizer.to_str(), "chat_template": codec.chat_template,
      "bos_id": codec.bos_id, "eos_id": codec.eos_id, "add_bos": codec.add_bos})).hexdigest()[:16]


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _nest(flat: Mapping[str, Any]) -> dict:
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    parts = path.split("/")
    for key in parts[:-1]:
      node = node.setdefault(key, {})
    node[parts[-1]] = leaf
  return out


# ---------------------------------------------------------------------------- sharding
def param_partition(kind: str, path: str, shape: Sequence[int], model_size: int):
  """PartitionSpec of one weight over a ("data", "model") mesh: Megatron-style tensor
  parallelism on the ``model`` axis (heads, FFN width, vocabulary), replicated over ``data``;
  a dimension that the ``model`` axis does not divide is replicated instead."""
  from jax.sharding import PartitionSpec as P

  leaf = path.split("/")[-1]
  axis = None
  if kind == "embed" and leaf == "table":
    axis = 0  # [V, D]: vocabulary-parallel
  elif kind == "head" and leaf == "unembed":
    axis = 0
  elif kind == "blocks":
    axis = {"q": 1, "k": 1, "v": 1, "o": 0, "q_bias": 0, "k_bias": 0, "v_bias": 0,
            "gate": 1, "up": 1, "down": 0}.get(leaf)
  if axis is None or model_size <= 1 or shape[axis] % model_size:
    return P()
  spec = [None] * len(shape)
  spec[axis] = "model"
  return P(*spec)


def _sharding_key(mesh) -> Any:
  if mesh is None:
    return None
  return (tuple(mesh.shape.items()), tuple(int(d.id) for d in mesh.devices.flat))


# ----------------------------------------------------------------------------- manifests
@dataclasses.dataclass(frozen=True)
class Manifest:
  """A thoughtlet version as published (weights not loaded)."""

  name: str
  kind: Kind
  version: str
  versioned_hash: str
  layers: tuple[int, int] | None
  signature: SemanticSignature
  profile: ResourceProfile | None
  config: ModelConfig
  params: Mapping[str, Mapping]  # path -> {shape, dtype}
  files: Mapping[str, Mapping]  # relative path -> {sha256, bytes}
  parent: str | None
  signed_by: str | None
  raw: Mapping[str, Any]

  @property
  def ref(self) -> str:
    return f"{self.name}@{self.version}"

  @property
  def param_bytes(self) -> int:
    return sum(int(np.prod(s["shape"])) * np.dtype(s["dtype"]).itemsize for s in self.params.values())

  def identity(self) -> dict:
    return {"name": self.name, "kind": self.kind.value,
            "layers": None if self.layers is None else list(self.layers),
            "semantic_signature": self.signature.to_json(), "model_config": self.config.to_json()}

  @classmethod
  def from_json(cls, d: Mapping) -> "Manifest":
    if d.get("format") != MANIFEST_FORMAT:
      raise RegistryError(f"manifest format {d.get('format')!r} is not {MANIFEST_FORMAT!r}")
    prof = d.get("resource_profile")
    return cls(d["name"], Kind(d["kind"]), d["version"], d["versioned_hash"],
               None if d.get("layers") is None else tuple(d["layers"]),
               SemanticSignature.from_json(d["semantic_signature"]),
               None if prof is None else ResourceProfile.from_json(prof),
               ModelConfig.from_json(d["model"]["config"]), d["params"], d["files"], d.get("parent"),
               d.get("signed_by"), d)


def _manifest_json(t: Thoughtlet, version: str, vhash: str, files: Mapping, parent: str | None,
                   signed_by: str | None, tokenizer_hash: str) -> dict:
  return {
      "format": MANIFEST_FORMAT, "name": t.name, "kind": t.kind.value, "version": version,
      "versioned_hash": vhash, "layers": None if t.layers is None else list(t.layers),
      "semantic_signature": t.signature.to_json(),
      "resource_profile": None if t.profile is None else t.profile.to_json(),
      "model": {"config": t.config.to_json(), "family": t.config.family_hash, "tokenizer_hash": tokenizer_hash},
      "params": param_spec(t.params), "files": dict(files), "parent": parent, "signed_by": signed_by,
      "created": _now(),
  }


# ---------------------------------------------------------------------------- the cache
@dataclasses.dataclass
class RegistryStats:
  hits: int = 0
  misses: int = 0
  evictions: int = 0
  restores: int = 0
  restored_bytes: int = 0
  resident_bytes: int = 0
  budget_bytes: int | None = None
  integrity_failures: int = 0
  signature_failures: int = 0
  failures: list = dataclasses.field(default_factory=list)  # {"thoughtlet", "file", "reason"}
  restore_seconds: dict = dataclasses.field(default_factory=dict)  # "name@version" -> s
  resident: list = dataclasses.field(default_factory=list)  # "name@version", LRU first

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class _Resident:
  params: dict
  nbytes: int
  ref: str


class ResidentSet:
  """Restored thoughtlets kept in memory: an LRU under an optional byte budget."""

  def __init__(self, budget_bytes: int | None = None):
    self.budget = budget_bytes
    self._entries: collections.OrderedDict[tuple, _Resident] = collections.OrderedDict()

  @property
  def nbytes(self) -> int:
    return sum(e.nbytes for e in self._entries.values())

  def get(self, key: tuple) -> _Resident | None:
    entry = self._entries.get(key)
    if entry is not None:
      self._entries.move_to_end(key)
    return entry

  def make_room(self, need: int, pinned: set, what: str) -> list[_Resident]:
    """Evict least recently used unpinned entries until ``need`` more bytes fit."""
    if self.budget is None:
      return []
    pinned_bytes = sum(e.nbytes for k, e in self._entries.items() if k in pinned)
    if need + pinned_bytes > self.budget:
      raise MemoryBudgetError(
          f"{what} needs {need + pinned_bytes} bytes of weights resident at once but the registry's "
          f"memory budget is {self.budget} bytes; raise memory_budget or use a shorter path")
    evicted = []
    for key in list(self._entries):
      if self.nbytes + need <= self.budget:
        break
      if key not in pinned:
        evicted.append(self._entries.pop(key))
    return evicted

  def put(self, key: tuple, entry: _Resident) -> None:
    self._entries[key] = entry
    self._entries.move_to_end(key)

  def clear(self) -> int:
    n = len(self._entries)
    self._entries.clear()
    return n

  def refs(self) -> list[str]:
    return [e.ref for e in self._entries.values()]


# ---------------------------------------------------------------------------- registry
class Registry:
  """A registry directory opened for reading (and, with :meth:`publish`, writing)."""

  def __init__(self, root: str | os.PathLike, *, trusted_keys: Iterable | None = None,
               memory_budget: int | None = None, verify_files: bool = True,
               require_signatures: bool | None = None):
    self.root = Path(root).absolute()  # Orbax takes absolute paths only
    self._explicit_trust = trusted_keys is not None
    self._trusted = {} if trusted_keys is None else _load_keys(trusted_keys)
    self.require_signatures = self._explicit_trust if require_signatures is None else require_signatures
    self.verify_files = verify_files
    self._resident = ResidentSet(memory_budget)
    self._stats = RegistryStats(budget_bytes=memory_budget)
    self._lock = threading.RLock()
    self._codec = None
    self.refresh()

  @classmethod
  def open(cls, root: str | os.PathLike, **kwargs) -> "Registry":
    return cls(root, **kwargs)

  # ---- index ------------------------------------------------------------------------
  def refresh(self) -> None:
    """Read the index again (one read: a consistent snapshot of current versions)."""
    body, sig = _read_index(self.root)
    self._check_signature(canonical_json(body), sig, "index.json", None)
    self._index = body
    self.config = ModelConfig.from_json(body["model"]["config"])

  @property
  def generation(self) -> int:
    return int(self._index["generation"])

  @property
  def names(self) -> list[str]:
    return list(self._index["order"])

  @property
  def current(self) -> dict[str, str]:
    return {n: e["version"] for n, e in self._index["current"].items()}

  @property
  def tokenizer_hash(self) -> str:
    return self._index["codec"]["digest"]

  def block_spans(self) -> dict[tuple[int, int], str]:
    """Layer span -> name of the current block thoughtlets (from the index alone)."""
    return {tuple(e["layers"]): n for n, e in self._index["current"].items() if e.get("layers")}

  def versions(self, name: str) -> list[str]:
    self._known(name)
    return list(self._index["history"].get(name, []))

  def _known(self, name: str) -> None:
    if name not in self._index["current"]:
      raise UnknownThoughtletError(f"the registry at {self.root} has no thoughtlet {name!r}; it has "
                                   f"{', '.join(self.names)}")

  def resolve(self, name: str, version: str | None = None) -> str:
    """The full version of ``name`` for ``version`` (a unique prefix), or the current one."""
    self._known(name)
    if version is None:
      return self._index["current"][name]["version"]
    found = [v for v in self._index["history"][name] if v.startswith(version)]
    if len(found) != 1:
      raise UnknownThoughtletError(
          f"{name}@{version}: {'no' if not found else 'more than one'} published version matches; "
          f"versions of {name}: {', '.join(self._index['history'][name])}")
    return found[0]

  def version_dir(self, name: str, version: str) -> Path:
    return self.root / "thoughtlets" / dir_name(name) / version

  # ---- keys and signatures --------------------------------------------------------------
  def _keys(self) -> dict:
    if self._explicit_trust:
      return self._trusted
    keys = {}
    for p in sorted((self.root / "keys").glob("*.pub")):
      k = signing.load_public_key(p)
      keys[signing.key_id(k)] = k
    return keys

  def _check_signature(self, message: bytes, record: dict | None, what: str, thoughtlet: str | None) -> bool:
    """True if signed and verified; False if unsigned and signatures are optional."""
    if record is None:
      if self.require_signatures:
        self._count_failure(thoughtlet or what, what, "unsigned, but signatures are required", sig=True)
        raise signing.SignatureError(f"{what} is not signed, but this registry was opened with trusted "
                                     f"keys; sign it with `thoughtjax registry build --sign-key`")
      return False
    try:
      signing.verify(self._keys(), message, signing.SignatureRecord.from_json(record), what)
    except signing.SignatureError as e:
      self._count_failure(thoughtlet or what, what, str(e), sig=True)
      raise
    return True

  def _count_failure(self, thoughtlet: str, file: str, reason: str, sig: bool = False) -> None:
    with self._lock:
      if sig:
        self._stats.signature_failures += 1
      else:
        self._stats.integrity_failures += 1
      self._stats.failures.append({"thoughtlet": thoughtlet, "file": file, "reason": reason})

  # ---- manifests ------------------------------------------------------------------------
  def manifest(self, name: str, version: str | None = None, *, check: bool = True) -> Manifest:
    """The manifest of a version, its detached signature checked."""
    version = self.resolve(name, version)
    vdir = self.version_dir(name, version)
    ref = f"{name}@{version}"
    try:
      raw_bytes = (vdir / "manifest.json").read_bytes()
      raw = json.loads(raw_bytes)
    except FileNotFoundError:
      self._count_failure(ref, "manifest.json", "missing")
      raise IntegrityError(name, version, str(vdir / "manifest.json"), "the file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      self._count_failure(ref, "manifest.json", f"unreadable: {e}")
      raise IntegrityError(name, version, str(vdir / "manifest.json"), f"not valid JSON ({e})") from None
    sig_path = vdir / "manifest.sig"
    record = json.loads(sig_path.read_bytes()) if sig_path.exists() else None
    if check:
      self._check_signature(canonical_json(raw), record, f"{ref} manifest.json", ref)
    m = Manifest.from_json(raw)
    if (m.name, m.version) != (name, version) or not m.versioned_hash.startswith(version):
      self._count_failure(ref, "manifest.json", "names another thoughtlet or version")
      raise IntegrityError(name, version, str(vdir / "manifest.json"),
                           f"it describes {m.name}@{m.version}, not {ref}")
    return m

  def manifests(self) -> list[Manifest]:
    return [self.manifest(n) for n in self.names]

  def _check_files(self, m: Manifest, vdir: Path) -> None:
    listed = {rel: spec for rel, spec in m.files.items()}
    present = {str(p.relative_to(vdir)) for p in _files_under(vdir / "checkpoint")}
    for rel in sorted(present - set(listed)):
      self._count_failure(m.ref, rel, "not listed in the manifest")
      raise IntegrityError(m.name, m.version, str(vdir / rel), "the file is not listed in the signed manifest")

    def digest(rel):
      p = vdir / rel
      if not p.exists():
        return rel, None
      return rel, _sha256_file(p)

    workers = min(8, max(1, len(listed)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      results = dict(pool.map(digest, sorted(listed)))
    for rel in sorted(listed):
      got = results[rel]
      if got is None:
        self._count_failure(m.ref, rel, "missing")
        raise IntegrityError(m.name, m.version, str(vdir / rel), "the file is missing")
      if got != listed[rel]["sha256"]:
        self._count_failure(m.ref, rel, "sha256 mismatch")
        raise IntegrityError(m.name, m.version, str(vdir / rel),
                             f"sha256 {got[:16]}... does not match the manifest's {listed[rel]['sha256'][:16]}...")

  # ---- restore --------------------------------------------------------------------------
  def _target(self, m: Manifest, dtype, mesh):
    from jax.sharding import NamedSharding, SingleDeviceSharding

    flat = {}
    model_size = 1 if mesh is None else int(mesh.shape.get("model", 1))
    if mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
      raise RegistryError(
          "the mesh has Explicit axes; thoughtjax's model leaves sharding to XLA's propagation, so build the "
          "mesh with Auto axes: jax.sharding.Mesh(devices, ('data', 'model')) or "
          "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)")
    for path, spec in m.params.items():
      dt = np.dtype(spec["dtype"])
      if dtype is not None and np.issubdtype(dt, np.floating):
        dt = np.dtype(dtype)
      if mesh is None:
        sharding = SingleDeviceSharding(jax.devices()[0])
      else:
        sharding = NamedSharding(mesh, param_partition(m.kind.value, path, spec["shape"], model_size))
      flat[path] = jax.ShapeDtypeStruct(tuple(spec["shape"]), dt, sharding=sharding)
    return _nest(flat)

  @staticmethod
  def _key(name: str, version: str, dtype, mesh) -> tuple:
    return (name, version, None if dtype is None else np.dtype(dtype).name, _sharding_key(mesh))

  def restore(self, name: str, version: str | None = None, *, dtype=None, mesh=None,
              pinned: set | None = None) -> dict:
    """The weights of one thoughtlet version as a nested dict of arrays (from the resident
    set if there, else read, checked and restored into ``dtype`` and ``mesh`` sharding)."""
    version = self.resolve(name, version)
    key = self._key(name, version, dtype, mesh)
    with self._lock:
      entry = self._resident.get(key)
      if entry is not None:
        self._stats.hits += 1
        return entry.params
      self._stats.misses += 1
      m = self.manifest(name, version)
      target = self._target(m, dtype, mesh)
      need = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(target))
      for _ in self._resident.make_room(need, set(pinned or ()) | {key}, m.ref):
        self._stats.evictions += 1
    params, seconds = self._read(m, target)  # outside the lock: restores may overlap
    with self._lock:
      self._stats.restore_seconds[m.ref] = seconds
      self._stats.restores += 1
      self._stats.restored_bytes += need
      entry = self._resident.get(key)
      if entry is not None:  # another thread restored it meanwhile; keep one copy
        return entry.params
      self._resident.put(key, _Resident(params, need, m.ref))
      return params

  def _read(self, m: Manifest, target) -> tuple[dict, float]:
    """Check a version's files against its manifest, then restore it with Orbax."""
    t0 = time.perf_counter()
    vdir = self.version_dir(m.name, m.version)
    if self.verify_files:
      self._check_files(m, vdir)
    try:
      params = jax.block_until_ready(_restore_checkpoint(_checkpointer(), vdir / "checkpoint", target))
    except Exception as e:  # corrupt data that slipped past disabled file checks
      self._count_failure(m.ref, "checkpoint", f"restore failed: {e}")
      raise IntegrityError(m.name, m.version, str(vdir / "checkpoint"), f"Orbax could not restore it: {e}") from e
    return params, time.perf_counter() - t0

  def restore_many(self, units: Sequence[tuple[str, str | None]], *, dtype=None, mesh=None,
                   workers: int = 4) -> list[dict]:
    """Restore several versions that must be resident together (one path), up to ``workers``
    at a time; the byte budget is checked for all of them before anything is read."""
    with self._lock:
      resolved = [(n, self.resolve(n, v)) for n, v in units]
      keyed = {self._key(n, v, dtype, mesh) for n, v in resolved}
      missing = [u for u in dict.fromkeys(resolved) if self._resident.get(self._key(*u, dtype, mesh)) is None]
      if self._resident.budget is not None:
        need = 0
        for n, v in missing:
          m = self.manifest(n, v)
          need += sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self._target(m, dtype, None)))
        for _ in self._resident.make_room(need, keyed, "this path"):
          self._stats.evictions += 1
    if len(missing) > 1 and workers > 1:
      with concurrent.futures.ThreadPoolExecutor(min(workers, len(missing))) as pool:
        futures = [pool.submit(self.restore, n, v, dtype=dtype, mesh=mesh, pinned=keyed) for n, v in missing]
        for f in futures:
          f.result()
    return [self.restore(n, v, dtype=dtype, mesh=mesh, pinned=keyed) for n, v in resolved]

  def thoughtlet(self, name: str, version: str | None = None) -> Thoughtlet:
    """A published version as a :class:`Thoughtlet` (weights restored), e.g. to derive a new one."""
    m = self.manifest(name, version)
    params = self.restore(name, m.version)
    return Thoughtlet(m.name, m.kind, m.signature, params, m.config, m.layers, m.profile)

  def evict_all(self) -> None:
    with self._lock:
      self._stats.evictions += self._resident.clear()

  def stats(self) -> RegistryStats:
    with self._lock:
      s = dataclasses.replace(self._stats, failures=list(self._stats.failures),
                              restore_seconds=dict(self._stats.restore_seconds))
      s.resident_bytes = self._resident.nbytes
      s.resident = self._resident.refs()
      return s

  # ---- codec ----------------------------------------------------------------------------
  @property
  def codec(self):
    if self._codec is None:
      from tokenizers import Tokenizer

      from thoughtjax.tokenizer import TextCodec

      entry = self._index["codec"]
      cdir = self.root / entry["dir"]
      for rel, digest in entry["files"].items():
        p = cdir / rel
        if not p.exists() or _sha256_file(p) != digest:
          self._count_failure("codec", rel, "sha256 mismatch" if p.exists() else "missing")
          raise IntegrityError("codec", None, str(p), "does not match the digest in the signed index")
      meta = json.loads((cdir / "codec.json").read_text())
      self._codec = TextCodec(Tokenizer.from_file(str(cdir / "tokenizer.json")), meta["chat_template"],
                              meta["bos_id"], meta["eos_id"], meta["add_bos"])
    return self._codec

  # ---- publishing -------------------------------------------------------------------------
  def publish(self, thoughtlets: Sequence[Thoughtlet], *, sign_key=None, on_step: StepHook | None = None,
              settings: ProfileSettings | None = ProfileSettings()) -> dict[str, str]:
    """Publish new versions atomically and make them current; returns name -> version.

    Thoughtlets without a profile are measured first (``settings``; None publishes them
    unprofiled). Each replaces the current version of its name; its input and output
    types must stay those of the current version.
    """
    thoughtlets = list(thoughtlets)
    for t in thoughtlets:
      self._known(t.name)
      cur = self.manifest(t.name)
      if t.config != self.config:
        raise RegistryError(f"{t.name}: the new version was cut from another model config; this registry "
                            f"holds {self.config}")
      for side in ("input", "output"):
        want, got = getattr(cur.signature, side), getattr(t.signature, side)
        if want != got:
          raise RegistryError(f"{t.name}: a new version must keep the {side} type {want}; got {got}. "
                              f"Paths through {t.name} would no longer compose")
    if settings is not None and any(t.profile is None for t in thoughtlets):
      table = None
      if any(t.kind is Kind.TEMPLATE or (t.kind is Kind.HEAD and self.config.tie_embeddings) for t in thoughtlets):
        new_embed = [t for t in thoughtlets if t.kind is Kind.EMBED]
        table = (new_embed[0].params if new_embed else self.restore("embed"))["table"]
      thoughtlets = [t if t.profile is not None else
                     dataclasses.replace(t, profile=measure_profile(t, settings, table)) for t in thoughtlets]
    versions = _publish(self.root, thoughtlets, sign_key=sign_key, on_step=on_step, model=None, codec=None)
    self.refresh()
    return versions

  # ---- verification -----------------------------------------------------------------------
  def verify(self, *, hardware: bool = False, all_versions: bool = False,
             tolerance: "Tolerance | None" = None, settings: ProfileSettings | None = None,
             deep: bool = True) -> "VerifyReport":
    """Check every (current, or every published) version: file digests, signatures and the
    versioned hash recomputed from the restored weights. With ``hardware``, re-measure
    profiles and raise :class:`ResourceProfileMismatch` where they disagree."""
    report = VerifyReport(root=str(self.root), generation=self.generation,
                          index_signed=self._index_signed())
    self.codec  # digests of the tokenizer files
    todo = [(n, v) for n in self.names for v in (self.versions(n) if all_versions else [self.resolve(n)])]
    for name, version in todo:
      m = self.manifest(name, version)
      self._check_files(m, self.version_dir(name, version))
      status = {"ref": m.ref, "signed_by": m.signed_by, "files": len(m.files)}
      if deep:
        params = self.restore(name, version)
        got = versioned_hash(m.identity(), params)
        if got != m.versioned_hash:
          self._count_failure(m.ref, "checkpoint", "versioned hash mismatch")
          raise IntegrityError(name, version, str(self.version_dir(name, version) / "checkpoint"),
                               f"the restored weights hash to {got[:16]}..., the manifest says "
                               f"{m.versioned_hash[:16]}...")
        status["versioned_hash"] = "ok"
      report.thoughtlets.append(status)
    if hardware:
      report.mismatches = self.verify_hardware(tolerance or Tolerance(), settings)
    return report

  def _index_signed(self) -> bool:
    _, sig = _read_index(self.root)
    return sig is not None

  def verify_hardware(self, tolerance: "Tolerance", settings: ProfileSettings | None = None,
                      names: Sequence[str] | None = None, raise_on_mismatch: bool = True) -> list[Mismatch]:
    """Re-measure the current versions' profiles on this machine and compare."""
    mismatches: list[Mismatch] = []
    notes = set()
    table = None
    for name in names or self.names:
      m = self.manifest(name)
      if m.profile is None:
        mismatches.append(Mismatch(m.ref, "resource_profile", float("nan"), float("nan"), "manifest has none"))
        continue
      t = self.thoughtlet(name)
      if table is None and (t.kind is Kind.TEMPLATE or (t.kind is Kind.HEAD and self.config.tie_embeddings)):
        table = self.restore("embed")["table"]
      d = m.profile
      s = settings or ProfileSettings(batch=d.batch, context=d.context)
      got = measure_profile(t, s, table)
      for fp_key in ("platform", "device_kind", "cpu", "jax", "jaxlib"):
        if d.fingerprint.get(fp_key) != got.fingerprint.get(fp_key):
          notes.add(f"{fp_key}: declared {d.fingerprint.get(fp_key)!r}, here {got.fingerprint.get(fp_key)!r}")
      mismatches.extend(tolerance.compare(m.ref, d, got))
    if mismatches and raise_on_mismatch:
      note = ("The profiles were measured on different hardware/software (" + "; ".join(sorted(notes))
              + "); re-run `thoughtjax registry build` here to re-profile.") if notes else ""
      raise ResourceProfileMismatch(mismatches, note)
    return mismatches


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Relative tolerances of ``verify --hardware``; ``None`` skips a field.

  Parameter bytes must match exactly. Latency is compared as a ratio: measured/declared
  must lie in ``[1/(1+latency), 1+latency]``, unless the two differ by less than
  ``latency_floor_s`` (timer and scheduler noise swamp microsecond-scale steps).
  """

  flops: float | None = 0.02
  peak_memory: float | None = 0.25
  latency: float | None = 1.0
  latency_floor_s: float = 1e-4

  def compare(self, ref: str, d: ResourceProfile, got: ResourceProfile) -> list[Mismatch]:
    out = []
    if d.param_bytes != got.param_bytes:
      out.append(Mismatch(ref, "param_bytes", d.param_bytes, got.param_bytes, "exact"))

    def rel(field, tol):
      a, b = float(getattr(d, field)), float(getattr(got, field))
      if tol is not None and abs(a - b) > tol * max(abs(a), 1e-30):
        out.append(Mismatch(ref, field, a, b, f"±{tol:.0%}"))

    rel("flops_per_token", self.flops)
    rel("peak_memory_bytes", self.peak_memory)
    if self.latency is not None:
      a, b = d.latency_mean_s, got.latency_mean_s
      ratio = b / a if a > 0 else float("inf")
      if abs(b - a) > self.latency_floor_s and not (1 / (1 + self.latency) <= ratio <= 1 + self.latency):
        out.append(Mismatch(ref, "latency_mean_s", a, b, f"x{1 + self.latency:g}"))
    return out


@dataclasses.dataclass
class VerifyReport:
  root: str
  generation: int
  index_signed: bool
  thoughtlets: list = dataclasses.field(default_factory=list)
  mismatches: list = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- index I/O
def _read_index(root: Path) -> tuple[dict, dict | None]:
  path = root / "index.json"
  try:
    doc = json.loads(path.read_bytes())
  except FileNotFoundError:
    raise RegistryError(f"{root} is not a thoughtlet registry (no index.json); create one with "
                        f"`thoughtjax registry build`") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise IntegrityError("index", None, str(path), f"not valid JSON ({e})") from None
  body = doc.get("index") if isinstance(doc, dict) else None
  if not isinstance(body, dict) or body.get("format") != FORMAT:
    raise RegistryError(f"{path}: not a {FORMAT} index")
  return body, doc.get("signature")


def _load_keys(keys: Iterable) -> dict:
  out = {}
  for k in keys:
    if not hasattr(k, "verify"):
      k = signing.load_public_key(k)
    out[signing.key_id(k)] = k
  return out


@contextlib.contextmanager
def _writer_lock(root: Path):
  root.mkdir(parents=True, exist_ok=True)
  with open(root / ".lock", "a+") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _checkpointer():
  """A synchronous Orbax PyTree checkpointer (OCDBT). Uncompressed: weights barely compress,
  and zstd decoding made restores 2-3x slower than reading the bytes (BENCHMARKS.md)."""
  import orbax.checkpoint as ocp

  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _restore_checkpoint(ckptr, path: Path, target):
  """Restore straight into ``target``'s dtypes and shardings (``jax.ShapeDtypeStruct`` leaves)."""
  import orbax.checkpoint as ocp

  return ckptr.restore(path, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))


def _save_checkpoint(path: Path, params: Mapping) -> None:
  import orbax.checkpoint as ocp

  tree = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), dict(params))
  _checkpointer().save(path, args=ocp.args.PyTreeSave(tree))


def _stage_codec(staging: Path, codec) -> tuple[str, dict]:
  digest = codec_digest(codec)
  cdir = staging / "codec" / digest
  cdir.mkdir(parents=True)
  _write_file(cdir / "tokenizer.json", codec.tokenizer.to_str().encode())
  _write_file(cdir / "codec.json", canonical_json({
      "chat_template": codec.chat_template, "bos_id": codec.bos_id, "eos_id": codec.eos_id,
      "add_bos": codec.add_bos}))
  return digest, {p.name: _sha256_file(p) for p in _files_under(cdir)}


def _publish(root: Path, thoughtlets: Sequence[Thoughtlet], *, sign_key, on_step: StepHook | None,
             model: dict | None, codec, order: Sequence[str] | None = None,
             mapping_text: str | None = None) -> dict[str, str]:
  """Stage, verify, rename into place, then switch the index (see the module docstring)."""
  step = on_step or (lambda event, name: None)
  key = signing.load_private_key(sign_key) if isinstance(sign_key, (str, os.PathLike)) else sign_key
  key_id = None if key is None else signing.key_id(key.public_key())
  root = Path(root).absolute()  # Orbax takes absolute paths only
  with _writer_lock(root):
    staging_root = root / ".staging"
    shutil.rmtree(staging_root, ignore_errors=True)  # only a dead writer leaves anything here
    staging = staging_root / uuid.uuid4().hex
    staging.mkdir(parents=True)
    old = None if not (root / "index.json").exists() else _read_index(root)[0]
    if old is None and (model is None or codec is None):
      raise RegistryError(f"{root} is not a registry yet; build it first")
    if old is not None and model is not None and old["model"]["config"] != model["config"]:
      raise RegistryError(f"{root} holds thoughtlets of another model ({old['model']['config']}); "
                          f"build into an empty directory")
    tok_hash = codec_digest(codec) if codec is not None else old["codec"]["digest"]
    codec_entry = None
    if codec is not None:
      digest, files = _stage_codec(staging, codec)
      codec_entry = {"dir": f"codec/{digest}", "digest": digest, "files": files}

    staged: list[tuple[Thoughtlet, str, Path]] = []
    versions: dict[str, str] = {}
    for t in thoughtlets:
      vhash = t.versioned_hash()
      version = vhash[:VERSION_LEN]
      versions[t.name] = version
      final = root / "thoughtlets" / dir_name(t.name) / version
      if final.exists():  # content-addressed: this exact version is already published
        staged.append((t, version, final))
        continue
      vdir = staging / "thoughtlets" / dir_name(t.name) / version
      vdir.mkdir(parents=True)
      step("stage:start", t.name)
      _save_checkpoint(vdir / "checkpoint", t.params)
      step("stage:checkpoint", t.name)
      files = {str(p.relative_to(vdir)): {"sha256": _sha256_file(p), "bytes": p.stat().st_size}
               for p in _files_under(vdir / "checkpoint")}
      parent = None if old is None or t.name not in old["current"] else old["current"][t.name]["version"]
      manifest = _manifest_json(t, version, vhash, files, parent, key_id, tok_hash)
      _write_file(vdir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
      if key is not None:
        _write_file(vdir / "manifest.sig", canonical_json(signing.sign(key, canonical_json(manifest)).to_json()))
      step("stage:manifest", t.name)
      staged.append((t, version, vdir))

    # Verify what is about to become visible: digests, signature, weights as restored.
    keys = {} if key is None else {key_id: key.public_key()}
    for t, version, vdir in staged:
      _verify_version_dir(vdir, t.name, version, keys)
      step("verify", t.name)

    # Commit: new version directories first (unreferenced, so invisible), then the index.
    if codec_entry is not None and not (root / codec_entry["dir"]).exists():
      (root / "codec").mkdir(exist_ok=True)
      os.rename(staging / codec_entry["dir"], root / codec_entry["dir"])
    if key is not None:
      (root / "keys").mkdir(exist_ok=True)
      pub = root / "keys" / f"{key_id}.pub"
      if not pub.exists():  # readers list this directory: the file appears whole or not at all
        _write_file(staging / f"{key_id}.pub", signing.public_pem(key.public_key()))
        os.replace(staging / f"{key_id}.pub", pub)
    for t, version, vdir in staged:
      final = root / "thoughtlets" / dir_name(t.name) / version
      if vdir != final:
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
          os.rename(vdir, final)
        except OSError:
          if not final.exists():
            raise
        _fsync(final.parent)
      step("commit:version", t.name)

    body = _next_index(old, staged, model, codec_entry, order, mapping_text)
    doc = {"index": body, "signature": None if key is None else signing.sign(key, canonical_json(body)).to_json()}
    tmp = staging / "index.json"
    _write_file(tmp, json.dumps(doc, indent=1, sort_keys=True).encode())
    step("commit:index-written", None)
    os.replace(tmp, root / "index.json")
    _fsync(root)
    step("commit:index", None)
    shutil.rmtree(staging_root, ignore_errors=True)
  return versions


def _next_index(old: dict | None, staged, model, codec_entry, order, mapping_text) -> dict:
  if old is None:
    body = {"format": FORMAT, "generation": 0, "model": model, "codec": codec_entry,
            "order": list(order or []), "current": {}, "history": {}}
  else:
    body = json.loads(json.dumps(old))
    if codec_entry is not None:
      body["codec"] = codec_entry
  body["generation"] = int(body["generation"]) + 1
  for t, version, _ in staged:
    body["current"][t.name] = {"version": version, "dir": f"thoughtlets/{dir_name(t.name)}/{version}",
                               "kind": t.kind.value, "layers": None if t.layers is None else list(t.layers)}
    hist = body["history"].setdefault(t.name, [])
    if version in hist:
      hist.remove(version)
    hist.append(version)
    if t.name not in body["order"]:
      body["order"].append(t.name)
  if mapping_text is not None:
    body["mapping_sha3_256"] = hashlib.sha3_256(mapping_text.encode()).hexdigest()
  body["published"] = _now()
  return body


def _verify_version_dir(vdir: Path, name: str, version: str, keys: dict) -> None:
  """Staged-version check: digests, signature, and the versioned hash of a fresh restore."""
  raw = json.loads((vdir / "manifest.json").read_bytes())
  sig = vdir / "manifest.sig"
  if keys:
    signing.verify(keys, canonical_json(raw), signing.SignatureRecord.from_json(json.loads(sig.read_bytes())),
                   f"{name}@{version} manifest.json (staged)")
  m = Manifest.from_json(raw)
  for rel, spec in m.files.items():
    if _sha256_file(vdir / rel) != spec["sha256"]:
      raise IntegrityError(name, version, str(vdir / rel), "staged file changed before commit")
  target = _nest({p: jax.ShapeDtypeStruct(tuple(s["shape"]), np.dtype(s["dtype"])) for p, s in m.params.items()})
  params = _restore_checkpoint(_checkpointer(), vdir / "checkpoint", target)
  if versioned_hash(m.identity(), params) != m.versioned_hash:
    raise IntegrityError(name, version, str(vdir / "checkpoint"), "staged weights do not hash to the version")


# ---------------------------------------------------------------------------------- build
def cut_thoughtlets(model, codec, mapping: SemanticMapping) -> list[Thoughtlet]:
  """One unprofiled thoughtlet per mapping entry, weights taken from ``model``."""
  cfg = model.cfg
  mapping.check_model(cfg.num_layers)
  tok = codec_digest(codec)
  out = []
  for e in mapping.entries:
    kind = Kind(e.kind)
    sig = signature_for(kind, cfg, tok, layers=e.layers, max_context=e.constraint_dict.get("max_context"),
                        tags=e.tags, description=e.description)
    params = cut(model, kind, layers=e.layers, codec=codec, system=e.system)
    if kind is Kind.TEMPLATE:
      sig = dataclasses.replace(sig, constraints={**sig.constraints, "system": e.system,
                                                  "prefix_len": int(params["prefix_ids"].shape[0]),
                                                  "suffix_len": int(params["suffix_ids"].shape[0])})
    out.append(Thoughtlet(e.name, kind, sig, params, cfg, e.layers))
  return out


def build(out: str | os.PathLike, mapping: str | os.PathLike | SemanticMapping, model, *, codec=None,
          sign_key=None, settings: ProfileSettings | None = ProfileSettings(),
          progress: Callable[[str, str, int, int], None] | None = None, source: str | None = None,
          source_hash: str | None = None) -> Registry:
  """Cut ``model`` along ``mapping``, profile every thoughtlet and publish them to ``out``.

  ``model`` is a known model name or path (loaded with :func:`thoughtjax.loading.load`), a
  :class:`~thoughtjax.loading.LoadedModel`, or a :class:`~thoughtjax.model.Transformer` with
  ``codec`` given. Building into an existing registry of the same model publishes the changed
  thoughtlets as new versions (one atomic index switch); unchanged ones keep their version.
  """
  from thoughtjax.loading import LoadedModel
  from thoughtjax.loading import load as load_model
  from thoughtjax.model import Transformer

  report = progress or (lambda stage, name, i, n: None)
  if isinstance(model, (str, os.PathLike)):
    report("load", str(model), 0, 1)
    name = str(model)
    model = load_model(model)
    report("load", name, 1, 1)
  if isinstance(model, LoadedModel):
    codec = codec or model.codec
    source, source_hash = source or model.source, source_hash or model.source_hash
    model = model.model
  if not isinstance(model, Transformer) or codec is None:
    raise TypeError("build needs a model name/path, a LoadedModel, or a Transformer together with codec=")
  cfg = model.cfg
  if not isinstance(mapping, SemanticMapping):
    mapping = load_mapping(mapping, cfg.num_layers)
  units = cut_thoughtlets(model, codec, mapping)
  n = len(units)
  if settings is not None:
    table = model.embed.table[...]
    profiled = []
    for i, t in enumerate(units):
      report("profile", t.name, i, n)
      profiled.append(dataclasses.replace(t, profile=measure_profile(t, settings, table)))
    units = profiled
  counter = {"stage:checkpoint": 0, "verify": 0, "commit:version": 0}

  def on_step(event, name):
    if event in counter:
      counter[event] += 1
      report({"stage:checkpoint": "write", "verify": "verify", "commit:version": "commit"}[event],
             name, counter[event], n)

  model_info = {"config": cfg.to_json(), "family": cfg.family_hash, "source": source or "in-memory model",
                "source_hash": source_hash}
  _publish(Path(out), units, sign_key=sign_key, on_step=on_step, model=model_info, codec=codec,
           order=[t.name for t in units], mapping_text=mapping.text)
  report("done", "", n, n)
  return Registry(out)


def collect_garbage(root: str | os.PathLike, *, keep: int = 2, dry_run: bool = False) -> list[Path]:
  """Remove version directories that are not among the last ``keep`` published versions of
  their thoughtlet (the current one always stays), and directories of versions that never
  became current (left by a writer that died before switching the index).

  Readers that opened the registry before an update may still restore an old version; run
  this only when no such reader needs versions older than ``keep``.
  """
  if keep < 1:
    raise ValueError(f"keep must be >= 1 (the current version always stays), got {keep}")
  root = Path(root).absolute()
  removed = []
  with _writer_lock(root):
    body, _ = _read_index(root)
    live = set()
    for name, hist in body["history"].items():
      live.update((dir_name(name), v) for v in hist[-keep:])
      live.add((dir_name(name), body["current"][name]["version"]))
    for vdir in sorted((root / "thoughtlets").glob("*/*")):
      if (vdir.parent.name, vdir.name) not in live:
        removed.append(vdir)
        if not dry_run:
          # Rename first so a half-deleted directory is never mistaken for a version.
          doomed = root / ".staging" / f"gc-{uuid.uuid4().hex}"
          doomed.parent.mkdir(exist_ok=True)
          os.rename(vdir, doomed)
          shutil.rmtree(doomed)
  return removed


def is_registry(path: str | os.PathLike) -> bool:
  return (Path(path) / "index.json").is_file()

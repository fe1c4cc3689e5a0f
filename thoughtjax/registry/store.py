"""The read-only view of a registry: index, manifests, signatures, lazy verified restores.

A reader reads the index once per :meth:`Registry.open`/:meth:`Registry.refresh`, so it sees
one consistent set of current versions. Every file a restore reads is checked against the
SHA-256 digest its signed manifest lists (SHA-256 rather than SHA3 here because it runs at
memory speed with CPU support; the versioned hash stays SHA3-512). A mismatch raises
:class:`IntegrityError` naming the thoughtlet, version and file, counts it in
:meth:`Registry.stats`, and nothing falls back to another version.

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

import concurrent.futures
import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Sequence

import jax
import numpy as np

from thoughtjax import signing
from thoughtjax.config import ModelConfig
from thoughtjax.registry.checkpoint import _checkpointer, _restore_checkpoint
from thoughtjax.registry.errors import IntegrityError, Mismatch, RegistryError, UnknownThoughtletError
from thoughtjax.registry.layout import _files_under, _nest, _read_index, _sha256_file, dir_name
from thoughtjax.registry.manifest import Manifest
from thoughtjax.registry.publish import StepHook, _publish
from thoughtjax.registry.resident import RegistryStats, ResidentSet, _Resident
from thoughtjax.registry.sharding import _sharding_key, param_partition
from thoughtjax.registry.trust import _load_keys
from thoughtjax.registry.verify import Tolerance, VerifyReport, verify_hardware, verify_registry
from thoughtjax.thoughtlet import Kind, ProfileSettings, Thoughtlet, canonical_json, measure_profile


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
  def verify(self, *, hardware: bool = False, all_versions: bool = False, tolerance: Tolerance | None = None,
             settings: ProfileSettings | None = None, deep: bool = True) -> VerifyReport:
    """See :func:`thoughtjax.registry.verify.verify_registry`."""
    return verify_registry(self, hardware=hardware, all_versions=all_versions, tolerance=tolerance,
                           settings=settings, deep=deep)

  def _index_signed(self) -> bool:
    _, sig = _read_index(self.root)
    return sig is not None

  def verify_hardware(self, tolerance: Tolerance, settings: ProfileSettings | None = None,
                      names: Sequence[str] | None = None, raise_on_mismatch: bool = True) -> list[Mismatch]:
    """See :func:`thoughtjax.registry.verify.verify_hardware`."""
    return verify_hardware(self, tolerance, settings, names, raise_on_mismatch)

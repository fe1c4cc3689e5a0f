"""The read-only view of a registry: index, manifests, signatures, lazy verified restores.

A reader reads the index once per :meth:`Registry.open`/:meth:`Registry.refresh`, so it sees
one consistent set of current versions, and checks it under its :class:`TrustPolicy` (see
:mod:`.trust`). Every file a restore reads is checked against the SHA-256 digest its signed
manifest lists, on the very bytes Orbax then reads (a private verified copy). SHA-256 rather
than SHA3 here because it runs at memory speed with CPU support; the versioned hash stays SHA3-512. A mismatch raises
:class:`IntegrityError` naming the thoughtlet, version and file, counts it in
:meth:`Registry.stats`, and nothing falls back to another version.

**Lazy restore and residency.** :meth:`Registry.restore` reads one thoughtlet version, straight
into the requested dtype and sharding (Orbax restores into ``jax.ShapeDtypeStruct`` targets that
carry both). Restored weights stay in a resident set, an LRU under an optional byte budget,
with hit/miss/eviction counts.

**Manifest cache.** A checked manifest is kept per open registry, keyed by the index sequence and the
``stat`` of ``manifest.json`` and ``manifest.sig`` (device, inode, size, modification and change time): a path
naming one thoughtlet many times costs one read and one signature check, and a file changed in any way is
read and checked again. :meth:`refresh` drops the cache.

**Weight forms.** ``weights`` (per registry, or per :meth:`Registry.restore`) says what a restore returns:
``"f32"`` (default), ``"native"`` or ``"stored"``; :mod:`.forms` states each, and computes the restore targets,
the conversion and the resident bytes.

**Mapped restore.** A verified restore on one device also keeps what it returned as a page-aligned file in the
cache (:mod:`.mapped`), verified once (its SHA-256 recorded as it is written, from arrays whose files matched
their signed digests); later restores of the same content, in this process or another, map that file after
checking that it is unchanged, which on the CPU backend costs no copy. A changed file is refused (counted as
``mapped_refusals``), removed, and the version restored from its checkpoint. ``mapped=False`` turns it off.

**Multi-host.** With ``jax.distributed.initialize()`` called first in every process, pass a
``Mesh`` spanning all processes' devices to :meth:`restore` / :func:`thoughtjax.compose.compose`:
Orbax then restores on each process only the shards its devices hold (the SHA-256 file checks
still read and copy each thoughtlet's files whole), the registry directory must be on storage every host
can read (a shared file system: the checks read plain files), and every process must make the
same restore and compose calls in the same order, as with any SPMD program. Publishing is a
single-writer operation (the writer lock is a local ``flock``): run it from one process only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import jax
import numpy as np

from thoughtjax.config import ModelConfig
from thoughtjax.registry.checkpoint import checkpointer, restore_checkpoint, verified_copy
from thoughtjax.registry.codec import load_codec
from thoughtjax.registry.errors import IntegrityError, Mismatch, RegistryError, RestoreError, UnknownThoughtletError
from thoughtjax.registry.forms import check_form, resident_bytes, restore_targets, to_form
from thoughtjax.registry.layout import UnsafeFile, dir_name, file_tree, nest_flat, read_index, sha256_regular
from thoughtjax.registry.lease import ReaderLease
from thoughtjax.registry.manifest import Manifest
from thoughtjax.registry.mapped import MAPPED, MappedFileChanged, MappedStore, content_key, source_identities
from thoughtjax.registry.publish import StepHook, publish_version
from thoughtjax.registry.resident import RegistryStats, ResidentEntry, ResidentSet
from thoughtjax.registry.sharding import sharding_key
from thoughtjax.registry.trust import INTEGRITY, RESTORE, SIGNATURE, RollbackState, TrustPolicy, Verifier, sequence_of
from thoughtjax.registry.verify import Tolerance, VerifyReport, verify_hardware, verify_registry
from thoughtjax.registry.versions import match_version
from thoughtjax.thoughtlet import Kind, ProfileSettings, Thoughtlet, measure_profile

# Checked manifests kept per open registry (module docstring, "Manifest cache").
MANIFEST_CACHE = 4096

log = logging.getLogger(__name__)


def _stat_key(path: Path) -> tuple | None:
  """What identifies a file's content without reading it: inode, size, modification and change times (the
  change time cannot be set back by the writer). None when it cannot be stat'ed (never a cache hit)."""
  try:
    st = os.stat(path, follow_symlinks=False)
  except OSError:
    return None
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _counter(stats: RegistryStats, lock) -> Callable[[str, str, str, str], None]:
  def count(kind: str, thoughtlet: str, file: str, reason: str) -> None:
    with lock:
      stats.count(kind, thoughtlet, file, reason)

  return count


class Registry:
  """A registry directory opened for reading (and, with :meth:`publish`, writing).

  ``trust`` (a :class:`TrustPolicy`, default ``TrustPolicy()``) decides which keys are trusted and
  how unsigned files are treated; ``weights`` is the form restores return by default (:mod:`.forms`);
  every refusal is a named :class:`RegistryError`, counted in :meth:`stats`. An open registry holds a reader lease (see :mod:`.lease`) until :meth:`close`
  (or garbage collection), so ``gc`` keeps the versions it may restore; use it as a context manager.
  """

  def __init__(
    self,
    root: str | os.PathLike,
    trust: TrustPolicy | None = None,
    *,
    memory_budget: int | None = None,
    verify_files: bool = True,
    trusted_keys: Iterable | None = None,
    require_signatures: bool | None = None,
    weights: str = "f32",
    mapped: bool | str | os.PathLike = True,
  ):
    self.root = Path(root).absolute()  # Orbax takes absolute paths only
    # Mapped restores (module docstring): True keeps them in <cache>/mapped, a path elsewhere, False not at all.
    self._mapped: MappedStore | bool | None = MappedStore(mapped) if isinstance(mapped, str | os.PathLike) else mapped
    self.weights = check_form(weights)
    if trusted_keys is not None or require_signatures is not None:
      # The keywords TrustPolicy replaces, still accepted from callers not yet moved over.
      if trust is not None:
        raise TypeError("pass trust=TrustPolicy(...) or the older trusted_keys=/require_signatures=, not both")
      trust = TrustPolicy(public_keys=tuple(trusted_keys or ()), require_signatures=bool(require_signatures))
    self.trust = trust or TrustPolicy()
    self.verify_files = verify_files
    self._resident = ResidentSet(memory_budget)
    self._stats = RegistryStats(budget_bytes=memory_budget)
    self._lock = threading.RLock()
    # Counts a refusal; closes over the stats, not self, so a dropped Registry is freed (and its lease
    # released) at once rather than by the cycle collector.
    self.record_failure = _counter(self._stats, self._lock)
    self._codec = None
    self._index: dict | None = None
    self._held: set[tuple[str, str]] = set()  # (dir name, version) resolved explicitly
    self._manifests: dict[tuple, tuple] = {}  # (name, version, check) -> (stamp, Manifest): see manifest()
    self.verifier = Verifier(self.root, self.trust, self.record_failure)
    self._lease = ReaderLease.acquire(self.root)  # before the index is read: gc then sees this reader
    try:
      self.refresh()
    except BaseException:
      self.close()
      raise

  @classmethod
  def open(cls, root: str | os.PathLike, trust: TrustPolicy | None = None, **kwargs) -> Registry:
    return cls(root, trust, **kwargs)

  def close(self) -> None:
    """Release the reader lease (gc may then remove versions this reader held); idempotent."""
    if self._lease is not None:
      self._lease.release()
      self._lease = None

  def __enter__(self) -> Registry:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- index ------------------------------------------------------------------------
  def refresh(self) -> None:
    """Read the index again (one read: a consistent snapshot of current versions), check its
    structure, signature and sequence (never lower than one seen before: :class:`RollbackError`)."""
    state = RollbackState(self.trust.state_path()).snapshot()  # before the read (see snapshot)
    body, sig = read_index(self.root)
    same = self._index is not None and self._index.get("registry_id") == body.get("registry_id")
    seen = sequence_of(self._index) if same else None  # a registry rebuilt at this path starts over
    verifier = Verifier(self.root, self.trust, self.record_failure)
    verifier.check_index(body, sig, state, seen=seen)
    with self._lock:
      self.verifier, self._index, self._index_record = verifier, body, sig
      self.config = ModelConfig.from_json(body["model"]["config"])
      self._manifests.clear()
    self._hold_lease()

  def _hold_lease(self, also: tuple[str, str] | None = None) -> None:
    """The lease holds the current versions and every version this reader resolved by name."""
    with self._lock:
      current = {(dir_name(n), e["version"]) for n, e in self._index["current"].items()}
      if also is not None:
        if also in self._held:
          return
        self._held.add(also)
        if also in current:  # held already: the lease file stays as written (a restore writes nothing)
          return
      if self._lease is not None:
        self._lease.hold(self._held | current)

  @property
  def sequence(self) -> int:
    """The index's signed sequence number: every publish increments it."""
    return int(sequence_of(self._index))

  @property
  def generation(self) -> int:
    """Alias of :attr:`sequence`."""
    return self.sequence

  @property
  def registry_id(self) -> str | None:
    return self._index.get("registry_id")

  @property
  def signing_keys(self) -> list[str]:
    """Ids of the keys that signed this registry (empty: unsigned)."""
    return list(self._index.get("signing_keys") or [])

  @property
  def signed(self) -> bool:
    return self._index_record is not None

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
    """Layer span -> name of the current block thoughtlets (from the index alone); weight variants
    (``blocks[a:b)@int8``, see :mod:`thoughtjax.path_syntax`) are not listed: a path names them."""
    return {tuple(e["layers"]): n for n, e in self._index["current"].items() if e.get("layers") and "@" not in n}

  def versions(self, name: str) -> list[str]:
    self._known(name)
    return list(self._index["history"].get(name, []))

  def _known(self, name: str) -> None:
    if name not in self._index["current"]:
      raise UnknownThoughtletError(
        f"the registry at {self.root} has no thoughtlet {name!r}; it has {', '.join(self.names)}"
      )

  def resolve(self, name: str, version: str | None = None) -> str:
    """The full version of ``name`` for ``version``, or the current one. ``version`` is the full version
    or a prefix of at least :data:`~.versions.MIN_VERSION_PREFIX` hex digits that names one published version still
    present in the registry (one that gc removed is listed in the history only: :class:`UnknownThoughtletError`)."""
    self._known(name)
    current = self._index["current"][name]["version"]
    if version is None:
      return current
    found = match_version(name, version, self._index["history"][name])
    self._hold_lease((dir_name(name), found))  # before anything is read: gc keeps it from now on
    vdir = self.version_dir(name, found)
    if found != current and not (vdir.is_dir() and not vdir.is_symlink()):
      raise UnknownThoughtletError(
        f"{name}@{found} was removed from {self.root} (by `thoughtjax registry gc`); the index lists it in "
        f"the history only. Use the current version {current}, or publish that version again"
      )
    return found

  def version_dir(self, name: str, version: str) -> Path:
    return self.root / "thoughtlets" / dir_name(name) / version

  # ---- failures -----------------------------------------------------------------------------
  def count_failure(self, thoughtlet: str, file: str, reason: str, sig: bool = False) -> None:
    self.record_failure(SIGNATURE if sig else INTEGRITY, thoughtlet, file, reason)

  # ---- manifests ------------------------------------------------------------------------
  def manifest(self, name: str, version: str | None = None, *, check: bool = True) -> Manifest:
    """The manifest of a version: read once, checked against the digest the index records and
    against its detached signature (``check=False`` skips the signature). A checked manifest is kept
    while its files stay the same (module docstring, "Manifest cache")."""
    version = self.resolve(name, version)
    vdir = self.version_dir(name, version)
    key = (name, version, check)
    stamp = (id(self.verifier), self.sequence, _stat_key(vdir / "manifest.json"), _stat_key(vdir / "manifest.sig"))
    with self._lock:
      hit = self._manifests.get(key)
    if hit is not None and hit[0] == stamp and stamp[2] is not None:
      return hit[1]
    m = self._check_manifest(name, version, vdir, check)
    with self._lock:
      if len(self._manifests) >= MANIFEST_CACHE:
        self._manifests.clear()
      self._manifests[key] = (stamp, m)
    return m

  def _check_manifest(self, name: str, version: str, vdir: Path, check: bool) -> Manifest:
    ref = f"{name}@{version}"
    digest = (self._index.get("manifest_sha256") or {}).get(ref)
    _, raw = self.verifier.check_manifest(name, version, vdir, digest, check_signature=check, index_signed=self.signed)
    try:
      m = Manifest.from_json(raw)
    except (KeyError, TypeError, ValueError, RegistryError) as e:
      self.count_failure(ref, "manifest.json", f"malformed: {e}")
      raise IntegrityError(name, version, str(vdir / "manifest.json"), f"not a manifest ({e})") from None
    if (m.name, m.version) != (name, version) or not m.versioned_hash.startswith(version):
      self.count_failure(ref, "manifest.json", "names another thoughtlet or version")
      raise IntegrityError(name, version, str(vdir / "manifest.json"), f"it describes {m.name}@{m.version}, not {ref}")
    return m

  def manifests(self) -> list[Manifest]:
    return [self.manifest(n) for n in self.names]

  def _check_unlisted(self, m: Manifest, vdir: Path) -> None:
    """Every entry under the checkpoint directory is a plain file or directory the manifest lists; a link,
    a FIFO or a device there (or a linked directory on the way) is refused before anything is read."""
    rel_dir = vdir.relative_to(self.root) / "checkpoint"
    try:
      entries = file_tree(self.root, rel_dir)
    except FileNotFoundError:
      entries = {}
    except UnsafeFile as e:
      self.count_failure(m.ref, "checkpoint", str(e))
      raise IntegrityError(
        m.name, m.version, str(vdir / "checkpoint"), f"{e}; nothing is read through a link"
      ) from None
    for rel, kind in sorted(entries.items()):
      key = f"checkpoint/{rel}"
      if kind in ("link", "special"):
        what = "a symbolic link" if kind == "link" else "not a regular file (a FIFO, socket or device)"
        self.count_failure(m.ref, key, what)
        raise IntegrityError(
          m.name, m.version, str(vdir / key), f"{what}; a checkpoint holds plain files only, and none is read"
        )
      if kind == "file" and key not in m.files:
        self.count_failure(m.ref, key, "not listed in the manifest")
        raise IntegrityError(m.name, m.version, str(vdir / key), "the file is not listed in the signed manifest")

  def check_files(self, m: Manifest, vdir: Path) -> None:
    listed = {rel: spec for rel, spec in m.files.items()}
    self._check_unlisted(m, vdir)
    base = vdir.relative_to(self.root)

    def digest(rel):
      try:
        got, n = sha256_regular(self.root, base / rel, int(listed[rel]["bytes"]))
      except FileNotFoundError:
        return rel, None, None
      except UnsafeFile as e:
        return rel, None, f"{e}; a checkpoint file is a plain file inside the version directory"
      if n > int(listed[rel]["bytes"]):
        return rel, None, f"holds more than the {listed[rel]['bytes']} bytes the manifest lists"
      return rel, got, None

    workers = min(8, max(1, len(listed)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      results = {rel: (got, why) for rel, got, why in pool.map(digest, sorted(listed))}
    for rel in sorted(listed):
      got, why = results[rel]
      if why is not None:
        self.count_failure(m.ref, rel, why)
        raise IntegrityError(m.name, m.version, str(vdir / rel), why)
      if got is None:
        self.count_failure(m.ref, rel, "missing")
        raise IntegrityError(m.name, m.version, str(vdir / rel), "the file is missing")
      if got != listed[rel]["sha256"]:
        self.count_failure(m.ref, rel, "sha256 mismatch")
        raise IntegrityError(
          m.name,
          m.version,
          str(vdir / rel),
          f"sha256 {got[:16]}... does not match the manifest's {listed[rel]['sha256'][:16]}...",
        )

  # ---- restore --------------------------------------------------------------------------
  def _key(self, name: str, version: str, dtype, mesh, weights: str | None = None) -> tuple:
    form = check_form(weights or self.weights)
    return (name, version, None if dtype is None else np.dtype(dtype).name, sharding_key(mesh), form)

  def restore(
    self,
    name: str,
    version: str | None = None,
    *,
    dtype=None,
    mesh=None,
    pinned: set | None = None,
    weights: str | None = None,
  ) -> dict:
    """The weights of one thoughtlet version as a nested dict of arrays (from the resident
    set if there, else read, checked and restored into ``dtype`` and ``mesh`` sharding), native weights
    in form ``weights`` (default: the registry's; see :mod:`.forms`). ``dtype`` casts float
    arrays; packed native weights keep their narrow types (they compute in float32)."""
    version = self.resolve(name, version)
    weights = check_form(weights or self.weights)
    key = self._key(name, version, dtype, mesh, weights)
    with self._lock:
      entry = self._resident.get(key)
      if entry is not None:
        self._stats.hits += 1
        return entry.params
      self._stats.misses += 1
      m = self.manifest(name, version)
      need = resident_bytes(m, dtype, weights)
      for _ in self._resident.make_room(need, set(pinned or ()) | {key}, m.ref):
        self._stats.evictions += 1
    t0 = time.perf_counter()
    params = self._load(m, dtype, mesh, weights)  # outside the lock: restores may overlap
    seconds = time.perf_counter() - t0
    with self._lock:
      self._stats.restore_seconds[m.ref] = seconds
      self._stats.restores += 1
      self._stats.restored_bytes += need
      entry = self._resident.get(key)
      if entry is not None:  # another thread restored it meanwhile; keep one copy
        return entry.params
      self._resident.put(key, ResidentEntry(params, need, m.ref))
      return params

  def _mapped_store(self) -> MappedStore | None:
    if self._mapped is True:
      from thoughtjax import cachedir

      try:
        self._mapped = MappedStore(cachedir.cache_subdir("mapped"))
      except OSError as e:  # an unsafe or unwritable cache: restores read the checkpoints
        log.warning("restores will not be mapped: %s", e)
        self._mapped = None
    return self._mapped or None

  def _load(self, m: Manifest, dtype, mesh, weights: str) -> dict:
    """Version ``m``'s arrays in form ``weights``: mapped from its verified mapped form when its checkpoint files
    are the ones checked for it (one device only), else restored from the checkpoint and, when its files were
    checked, kept mapped for the next restore (module docstring, "Mapped restore")."""
    store = self._mapped_store() if mesh is None else None
    if store is None:
      return to_form(m, self._read(m, nest_flat(restore_targets(m, dtype, mesh)))[0], dtype, mesh, weights)
    key = content_key(m, weights, dtype)
    vdir = self.version_dir(m.name, m.version)
    sources = source_identities(vdir / rel for rel in sorted(m.files))
    if sources is not None:
      if self.verify_files:
        self._check_unlisted(m, vdir)
      params = self._mapped_load(store, key, sources, m)
      if params is not None:
        with self._lock:
          self._stats.mapped_restores += 1
        return params
    params = to_form(m, self._read(m, nest_flat(restore_targets(m, dtype, mesh)))[0], dtype, mesh, weights)
    # Kept only from files that were checked and did not change while they were read.
    if self.verify_files and sources is not None and source_identities(sources) == sources:
      if store.save(key, params, sources):
        params = self._mapped_load(store, key, sources, m) or params  # the arrays alias the file; the copy goes
    return params

  def _mapped_load(self, store: MappedStore, key: str, sources: dict, m: Manifest) -> dict | None:
    try:
      return store.load(key, sources)
    except MappedFileChanged as e:
      self.record_failure(MAPPED, m.ref, str(store.dir / key), str(e))
      log.warning("refused the mapped form of %s: %s; restoring it from its checkpoint", m.ref, e)
      return None

  def _read(self, m: Manifest, target) -> tuple[dict, float]:
    """Restore a version with Orbax from a private copy of its files whose bytes were hashed on the
    way there (what is checked is what is read). A failure after the checks passed is reported as
    what it is (:class:`RestoreError`: memory, sharding, I/O), not as tampering."""
    t0 = time.perf_counter()
    vdir = self.version_dir(m.name, m.version)
    copy = None
    if self.verify_files:
      self._check_unlisted(m, vdir)

      def fail(rel, reason):
        self.count_failure(m.ref, rel, reason)
        return IntegrityError(m.name, m.version, str(vdir / rel), reason)

      copy = verified_copy(vdir, m.files, fail, root=self.root)
    try:
      params = jax.block_until_ready(restore_checkpoint(checkpointer(), (copy or vdir) / "checkpoint", target))
    except Exception as e:
      self.record_failure(RESTORE, m.ref, "checkpoint", f"{type(e).__name__}: {e}")
      checked = (
        "every file matched its signed sha256 digest, so this is not tampering"
        if self.verify_files
        else "file checks were off (verify_files=False): run `thoughtjax registry verify` to rule out corruption"
      )
      raise RestoreError(
        f"restoring {m.ref} from {vdir / 'checkpoint'} failed with {type(e).__name__}: {e} "
        f"({checked}). Fix the cause (free memory or lower memory_budget, check the mesh, "
        f"check the file system) and restore again"
      ) from e
    finally:
      if copy is not None:
        shutil.rmtree(copy, ignore_errors=True)
    return params, time.perf_counter() - t0

  def restore_many(
    self,
    units: Sequence[tuple[str, str | None]],
    *,
    dtype=None,
    mesh=None,
    workers: int = 4,
    weights: str | None = None,
  ) -> list[dict]:
    """Restore several versions that must be resident together (one path), up to ``workers``
    at a time; the byte budget is checked for all of them before anything is read."""
    weights = check_form(weights or self.weights)
    with self._lock:
      resolved = [(n, self.resolve(n, v)) for n, v in units]
      keyed = {self._key(n, v, dtype, mesh, weights) for n, v in resolved}
      missing = [u for u in dict.fromkeys(resolved) if self._resident.get(self._key(*u, dtype, mesh, weights)) is None]
      if self._resident.budget is not None:
        need = 0
        for n, v in missing:
          m = self.manifest(n, v)
          need += resident_bytes(m, dtype, weights)
        for _ in self._resident.make_room(need, keyed, "this path"):
          self._stats.evictions += 1
    kw = dict(dtype=dtype, mesh=mesh, pinned=keyed, weights=weights)
    if len(missing) > 1 and workers > 1:
      with concurrent.futures.ThreadPoolExecutor(min(workers, len(missing))) as pool:
        futures = [pool.submit(self.restore, n, v, **kw) for n, v in missing]
        for f in futures:
          f.result()
    return [self.restore(n, v, **kw) for n, v in resolved]

  def thoughtlet(self, name: str, version: str | None = None, *, weights: str = "native") -> Thoughtlet:
    """A published version as a :class:`Thoughtlet` (weights restored), e.g. to derive a new one. Native
    weights stay packed by default: the form it was profiled in and that republishing stores."""
    m = self.manifest(name, version)
    params = self.restore(name, m.version, weights=weights)
    return Thoughtlet(m.name, m.kind, m.signature, params, m.config, m.layers, m.profile)

  def evict_all(self) -> None:
    with self._lock:
      self._stats.evictions += self._resident.clear()

  def evict_except(self, keep) -> int:
    """Drop the restored weights of every version not in ``keep`` (refs, ``name@version``) from the resident
    set; returns how many. Arrays a caller still holds (a composed model) stay alive with it."""
    with self._lock:
      n = self._resident.drop_except(set(keep))
      self._stats.evictions += n
      return n

  def resident_params(self) -> list[dict]:
    """The restored params the resident set holds now, least recently used first (the refs are in
    ``stats().resident``): what :meth:`evict_all` drops."""
    with self._lock:
      return self._resident.params()

  def stats(self) -> RegistryStats:
    with self._lock:
      s = dataclasses.replace(
        self._stats, failures=list(self._stats.failures), restore_seconds=dict(self._stats.restore_seconds)
      )
      s.resident_bytes = self._resident.nbytes
      s.resident = self._resident.refs()
      return s

  # ---- codec ----------------------------------------------------------------------------
  @property
  def codec(self):
    if self._codec is None:
      entry = self._index["codec"]
      cdir = self.root / entry["dir"]

      def fail(rel, reason):
        self.count_failure("codec", rel, reason)
        return IntegrityError("codec", None, str(cdir / rel), f"{reason} (checked against the index)")

      self._codec = load_codec(cdir, entry["files"], fail, root=self.root)
    return self._codec

  # ---- publishing -------------------------------------------------------------------------
  def publish(
    self,
    thoughtlets: Sequence[Thoughtlet],
    *,
    sign_key=None,
    on_step: StepHook | None = None,
    settings: ProfileSettings | None = ProfileSettings(),
    revoke_keys: Sequence[str] = (),
  ) -> dict[str, str]:
    """Publish new versions atomically and make them current; returns name -> version.

    Thoughtlets without a profile are measured first (``settings``; None publishes them
    unprofiled). Each replaces the current version of its name; its input and output
    types must stay those of the current version. ``revoke_keys`` (key ids; needs ``sign_key``, another
    key): the new index drops them from its signing keys and lists them as revoked, and readers then refuse
    what only they signed (registry/README.md, Key rotation); ``publish([], sign_key=new, revoke_keys=[old])``
    publishes nothing else.
    """
    thoughtlets = list(thoughtlets)
    for t in thoughtlets:
      if t.config != self.config:
        raise RegistryError(
          f"{t.name}: the new version was cut from another model config; this registry holds {self.config}"
        )
      if t.kind is Kind.BRIDGE and t.name not in self._index["current"]:
        continue  # a bridge is trained, not cut by the mapping: its first version brings a new name
      self._known(t.name)
      cur = self.manifest(t.name)
      for side in ("input", "output"):
        want, got = getattr(cur.signature, side), getattr(t.signature, side)
        if want != got:
          raise RegistryError(
            f"{t.name}: a new version must keep the {side} type {want}; got {got}. "
            f"Paths through {t.name} would no longer compose"
          )
    if settings is not None and any(t.profile is None for t in thoughtlets):
      table = None
      if any(t.kind is Kind.TEMPLATE or (t.kind is Kind.HEAD and self.config.tie_embeddings) for t in thoughtlets):
        new_embed = [t for t in thoughtlets if t.kind is Kind.EMBED]
        table = (new_embed[0].params if new_embed else self.restore("embed", weights="native"))["table"]
      thoughtlets = [
        t if t.profile is not None else dataclasses.replace(t, profile=measure_profile(t, settings, table))
        for t in thoughtlets
      ]
    versions = publish_version(
      self.root,
      thoughtlets,
      sign_key=sign_key,
      on_step=on_step,
      model=None,
      codec=None,
      trust=self.trust,
      on_failure=self.record_failure,
      revoke=tuple(revoke_keys),
    )
    self.refresh()
    return versions

  # ---- verification -----------------------------------------------------------------------
  def verify(
    self,
    *,
    hardware: bool = False,
    all_versions: bool = False,
    tolerance: Tolerance | None = None,
    settings: ProfileSettings | None = None,
    deep: bool = True,
  ) -> VerifyReport:
    """See :func:`thoughtjax.registry.verify.verify_registry`."""
    return verify_registry(
      self, hardware=hardware, all_versions=all_versions, tolerance=tolerance, settings=settings, deep=deep
    )

  def verify_hardware(
    self,
    tolerance: Tolerance,
    settings: ProfileSettings | None = None,
    names: Sequence[str] | None = None,
    raise_on_mismatch: bool = True,
  ) -> list[Mismatch]:
    """See :func:`thoughtjax.registry.verify.verify_hardware`."""
    return verify_hardware(self, tolerance, settings, names, raise_on_mismatch)

"""Who a registry reader or writer trusts, and the rollback state that outlives one process.

A :class:`TrustPolicy` says which Ed25519 public keys are trusted and how unsigned files are
treated. The rules (TUF's that matter here):

* **A signed registry stays signed.** An index records the ids of every key that signed the
  registry (``signing_keys``). Once a registry is signed (its index names signing keys, it holds
  ``keys/*.pub``, or this user saw it signed), an unsigned index or manifest is a
  :class:`SignatureDowngradeError` unless the caller opts out with ``allow_unsigned=True``.
* **Whose keys.** With ``public_keys`` every signature must verify against one of them, and
  everything must be signed (a manifest published unsigned before the registry was first signed is
  covered by the digest the signed index records for it). Without, the keys stored in ``DIR/keys``
  that the index names are used: that proves the files are intact and consistent, not who wrote them.
* **No rollback, no swap.** Every index carries a signed sequence number that each publish increments.
  A reader or writer refuses an index whose sequence is lower than the highest it has seen at the same
  location (:class:`RollbackError`), and another registry (another registry id) presented where it read one
  (:class:`RegistrySwapError`, a rollback), whatever key signed it. What was seen lives in a small per-user
  JSON file (``state_file``; default ``$THOUGHTJAX_TRUST_STATE`` or ``<cache dir>/trust-state.json``), keyed by
  the registry's resolved location and the path it was opened by (:func:`locations`): registry id, highest
  sequence, signed or not, signing keys, revoked keys. A deliberate rebuild is accepted with :func:`accept`
  (CLI ``thoughtjax registry accept DIR``). The file is updated under a lock and replaced durably (a new
  temporary file, fsync, rename, fsync of the directory); it keeps the :data:`STATE_ENTRIES` most recently
  seen locations.
* **Revocation.** An index that drops a key from ``signing_keys`` (and lists it in ``revoked_keys``) revokes it:
  an index signed by a revoked key, or a manifest signed only by one whose digest no current index records,
  is a :class:`RevokedKeyError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from thoughtjax import settings, signing
from thoughtjax.config import ModelConfig
from thoughtjax.errors import UserError
from thoughtjax.fetch import cache_dir
from thoughtjax.registry.errors import (
  IntegrityError,
  RegistryError,
  RegistrySwapError,
  RevokedKeyError,
  RollbackError,
  SignatureDowngradeError,
  SignatureError,
)
from thoughtjax.registry.layout import (
  MAX_JSON_BYTES,
  MAX_SIG_BYTES,
  VERSION_RE,
  UnsafeFile,
  read_index,
  read_regular,
  sha256_bytes,
)
from thoughtjax.thoughtlet import canonical_json

STATE_FORMAT = "thoughtjax.trust-state/2"
STATE_FORMAT_V1 = "thoughtjax.trust-state/1"  # keyed by registry id and path; read and migrated
STATE_ENV = settings.TRUST_STATE
STATE_ENTRIES = 4096
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class TrustPolicy:
  """Trust of a reader or writer.

  ``public_keys``: trusted keys (PEM file paths or Ed25519 public key objects); giving any makes
  signatures required (an unsigned file cannot come from a trusted key). ``require_signatures``:
  refuse anything unsigned even with the registry's own keys. ``allow_unsigned``: the explicit
  opt-out that opens a signed registry whose signatures were removed. ``state_file``: the rollback
  state (see the module docstring).
  """

  public_keys: tuple = ()
  require_signatures: bool = False
  allow_unsigned: bool = False
  state_file: str | os.PathLike | None = None

  def __post_init__(self):
    if isinstance(self.public_keys, (str, os.PathLike)) or hasattr(self.public_keys, "verify"):
      object.__setattr__(self, "public_keys", (self.public_keys,))
    else:
      object.__setattr__(self, "public_keys", tuple(self.public_keys))
    if self.allow_unsigned and self.signatures_required:
      raise UserError(
        "TrustPolicy: allow_unsigned=True contradicts require_signatures=True / public_keys; pass one or the other"
      )

  @property
  def signatures_required(self) -> bool:
    return self.require_signatures or bool(self.public_keys)

  @property
  def explicit(self) -> bool:
    return bool(self.public_keys)

  def trusted_keys(self) -> dict:
    """key id -> public key of ``public_keys``."""
    return _load_keys(self.public_keys)

  def state_path(self) -> Path:
    if self.state_file is not None:
      return Path(self.state_file)
    env = settings.current().trust_state
    if env:
      return env

    return cache_dir() / "trust-state.json"


def _load_keys(keys: Iterable) -> dict:
  out = {}
  for k in keys:
    if not hasattr(k, "verify"):
      k = signing.load_public_key(k)
    out[signing.key_id(k)] = k
  return out


def recorded_keys(root: Path) -> dict:
  """key id -> public key of the files in ``DIR/keys`` (named ``<key id>.pub``)."""
  keys = {}
  for p in sorted((root / "keys").glob("*.pub")):
    try:
      k = signing.load_public_key(read_regular(root, Path("keys") / p.name, MAX_SIG_BYTES))
    except (UnsafeFile, signing.SignatureError) as e:
      raise SignatureError(
        f"{p}: {e}; a registry's keys directory holds only the PEM public keys of its "
        f"signers. Restore the file from a backup or remove it"
      ) from None
    if signing.key_id(k) == p.stem:  # a key file under another key's name is not that key
      keys[p.stem] = k
  return keys


def locations(root: Path) -> list[str]:
  """Where a registry is read from, as the rollback state keys it: its resolved location (links followed) and
  the absolute path it was opened by, when they differ (a link re-pointed at an older copy is caught by the
  path it was read through)."""
  return list(dict.fromkeys([os.path.realpath(root), os.path.abspath(root)]))


def state_key(registry_id: str | None, root: Path) -> str:
  """The state key of ``root`` (the resolved location; ``registry_id`` is recorded in the entry instead)."""
  return locations(root)[0]


class RollbackState:
  """The per-user record of what was seen per registry location (see the module docstring): for each, the
  registry id, the highest sequence, whether it was signed, its signing keys and the keys it revoked."""

  def __init__(self, path: Path):
    self.path = Path(path)
    self._snapshot: dict | None = None

  def snapshot(self) -> RollbackState:
    """Freeze what :meth:`get` answers to the entries recorded now. Take it *before* reading the
    index: a concurrent reader may record a newer sequence between our read of the index and our
    check, which is not a rollback; a sequence recorded before our read began is."""
    try:
      self._snapshot = self._read()
    except OSError as e:
      raise self._unusable(e) from e
    return self

  def _read(self) -> dict:
    try:
      fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
      return {}
    except OSError as e:
      if e.errno == errno.ELOOP:
        raise RegistryError(
          f"trust state {self.path} is a symbolic link; it records what this user has seen of each registry "
          f"and is written in place. Remove the link (or point {STATE_ENV} at a plain file)"
        ) from None
      raise
    try:
      if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise RegistryError(f"trust state {self.path} is not a regular file; remove it or point {STATE_ENV} elsewhere")
      data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
      os.close(fd)
    try:
      doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
      raise RegistryError(
        f"trust state {self.path} is not valid JSON ({e}); it records the highest index "
        f"sequence seen per registry. Delete it to start over (rollback protection then "
        f"restarts from the sequences seen next)"
      ) from None
    fmt = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
    if fmt == STATE_FORMAT_V1:
      return _migrate_v1(doc.get("registries") or {})
    if fmt != STATE_FORMAT or not isinstance(doc.get("registries"), dict):
      raise RegistryError(
        f"trust state {self.path}: expected format {STATE_FORMAT!r}, got {fmt!r}; delete it to start over"
      )
    return doc["registries"]

  def get(self, key: str) -> dict | None:
    if self._snapshot is not None:
      entry = self._snapshot.get(key)
    else:
      try:
        entry = self._read().get(key)
      except OSError as e:
        raise self._unusable(e) from e
    return entry if isinstance(entry, dict) else None

  def _unusable(self, e: OSError) -> RegistryError:
    return RegistryError(
      f"trust state {self.path}: cannot be read or written ({e}); it records the highest index "
      f"sequence seen per registry. Point {STATE_ENV} (or TrustPolicy(state_file=...)) at a "
      f"writable file"
    )

  @contextlib.contextmanager
  def _locked(self):
    self.path.parent.mkdir(parents=True, exist_ok=True)
    lock = self.path.with_name(self.path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
      yield
    finally:
      os.close(fd)

  def record(
    self,
    keys: str | Iterable[str],
    sequence: int,
    signed: bool,
    *,
    registry_id: str | None = None,
    signing_keys: Iterable[str] = (),
    revoked: Iterable[str] = (),
    replace: bool = False,
  ) -> dict:
    """Record a registry seen at the locations ``keys``: its id, its sequence (the stored one is never lowered
    unless ``replace``: a deliberate rebuild, see :func:`accept`), its signing keys and the keys revoked there
    (never forgotten). Returns the entry."""
    try:
      return self._record(
        [keys] if isinstance(keys, str) else list(keys),
        int(sequence),
        bool(signed),
        registry_id,
        sorted(set(signing_keys)),
        set(revoked),
        replace,
      )
    except OSError as e:
      raise self._unusable(e) from e

  def _record(self, keys, sequence, signed, registry_id, signing_keys, revoked, replace) -> dict:
    with self._locked():
      entries = self._read()
      changed, out = False, None
      for key in keys:
        old = entries.get(key) if isinstance(entries.get(key), dict) else {}
        keep = {} if replace else old
        entry = {
          "registry_id": registry_id if replace or "registry_id" not in old else old["registry_id"],
          "sequence": max(int(keep.get("sequence", -1)), sequence),
          "signed": bool(keep.get("signed")) or signed,
          "keys": signing_keys or list(keep.get("keys") or []),
          "revoked": sorted(set(old.get("revoked") or []) | revoked),
          "seen": time.time(),
        }
        if entry["registry_id"] is None:
          entry["registry_id"] = registry_id
        out = entry
        same = {k: v for k, v in entry.items() if k != "seen"} == {k: v for k, v in old.items() if k != "seen"}
        if same and time.time() - float(old.get("seen", 0)) < 3600:
          out = old
          continue  # nothing new: skip the write
        entries[key] = entry
        changed = True
      if changed:
        if len(entries) > STATE_ENTRIES:  # keep the file small: forget the least recently seen
          entries = dict(sorted(entries.items(), key=lambda kv: -float(kv[1].get("seen", 0)))[:STATE_ENTRIES])
        self._write(entries)
      return out

  def _write(self, entries: dict) -> None:
    """Replace the file durably: a new temporary file (never through a link), fsynced, renamed over the old
    one, then the directory fsynced, so a crash leaves the old state or the new one, whole."""
    tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
      f.write(json.dumps({"format": STATE_FORMAT, "registries": entries}, sort_keys=True).encode())
      f.flush()
      os.fsync(f.fileno())
    _step("state:tmp-written")
    os.replace(tmp, self.path)
    _step("state:renamed")
    dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
      os.fsync(dfd)
    finally:
      os.close(dfd)


def _step(event: str) -> None:
  """A test hook (kill-during-write tests replace it); does nothing."""


def _migrate_v1(entries: dict) -> dict:
  """Entries of a format-1 state (keyed ``<registry id>:<path>``) keyed by location, the most recent per path."""
  out: dict = {}
  for key, e in sorted(entries.items(), key=lambda kv: float(kv[1].get("seen", 0)) if isinstance(kv[1], dict) else 0):
    if not isinstance(key, str) or ":" not in key or not isinstance(e, dict):
      continue
    rid, _, path = key.partition(":")
    out[path] = {**e, "registry_id": None if rid == "legacy" else rid, "keys": [], "revoked": []}
  return out


def accept(root: str | os.PathLike, trust: TrustPolicy | None = None) -> dict:
  """Accept the registry now at ``root`` as a deliberate rebuild or replacement (CLI ``thoughtjax registry
  accept DIR``): its index is verified under ``trust`` (structure, signature, no key revoked here) except
  for the rollback and swap checks, and it is recorded as the registry seen there, its id and sequence
  replacing what this user saw. Keys revoked at that location stay revoked. Returns the new entry."""

  root = Path(root).absolute()
  trust = trust or TrustPolicy()
  state = RollbackState(trust.state_path())
  body, record = read_index(root)
  verifier = Verifier(root, trust)
  verifier.check_index(body, record, state, accept=True)
  return state.record(
    locations(root),
    sequence_of(body),
    verifier.signed,
    registry_id=body.get("registry_id"),
    signing_keys=body.get("signing_keys") or [],
    revoked=verifier.revoked,
    replace=True,
  )


# Failure kinds, each counted in RegistryStats (see resident.py).
INTEGRITY, SIGNATURE, DOWNGRADE, ROLLBACK = "integrity", "signature", "downgrade", "rollback"
RESTORE, WRITER = "restore", "writer"


class Verifier:
  """Applies a :class:`TrustPolicy` to one registry directory: the index (structure, signature,
  sequence) and manifests (index digest, detached signature). Every refusal is reported to
  ``on_failure(kind, thoughtlet, file, reason)`` before it is raised, so a caller can count it."""

  def __init__(self, root: Path, policy: TrustPolicy, on_failure=None, extra_keys: dict | None = None):
    self.root, self.policy = Path(root), policy
    self._on_failure = on_failure or (lambda kind, thoughtlet, file, reason: None)
    self._extra = dict(extra_keys or {})
    self._keys: dict | None = None
    self.signed = False  # the registry is signed: every file must carry a valid signature
    self.revoked: set[str] = set()  # key ids revoked for this registry (check_index)

  def _read(self, path: Path, limit: int) -> bytes:
    """A registry file's bytes: a regular file below the root reached without links, at most ``limit``."""
    return read_regular(self.root, Path(path).relative_to(self.root), limit)

  def fail(self, kind: str, exc: Exception, thoughtlet: str, file: str) -> Exception:
    self._on_failure(kind, thoughtlet, file, str(exc))
    return exc

  def keys(self, body: dict | None = None) -> dict:
    """The keys signatures are checked against: the policy's, else those in ``DIR/keys`` that the
    index names as signing keys; plus a writer's own key."""
    if self._keys is None or body is not None:
      if self.policy.explicit:
        keys = self.policy.trusted_keys()
      else:
        keys = recorded_keys(self.root)
        named = None if body is None else body.get("signing_keys")
        if named is not None:
          keys = {k: v for k, v in keys.items() if k in named}
      self._keys = {**keys, **self._extra}
    return self._keys

  # ---- index ----------------------------------------------------------------------------
  def check_index(
    self, body: dict, record, state: RollbackState | None, *, seen: int | None = None, accept: bool = False
  ) -> bool:
    """Check an index read from ``DIR/index.json``; True if it is signed. ``seen``: a sequence this
    process already saw for the registry (in addition to the state file). ``accept``: skip the rollback and
    swap checks and record nothing (:func:`accept` records the registry itself)."""
    path = str(self.root / "index.json")
    self.check_structure(body)
    keys = self.keys(body)
    locs = locations(self.root)
    entries = [] if state is None else [e for e in (state.get(loc) for loc in locs) if e is not None]
    # Keys revoked here: listed by the index, recorded by this user, or dropped from the signing keys an
    # earlier index at this location listed (a published index that drops a key revokes it).
    named = body.get("signing_keys")
    self.revoked = set(body.get("revoked_keys") or [])
    for e in entries:
      self.revoked |= set(e.get("revoked") or [])
      if record is not None and named is not None:
        self.revoked |= set(e.get("keys") or []) - set(named)
    if record is not None:
      self.signed = True
      what = f"{path} (index signature)"
      try:
        rec = signing.SignatureRecord.from_json(record)
      except signing.SignatureError as e:
        raise self.fail(SIGNATURE, SignatureError(f"{e}. {_KEY_FIX}"), "index", path) from None
      if rec.key_id in self.revoked:
        raise self.fail(
          SIGNATURE,
          RevokedKeyError(
            f"{what}: signed by key {rec.key_id}, which was revoked for the registry at {self.root} (an index "
            f"published there dropped it from its signing keys); whatever only that key signed is refused. "
            f"Restore the newest index.json, or publish with a current key (see `thoughtjax registry "
            f"revoke-key` in registry/README.md, Key rotation)"
          ),
          "index",
          path,
        )
      try:
        signing.verify(keys, canonical_json(body), rec, what)
      except signing.SignatureError as e:
        raise self.fail(SIGNATURE, SignatureError(f"{e}. {_KEY_FIX}"), "index", path) from None
      if named is not None and rec.key_id not in named:
        raise self.fail(
          SIGNATURE,
          SignatureError(
            f"{what}: signed by key {rec.key_id}, which the index does not list among its signing keys "
            f"{sorted(named)}; the index was re-signed by a key that never signed this registry"
          ),
          "index",
          path,
        )
    entry = {"signed": any(e.get("signed") for e in entries)} if entries else None
    if record is None:
      why = self._signed_evidence(body, entry)
      if self.policy.signatures_required:
        raise self.fail(
          SIGNATURE,
          SignatureError(
            f"{path}: the index is not signed, but signatures are required (trusted public keys were given "
            f"or require_signatures=True); sign the registry with `thoughtjax registry build --sign-key`"
          ),
          "index",
          path,
        )
      if why and not self.policy.allow_unsigned:
        raise self.fail(
          DOWNGRADE,
          SignatureDowngradeError(
            f"{path}: the index is not signed, but the registry is signed ({why}); its signature was removed. "
            f"Restore index.json from a backup, or open with TrustPolicy(allow_unsigned=True) if you mean "
            f"to read it unsigned"
          ),
          "index",
          path,
        )
      self.signed = bool(why) and not self.policy.allow_unsigned
    if accept:
      return record is not None
    seq = sequence_of(body)
    rid = body.get("registry_id")
    fix = (
      f"Restore the newest index.json; if the registry at {self.root} was deliberately rebuilt or replaced, "
      f"accept it with `thoughtjax registry accept {self.root}` (thoughtjax.registry.accept), which verifies it "
      f"and records it as the registry seen there"
    )
    for e in entries:
      if e.get("registry_id") is not None and e["registry_id"] != rid:
        raise self.fail(
          ROLLBACK,
          RegistrySwapError(
            f"{path}: this user last read registry {e['registry_id']} (sequence {e.get('sequence')}, signing "
            f"keys {e.get('keys') or 'none'}) at {self.root}; the index now presents registry {rid} at sequence "
            f"{seq}: another registry was put in its place (a swap is refused like a rollback). {fix}"
          ),
          "index",
          path,
        )
    candidates = [int(e["sequence"]) for e in entries if isinstance(e.get("sequence"), int)]
    highest = max(candidates + ([] if seen is None else [int(seen)]), default=-1)
    if seq < highest:
      raise self.fail(
        ROLLBACK,
        RollbackError(
          f"{path}: index sequence {seq} is lower than {highest}, already seen for registry "
          f"{rid} at {self.root}; an older index was put back (rollback). {fix}"
        ),
        "index",
        path,
      )
    if state is not None:
      state.record(locs, seq, self.signed, registry_id=rid, signing_keys=named or [], revoked=self.revoked)
    return record is not None

  def _signed_evidence(self, body: dict, entry: dict | None) -> str:
    if body.get("signing_keys"):
      return f"the index lists signing keys {sorted(body['signing_keys'])}"
    if any((self.root / "keys").glob("*.pub")):
      return f"{self.root / 'keys'} holds its public keys"
    if entry and entry.get("signed"):
      return "it was signed when this user last opened it"
    return ""

  def check_structure(self, body: dict) -> None:
    """Version strings and directories named by the index are what they must be: no path escapes."""
    path = str(self.root / "index.json")

    def bad(reason):
      return self.fail(INTEGRITY, IntegrityError("index", None, path, reason), "index", path)

    def short(x) -> str:
      return repr(x)[:120]

    def str_list(key, pattern=None):
      v = body.get(key)
      if v is None:
        return
      if not (isinstance(v, list) and len(v) <= 4096 and all(isinstance(x, str) for x in v)) or (
        pattern is not None and not all(pattern.fullmatch(x) for x in v)
      ):
        raise bad(f"{key!r} is {short(v)}, not a list of {'key ids' if pattern else 'names'}")

    try:
      current, history = body["current"], body["history"]
      if not isinstance(current, dict) or not isinstance(history, dict):
        raise bad("'current' and 'history' must be objects")
      for name, e in current.items():
        if not isinstance(name, str) or not isinstance(e, dict):
          raise bad(f"entry {short(name)} of 'current' is not a name -> object entry")
        _check_version(e.get("version"), f"current version of {short(name)}", bad)
        if name not in history or not isinstance(history[name], list) or e["version"] not in history[name]:
          raise bad(f"current version {e['version']} of {short(name)} is missing from its history")
        layers = e.get("layers")
        if layers is not None and not (
          isinstance(layers, list) and len(layers) == 2 and all(type(x) is int and 0 <= x < 1 << 20 for x in layers)
        ):
          raise bad(f"layers of {short(name)} are {short(layers)}, not [start, end] or null")
        if not isinstance(e.get("kind", ""), str):
          raise bad(f"kind of {short(name)} is {short(e.get('kind'))}, not a string")
      for name, versions in history.items():
        if not isinstance(versions, list):
          raise bad(f"history of {short(name)} is not a list")
        for v in versions:
          _check_version(v, f"version in the history of {short(name)}", bad)
      str_list("order")
      str_list("signing_keys", VERSION_RE)
      str_list("revoked_keys", VERSION_RE)
      rid = body.get("registry_id")
      if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= 128):
        raise bad(f"registry_id {short(rid)} is not a string of 1 to 128 characters")
      digests = body.get("manifest_sha256")
      if digests is not None and not (
        isinstance(digests, dict)
        and all(isinstance(k, str) and isinstance(d, str) and _SHA256_RE.fullmatch(d) for k, d in digests.items())
      ):
        raise bad("'manifest_sha256' is not an object of name@version -> 64 hex digits")
      codec = body.get("codec") or {}
      digest = codec.get("digest") if isinstance(codec, dict) else None
      if not (isinstance(digest, str) and VERSION_RE.fullmatch(digest) and codec.get("dir") == f"codec/{digest}"):
        raise bad(f"codec entry {short(codec)} must name dir 'codec/<16 hex digits>' matching its digest")
      files = codec.get("files")
      if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(d, str) for k, d in files.items())):
        raise bad(f"codec files {short(files)} is not an object of file name -> sha256")
      seq = sequence_of(body)
      if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 1 << 63:
        raise bad(f"sequence {short(seq)} is not a non-negative 64-bit integer")
      try:
        ModelConfig.from_json(body["model"]["config"])
      except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise bad(f"model config is not one ({type(e).__name__}: {str(e)[:200]})") from None
    except (KeyError, TypeError, AttributeError) as e:
      raise bad(f"malformed index ({type(e).__name__}: {str(e)[:200]})") from None

  # ---- manifests --------------------------------------------------------------------------
  def check_manifest(
    self,
    name: str,
    version: str,
    vdir: Path,
    index_digest: str | None,
    check_signature: bool = True,
    *,
    index_signed: bool = False,
  ) -> tuple[bytes, dict]:
    """Read ``manifest.json`` once, check it against the digest the index records and its detached
    signature; returns (bytes, parsed). A manifest published unsigned (``signed_by`` null) before the
    registry was signed is authenticated by the digest a signed index records for it instead."""
    ref = f"{name}@{version}"
    path = vdir / "manifest.json"
    try:
      raw_bytes = self._read(vdir / "manifest.json", MAX_JSON_BYTES)
    except FileNotFoundError:
      raise self.fail(
        INTEGRITY, IntegrityError(name, version, str(path), "the file is missing"), ref, "manifest.json"
      ) from None
    except UnsafeFile as e:
      raise self.fail(
        INTEGRITY, IntegrityError(name, version, str(path), f"{e}; a manifest is a plain file"), ref, "manifest.json"
      ) from None
    digest_ok = index_digest is None or sha256_bytes(raw_bytes) == index_digest

    def digest_error():
      return self.fail(
        INTEGRITY,
        IntegrityError(
          name,
          version,
          str(path),
          f"sha256 {sha256_bytes(raw_bytes)[:16]}... does not match the "
          f"{index_digest[:16]}... that the index records for it",
        ),
        ref,
        "manifest.json",
      )

    try:
      raw = json.loads(raw_bytes)
      if not isinstance(raw, dict):
        raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as e:
      if not digest_ok:
        raise digest_error() from None
      raise self.fail(
        INTEGRITY, IntegrityError(name, version, str(path), f"not valid JSON ({e})"), ref, "manifest.json"
      ) from None
    if check_signature:  # first: an edited signed manifest is reported as the failed signature it is
      by_digest = index_signed and index_digest is not None
      self._check_manifest_signature(name, version, vdir, raw, by_digest and raw.get("signed_by") is None, by_digest)
    if not digest_ok:
      raise digest_error()
    return raw_bytes, raw

  def _check_manifest_signature(
    self, name: str, version: str, vdir: Path, raw: dict, bound: bool, by_digest: bool = False
  ) -> None:
    """``bound``: an unsigned manifest the signed index vouches for by digest. ``by_digest``: the signed index
    records this manifest's digest, which vouches for it when its own signer was revoked since."""
    ref = f"{name}@{version}"
    sig_path = vdir / "manifest.sig"
    what = f"{ref} manifest.json ({vdir / 'manifest.json'})"
    try:
      sig_bytes = self._read(sig_path, MAX_SIG_BYTES)
    except FileNotFoundError:
      sig_bytes = None
    except UnsafeFile as e:
      raise self.fail(
        SIGNATURE,
        SignatureError(f"{what}: {e}; a signature is a plain file. Republish the thoughtlet"),
        ref,
        "manifest.sig",
      ) from None
    if sig_bytes is None:
      if bound:
        return
      if self.policy.signatures_required:
        raise self.fail(
          SIGNATURE,
          SignatureError(
            f"{what} is not signed ({sig_path} is missing), but signatures are required; sign it with "
            f"`thoughtjax registry build --sign-key`"
          ),
          ref,
          "manifest.sig",
        )
      if (self.signed or raw.get("signed_by")) and not self.policy.allow_unsigned:
        why = "the registry is signed" if self.signed else f"the manifest says key {raw['signed_by']} signed it"
        raise self.fail(
          DOWNGRADE,
          SignatureDowngradeError(
            f"{what}: {sig_path} is missing but {why}; the signature was removed. Restore it from a backup or "
            f"republish the thoughtlet, or open with TrustPolicy(allow_unsigned=True) to read it unsigned"
          ),
          ref,
          "manifest.sig",
        )
      return
    try:
      record = signing.SignatureRecord.from_json(json.loads(sig_bytes))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, signing.SignatureError) as e:
      raise self.fail(
        SIGNATURE,
        SignatureError(f"{what}: {sig_path} is not a signature record ({e}); restore it or republish the thoughtlet"),
        ref,
        "manifest.sig",
      ) from None
    if record.key_id in self.revoked:
      if by_digest:
        return  # signed by a key revoked since; the index (signed by a current key) binds its digest
      raise self.fail(
        SIGNATURE,
        RevokedKeyError(
          f"{what}: signed only by key {record.key_id}, which was revoked for the registry at {self.root}, and the "
          f"signed index records no digest for it; republish the thoughtlet with a current key"
        ),
        ref,
        "manifest.sig",
      )
    try:
      signing.verify(self.keys(), canonical_json(raw), record, what)
    except signing.SignatureError as e:
      raise self.fail(SIGNATURE, SignatureError(f"{e}. {_KEY_FIX}"), ref, "manifest.sig") from None


_KEY_FIX = (
  "If the content is genuine, pass the signer's public key (TrustPolicy(public_keys=...), CLI "
  "--public-key); otherwise restore the file from a backup"
)


def sequence_of(body: dict):
  """The index's sequence number (indexes written before sequences were named call it generation)."""
  return body.get("sequence", body.get("generation"))


def _check_version(v, what: str, bad) -> None:
  if not (isinstance(v, str) and VERSION_RE.fullmatch(v)):
    raise bad(f"{what} is {repr(v)[:80]}; a version is exactly 16 lowercase hex digits (no separators, no '..')")

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
* **No rollback.** Every index carries a signed sequence number that each publish increments.
  A reader or writer refuses an index whose sequence is lower than the highest it has seen for
  the same registry (:class:`RollbackError`). The highest sequences live in a small per-user JSON
  file (``state_file``; default ``$THOUGHTJAX_TRUST_STATE`` or ``<cache dir>/trust-state.json``),
  keyed by the registry id recorded in the index and the registry's directory, so a copy of a
  registry elsewhere is tracked on its own. The file is updated under a lock and replaced
  atomically; it keeps the :data:`STATE_ENTRIES` most recently seen registries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from thoughtjax import signing
from thoughtjax.errors import UserError
from thoughtjax.registry.errors import (
  IntegrityError,
  RegistryError,
  RollbackError,
  SignatureDowngradeError,
  SignatureError,
)
from thoughtjax.registry.layout import (
  MAX_JSON_BYTES,
  MAX_SIG_BYTES,
  VERSION_RE,
  UnsafeFile,
  _read_regular,
  _sha256_bytes,
)
from thoughtjax.thoughtlet import canonical_json

STATE_FORMAT = "thoughtjax.trust-state/1"
STATE_ENV = "THOUGHTJAX_TRUST_STATE"
STATE_ENTRIES = 4096


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
    env = os.environ.get(STATE_ENV)
    if env:
      return Path(env)
    from thoughtjax.fetch import cache_dir

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
      k = signing.load_public_key(_read_regular(root, Path("keys") / p.name, MAX_SIG_BYTES))
    except (UnsafeFile, signing.SignatureError) as e:
      raise SignatureError(
        f"{p}: {e}; a registry's keys directory holds only the PEM public keys of its "
        f"signers. Restore the file from a backup or remove it"
      ) from None
    if signing.key_id(k) == p.stem:  # a key file under another key's name is not that key
      keys[p.stem] = k
  return keys


def state_key(registry_id: str | None, root: Path) -> str:
  return f"{registry_id or 'legacy'}:{Path(root).absolute()}"


class RollbackState:
  """The per-user record of the highest sequence seen per registry (see the module docstring)."""

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
      doc = json.loads(self.path.read_bytes())
    except FileNotFoundError:
      return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RegistryError(
        f"trust state {self.path} is not valid JSON ({e}); it records the highest index "
        f"sequence seen per registry. Delete it to start over (rollback protection then "
        f"restarts from the sequences seen next)"
      ) from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
      got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
      raise RegistryError(
        f"trust state {self.path}: expected format {STATE_FORMAT!r}, got {got!r}; delete it to start over"
      )
    return doc.get("registries", {})

  def get(self, key: str) -> dict | None:
    if self._snapshot is not None:
      return self._snapshot.get(key)
    try:
      return self._read().get(key)
    except OSError as e:
      raise self._unusable(e) from e

  def _unusable(self, e: OSError) -> RegistryError:
    return RegistryError(
      f"trust state {self.path}: cannot be read or written ({e}); it records the highest index "
      f"sequence seen per registry. Point {STATE_ENV} (or TrustPolicy(state_file=...)) at a "
      f"writable file"
    )

  @contextlib.contextmanager
  def _locked(self):
    self.path.parent.mkdir(parents=True, exist_ok=True)
    with open(self.path.with_name(self.path.name + ".lock"), "a+") as f:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)

  def record(self, key: str, sequence: int, signed: bool) -> dict:
    """Raise the stored sequence of ``key`` to ``sequence`` (never lower it); returns the entry."""
    try:
      return self._record(key, sequence, signed)
    except OSError as e:
      raise self._unusable(e) from e

  def _record(self, key: str, sequence: int, signed: bool) -> dict:
    with self._locked():
      entries = self._read()
      old = entries.get(key, {})
      entry = {
        "sequence": max(int(old.get("sequence", -1)), int(sequence)),
        "signed": bool(old.get("signed")) or signed,
        "seen": time.time(),
      }
      if (
        entry["sequence"] == old.get("sequence")
        and entry["signed"] == old.get("signed")
        and key in entries
        and time.time() - float(old.get("seen", 0)) < 3600
      ):
        return old  # nothing new: skip the write
      entries[key] = entry
      if len(entries) > STATE_ENTRIES:  # keep the file small: forget the least recently seen
        entries = dict(sorted(entries.items(), key=lambda kv: -float(kv[1].get("seen", 0)))[:STATE_ENTRIES])
      tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
      with open(tmp, "wb") as f:
        f.write(json.dumps({"format": STATE_FORMAT, "registries": entries}, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, self.path)
      return entry


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

  def _read(self, path: Path, limit: int) -> bytes:
    """A registry file's bytes: a regular file below the root reached without links, at most ``limit``."""
    return _read_regular(self.root, Path(path).relative_to(self.root), limit)

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
  def check_index(self, body: dict, record, state: RollbackState | None, *, seen: int | None = None) -> bool:
    """Check an index read from ``DIR/index.json``; True if it is signed. ``seen``: a sequence this
    process already saw for the registry (in addition to the state file)."""
    path = str(self.root / "index.json")
    self.check_structure(body)
    keys = self.keys(body)
    if record is not None:
      self.signed = True
      what = f"{path} (index signature)"
      try:
        rec = signing.SignatureRecord.from_json(record)
        signing.verify(keys, canonical_json(body), rec, what)
      except signing.SignatureError as e:
        raise self.fail(SIGNATURE, SignatureError(f"{e}. {_KEY_FIX}"), "index", path) from None
      named = body.get("signing_keys")
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
    entry = None if state is None else state.get(state_key(body.get("registry_id"), self.root))
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
    seq = sequence_of(body)
    candidates = ([int(entry["sequence"])] if entry else []) + ([] if seen is None else [int(seen)])
    highest = max(candidates, default=-1)
    if seq < highest:
      raise self.fail(
        ROLLBACK,
        RollbackError(
          f"{path}: index sequence {seq} is lower than {highest}, already seen for registry "
          f"{body.get('registry_id')} at {self.root}; an older index was put back (rollback). Restore the "
          f"newest index.json, or if the registry was deliberately rebuilt at this path remove its entry "
          f"from the trust state {state.path if state else '(none)'}"
        ),
        "index",
        path,
      )
    if state is not None:
      state.record(state_key(body.get("registry_id"), self.root), seq, self.signed)
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

    try:
      current, history = body["current"], body["history"]
      for name, e in current.items():
        if not isinstance(name, str) or not isinstance(e, dict):
          raise bad(f"entry {name!r} of 'current' is not a name -> object entry")
        _check_version(e.get("version"), f"current version of {name!r}", bad)
        if name not in history or e["version"] not in history[name]:
          raise bad(f"current version {e['version']} of {name!r} is missing from its history")
      for name, versions in history.items():
        if not isinstance(versions, list):
          raise bad(f"history of {name!r} is not a list")
        for v in versions:
          _check_version(v, f"version in the history of {name!r}", bad)
      codec = body.get("codec") or {}
      digest = codec.get("digest")
      if not (isinstance(digest, str) and VERSION_RE.fullmatch(digest) and codec.get("dir") == f"codec/{digest}"):
        raise bad(f"codec entry {codec!r} must name dir 'codec/<16 hex digits>' matching its digest")
      seq = sequence_of(body)
      if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise bad(f"sequence {seq!r} is not a non-negative integer")
    except (KeyError, TypeError, AttributeError) as e:
      raise bad(f"malformed index ({type(e).__name__}: {e})") from None

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
    digest_ok = index_digest is None or _sha256_bytes(raw_bytes) == index_digest

    def digest_error():
      return self.fail(
        INTEGRITY,
        IntegrityError(
          name,
          version,
          str(path),
          f"sha256 {_sha256_bytes(raw_bytes)[:16]}... does not match the "
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
      bound = index_signed and index_digest is not None and raw.get("signed_by") is None
      self._check_manifest_signature(name, version, vdir, raw, bound)
    if not digest_ok:
      raise digest_error()
    return raw_bytes, raw

  def _check_manifest_signature(self, name: str, version: str, vdir: Path, raw: dict, bound: bool) -> None:
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
    raise bad(f"{what} is {v!r}; a version is exactly 16 lowercase hex digits (no separators, no '..')")

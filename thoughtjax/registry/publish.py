"""Publishing: new thoughtlet versions become current in one atomic index switch.

:func:`publish_version` takes the writer lock, writes every new version under ``.staging/``, verifies
what it wrote (file digests, signature, and the versioned hash recomputed from a restore), renames
each version directory into place (new, unreferenced directories: invisible to readers), then
writes the new index beside the old one and swaps it in with one ``os.replace``. A process killed
at any point leaves either the old index (and possibly unreferenced new directories, reused or
collected later) or the new one.

A writer signs what it builds on, so it first verifies the index it read and every version that
index names (structure, signature by a trusted or recorded key, sequence against the rollback
state, each manifest's digest and signature): an edited index is refused
(:class:`UntrustedIndexError`), never laundered into a validly signed successor. A signed registry
stays signed: publishing into it without a key is a :class:`SignatureDowngradeError`. Every new
file and directory is fsynced before the rename that makes it reachable.

A version is the first 16 hex digits of the thoughtlet's ``versioned_hash`` (SHA3-512 over its
canonical signature and weights), so versions are content-addressed and immutable: a version
directory, once in place, never changes. The index is the only file that is ever replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from thoughtjax import signing
from thoughtjax.registry.checkpoint import checkpointer, restore_checkpoint, save_checkpoint
from thoughtjax.registry.codec import codec_digest, stage_codec
from thoughtjax.registry.errors import (
  IntegrityError,
  RegistryError,
  ReusedVersionError,
  RevokedKeyError,
  RollbackError,
  SignatureDowngradeError,
  UntrustedIndexError,
)
from thoughtjax.registry.layout import (
  FORMAT,
  MAX_SIG_BYTES,
  VERSION_LEN,
  UnsafeFile,
  dir_name,
  files_under,
  fsync_dir_tree,
  fsync_entry,
  mkdir_durable,
  nest_flat,
  read_index,
  read_regular,
  sha256_bytes,
  sha256_of_file,
  sha256_regular,
  utc_now,
  write_file,
  writer_lock,
)
from thoughtjax.registry.manifest import Manifest, manifest_json
from thoughtjax.registry.trust import (
  DOWNGRADE,
  INTEGRITY,
  WRITER,
  RollbackState,
  TrustPolicy,
  Verifier,
  locations,
  sequence_of,
)
from thoughtjax.thoughtlet import Thoughtlet, canonical_json, versioned_hash
from thoughtjax.thoughtlet.stored import to_stored

StepHook = Callable[[str, "str | None"], None]


def publish_version(
  root: Path,
  thoughtlets: Sequence[Thoughtlet],
  *,
  sign_key,
  on_step: StepHook | None,
  model: dict | None,
  codec,
  order: Sequence[str] | None = None,
  mapping_text: str | None = None,
  trust: TrustPolicy | None = None,
  on_failure=None,
  revoke: Sequence[str] = (),
) -> dict[str, str]:
  """Verify the base, stage, verify, fsync, rename into place, then switch the index (module docstring).
  ``on_failure(kind, thoughtlet, file, reason)`` is told of every refusal before it is raised. ``revoke``:
  key ids the new index drops from its signing keys and lists as revoked (module docstring, keys)."""
  step = on_step or (lambda event, name: None)
  # Packed weights (native blocks, int8 variants) are checkpointed as the arrays their hash covers.
  thoughtlets = [dataclasses.replace(t, params=to_stored(t.params)) for t in thoughtlets]
  count = on_failure or (lambda kind, thoughtlet, file, reason: None)
  key = signing.load_private_key(sign_key) if isinstance(sign_key, (str, os.PathLike)) else sign_key
  key_id = None if key is None else signing.key_id(key.public_key())
  trust = trust or TrustPolicy()
  root = Path(root).absolute()  # Orbax takes absolute paths only
  with writer_lock(root):
    staging_root = root / ".staging"
    if staging_root.is_symlink():
      staging_root.unlink()  # a planted link: staged files never go through it out of the registry
    shutil.rmtree(staging_root, ignore_errors=True)  # only a dead writer leaves anything here
    staging = staging_root / uuid.uuid4().hex
    staging.mkdir(parents=True)
    try:
      old, old_record = read_index(root) if (root / "index.json").exists() else (None, None)
      if old is None and (model is None or codec is None):
        raise RegistryError(f"{root} is not a registry yet; build it first")
      signed_base, revoked = False, set()
      if old is not None:
        signed_base, revoked = _verify_base(root, old, old_record, trust, key, count)
        if old["model"]["config"] != (model or old["model"])["config"]:
          raise RegistryError(
            f"{root} holds thoughtlets of another model ({old['model']['config']}); build into an empty directory"
          )
      _check_keys(root, old, key_id, set(revoke), revoked)
      if signed_base and key is None:
        path = str(root / "index.json")
        count(DOWNGRADE, "index", path, "publish without a key into a signed registry")
        count(WRITER, "index", path, "publish without a key into a signed registry")
        raise SignatureDowngradeError(
          f"{path}: the registry is signed (keys {sorted(old.get('signing_keys') or [])}) but this publish has "
          f"no signing key; it would turn a signed registry unsigned. Pass sign_key= (CLI: --sign-key) with "
          f"the private key of one of its signing keys"
        )
      tok_hash = codec_digest(codec) if codec is not None else old["codec"]["digest"]
      codec_entry = None
      if codec is not None:
        digest, files = stage_codec(staging, codec)
        codec_entry = {"dir": f"codec/{digest}", "digest": digest, "files": files}
        fsync_dir_tree(staging / "codec" / digest)

      published = set() if old is None else {(n, v) for n, vs in old["history"].items() for v in vs}
      staged: list[tuple[Thoughtlet, str, Path]] = []
      versions: dict[str, str] = {}
      digests: dict[str, str] = {}
      for t in thoughtlets:
        vhash = t.versioned_hash()
        version = vhash[:VERSION_LEN]
        versions[t.name] = version
        final = root / "thoughtlets" / dir_name(t.name) / version
        if final.exists():  # content-addressed: this exact version is already here
          digests[f"{t.name}@{version}"] = _check_existing(
            final, t.name, version, vhash, key, (t.name, version) in published, count
          )
          staged.append((t, version, final))
          continue
        vdir = staging / "thoughtlets" / dir_name(t.name) / version
        vdir.mkdir(parents=True)
        step("stage:start", t.name)
        save_checkpoint(vdir / "checkpoint", t.params)
        step("stage:checkpoint", t.name)
        files = {
          str(p.relative_to(vdir)): {"sha256": sha256_of_file(p), "bytes": p.stat().st_size}
          for p in files_under(vdir / "checkpoint")
        }
        parent = None if old is None or t.name not in old["current"] else old["current"][t.name]["version"]
        manifest = manifest_json(t, version, vhash, files, parent, key_id, tok_hash)
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        write_file(vdir / "manifest.json", data)
        digests[f"{t.name}@{version}"] = sha256_bytes(data)
        if key is not None:
          write_file(vdir / "manifest.sig", canonical_json(signing.sign(key, canonical_json(manifest)).to_json()))
        # Every checkpoint file and directory reaches the disk before the rename that makes it reachable.
        fsync_dir_tree(vdir)
        step("stage:manifest", t.name)
        staged.append((t, version, vdir))

      # Verify what is about to become visible: digests, signature, weights as restored.
      keys = {} if key is None else {key_id: key.public_key()}
      for t, version, vdir in staged:
        if vdir.is_relative_to(staging):
          _verify_version_dir(vdir, t.name, version, keys)
        step("verify", t.name)

      # Commit: new version directories first (unreferenced, so invisible), then the index.
      if codec_entry is not None and not (root / codec_entry["dir"]).exists():
        mkdir_durable(root / "codec")
        os.rename(staging / codec_entry["dir"], root / codec_entry["dir"])
        fsync_entry(root / "codec")
      if key is not None:
        mkdir_durable(root / "keys")
        pub = root / "keys" / f"{key_id}.pub"
        if not pub.exists():  # readers list this directory: the file appears whole or not at all
          write_file(staging / f"{key_id}.pub", signing.public_pem(key.public_key()))
          os.replace(staging / f"{key_id}.pub", pub)
          fsync_entry(root / "keys")
      for t, version, vdir in staged:
        final = root / "thoughtlets" / dir_name(t.name) / version
        if vdir != final:
          mkdir_durable(final.parent)
          try:
            os.rename(vdir, final)
          except OSError:
            if not final.exists():
              raise
          fsync_entry(final.parent)
        step("commit:version", t.name)

      body = _next_index(old, staged, model, codec_entry, order, mapping_text, key_id, digests, set(revoke))
      doc = {"index": body, "signature": None if key is None else signing.sign(key, canonical_json(body)).to_json()}
      tmp = staging / "index.json"
      write_file(tmp, json.dumps(doc, indent=1, sort_keys=True).encode())
      step("commit:index-written", None)
      os.replace(tmp, root / "index.json")
      fsync_entry(root)
      step("commit:index", None)
      shutil.rmtree(staging_root, ignore_errors=True)
      try:  # the writer has seen its own sequence; a reader records it on open anyway
        # A new registry (no index before) is the writer's deliberate rebuild of this location: it replaces
        # whatever registry this user saw here before.
        RollbackState(trust.state_path()).record(
          locations(root),
          body["sequence"],
          key is not None,
          registry_id=body["registry_id"],
          signing_keys=body.get("signing_keys") or [],
          revoked=body.get("revoked_keys") or [],
          replace=old is None,
        )
      except RegistryError:
        pass  # the publish is complete; an unwritable state file is reported by the next open
    except BaseException:
      shutil.rmtree(staging_root, ignore_errors=True)  # a refused or failed publish leaves nothing behind
      raise
  return versions


def _check_keys(root: Path, old: dict | None, key_id: str | None, revoke: set, revoked: set) -> None:
  """A writer never signs with a revoked key, and revokes only signing keys of the registry, never its own."""
  if key_id is not None and key_id in revoked | set((old or {}).get("revoked_keys") or []):
    raise RevokedKeyError(
      f"{root}: key {key_id} was revoked for this registry; a writer does not sign with it. Sign with a current "
      f"key (registry/README.md, Key rotation)"
    )
  if not revoke:
    return
  signing_keys = set((old or {}).get("signing_keys") or [])
  if key_id is None or key_id in revoke or not revoke <= signing_keys:
    raise RegistryError(
      f"{root}: revoking keys {sorted(revoke)} needs a signing key that is not revoked (got "
      f"{key_id or 'none'}), and only signing keys of the registry can be revoked (it has {sorted(signing_keys)})"
    )


def _verify_base(root: Path, body: dict, record, trust: TrustPolicy, key, count) -> tuple[bool, set]:
  """Verify the index a writer builds on and every version it names; (whether the registry is signed, the key
  ids revoked there).
  A writer never opts out of signatures (``allow_unsigned``): it would sign what it cannot vouch for."""
  extra = {} if key is None else {signing.key_id(key.public_key()): key.public_key()}
  verifier = Verifier(root, dataclasses.replace(trust, allow_unsigned=False), count, extra_keys=extra)
  digests = body.get("manifest_sha256") or {}
  try:
    verifier.check_index(body, record, RollbackState(trust.state_path()))
    for name, versions in body["history"].items():
      for version in versions:
        vdir = root / "thoughtlets" / dir_name(name) / version
        if version != body["current"].get(name, {}).get("version") and not vdir.exists():
          continue  # an old version removed by gc; nothing refers to it any more
        ref = f"{name}@{version}"
        _, raw = verifier.check_manifest(name, version, vdir, digests.get(ref), index_signed=record is not None)
        if (
          raw.get("name") != name
          or raw.get("version") != version
          or not str(raw.get("versioned_hash", "")).startswith(version)
        ):
          raise verifier.fail(
            INTEGRITY,
            IntegrityError(name, version, str(vdir / "manifest.json"), f"it does not describe {ref}"),
            ref,
            "manifest.json",
          )
  except RollbackError:
    count(WRITER, "index", str(root / "index.json"), "rollback")
    raise
  except RegistryError as e:
    count(WRITER, "index", str(root / "index.json"), str(e))
    raise UntrustedIndexError(
      f"refusing to publish on top of {root / 'index.json'}: {e}. A writer signs the index it builds on, so "
      f"it must verify first; restore the changed files from a backup (or rebuild the registry) and publish "
      f"again"
    ) from e
  return verifier.signed, set(verifier.revoked)


def _check_existing(final: Path, name: str, version: str, vhash: str, key, published: bool, count) -> str:
  """Vouch for a version directory that is already in place; returns its manifest's sha256.

  One the verified index names was checked with it. Any other was left by a writer that died before
  its index switch, or put there by someone else: it is reused only if signed by this publish's key
  (unsigned for an unsigned publish) and its files and weights hash to the version."""
  ref = f"{name}@{version}"
  try:
    data = read_regular(final, "manifest.json")
  except (OSError, UnsafeFile):
    data = b""
  try:
    raw = json.loads(data)
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
    raw = {}
  if not isinstance(raw, dict):
    raw = {}
  if published:
    if raw.get("versioned_hash") != vhash:
      count(INTEGRITY, ref, "manifest.json", "published version's hash differs")
      raise IntegrityError(
        name,
        version,
        str(final / "manifest.json"),
        f"it records versioned hash {str(raw.get('versioned_hash'))[:16]}..., but the weights "
        f"being published hash to {vhash[:16]}...",
      )
    return sha256_bytes(data)
  key_id = None if key is None else signing.key_id(key.public_key())
  sig = final / "manifest.sig"
  problem = None
  if key is None and (sig.exists() or raw.get("signed_by")):
    problem = f"it is signed (by key {raw.get('signed_by')}) but this publish is unsigned"
  elif key is not None:
    try:
      record = signing.SignatureRecord.from_json(json.loads(read_regular(final, "manifest.sig", MAX_SIG_BYTES)))
      signing.verify({key_id: key.public_key()}, canonical_json(raw), record, f"{final / 'manifest.json'}")
    except FileNotFoundError:
      problem = f"it is unsigned, but this publish signs with key {key_id}"
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, UnsafeFile, signing.SignatureError) as e:
      problem = f"its signature is not this publish's (key {key_id}): {e}"
  if problem:
    count(WRITER, ref, str(final), problem)
    raise ReusedVersionError(
      f"{final}: a version directory that no published index names is in the way of {ref}, and {problem}; "
      f"it cannot be vouched for. Run `thoughtjax registry gc {final.parents[2]}` to remove unreferenced "
      f"version directories, then publish again"
    )
  try:
    _verify_version_dir(final, name, version, {} if key is None else {key_id: key.public_key()})
  except (RegistryError, signing.SignatureError, OSError, KeyError, ValueError, TypeError, UnsafeFile) as e:
    count(INTEGRITY, ref, str(final), f"left-over version directory fails verification: {e}")
    raise IntegrityError(
      name,
      version,
      str(final),
      f"a left-over version directory fails verification ({e}); run `thoughtjax registry gc` and publish again",
    ) from None
  return sha256_bytes(data)


def _next_index(
  old: dict | None,
  staged,
  model,
  codec_entry,
  order,
  mapping_text,
  key_id: str | None,
  digests: dict,
  revoke: set = frozenset(),
) -> dict:
  if old is None:
    body = {
      "format": FORMAT,
      "sequence": 0,
      "registry_id": uuid.uuid4().hex,
      "model": model,
      "codec": codec_entry,
      "order": list(order or []),
      "current": {},
      "history": {},
    }
  else:
    body = json.loads(json.dumps(old))
    body["sequence"] = sequence_of(body)
    body.pop("generation", None)  # named sequence since registry ids and rollback checks came in
    body.setdefault("registry_id", uuid.uuid4().hex)
    if codec_entry is not None:
      body["codec"] = codec_entry
  body["sequence"] = int(body["sequence"]) + 1
  revoked = set(body.get("revoked_keys") or []) | set(revoke)
  if key_id is not None:
    body["signing_keys"] = sorted((set(body.get("signing_keys") or []) | {key_id}) - revoked)
  else:
    body.setdefault("signing_keys", [])
  if revoked:
    body["revoked_keys"] = sorted(revoked)
  body.setdefault("manifest_sha256", {}).update(digests)
  for t, version, _ in staged:
    body["current"][t.name] = {
      "version": version,
      "dir": f"thoughtlets/{dir_name(t.name)}/{version}",
      "kind": t.kind.value,
      "layers": None if t.layers is None else list(t.layers),
    }
    hist = body["history"].setdefault(t.name, [])
    if version in hist:
      hist.remove(version)
    hist.append(version)
    if t.name not in body["order"]:
      body["order"].append(t.name)
  if mapping_text is not None:
    body["mapping_sha3_256"] = hashlib.sha3_256(mapping_text.encode()).hexdigest()
  body["published"] = utc_now()
  return body


def _verify_version_dir(vdir: Path, name: str, version: str, keys: dict) -> None:
  """Staged-version check: digests, signature, and the versioned hash of a fresh restore."""
  raw = json.loads(read_regular(vdir, "manifest.json"))
  if keys:
    signing.verify(
      keys,
      canonical_json(raw),
      signing.SignatureRecord.from_json(json.loads(read_regular(vdir, "manifest.sig", MAX_SIG_BYTES))),
      f"{name}@{version} manifest.json (staged)",
    )
  m = Manifest.from_json(raw)  # checks the file list: relative paths below checkpoint/ only
  for rel, spec in m.files.items():
    got, n = sha256_regular(vdir, rel, spec["bytes"])
    if got != spec["sha256"] or n != spec["bytes"]:
      raise IntegrityError(name, version, str(vdir / rel), "staged file changed before commit")
  target = nest_flat({p: jax.ShapeDtypeStruct(tuple(s["shape"]), np.dtype(s["dtype"])) for p, s in m.params.items()})
  params = restore_checkpoint(checkpointer(), vdir / "checkpoint", target)
  if versioned_hash(m.identity(), params) != m.versioned_hash:
    raise IntegrityError(name, version, str(vdir / "checkpoint"), "staged weights do not hash to the version")

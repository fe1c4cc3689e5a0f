"""Calibrations stored in a registry: ``DIR/calibration/<sequence>.json`` plus a detached signature.

Layout::

    DIR/calibration/<sequence>.json   {"registry_id", "sequence", "sha3_256", "calibration": {...}}
    DIR/calibration/<sequence>.sig    Ed25519 signature record over the canonical bytes of the .json
                                      object (absent when the registry is unsigned)

A calibration is written like the index: canonical JSON, fsynced to a temporary file, then one
``os.replace`` under the registry's writer lock. The document records the SHA3-256 of the canonical
calibration bytes, so corruption is caught even in an unsigned registry; in a signed registry the
signature (by one of the keys the index names, or a trusted key) is what makes it authentic, and an
unsigned calibration in a signed registry is a :class:`SignatureDowngradeError`. Writing into a signed
registry without a key is refused the same way, so a signed registry stays signed.

Every refusal on read is counted in :meth:`Registry.stats` (kinds ``integrity``, ``signature``,
``downgrade``) before it is raised, and nothing falls back to another calibration.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from thoughtjax import signing
from thoughtjax.registry.errors import IntegrityError, RegistryError, SignatureDowngradeError, SignatureError
from thoughtjax.registry.layout import (
  MAX_JSON_BYTES,
  MAX_SIG_BYTES,
  UnsafeFile,
  fsync_entry,
  mkdir_durable,
  read_regular,
  write_file,
  writer_lock,
)
from thoughtjax.registry.trust import DOWNGRADE, INTEGRITY, SIGNATURE
from thoughtjax.synthesis.calibration import Calibration, CalibrationError
from thoughtjax.thoughtlet import canonical_json

DIRNAME = "calibration"


class MissingCalibrationError(RegistryError, LookupError):
  """The registry holds no calibration for its current sequence."""


def calibration_path(root: str | os.PathLike, sequence: int) -> Path:
  return Path(root) / DIRNAME / f"{int(sequence)}.json"


def stored_sequences(root: str | os.PathLike) -> list[int]:
  """Sequences with a stored calibration, ascending."""
  d = Path(root) / DIRNAME
  return sorted(int(p.stem) for p in d.glob("*.json") if p.stem.isdigit()) if d.is_dir() else []


def write_calibration(registry, calibration, *, sign_key=None) -> Path:
  """Store ``calibration`` (made at ``registry.sequence``) in ``registry``, signed with ``sign_key``
  (a private key or its PEM path). A signed registry needs a key: its calibration must be signed too."""
  if not isinstance(calibration, Calibration):
    raise TypeError(f"write_calibration takes a Calibration, got {type(calibration).__name__}")
  if calibration.sequence != registry.sequence:
    raise RegistryError(
      f"calibration made at registry sequence {calibration.sequence}, but {registry.root} is at "
      f"sequence {registry.sequence}; calibrate again (thoughtjax registry calibrate DIR)"
    )
  key = signing.load_private_key(sign_key) if isinstance(sign_key, (str, os.PathLike)) else sign_key
  root = Path(registry.root)
  if key is None and (registry.signed or registry.signing_keys):
    registry.record_failure(
      DOWNGRADE, "calibration", str(root / DIRNAME), "calibration without a key into a signed registry"
    )
    raise SignatureDowngradeError(
      f"{root}: the registry is signed (keys {registry.signing_keys}) but no signing key was given for its "
      f"calibration; an unsigned calibration would be refused by every reader. Pass sign_key= (CLI: "
      f"--sign-key) with the private key of one of its signing keys"
    )
  body = calibration.to_json()
  doc = {
    "registry_id": registry.registry_id,
    "sequence": calibration.sequence,
    "sha3_256": hashlib.sha3_256(body).hexdigest(),
    "calibration": json.loads(body),
  }
  data = canonical_json(doc)
  path = calibration_path(root, calibration.sequence)
  with writer_lock(root):
    mkdir_durable(path.parent)
    sig_path = path.with_suffix(".sig")
    if key is not None:
      tmp_sig = path.with_name(f".{path.stem}.sig.{os.getpid()}.tmp")
      write_file(tmp_sig, canonical_json(signing.sign(key, data).to_json()))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_file(tmp, data)
    # The signature goes first: a reader that sees the new .json always finds its own signature.
    if key is not None:
      os.replace(tmp_sig, sig_path)
    elif sig_path.exists():
      os.unlink(sig_path)
    os.replace(tmp, path)
    fsync_entry(path.parent)
  return path


def read_calibration(registry, sequence: int | None = None):
  """The stored :class:`~thoughtjax.synthesis.calibration.Calibration` of ``registry`` at ``sequence``
  (default: its current sequence), its digest and signature checked under the registry's trust policy."""
  seq = registry.sequence if sequence is None else int(sequence)
  root = Path(registry.root)
  path = calibration_path(root, seq)
  what = f"calibration {path}"
  count = registry.record_failure

  def integrity(reason: str) -> IntegrityError:
    count(INTEGRITY, "calibration", str(path), reason)
    return IntegrityError("calibration", str(seq), str(path), reason)

  try:  # a regular file reached without links, bounded (a FIFO or a link to /dev/zero never hangs a reload)
    data = read_regular(root, path.relative_to(root), MAX_JSON_BYTES)
  except UnsafeFile as e:
    raise integrity(f"{e}; a calibration is a plain file") from None
  except FileNotFoundError:
    have = stored_sequences(root)
    raise MissingCalibrationError(
      f"{root} has no calibration for registry sequence {seq}"
      + (f" (it has calibrations for sequences {have}: the registry changed since)" if have else "")
      + f"; calibrate it: thoughtjax registry calibrate {root}"
    ) from None
  sig_path = path.with_suffix(".sig")
  signed_registry = registry.signed or bool(registry.signing_keys)
  if os.path.lexists(sig_path):
    try:
      record = signing.SignatureRecord.from_json(
        json.loads(read_regular(root, sig_path.relative_to(root), MAX_SIG_BYTES))
      )
      signing.verify(registry.verifier.keys(), data, record, what)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, UnsafeFile, signing.SignatureError) as e:
      count(SIGNATURE, "calibration", str(sig_path), str(e))
      raise SignatureError(
        f"{e}. The calibration was changed after it was signed; recalibrate "
        f"(thoughtjax registry calibrate {root} --sign-key KEY) or restore it from a backup"
      ) from None
  elif signed_registry and not registry.trust.allow_unsigned or registry.trust.signatures_required:
    count(DOWNGRADE, "calibration", str(sig_path), "signature missing")
    raise SignatureDowngradeError(
      f"{what}: {sig_path} is missing but the registry is signed (or signatures are required); the signature "
      f"was removed. Recalibrate with --sign-key, or open with TrustPolicy(allow_unsigned=True) to read it "
      f"unsigned"
    )
  try:
    doc = json.loads(data)
    body = canonical_json(doc["calibration"])
    want = doc["sha3_256"]
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError, ValueError) as e:
    raise integrity(f"not a calibration document ({type(e).__name__}: {e})") from None
  got = hashlib.sha3_256(body).hexdigest()
  if got != want:
    raise integrity(f"sha3-256 of the calibration is {got[:16]}..., the document records {str(want)[:16]}...")
  if doc.get("sequence") != seq or doc.get("registry_id") != registry.registry_id:
    raise integrity(
      f"the document is for registry {doc.get('registry_id')} sequence {doc.get('sequence')}, not "
      f"{registry.registry_id} sequence {seq}; it was copied from elsewhere"
    )
  try:
    calibration = Calibration.from_json(body)
  except CalibrationError as e:
    raise integrity(f"malformed calibration: {e}") from None
  if calibration.sequence != seq:
    raise integrity(f"calibration says sequence {calibration.sequence}, stored as {seq}")
  return calibration

"""Ed25519 signatures over canonical manifest bytes (via ``cryptography``).

A key pair is two PEM files: ``NAME.key`` (PKCS#8 private key, mode 0600) and
``NAME.pub`` (SubjectPublicKeyInfo). A key is named by its *key id*, the first 16
hex digits of SHA3-256 over the raw 32-byte public key. A signature record is the
JSON object ``{"algorithm": "ed25519", "key_id": ..., "signature": <base64>}``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from thoughtjax.errors import UserError

ALGORITHM = "ed25519"


class SignatureError(UserError, ValueError):
  """A signature is missing, malformed, made by an unknown key, or does not verify."""


def key_id(public_key: Ed25519PublicKey) -> str:
  raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
  return hashlib.sha3_256(raw).hexdigest()[:16]


def public_pem(public_key: Ed25519PublicKey) -> bytes:
  return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def keygen(path: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
  """Write ``PATH.key`` and ``PATH.pub``; returns both paths. ``PATH`` is a name, not a file name
  to re-suffix: ``keys/team.v2`` writes ``keys/team.v2.key`` (a trailing ``.key``/``.pub`` is dropped)."""
  base = Path(path)
  if base.suffix in (".key", ".pub"):
    base = base.with_suffix("")
  priv_path, pub_path = base.with_name(base.name + ".key"), base.with_name(base.name + ".pub")
  if not overwrite and (priv_path.exists() or pub_path.exists()):
    raise FileExistsError(
      f"{priv_path} or {pub_path} already exists; pass overwrite=True (CLI: --force) to replace the key pair"
    )
  base.parent.mkdir(parents=True, exist_ok=True)
  key = Ed25519PrivateKey.generate()
  pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
  fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(fd, "wb") as f:
    f.write(pem)
  pub_path.write_bytes(public_pem(key.public_key()))
  return priv_path, pub_path


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
  data = Path(path).read_bytes()
  try:
    key = serialization.load_pem_private_key(data, password=None)
  except (ValueError, TypeError) as e:
    raise SignatureError(
      f"{path}: not an unencrypted PEM private key ({e}); create one with `thoughtjax registry keygen`"
    ) from None
  if not isinstance(key, Ed25519PrivateKey):
    raise SignatureError(f"{path}: expected an Ed25519 private key, got {type(key).__name__}")
  return key


def load_public_key(source: str | os.PathLike | bytes) -> Ed25519PublicKey:
  """A public key from a PEM file path or PEM bytes."""
  data = source if isinstance(source, bytes) else Path(source).read_bytes()
  try:
    key = serialization.load_pem_public_key(data)
  except ValueError as e:
    raise SignatureError(f"not a PEM public key ({e})") from None
  if not isinstance(key, Ed25519PublicKey):
    raise SignatureError(f"expected an Ed25519 public key, got {type(key).__name__}")
  return key


@dataclasses.dataclass(frozen=True)
class SignatureRecord:
  key_id: str
  signature: bytes
  algorithm: str = ALGORITHM

  def to_json(self) -> dict:
    return {"algorithm": self.algorithm, "key_id": self.key_id, "signature": base64.b64encode(self.signature).decode()}

  @classmethod
  def from_json(cls, d: dict) -> SignatureRecord:
    try:
      fields = d["key_id"], d["signature"], d["algorithm"]
      if not all(isinstance(f, str) and len(f) <= 4096 for f in fields):
        raise TypeError("key_id, signature and algorithm must be strings of at most 4096 characters")
      return cls(fields[0], base64.b64decode(fields[1], validate=True), fields[2])
    except (KeyError, TypeError, ValueError) as e:
      raise SignatureError(f"malformed signature record {repr(d)[:200]}: {e}") from None


def sign(private_key: Ed25519PrivateKey, message: bytes) -> SignatureRecord:
  return SignatureRecord(key_id(private_key.public_key()), private_key.sign(message))


def verify(public_keys: dict[str, Ed25519PublicKey], message: bytes, record: SignatureRecord, what: str) -> None:
  """Raise :class:`SignatureError` naming ``what`` unless ``record`` verifies."""
  if record.algorithm != ALGORITHM:
    raise SignatureError(f"{what}: signature algorithm {record.algorithm!r}, expected {ALGORITHM!r}")
  key = public_keys.get(record.key_id)
  if key is None:
    raise SignatureError(
      f"{what}: signed by key {record.key_id}, which is not among the trusted "
      f"keys {sorted(public_keys) or '(none)'}; pass its public key"
    )
  try:
    key.verify(record.signature, message)
  except InvalidSignature:
    raise SignatureError(
      f"{what}: the Ed25519 signature by key {record.key_id} does not verify; "
      f"the signed content was changed after signing"
    ) from None

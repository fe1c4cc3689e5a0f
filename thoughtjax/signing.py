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
import secrets
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


def _write_new(path: Path, data: bytes, mode: int) -> None:
  """Put ``data`` at ``path`` as a new file of exactly ``mode``: written to a temporary file beside it (created
  new, never through a link), fsynced, renamed over ``path`` (a link or an old file there is replaced itself,
  never what a link points to, and an old file's wider mode is not kept), then the directory fsynced."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
  try:
    os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(dfd)
  finally:
    os.close(dfd)


def keygen(path: str | os.PathLike, overwrite: bool = False) -> tuple[Path, Path]:
  """Write ``PATH.key`` (mode 0600) and ``PATH.pub`` (0644); returns both paths. ``PATH`` is a name, not a file
  name to re-suffix: ``keys/team.v2`` writes ``keys/team.v2.key`` (a trailing ``.key``/``.pub`` is dropped).
  Each file is written durably and new (see :func:`_write_new`): ``overwrite`` replaces an existing file or a
  link there, never writes through it, and the private key is 0600 even where an old file was wider."""
  base = Path(path)
  if base.suffix in (".key", ".pub"):
    base = base.with_suffix("")
  priv_path, pub_path = base.with_name(base.name + ".key"), base.with_name(base.name + ".pub")
  if not overwrite and (os.path.lexists(priv_path) or os.path.lexists(pub_path)):
    raise FileExistsError(
      f"{priv_path} or {pub_path} already exists; pass overwrite=True (CLI: --force) to replace the key pair"
    )
  base.parent.mkdir(parents=True, exist_ok=True)
  key = Ed25519PrivateKey.generate()
  pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
  _write_new(priv_path, pem, 0o600)
  _write_new(pub_path, public_pem(key.public_key()), 0o644)
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

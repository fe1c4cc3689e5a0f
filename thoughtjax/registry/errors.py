"""Errors of the registry: every refusal is a named :class:`RegistryError` (a ``UserError``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from thoughtjax import signing
from thoughtjax.errors import UserError


class RegistryError(UserError, RuntimeError):
  """A registry cannot be opened, read or updated as asked."""


class RegistryFormatError(RegistryError):
  """A registry (or manifest) was written in another on-disk format than this thoughtjax reads."""


class SignatureError(RegistryError, signing.SignatureError):
  """A registry file's signature is missing, malformed, made by an untrusted key, or does not verify."""


class SignatureDowngradeError(SignatureError):
  """A signed registry presents an unsigned file, or a writer without a key would publish into it."""


class RollbackError(RegistryError):
  """An index's sequence number is lower than one already seen for the same registry."""


class RegistrySwapError(RollbackError):
  """Another registry (another registry id) was put where this user read one: refused like a rollback until
  accepted as a deliberate rebuild (``thoughtjax registry accept DIR``)."""


class RevokedKeyError(SignatureError):
  """Something is signed only by a key that the registry revoked (a published index dropped it)."""


class UntrustedIndexError(RegistryError):
  """A writer refuses to build on an index (or a version it names) that fails verification."""


class ReusedVersionError(RegistryError):
  """A version directory left in place by an earlier writer cannot be reused as this publish's."""


class RestoreError(RegistryError):
  """Orbax could not restore a version whose files passed their checks (memory, sharding, I/O)."""


class ScratchSpaceError(RestoreError):
  """No room to copy a version's files for a verified restore (the memory-backed scratch and the temp dir full)."""


class IntegrityError(RegistryError):
  """A registry file does not match its signed digest (corruption or tampering)."""

  def __init__(self, thoughtlet: str, version: str | None, file: str, reason: str):
    who = thoughtlet if version is None else f"{thoughtlet}@{version}"
    super().__init__(
      f"integrity check failed for {who}: file {file}: {reason}. The file was changed "
      f"after it was published; nothing was loaded from it and no other version is "
      f"used in its place. Republish the thoughtlet or restore the file from a backup."
    )
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
    return (
      f"{self.thoughtlet}: {self.field} declared {self.declared:.6g}, measured "
      f"{self.measured:.6g} (tolerance {self.tolerance})"
    )


class ResourceProfileMismatch(RegistryError):
  """Re-measured resource profiles disagree with the declared ones beyond tolerance."""

  def __init__(self, mismatches: Sequence[Mismatch], fingerprint_note: str = ""):
    lines = "\n  ".join(str(m) for m in mismatches)
    super().__init__(
      f"{len(mismatches)} resource profile value(s) disagree with the manifest:\n  {lines}"
      + (f"\n{fingerprint_note}" if fingerprint_note else "")
    )
    self.mismatches = list(mismatches)

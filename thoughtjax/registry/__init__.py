"""The thoughtlet registry: a directory of Orbax checkpoints, signed manifests and one signed index.

One concept per module: :mod:`.errors`, :mod:`.layout` (on-disk layout, file I/O, fsync),
:mod:`.manifest`, :mod:`.codec`, :mod:`.checkpoint` (Orbax I/O, verified copies), :mod:`.trust`
(TrustPolicy, rollback state, verification of indexes and manifests), :mod:`.lease` (reader leases),
:mod:`.resident` (resident set, stats), :mod:`.store` (the read-only :class:`Registry`), :mod:`.forms` (what a
restore in each weight form reads and returns), :mod:`.versions` (naming a version by a prefix), :mod:`.publish`, :mod:`.verify`, :mod:`.build`, :mod:`.sharding`, :mod:`.gc`.
"""

from thoughtjax.registry.build import build, cut_thoughtlets
from thoughtjax.registry.codec import codec_digest
from thoughtjax.registry.errors import (
  IntegrityError,
  MemoryBudgetError,
  Mismatch,
  RegistryError,
  RegistryFormatError,
  RegistrySwapError,
  ResourceProfileMismatch,
  RestoreError,
  ReusedVersionError,
  RevokedKeyError,
  RollbackError,
  ScratchSpaceError,
  SignatureDowngradeError,
  SignatureError,
  UnknownThoughtletError,
  UntrustedIndexError,
)
from thoughtjax.registry.gc import GcReport, collect_garbage
from thoughtjax.registry.layout import (
  FORMAT,
  FORMAT_VERSION,
  MANIFEST_FORMAT,
  VERSION_LEN,
  dir_name,
  is_older_format,
  is_registry,
)
from thoughtjax.registry.manifest import Manifest
from thoughtjax.registry.publish import StepHook
from thoughtjax.registry.resident import RegistryStats, ResidentSet
from thoughtjax.registry.sharding import param_partition
from thoughtjax.registry.store import Registry
from thoughtjax.registry.trust import TrustPolicy, accept
from thoughtjax.registry.verify import Tolerance, VerifyReport

__all__ = [
  "FORMAT",
  "FORMAT_VERSION",
  "MANIFEST_FORMAT",
  "VERSION_LEN",
  "GcReport",
  "IntegrityError",
  "Manifest",
  "MemoryBudgetError",
  "Mismatch",
  "Registry",
  "RegistryError",
  "RegistryFormatError",
  "RegistryStats",
  "RegistrySwapError",
  "ResidentSet",
  "ResourceProfileMismatch",
  "RestoreError",
  "ScratchSpaceError",
  "ReusedVersionError",
  "RevokedKeyError",
  "RollbackError",
  "SignatureDowngradeError",
  "SignatureError",
  "StepHook",
  "Tolerance",
  "TrustPolicy",
  "UnknownThoughtletError",
  "UntrustedIndexError",
  "VerifyReport",
  "accept",
  "build",
  "codec_digest",
  "collect_garbage",
  "cut_thoughtlets",
  "dir_name",
  "is_older_format",
  "is_registry",
  "param_partition",
]

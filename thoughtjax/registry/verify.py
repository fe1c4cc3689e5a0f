"""Verification of a registry: digests, signatures, versioned hashes, and re-measured profiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from thoughtjax.registry.errors import IntegrityError, Mismatch, ResourceProfileMismatch
from thoughtjax.thoughtlet import Kind, ProfileSettings, ResourceProfile, measure_profile, versioned_hash


@dataclasses.dataclass(frozen=True)
class Tolerance:
  """Relative tolerances of ``verify --hardware``; ``None`` skips a field.

  Parameter bytes must match exactly. Latency is compared as a ratio: measured/declared
  must lie in ``[1/(1+latency), 1+latency]``, unless the two differ by less than
  ``latency_floor_s`` (timer and scheduler noise swamp microsecond-scale steps).
  """

  flops: float | None = 0.02
  peak_memory: float | None = 0.25
  latency: float | None = 1.0
  latency_floor_s: float = 1e-4

  def compare(self, ref: str, d: ResourceProfile, got: ResourceProfile) -> list[Mismatch]:
    out = []
    if d.param_bytes != got.param_bytes:
      out.append(Mismatch(ref, "param_bytes", d.param_bytes, got.param_bytes, "exact"))

    def rel(field, tol):
      a, b = float(getattr(d, field)), float(getattr(got, field))
      if tol is not None and abs(a - b) > tol * max(abs(a), 1e-30):
        out.append(Mismatch(ref, field, a, b, f"±{tol:.0%}"))

    rel("flops_per_token", self.flops)
    rel("peak_memory_bytes", self.peak_memory)
    if self.latency is not None:
      a, b = d.latency_mean_s, got.latency_mean_s
      ratio = b / a if a > 0 else float("inf")
      if abs(b - a) > self.latency_floor_s and not (1 / (1 + self.latency) <= ratio <= 1 + self.latency):
        out.append(Mismatch(ref, "latency_mean_s", a, b, f"x{1 + self.latency:g}"))
    return out


@dataclasses.dataclass
class VerifyReport:
  root: str
  generation: int
  index_signed: bool
  sequence: int = 0
  registry_id: str | None = None
  signing_keys: list = dataclasses.field(default_factory=list)
  thoughtlets: list = dataclasses.field(default_factory=list)
  mismatches: list = dataclasses.field(default_factory=list)


def verify_registry(
  reg,
  *,
  hardware: bool = False,
  all_versions: bool = False,
  tolerance: Tolerance | None = None,
  settings: ProfileSettings | None = None,
  deep: bool = True,
) -> VerifyReport:
  """Check every (current, or every published) version: file digests, signatures and the
  versioned hash recomputed from the restored weights. With ``hardware``, re-measure
  profiles and raise :class:`ResourceProfileMismatch` where they disagree."""
  report = VerifyReport(
    root=str(reg.root),
    generation=reg.sequence,
    index_signed=reg.signed,
    sequence=reg.sequence,
    registry_id=reg.registry_id,
    signing_keys=reg.signing_keys,
  )
  _ = reg.codec  # digests of the tokenizer files
  todo = [(n, v) for n in reg.names for v in (reg.versions(n) if all_versions else [reg.resolve(n)])]
  for name, version in todo:
    m = reg.manifest(name, version)
    reg.check_files(m, reg.version_dir(name, version))
    status = {"ref": m.ref, "signed_by": m.signed_by, "files": len(m.files)}
    if deep:
      params = reg.restore(name, version, weights="stored")  # the arrays the hash covers, as stored
      got = versioned_hash(m.identity(), params)
      if got != m.versioned_hash:
        reg.count_failure(m.ref, "checkpoint", "versioned hash mismatch")
        raise IntegrityError(
          name,
          version,
          str(reg.version_dir(name, version) / "checkpoint"),
          f"the restored weights hash to {got[:16]}..., the manifest says {m.versioned_hash[:16]}...",
        )
      status["versioned_hash"] = "ok"
    report.thoughtlets.append(status)
  if hardware:
    report.mismatches = verify_hardware(reg, tolerance or Tolerance(), settings)
  return report


def verify_hardware(
  reg,
  tolerance: Tolerance,
  settings: ProfileSettings | None = None,
  names: Sequence[str] | None = None,
  raise_on_mismatch: bool = True,
) -> list[Mismatch]:
  """Re-measure the current versions' profiles on this machine and compare."""
  mismatches: list[Mismatch] = []
  notes = set()
  table = None
  for name in names or reg.names:
    m = reg.manifest(name)
    if m.profile is None:
      mismatches.append(Mismatch(m.ref, "resource_profile", float("nan"), float("nan"), "manifest has none"))
      continue
    t = reg.thoughtlet(name)
    if table is None and (t.kind is Kind.TEMPLATE or (t.kind is Kind.HEAD and reg.config.tie_embeddings)):
      table = reg.restore("embed", weights="native")["table"]  # the form build profiled with
    d = m.profile
    s = settings or ProfileSettings(batch=d.batch, context=d.context)
    got = measure_profile(t, s, table)
    for fp_key in ("platform", "device_kind", "cpu", "jax", "jaxlib"):
      if d.fingerprint.get(fp_key) != got.fingerprint.get(fp_key):
        notes.add(f"{fp_key}: declared {d.fingerprint.get(fp_key)!r}, here {got.fingerprint.get(fp_key)!r}")
    mismatches.extend(tolerance.compare(m.ref, d, got))
  if mismatches and raise_on_mismatch:
    note = (
      (
        "The profiles were measured on different hardware/software ("
        + "; ".join(sorted(notes))
        + "); re-run `thoughtjax registry build` here to re-profile."
      )
      if notes
      else ""
    )
    raise ResourceProfileMismatch(mismatches, note)
  return mismatches

"""Calibration records: what each candidate path is worth per hint, and what it costs on this machine.

A :class:`Calibration` is made against one registry sequence (the index ``generation``) on one
machine (``fingerprint``). It holds

* ``candidates``: the paths synthesis may choose, each with the thoughtlets it needs pinned to the
  versions current at that sequence (:class:`Candidate`); exactly one is the full path;
* ``quality[path_hash][hint]``: :class:`HintQuality`, measured against the full path on the hint's
  calibration split and, separately, its held-out split (:class:`PathQuality`);
* ``latency``: the fitted :class:`~thoughtjax.synthesis.latency_params.LatencyParams` of this machine.

The full path is lossless by definition (agreement 1, KL 0, ΔNLL 0) and need not be measured. So is a
*speculative* candidate (kind ``speculative``): the full path's units verifying what a :class:`DraftPlan`
proposes, in one program (:mod:`thoughtjax.decode.speculative`); greedy it gives the full path's tokens, sampled
its distribution. Its quality is the full path's; its cost is the full path's with the decode factor
calibration measured for it (``latency.corrections``), the draft's own units restored beside.

JSON form (``to_json``): canonical (sorted keys, no spaces, UTF-8, no NaN) so the bytes can be hashed
and signed like the registry index; ``{"format": "thoughtjax.calibration", "version": 1, ...}``.
``from_json`` refuses another format or version and any malformed field with
:class:`CalibrationError`, naming the field, the expected and the received value.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from thoughtjax.synthesis.candidate import (
  CalibrationError,
  Candidate,
  CandidateKind,
  json_count,
  json_fields,
  json_number,
)
from thoughtjax.synthesis.latency import LatencyModel
from thoughtjax.synthesis.latency_params import LatencyModelError, LatencyParams
from thoughtjax.thoughtlet import canonical_json

FORMAT = "thoughtjax.calibration"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------------- quality
@dataclasses.dataclass(frozen=True)
class PathQuality:
  """A path against the full path on one split of one hint's corpus.

  ``top1_agreement`` in [0, 1]: share of positions where the next-token argmax agrees;
  ``mean_kl`` >= 0 (nats): mean KL(full || path); ``delta_nll`` (nats/token): path NLL minus full NLL
  (may be negative); ``tokens``: positions measured.
  """

  top1_agreement: float
  mean_kl: float
  delta_nll: float
  tokens: int

  def __post_init__(self):
    json_number(self.top1_agreement, "top1_agreement", 0.0, 1.0)
    json_number(self.mean_kl, "mean_kl")
    json_number(self.delta_nll, "delta_nll", -math.inf)
    json_count(self.tokens, "tokens")

  def to_json(self) -> dict:
    return {
      "top1_agreement": float(self.top1_agreement),
      "mean_kl": float(self.mean_kl),
      "delta_nll": float(self.delta_nll),
      "tokens": int(self.tokens),
    }

  @classmethod
  def from_json(cls, d: Any, where: str) -> PathQuality:
    d = json_fields(d, where, {"top1_agreement", "mean_kl", "delta_nll", "tokens"})
    return cls(
      json_number(d["top1_agreement"], f"{where}.top1_agreement", 0.0, 1.0),
      json_number(d["mean_kl"], f"{where}.mean_kl"),
      json_number(d["delta_nll"], f"{where}.delta_nll", -math.inf),
      json_count(d["tokens"], f"{where}.tokens"),
    )


LOSSLESS = PathQuality(1.0, 0.0, 0.0, 0)


@dataclasses.dataclass(frozen=True)
class HintQuality:
  """One path on one hint: floors are checked on ``calibration``; ``heldout`` shows whether they generalize."""

  calibration: PathQuality
  heldout: PathQuality

  def to_json(self) -> dict:
    return {"calibration": self.calibration.to_json(), "heldout": self.heldout.to_json()}

  @classmethod
  def from_json(cls, d: Any, where: str) -> HintQuality:
    d = json_fields(d, where, {"calibration", "heldout"})
    return cls(
      PathQuality.from_json(d["calibration"], f"{where}.calibration"),
      PathQuality.from_json(d["heldout"], f"{where}.heldout"),
    )


LOSSLESS_HINT = HintQuality(LOSSLESS, LOSSLESS)


# ----------------------------------------------------------------------------- calibration
@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
  """Candidates, their per-hint quality and this machine's latency parameters, for one registry sequence.

  ``current`` (optional): the registry's current version of each thoughtlet name at ``sequence``; a
  candidate pinned to any other version is refused, so synthesis can never choose an older version.
  Records are not to be mutated after construction (planners precompute from them).
  """

  sequence: int
  fingerprint: str
  candidates: tuple[Candidate, ...]
  quality: Mapping[str, Mapping[str, HintQuality]]
  latency: LatencyParams
  current: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "candidates", tuple(self.candidates))
    json_count(self.sequence, "calibration sequence")
    if not isinstance(self.fingerprint, str) or not self.fingerprint:
      raise CalibrationError(f"calibration fingerprint: expected a non-empty string, got {self.fingerprint!r}")
    hashes = [c.path_hash for c in self.candidates]
    dup = sorted({h for h in hashes if hashes.count(h) > 1})
    if dup:
      raise CalibrationError(
        f"calibration candidates: path hashes {dup} appear more than once; keep one record per path"
      )
    full = [c for c in self.candidates if c.kind is CandidateKind.FULL]
    if len(full) != 1:
      raise CalibrationError(
        f"calibration candidates: expected exactly one full path (kind 'full'), got "
        f"{len(full)}; the full path is always a candidate"
      )
    unknown = sorted(set(self.quality) - set(hashes))
    if unknown:
      raise CalibrationError(
        f"calibration quality: entries for unknown path hashes {unknown}; every quality entry must name a candidate"
      )
    for h, per_hint in self.quality.items():
      for hint, q in per_hint.items():
        if not isinstance(q, HintQuality):
          raise CalibrationError(f"calibration quality[{h}][{hint}]: expected a HintQuality, got {q!r}")
    full_refs = [u.ref for u in full[0].units]
    for c in self.candidates:
      if c.draft is not None and [u.ref for u in c.units] != full_refs:
        raise CalibrationError(
          f"speculative candidate {c.path_hash} verifies with {[u.ref for u in c.units]}, not the full path "
          f"{full_refs}: only the full path verifies losslessly; rebuild it from the full path's units"
        )
      for u in c.all_units:
        cur = self.current.get(u.name)
        if cur is not None and cur != u.version:
          raise CalibrationError(
            f"candidate {c.path!r} ({c.path_hash}) needs {u.ref}, but the current version of {u.name} at "
            f"registry sequence {self.sequence} is {cur!r}; a calibration only pins current versions. "
            f"Recalibrate (thoughtjax registry calibrate DIR)"
          )
    # Every unit must have a measured cost, so planning never fails on a missing key mid-request.
    probe = LatencyModel(self.latency)
    for c in self.candidates:
      try:
        probe.check(c)
      except LatencyModelError as e:
        raise CalibrationError(f"calibration latency: {e}") from None

  @property
  def full(self) -> Candidate:
    return next(c for c in self.candidates if c.kind is CandidateKind.FULL)

  @functools.cached_property
  def lossless(self) -> frozenset[str]:
    """Path hashes of the full path and the speculative candidates (the full path's quality by construction)."""
    return frozenset(c.path_hash for c in self.candidates if c.kind in (CandidateKind.FULL, CandidateKind.SPECULATIVE))

  def hint_quality(self, path_hash: str, hint: str) -> HintQuality | None:
    """Measured quality of a path on a hint; ``None``: not calibrated. The full path is lossless, and a
    speculative candidate has the full path's quality (measured or lossless)."""
    got = self.quality.get(path_hash, {}).get(hint)
    if path_hash in self.lossless and path_hash != self.full.path_hash:
      return self.hint_quality(self.full.path_hash, hint)
    if got is None and path_hash == self.full.path_hash:
      return LOSSLESS_HINT
    return got

  @property
  def hints(self) -> tuple[str, ...]:
    return tuple(sorted({h for per in self.quality.values() for h in per}))

  # ---- JSON
  def to_dict(self) -> dict:
    return {
      "format": FORMAT,
      "version": FORMAT_VERSION,
      "sequence": self.sequence,
      "fingerprint": self.fingerprint,
      "current": dict(self.current),
      "candidates": [c.to_json() for c in self.candidates],
      "quality": {h: {hint: q.to_json() for hint, q in per.items()} for h, per in self.quality.items()},
      "latency": self.latency.to_json(),
    }

  def to_json(self) -> bytes:
    """Canonical bytes: sorted keys, no spaces, UTF-8 (what is hashed and signed)."""
    return canonical_json(self.to_dict())

  def digest(self) -> str:
    return hashlib.sha3_256(self.to_json()).hexdigest()

  @classmethod
  def from_json(cls, data: bytes | str | Mapping) -> Calibration:
    """Parse and validate a calibration document; refuses another format or version."""
    if isinstance(data, (bytes, str)):
      try:
        d = json.loads(data)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CalibrationError(
          f"calibration: not valid JSON ({e}); regenerate it with thoughtjax registry calibrate DIR"
        ) from None
    else:
      d = data
    if not isinstance(d, Mapping):
      raise CalibrationError(f"calibration: expected a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT or d.get("version") != FORMAT_VERSION:
      raise CalibrationError(
        f"calibration: expected format {FORMAT!r} version {FORMAT_VERSION}, got format "
        f"{d.get('format')!r} version {d.get('version')!r}; recalibrate with this "
        f"thoughtjax (thoughtjax registry calibrate DIR)"
      )
    d = json_fields(
      d, "calibration", {"format", "version", "sequence", "fingerprint", "current", "candidates", "quality", "latency"}
    )
    current = d["current"]
    if not isinstance(current, Mapping) or not all(isinstance(v, str) for v in current.values()):
      raise CalibrationError(f"calibration.current: expected an object of name -> version, got {current!r}")
    if not isinstance(d["candidates"], list):
      raise CalibrationError(f"calibration.candidates: expected a list, got {type(d['candidates']).__name__}")
    candidates = tuple(Candidate.from_json(c, f"calibration.candidates[{i}]") for i, c in enumerate(d["candidates"]))
    if not isinstance(d["quality"], Mapping):
      raise CalibrationError(f"calibration.quality: expected an object, got {type(d['quality']).__name__}")
    quality = {}
    for h, per in d["quality"].items():
      if not isinstance(per, Mapping):
        raise CalibrationError(f"calibration.quality[{h}]: expected an object of hint -> quality, got {per!r}")
      quality[h] = {hint: HintQuality.from_json(q, f"calibration.quality[{h}][{hint}]") for hint, q in per.items()}
    try:
      latency = LatencyParams.from_json(d["latency"], "calibration.latency")
    except LatencyModelError as e:
      raise CalibrationError(str(e)) from None
    if not isinstance(d["fingerprint"], str):
      raise CalibrationError(f"calibration.fingerprint: expected a string, got {d['fingerprint']!r}")
    return cls(
      json_count(d["sequence"], "calibration.sequence"), d["fingerprint"], candidates, quality, latency, dict(current)
    )

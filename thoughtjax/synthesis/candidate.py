"""Candidate records: a path synthesis may choose, pinned to the versions of the thoughtlets it runs.

A :class:`Candidate` names its :class:`Unit`\\ s in execution order (``name@version``, parameter bytes, layers,
cost key), its identity (:func:`path_hash_of`) and its program layout (:func:`program_of`); a speculative one
also its :class:`DraftPlan`. The records sit below both the latency model (which prices a candidate) and the
calibration record (which stores candidates with their quality and the fitted latency), so neither imports
the other to reach them. Malformed records raise :class:`CalibrationError` (the error of every calibration
record), naming the field, the expected and the received value.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from thoughtjax.errors import UserError
from thoughtjax.path_syntax import VARIANTS, PathSyntaxError, parse_path, split_variant


class CalibrationError(UserError, ValueError):
  """A calibration document or record is malformed, of another format version, or inconsistent."""


class CandidateKind(enum.StrEnum):
  EXIT = "exit"
  SKIP = "skip"
  REPEAT = "repeat"
  FULL = "full"
  BRIDGED = "bridged"
  VARIANT = "variant"
  SPECULATIVE = "speculative"
  MANUAL = "manual"


def json_number(v: Any, where: str, lo: float = 0.0, hi: float = math.inf) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
    raise CalibrationError(f"{where}: expected a finite number in [{lo}, {hi}], got {v!r}")
  return float(v)


def json_count(v: Any, where: str) -> int:
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise CalibrationError(f"{where}: expected an integer >= 0, got {v!r}")
  return v


def json_fields(d: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> Mapping:
  if not isinstance(d, Mapping):
    raise CalibrationError(f"{where}: expected an object, got {type(d).__name__}")
  missing, extra = required - set(d), set(d) - required - set(optional)
  if missing or extra:
    raise CalibrationError(
      f"{where}: expected keys {sorted(required)}"
      + (f" (optional {sorted(optional)})" if optional else "")
      + f"; missing {sorted(missing)}, unknown {sorted(extra)}"
    )
  return d


# ------------------------------------------------------------------------------ candidates
@dataclasses.dataclass(frozen=True)
class Unit:
  """One thoughtlet a path runs, pinned: ``name@version``, its parameter bytes (restore cost), the
  number of transformer layers it runs (compile cost), and the key of its measured prefill/decode cost
  (default: its ref; thoughtlets of identical shape and format may share one). A weight variant is a
  thoughtlet of its own whose name carries the variant (``blocks[0:2)@int8``, ref ``blocks[0:2)@int8@<version>``)."""

  name: str
  version: str
  nbytes: int = 0
  layers: int = 0
  cost_key: str = ""

  def __post_init__(self):
    for f in ("name", "version"):
      v = getattr(self, f)
      # A name may end in one variant suffix (its base is checked like any name); a version never has '@'.
      base = split_variant(v)[0] if f == "name" and isinstance(v, str) else v
      if not isinstance(v, str) or not base or "@" in base or "," in v:
        raise CalibrationError(
          f"unit {f}: expected a non-empty string without ',' or '@'"
          + (f" (a name may end in one weight variant: @{', @'.join(VARIANTS)})" if f == "name" else "")
          + f", got {v!r}"
        )
    json_count(self.nbytes, f"unit {self.ref} nbytes")
    json_count(self.layers, f"unit {self.ref} layers")
    if not self.cost_key:
      object.__setattr__(self, "cost_key", self.ref)

  @property
  def ref(self) -> str:
    return f"{self.name}@{self.version}"

  def to_json(self) -> dict:
    return {
      "name": self.name,
      "version": self.version,
      "nbytes": self.nbytes,
      "layers": self.layers,
      "cost_key": self.cost_key,
    }

  @classmethod
  def from_json(cls, d: Any, where: str) -> Unit:
    d = json_fields(d, where, {"name", "version", "nbytes", "layers", "cost_key"})
    try:
      return cls(d["name"], d["version"], d["nbytes"], d["layers"], d["cost_key"])
    except CalibrationError as e:
      raise CalibrationError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class DraftPlan:
  """What drafts for a speculative candidate.

  ``path``: the draft's pinned refs as a path string (what :func:`thoughtjax.decode.speculative.resolve_draft`
  takes); ``draft_tokens``: K drafted per verify pass; ``vocab``: the size of a truncated draft head, or
  None; ``units``: the thoughtlets the draft reads that the full path does not (bridges, weight variants):
  restored with the candidate, and a failure of one blocks it; ``layers``: transformer layers the draft
  runs (the program compiles them beside the full path's).
  """

  path: str
  draft_tokens: int
  vocab: int | None = None
  units: tuple[Unit, ...] = ()
  layers: int = 0

  def __post_init__(self):
    object.__setattr__(self, "units", tuple(self.units))
    if not isinstance(self.path, str) or not self.path.strip():
      raise CalibrationError(f"draft path: expected a path string, got {self.path!r}")
    if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or self.draft_tokens < 1:
      raise CalibrationError(f"draft {self.path!r} draft_tokens: expected an integer >= 1, got {self.draft_tokens!r}")
    if self.vocab is not None and (isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 1):
      raise CalibrationError(f"draft {self.path!r} vocab: expected None or an integer >= 1, got {self.vocab!r}")
    json_count(self.layers, f"draft {self.path!r} layers")

  @property
  def weights(self) -> tuple[str, ...]:
    """The weight variants its path reads (``("int8",)`` for the full path in int8 weights); empty: the full
    path's own weights."""
    return tuple(dict.fromkeys(r.variant for r in _draft_refs(self.path) if r.variant is not None))

  @property
  def label(self) -> str:
    """The draft as one line: path, K, its weight form and the truncated head (what plans and traces show)."""
    extra = "".join(f", weights={w}" for w in self.weights) + ("" if self.vocab is None else f", vocab={self.vocab}")
    return f"{self.path} (k={self.draft_tokens}{extra})"

  def to_json(self) -> dict:
    return {
      "path": self.path,
      "draft_tokens": self.draft_tokens,
      "vocab": self.vocab,
      "units": [u.to_json() for u in self.units],
      "layers": self.layers,
    }

  @classmethod
  def from_json(cls, d: Any, where: str) -> DraftPlan:
    d = json_fields(d, where, {"path", "draft_tokens", "vocab", "units", "layers"})
    if not isinstance(d["units"], list):
      raise CalibrationError(f"{where}.units: expected a list, got {type(d['units']).__name__}")
    units = tuple(Unit.from_json(u, f"{where}.units[{i}]") for i, u in enumerate(d["units"]))
    try:
      return cls(d["path"], d["draft_tokens"], d["vocab"], units, d["layers"])
    except CalibrationError as e:
      raise CalibrationError(f"{where}: {e}") from None


def _draft_refs(path: str):

  try:
    return parse_path(path)
  except PathSyntaxError:  # a label that is not a path names no variant; resolving it fails loudly later
    return []


def _layout_item(item: str) -> str:
  """One ref of a draft path without its version: ``blocks[0:2)@int8@3fa2`` -> ``blocks[0:2)@int8`` (the
  variant stays: int8 blocks compile another program than f32 ones)."""
  base, at, last = item.strip().rpartition("@")
  return item.strip() if not at or last in VARIANTS else _layout_item(base)


def _draft_line(draft: DraftPlan | None, ref: bool) -> str:
  if draft is None:
    return ""
  path = draft.path if ref else ", ".join(_layout_item(p) for p in draft.path.split(","))
  return f"\ndraft:{path}|k={draft.draft_tokens}|vocab={draft.vocab}"


def path_hash_of(units: Sequence[Unit], draft: DraftPlan | None = None) -> str:
  """A path's identity: the same hash as :func:`thoughtjax.assembly.path_hash` over its resolved units
  (a speculative candidate's also covers its draft)."""
  return hashlib.sha3_256(("\n".join(u.ref for u in units) + _draft_line(draft, True)).encode()).hexdigest()[:16]


def program_of(units: Sequence[Unit], draft: DraftPlan | None = None) -> str:
  """A path's program layout: its unit names in order without versions (weights are program arguments,
  so two versions of one layout share a compiled program); a speculative one's also its draft's layout."""
  return hashlib.sha3_256(("\n".join(u.name for u in units) + _draft_line(draft, False)).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A path synthesis may choose. ``units`` are in execution order (a repeated span appears twice);
  ``path_hash`` must equal :func:`path_hash_of` of them (and of ``draft``). ``draft``: set exactly for a
  speculative candidate, whose ``units`` are the full path's (they verify) and ``path`` the full path."""

  path: str
  kind: CandidateKind
  units: tuple[Unit, ...]
  path_hash: str
  program: str
  draft: DraftPlan | None = None

  def __post_init__(self):
    object.__setattr__(self, "units", tuple(self.units))
    try:
      object.__setattr__(self, "kind", CandidateKind(self.kind))
    except ValueError:
      raise CalibrationError(
        f"candidate {self.path!r} kind: expected one of {[k.value for k in CandidateKind]}, got {self.kind!r}"
      ) from None
    if not self.units:
      raise CalibrationError(f"candidate {self.path!r}: no units; a path runs at least embed and head")
    if (self.kind is CandidateKind.SPECULATIVE) != (self.draft is not None):
      raise CalibrationError(
        f"candidate {self.path!r}: kind {self.kind.value!r} with draft {self.draft!r}; a draft is given exactly "
        f"for kind 'speculative' (build it with thoughtjax.synthesis.derived_candidates.speculative_candidates)"
      )
    want = path_hash_of(self.units, self.draft)
    if self.path_hash != want:
      raise CalibrationError(
        f"candidate {self.path!r}: path_hash {self.path_hash!r} does not match its units "
        f"(expected {want!r}); the record was altered or built by hand, rebuild it with "
        f"Candidate.build"
      )

  @classmethod
  def build(
    cls, path: str, kind: CandidateKind | str, units: Sequence[Unit], draft: DraftPlan | None = None
  ) -> Candidate:
    units = tuple(units)
    return cls(path, kind, units, path_hash_of(units, draft), program_of(units, draft), draft)

  @property
  def all_units(self) -> tuple[Unit, ...]:
    """Every unit it reads: its own, then its draft's."""
    return self.units + (() if self.draft is None else self.draft.units)

  @property
  def refs(self) -> tuple[str, ...]:
    """The distinct thoughtlets it needs (a draft's too), ``name@version``, in first-use order."""
    return tuple(dict.fromkeys(u.ref for u in self.all_units))

  def to_json(self) -> dict:
    out = {
      "path": self.path,
      "kind": self.kind.value,
      "units": [u.to_json() for u in self.units],
      "path_hash": self.path_hash,
      "program": self.program,
    }
    if self.draft is not None:  # absent otherwise: earlier calibrations keep their bytes and signatures
      out["draft"] = self.draft.to_json()
    return out

  @classmethod
  def from_json(cls, d: Any, where: str) -> Candidate:
    d = json_fields(d, where, {"path", "kind", "units", "path_hash", "program"}, {"draft"})
    if not isinstance(d["path"], str) or not d["path"].strip():
      raise CalibrationError(f"{where}.path: expected a path string, got {d['path']!r}")
    if not isinstance(d["units"], list):
      raise CalibrationError(f"{where}.units: expected a list, got {type(d['units']).__name__}")
    units = tuple(Unit.from_json(u, f"{where}.units[{i}]") for i, u in enumerate(d["units"]))
    for k in ("path_hash", "program"):
      if not isinstance(d[k], str):
        raise CalibrationError(f"{where}.{k}: expected a string, got {d[k]!r}")
    draft = None if d.get("draft") is None else DraftPlan.from_json(d["draft"], f"{where}.draft")
    try:
      return cls(d["path"], d["kind"], units, d["path_hash"], d["program"], draft)
    except CalibrationError as e:
      raise CalibrationError(f"{where}: {e}") from None

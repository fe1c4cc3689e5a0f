"""Latency parameters of one machine: the linear costs the latency model prices a path with, and their file form.

Contract: :class:`LinearCost` is ``ms = a + b * x`` with ``a, b >= 0``; :func:`fit_linear` fits one by least
squares from measured ``(x, ms)`` points and keeps it non-negative; :class:`Measurements` are the raw points
calibration takes, and :class:`LatencyParams` the fits of every stage's cost (the formulas are in
:mod:`thoughtjax.synthesis.latency`), with the factors calibration measured (``corrections``) and the batching fits
(``rows``). ``from_json`` validates everything it reads and raises :class:`LatencyModelError`, naming the field, the
expected and the received value; ``to_json`` writes what ``from_json`` reads back. :data:`STAGES` names the five
stages of a prediction and :data:`FACTOR_BOUNDS` the range every correction factor is kept in.

This is the bottom of the latency modules: :mod:`~thoughtjax.synthesis.latency_context`,
:mod:`~thoughtjax.synthesis.latency_load` and :mod:`~thoughtjax.synthesis.latency` import from it, never the reverse.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from thoughtjax.errors import UserError

STAGES = ("synthesis", "restore", "compile", "prefill", "decode")
FACTOR_BOUNDS = (0.25, 4.0)


class LatencyModelError(UserError, ValueError):
  """Latency parameters are missing, malformed, or cannot be fitted; the message says which and how to fix."""


# The key of LatencyParams.rows whose fit prices a path measured without one of its own (the full path's).
ROWS_DEFAULT = "default"


# ----------------------------------------------------------------------------- fitting
@dataclasses.dataclass(frozen=True)
class LinearCost:
  """``ms = a + b * x`` with ``a, b >= 0``."""

  a: float
  b: float = 0.0

  def __call__(self, x: float) -> float:
    return self.a + self.b * x

  def to_json(self) -> dict:
    return {"a": float(self.a), "b": float(self.b)}

  @classmethod
  def from_json(cls, d: Any, where: str) -> LinearCost:
    if not isinstance(d, Mapping) or set(d) != {"a", "b"}:
      raise LatencyModelError(f"{where}: expected an object {{\"a\": ms, \"b\": ms per unit}}, got {d!r}")
    vals = []
    for k in ("a", "b"):
      v = d[k]
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise LatencyModelError(f"{where}.{k}: expected a finite number >= 0, got {v!r}")
      vals.append(float(v))
    return cls(*vals)


def fit_linear(points: Iterable[tuple[float, float]], what: str) -> LinearCost:
  """Least-squares ``ms = a + b x`` through measured ``(x, ms)`` points, kept non-negative.

  One distinct ``x`` gives a constant (``b = 0``). A negative slope (noise on a flat cost) refits
  a constant; a negative intercept refits a line through the origin. ``what`` names the fit in errors.
  """
  pts = np.asarray(list(points), dtype=np.float64).reshape(-1, 2)
  if len(pts) == 0:
    raise LatencyModelError(
      f"{what}: no measurements to fit; measure at least one size (thoughtjax registry calibrate --latency-only)"
    )
  if not np.isfinite(pts).all() or (pts < 0).any():
    raise LatencyModelError(f"{what}: measurements must be finite and >= 0, got {pts.tolist()}")
  x, y = pts[:, 0], pts[:, 1]
  if len(np.unique(x)) < 2:
    return LinearCost(float(y.mean()))
  A = np.stack([np.ones_like(x), x], axis=1)
  (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
  if b < 0:
    return LinearCost(float(y.mean()))
  if a < 0:
    return LinearCost(0.0, float((x @ y) / (x @ x)))
  return LinearCost(float(a), float(b))


@dataclasses.dataclass(frozen=True)
class Measurements:
  """Raw latency measurements, one list of ``(x, ms)`` points per fit.

  ``prefill[cost_key]``: (prompt tokens, ms of one prefill through that thoughtlet);
  ``decode[cost_key]``: (context length, ms of one decode step through it); ``restore``: (bytes, ms);
  ``compile[prompt bucket]``: (layers run, ms); ``step``: per-step fixed overhead samples (ms);
  ``synthesis``: planning overhead samples (ms). Batch size 1.
  """

  prefill: Mapping[str, Sequence[tuple[float, float]]]
  decode: Mapping[str, Sequence[tuple[float, float]]]
  restore: Sequence[tuple[float, float]]
  compile: Mapping[int, Sequence[tuple[float, float]]]
  step: Sequence[float] = (0.0,)
  synthesis: Sequence[float] = (0.0,)


# ---------------------------------------------------------------------------- parameters
@dataclasses.dataclass(frozen=True)
class LatencyParams:
  """Fitted latency parameters of one machine (the formulas: :mod:`thoughtjax.synthesis.latency`).

  ``corrections`` holds learned factors: ``{"global": {stage: g}, "paths": {path_hash: {stage: r}}}`` (a path's
  factor is g * r; see :mod:`thoughtjax.synthesis.latency`), and ``"hints": {hint: {path_hash: {stage: r}}}``: a
  path's factor measured on one hint's requests, where it differs by hint (a draft from the text itself is accepted
  more often in code than in prose); a request's hints replace the path's ``r`` with theirs (the largest of them).
  ``rows``: path hash -> a decode step of ``W`` rows over one row's (``rows[h](W)``, 1 at one row), measured at
  calibration; ``rows["default"]`` (the full path's) prices a path measured without one of its own (its layers are
  the full path's), and without it a step of ``W`` rows costs ``W`` (no gain from batching).
  """

  prefill: Mapping[str, LinearCost]
  decode: Mapping[str, LinearCost]
  restore: LinearCost
  compile: Mapping[int, LinearCost]
  step_ms: float = 0.0
  synthesis_ms: float = 0.0
  corrections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  rows: Mapping[str, LinearCost] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.compile:
      raise LatencyModelError(
        "latency parameters have no compile fit; measure compile time for at least "
        "one prompt bucket (thoughtjax registry calibrate --latency-only)"
      )
    for name in ("step_ms", "synthesis_ms"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise LatencyModelError(f"latency {name}: expected a finite number >= 0, got {v!r}")

  @classmethod
  def fit(cls, m: Measurements) -> LatencyParams:
    """Least-squares fits of every cost from raw measurements."""
    return cls(
      prefill={k: fit_linear(v, f"prefill[{k}]") for k, v in m.prefill.items()},
      decode={k: fit_linear(v, f"decode[{k}]") for k, v in m.decode.items()},
      restore=fit_linear(m.restore, "restore"),
      compile={int(k): fit_linear(v, f"compile[{k}]") for k, v in m.compile.items()},
      step_ms=max(0.0, float(np.mean(m.step))),
      synthesis_ms=max(0.0, float(np.mean(m.synthesis))),
    )

  def to_json(self) -> dict:
    return {
      "prefill": {k: c.to_json() for k, c in self.prefill.items()},
      "decode": {k: c.to_json() for k, c in self.decode.items()},
      "restore": self.restore.to_json(),
      "compile": {str(k): c.to_json() for k, c in self.compile.items()},
      "step_ms": float(self.step_ms),
      "synthesis_ms": float(self.synthesis_ms),
      "corrections": corrections_json(self.corrections, "latency.corrections"),
      **({"rows": {h: c.to_json() for h, c in self.rows.items()}} if self.rows else {}),
    }

  @classmethod
  def from_json(cls, d: Any, where: str = "latency") -> LatencyParams:
    keys = {"prefill", "decode", "restore", "compile", "step_ms", "synthesis_ms", "corrections", "rows"}
    if not isinstance(d, Mapping):
      raise LatencyModelError(f"{where}: expected an object, got {type(d).__name__}")
    if set(d) - keys or {"prefill", "decode", "restore", "compile"} - set(d):
      raise LatencyModelError(
        f"{where}: expected keys {sorted(keys)} (corrections, rows, step_ms, synthesis_ms optional), got {sorted(d)}"
      )

    def table(name):
      t = d[name]
      if not isinstance(t, Mapping):
        raise LatencyModelError(f"{where}.{name}: expected an object of cost key -> {{a, b}}, got {t!r}")
      return {k: LinearCost.from_json(v, f"{where}.{name}[{k}]") for k, v in t.items()}

    compile_ = {}
    for k, v in table("compile").items():
      if not str(k).isdigit() or int(k) <= 0:
        raise LatencyModelError(f"{where}.compile: keys are prompt buckets (positive integers), got {k!r}")
      compile_[int(k)] = v
    return cls(
      prefill=table("prefill"),
      decode=table("decode"),
      restore=LinearCost.from_json(d["restore"], f"{where}.restore"),
      compile=compile_,
      step_ms=d.get("step_ms", 0.0),
      synthesis_ms=d.get("synthesis_ms", 0.0),
      corrections=corrections_json(d.get("corrections", {}), f"{where}.corrections"),
      rows=table("rows") if "rows" in d else {},
    )


def factor_json(v: Any, where: str) -> float:
  """A correction factor read from a file: a number in :data:`FACTOR_BOUNDS`, else :class:`LatencyModelError`."""
  lo, hi = FACTOR_BOUNDS
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
    raise LatencyModelError(f"{where}: expected a correction factor in [{lo}, {hi}], got {v!r}")
  return float(v)


def _stage_factors(d: Any, where: str) -> dict[str, float]:
  if not isinstance(d, Mapping) or set(d) - set(STAGES):
    raise LatencyModelError(f"{where}: expected an object of stage -> factor with stages {list(STAGES)}, got {d!r}")
  return {s: factor_json(v, f"{where}.{s}") for s, v in d.items()}


def corrections_json(d: Any, where: str) -> dict:
  """Validate and copy learned corrections (plain dicts, canonical-JSON ready)."""
  if not isinstance(d, Mapping) or set(d) - {"global", "paths", "hints"}:
    raise LatencyModelError(
      f"{where}: expected {{\"global\": {{stage: f}}, \"paths\": {{path_hash: {{stage: f}}}}, \"hints\": "
      f"{{hint: {{path_hash: {{stage: f}}}}}}}}, got {d!r}"
    )
  paths, hints = d.get("paths", {}), d.get("hints", {})
  for name, v in (("paths", paths), ("hints", hints)):
    if not isinstance(v, Mapping):
      raise LatencyModelError(f"{where}.{name}: expected an object, got {v!r}")
  out: dict = {}
  if d.get("global"):
    out["global"] = _stage_factors(d["global"], f"{where}.global")
  if paths:
    out["paths"] = {h: _stage_factors(f, f"{where}.paths[{h}]") for h, f in paths.items()}
  if hints:
    out["hints"] = {}
    for hint, per_path in hints.items():
      if not isinstance(per_path, Mapping):
        raise LatencyModelError(f"{where}.hints[{hint}]: expected an object of path_hash -> stages, got {per_path!r}")
      out["hints"][hint] = {h: _stage_factors(f, f"{where}.hints[{hint}][{h}]") for h, f in per_path.items()}
  return out

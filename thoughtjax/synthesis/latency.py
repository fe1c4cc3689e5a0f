"""The latency model: what a path will cost on this machine, stage by stage, before it runs.

A request's latency is predicted as five stages (milliseconds)::

    synthesis  planning overhead (a measured constant)
    restore    sum over the path's thoughtlets not yet resident of  r.a + r.b * bytes
               (r.a: fixed cost per restore, 1 / r.b: measured restore bandwidth in bytes/ms)
    compile    0 when the program key is compiled, else  c[bucket].a + c[bucket].b * layers_run
               (one fit per prompt-length bucket; the nearest measured bucket serves others)
    prefill    sum over the executed thoughtlets of  p[u].a + p[u].b * P          (P = bucket(T))
    decode     (N - 1) * (step_ms + sum over units of  d[u].a + d[u].b * S)      (S = bucket(T) + bucket(N))

for a prompt of T tokens and N new tokens. The shapes are those the program runs (``decode/program.py``): the
prefill runs over the prompt left-padded to its bucket P and yields the first token; each of the N - 1
decode steps attends over the whole KV cache of S slots (masked), whatever the context so far. So prefill
cost steps at bucket edges and a decode step costs the same throughout one request.

Under load (:class:`Load`, a server's slot engines with the streams they decode now), a request that joins its
path's busy engine pays that engine's step, as the engine measured it over its latest chunks, at the width it
computes with one row more (scaled by ``rows[path]``, how the path batches, measured at calibration:
:attr:`LatencyParams.rows`); an engine that has not stepped yet is priced by the fits at that width. A request
in an engine of its own shares the cores with every busy engine: its step costs ``1 + CONTENTION * k`` idle
steps beside ``k`` of them. So a variant alone beside a busy engine can cost far less per token than joining
that engine.

Units are counted as executed, so a repeated span costs twice in prefill and decode but is
restored once. Each linear cost is fitted by least squares from measurements at several sizes
(:func:`fit_linear`) and is non-negative by construction, so decode cost is non-decreasing in the
number of tokens and "how many tokens fit the budget" is a monotone search.

Learning from traces (:meth:`LatencyModel.update`): the model keeps multiplicative corrections per
stage, **per execution context** (:class:`LatencyContext`: engine — plain, speculative or a slot engine —,
weight form, batch width, kernels). A correction belongs to the context that taught it and a prediction
applies only its own context's: a server's slot engine, slower per stream and under load, never moves the
prediction of a command line's plain program. Within a context: a global factor g (how this machine runs now:
load, clocks) and, per path hash, a relative factor r (how that path deviates from the rest); a path's factor
is g * r (r = 1 for a path never traced). An observed ratio q = ``actual / raw`` moves g toward q (step
``global_alpha``) and the path's own factor g * r toward q (step ``alpha``), stored as r relative to the new
g: an observation's weight halves after about 7 later ones (g) or 2 (a path's own). Because load moves g for
every path at once, a path that has run is not made to look slower than one that has not merely because the
machine got busier. Corrections also decay with age: a context's factors relax halfway back to the
calibration's every :data:`HALF_LIFE_S` (6 hours) without an observation there, and a context silent for
:data:`MAX_AGE_S` is dropped. Ratios and factors are clipped to ``[1/4, 4]`` so one outlier cannot swing a
plan by more than 4x. Stages predicted at zero (already resident, already compiled) carry no information
and are not learned from, and a run that compiled its program teaches only restore and compile: its prefill
and decode carry one-off first-run costs that a warm request never pays (``LatencyTrace.compiled``). A run in a
slot engine is learned at the width its steps computed (``LatencyTrace.width``, the mean over its steps): streams
that joined or left its engine after it was planned scale its raw decode by the path's batching fit, so a burst
of requests, each planned before the next arrived, does not teach the model that every path got slower.
A candidate whose cost is not the sum of its units (a speculative plan: draft and verify in one
program) starts from a per-path factor that calibration measured, stored in ``corrections``: its units are
the full path's, so its raw decode is the full path's, and its decode factor is its measured decode time per
token over the full path's, on the calibration text (acceptance included). Its draft's own units add to
restore, and the draft's layers to compile.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from thoughtjax.decode.program import bucket
from thoughtjax.errors import UserError
from thoughtjax.serving.pool import choose_engine
from thoughtjax.serving.slots import width

if TYPE_CHECKING:
  from thoughtjax.synthesis.candidate import Candidate

STAGES = ("synthesis", "restore", "compile", "prefill", "decode")
FACTOR_BOUNDS = (0.25, 4.0)


class LatencyModelError(UserError, ValueError):
  """Latency parameters are missing, malformed, or cannot be fitted; the message says which and how to fix."""


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
  """Fitted latency parameters of one machine (see the module docstring for the formulas).

  ``corrections`` holds learned factors: ``{"global": {stage: g}, "paths": {path_hash: {stage: r}}}`` (a path's
  factor is g * r; see the module docstring), and ``"hints": {hint: {path_hash: {stage: r}}}``: a path's factor
  measured on one hint's requests, where it differs by hint (a draft from the text itself is accepted more often
  in code than in prose); a request's hints replace the path's ``r`` with theirs (the largest of them).
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
      "corrections": _corrections_json(self.corrections, "latency.corrections"),
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
      corrections=_corrections_json(d.get("corrections", {}), f"{where}.corrections"),
      rows=table("rows") if "rows" in d else {},
    )


def _factor(v: Any, where: str) -> float:
  lo, hi = FACTOR_BOUNDS
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
    raise LatencyModelError(f"{where}: expected a correction factor in [{lo}, {hi}], got {v!r}")
  return float(v)


def _stage_factors(d: Any, where: str) -> dict[str, float]:
  if not isinstance(d, Mapping) or set(d) - set(STAGES):
    raise LatencyModelError(f"{where}: expected an object of stage -> factor with stages {list(STAGES)}, got {d!r}")
  return {s: _factor(v, f"{where}.{s}") for s, v in d.items()}


def _corrections_json(d: Any, where: str) -> dict:
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


# ----------------------------------------------------------------------------- contexts
ENGINES = ("plain", "speculative", "slots", "masked")
# What a constrained request's decode step costs beyond a plain one, before any correction is learned: the
# program steps once per call instead of once per chunk, and the host fills the row's allowed-token mask
# from its grammar matcher. ``thoughtjax bench structured --overhead`` on the default model (f32, batch 1, quiet
# 2-core machine): 30.1 ms a free step, 32.0 ms a constrained one (BENCHMARKS.md, "Structured output").
MASKED_STEP_MS = 1.9
# What a decode step of a request in an engine of its own costs beside each busy slot engine, over its idle step,
# minus 1. Measured on the default model (2-core machine, BENCHMARKS.md "Plans under a server's load"): the int8
# full path's 64 tokens took 1.38x to 1.79x their time alone (median 1.6x of 8 runs) beside a float32 slot engine
# decoding 7 streams.
CONTENTION = 0.6
# The key of LatencyParams.rows whose fit prices a path measured without one of its own (the full path's).
ROWS_DEFAULT = "default"
# A context's learned factors relax halfway back to the calibration's every this many seconds without a new
# observation there (the machine, its load and its software change; an old correction is a guess).
HALF_LIFE_S = 6 * 3600.0
# Past this age a context's corrections weigh under 1/256 of what they did: dropped, not kept around.
MAX_AGE_S = 8 * HALF_LIFE_S


@dataclasses.dataclass(frozen=True)
class LatencyContext:
  """Where a program runs, which is what a learned correction belongs to (a correction learned in one context
  never moves a prediction in another).

  ``engine``: ``plain`` (one request's own program), ``speculative`` (draft and verify in one program) or
  ``slots`` (a slot engine's shared decode program: a server's continuous batching) or ``masked`` (one
  request's own program stepping once per call under an output constraint); ``weights``: the form
  restores give (f32, native); ``batch``: the program's batch width (1 alone; a slot engine's slot count,
  which it decodes whole every chunk whatever the rows in use); ``kernels``: the kernel implementation.
  """

  engine: str = "plain"
  weights: str = "f32"
  batch: int = 1
  kernels: str = "xla"

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise LatencyModelError(f"latency context engine: expected one of {list(ENGINES)}, got {self.engine!r}")
    if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
      raise LatencyModelError(f"latency context batch: expected an integer >= 1, got {self.batch!r}")
    for name in ("weights", "kernels"):
      v = getattr(self, name)
      if not isinstance(v, str) or not v or "|" in v:
        raise LatencyModelError(f"latency context {name}: expected a non-empty name without '|', got {v!r}")

  @property
  def key(self) -> str:
    """``engine|weights|b<batch>|kernels``: the context's name in the corrections file and in plans."""
    return f"{self.engine}|{self.weights}|b{self.batch}|{self.kernels}"

  @classmethod
  def from_key(cls, key: Any) -> LatencyContext:
    parts = key.split("|") if isinstance(key, str) else []
    if len(parts) != 4 or not parts[2].startswith("b") or not parts[2][1:].isdigit():
      raise LatencyModelError(f"latency context {key!r}: expected 'engine|weights|b<batch>|kernels'")
    return cls(parts[0], parts[1], int(parts[2][1:]), parts[3])

  def label(self) -> str:
    """The context in words (what ``plan --explain`` prints)."""
    engine = {
      "plain": "plain program",
      "speculative": "speculative program",
      "slots": f"slot engine of {self.batch} slots",
      "masked": "constrained program (one step per call)",
    }[self.engine]
    batch = "" if self.engine == "slots" else f", batch {self.batch}"
    return f"{engine}, {self.weights} weights{batch}, {self.kernels} kernels"


def _count_json(v: Any, where: str) -> int:
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise LatencyModelError(f"{where}: expected a count >= 0, got {v!r}")
  return v


def _learned_stages(d: Any, where: str) -> tuple[dict[str, float], dict[str, int]]:
  """``{stage: {"factor": f, "observations": n}}`` -> (factors, counts)."""
  if not isinstance(d, Mapping) or set(d) - set(STAGES):
    raise LatencyModelError(f"{where}: expected an object of stage -> {{factor, observations}}, got {d!r}")
  factors, counts = {}, {}
  for s, v in d.items():
    if not isinstance(v, Mapping) or set(v) != {"factor", "observations"}:
      raise LatencyModelError(f"{where}.{s}: expected {{\"factor\": f, \"observations\": n}}, got {v!r}")
    factors[s] = _factor(v["factor"], f"{where}.{s}.factor")
    counts[s] = _count_json(v["observations"], f"{where}.{s}.observations")
  return factors, counts


@dataclasses.dataclass(frozen=True)
class Learned:
  """What one context learned: the machine-wide factor per stage (``glob``), each path's factor relative to
  it (``paths``), how many observations taught each (``n_glob``, ``n_paths``), how many runs in all
  (``observations``) and when it last learned (``updated``, unix seconds). Replaced whole on every update."""

  glob: Mapping[str, float] = dataclasses.field(default_factory=dict)
  paths: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
  n_glob: Mapping[str, int] = dataclasses.field(default_factory=dict)
  n_paths: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
  observations: int = 0
  updated: float = 0.0

  def to_json(self) -> dict:
    def stages(f, n):
      return {s: {"factor": float(f[s]), "observations": int(n.get(s, 0))} for s in f}

    out: dict = {"updated": float(self.updated), "observations": int(self.observations)}
    if self.glob:
      out["global"] = stages(self.glob, self.n_glob)
    if self.paths:
      out["paths"] = {h: stages(f, self.n_paths.get(h, {})) for h, f in self.paths.items() if f}
    return out

  @classmethod
  def from_json(cls, d: Any, where: str) -> Learned:
    if not isinstance(d, Mapping) or set(d) - {"updated", "observations", "global", "paths"}:
      raise LatencyModelError(
        f"{where}: expected {{updated, observations, global: {{stage: {{factor, observations}}}}, paths: "
        f"{{path_hash: {{stage: ...}}}}}}, got {d!r}"
      )
    updated = d.get("updated")
    if isinstance(updated, bool) or not isinstance(updated, (int, float)) or not math.isfinite(updated):
      raise LatencyModelError(f"{where}.updated: expected unix seconds, got {updated!r}")
    glob, n_glob = _learned_stages(d.get("global", {}), f"{where}.global")
    paths = d.get("paths", {})
    if not isinstance(paths, Mapping):
      raise LatencyModelError(f"{where}.paths: expected an object, got {paths!r}")
    pf, pn = {}, {}
    for h, v in paths.items():
      pf[str(h)], pn[str(h)] = _learned_stages(v, f"{where}.paths[{h}]")
    return cls(glob, pf, n_glob, pn, _count_json(d.get("observations", 0), f"{where}.observations"), float(updated))


# ----------------------------------------------------------------------------- predicting
@dataclasses.dataclass(frozen=True)
class Residency:
  """What is warm right now: resident thoughtlet refs (``name@version``) and compiled program keys."""

  resident: frozenset[str] = frozenset()
  compiled: frozenset[str] = frozenset()

  def __post_init__(self):
    object.__setattr__(self, "resident", frozenset(self.resident))
    object.__setattr__(self, "compiled", frozenset(self.compiled))


COLD = Residency()


@dataclasses.dataclass(frozen=True)
class EngineLoad:
  """One slot engine now: its path, the streams in its slots or waiting for them (``rows``), its ring length
  (``cache_len``, the cache every step attends over) and, once it has stepped, the wall ms of one of its latest
  steps (``step_ms``, a median) at the width it then computed (``width``)."""

  path_hash: str
  rows: int
  cache_len: int
  width: int = 0
  step_ms: float | None = None

  def __post_init__(self):
    for name, least in (("rows", 0), ("cache_len", 1), ("width", 0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise LatencyModelError(f"engine load {name}: expected an integer >= {least}, got {v!r}")
    if self.step_ms is not None and (
      isinstance(self.step_ms, bool)
      or not isinstance(self.step_ms, (int, float))
      or not math.isfinite(self.step_ms)
      or self.step_ms <= 0
      or self.width < 1
    ):
      raise LatencyModelError(
        f"engine load step_ms: expected None or ms > 0 measured at a width >= 1, got {self.step_ms!r} at "
        f"width {self.width!r}"
      )


@dataclasses.dataclass(frozen=True)
class Load:
  """What a server's slot engines (``slots`` slots each) decode now (:class:`EngineLoad` each, idle ones
  dropped); ``Load()`` is an idle machine without slot engines."""

  engines: tuple[EngineLoad, ...] = ()
  slots: int = 1

  def __post_init__(self):
    if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
      raise LatencyModelError(f"load slots: expected an integer >= 1, got {self.slots!r}")
    object.__setattr__(self, "engines", tuple(e for e in self.engines if e.rows > 0))

  @classmethod
  def of_pool(cls, pool) -> Load:
    """The load of an engine pool now (:meth:`EnginePool.occupancy <thoughtjax.serving.pool.EnginePool.occupancy>`)."""
    engines = (EngineLoad(h, rows, ring, *(recent or (0, None))) for h, rows, ring, recent in pool.occupancy())
    return cls(tuple(engines), pool.slots)

  @property
  def rows(self) -> int:
    return sum(e.rows for e in self.engines)

  def of(self, path_hash: str, cache_len: int = 1) -> EngineLoad | None:
    """The engine of ``path_hash`` a request attending over ``cache_len`` slots joins (of those whose ring holds
    it, the one with the most streams, as an engine pool picks), or None."""
    return choose_engine(((e, e.rows, e.cache_len) for e in self.engines if e.path_hash == path_hash), cache_len)

  def describe(self) -> str:
    if not self.engines:
      return "idle"
    n = len(self.engines)
    return f"{self.rows} stream{'s' * (self.rows != 1)} decoding in {n} engine{'s' * (n != 1)}"


IDLE = Load()


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted ms per stage for one path and request (corrections applied), and the raw model values.

  ``decode_terms = (A, B)``: one decode step over a cache of ``cache_len`` slots costs ``A + B * cache_len``
  raw ms, before the decode factor ``decode_factor``; this lets :meth:`tokens_within` and trace learning
  re-evaluate decode for another token count (the cache is that of the request's program).
  ``context``: the execution context predicted for; ``corrections``: stage -> (factor, ``"path"`` or
  ``"global"``) for every factor != 1 applied; ``observations``: stage -> how many runs in that context taught
  it (0: measured by calibration, e.g. a speculative plan's decode); ``correction_age_s``: seconds since that
  context last learned (None when it never did). Under ``load`` a raw decode step costs ``load_factor`` idle
  ones (module docstring); ``width``: the rows of the step it was predicted to share (1: alone or in an idle
  engine; a busy engine's streams plus this one, padded as the engine pads them).
  """

  path_hash: str
  prompt_tokens: int
  max_tokens: int
  synthesis: float
  restore: float
  compile: float
  prefill: float
  decode: float
  raw: Mapping[str, float]
  decode_terms: tuple[float, float]
  decode_factor: float
  program_key: str
  cache_len: int = 0
  corrections: Mapping[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
  context: LatencyContext = LatencyContext()
  observations: Mapping[str, int] = dataclasses.field(default_factory=dict)
  correction_age_s: float | None = None
  load_factor: float = 1.0
  load: Load = IDLE
  width: int = 1
  # stage -> the request's hints' factor over the path's own (LatencyParams "hints"), where one applied: learning
  # divides it out, so what a run on one hint's text teaches the path does not move the other hints twice
  hint_scale: Mapping[str, float] = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> float:
    return self.synthesis + self.restore + self.compile + self.prefill + self.decode

  def stage(self, name: str) -> float:
    return getattr(self, name)

  def raw_decode(self, tokens: int) -> float:
    """Raw decode ms until ``tokens`` tokens are out: the prefill gives the first, each other is one step."""
    A, B = self.decode_terms
    return max(int(tokens) - 1, 0) * (A + B * self.cache_len) * self.load_factor

  def tokens_within(self, budget_ms: float) -> int:
    """How many decode tokens (at most ``max_tokens``) fit ``budget_ms`` after the fixed stages."""
    left = budget_ms - (self.synthesis + self.restore + self.compile + self.prefill)
    if left < 0:
      return 0
    lo, hi = 0, self.max_tokens  # decode cost is non-decreasing in n: binary search the last fit
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if self.decode_factor * self.raw_decode(mid) <= left:
        lo = mid
      else:
        hi = mid - 1
    return lo

  def to_json(self) -> dict:
    return {"total": self.total, **{s: self.stage(s) for s in STAGES}}


@dataclasses.dataclass(frozen=True)
class LatencyTrace:
  """What a run measured, for :meth:`LatencyModel.update`: its prediction, actual ms per stage
  (any subset of :data:`STAGES`), the tokens it produced (``None``: as predicted), whether it compiled
  its program (then its prefill and decode are not learned from), the context it ran in (``None``: the
  one predicted; a server's slot engine is another) and ``width``, the mean rows of the steps it shared in a
  slot engine (``None``: as predicted): streams that joined or left its engine after it was planned change
  what its decode cost, which is the load's doing, not the model's error."""

  prediction: Prediction
  actual_ms: Mapping[str, float]
  tokens_out: int | None = None
  compiled: bool = False
  context: LatencyContext | None = None
  width: float | None = None


@dataclasses.dataclass(frozen=True)
class _Costs:
  """Per-candidate sums, computed once: prefill and decode coefficients, distinct units, layers."""

  prefill: LinearCost
  decode: LinearCost
  units: tuple[tuple[str, int], ...]  # distinct (ref, bytes)
  layers: int
  program: str


def _clip(v: float) -> float:
  lo, hi = FACTOR_BOUNDS
  return min(hi, max(lo, v))


class LatencyModel:
  """Predicts stage latencies from :class:`LatencyParams` and learns corrections from traces, per
  :class:`LatencyContext` (module docstring).

  ``context``: the context a prediction is for when the caller names none (a speculative candidate is always
  predicted in the speculative one); ``learned``: context key -> :class:`Learned` (what earlier processes
  learned, e.g. from the corrections file); ``clock``: unix seconds (ages). Thread-safe for concurrent
  ``predict`` and ``update`` (updates replace a context's record under a lock).
  """

  def __init__(
    self,
    params: LatencyParams,
    *,
    alpha: float = 0.3,
    global_alpha: float = 0.1,
    context: LatencyContext | None = None,
    learned: Mapping[str, Learned] | None = None,
    half_life_s: float = HALF_LIFE_S,
    clock=None,
  ):

    for name, v in (("alpha", alpha), ("global_alpha", global_alpha)):
      if not 0 < v <= 1:
        raise LatencyModelError(f"LatencyModel {name}: expected a step in (0, 1], got {v!r}")
    if not half_life_s > 0:
      raise LatencyModelError(f"LatencyModel half_life_s: expected seconds > 0, got {half_life_s!r}")
    self.params = params
    self.alpha, self.global_alpha, self.half_life_s = alpha, global_alpha, float(half_life_s)
    self.context = context or LatencyContext()
    self.clock = clock or time.time
    # The calibration's own factors (a speculative plan's measured decode): the base of every context, what
    # learned factors start from and decay back to.
    corr = _corrections_json(params.corrections, "latency.corrections")
    self._base_global: dict[str, float] = dict(corr.get("global", {}))
    self._base_paths: dict[str, dict[str, float]] = {h: dict(f) for h, f in corr.get("paths", {}).items()}
    self._base_hints: dict[str, dict[str, dict[str, float]]] = corr.get("hints", {})
    self._learned: dict[str, Learned] = {}
    for key, rec in (learned or {}).items():
      LatencyContext.from_key(key)  # a malformed key is refused here, not at the first prediction
      self._learned[key] = rec
    self._dirty: set[str] = set()
    self._costs: dict[str, _Costs] = {}
    self._lock = threading.Lock()
    self.updates = 0

  # ---- per-candidate sums
  def check(self, candidate: Candidate) -> None:
    """Raise :class:`LatencyModelError` if a thoughtlet of ``candidate`` has no measured cost."""
    self._candidate_costs(candidate)

  def _candidate_costs(self, c: Candidate) -> _Costs:
    got = self._costs.get(c.path_hash)
    if got is not None:
      return got
    pa = pb = da = db = 0.0
    for u in c.units:
      p, d = self.params.prefill.get(u.cost_key), self.params.decode.get(u.cost_key)
      if p is None or d is None:
        raise LatencyModelError(
          f"path {c.path_hash} ({c.path}) needs {u.ref}, whose cost key {u.cost_key!r} has no measured "
          f"{'prefill' if p is None else 'decode'} cost; measured keys: {sorted(self.params.prefill)}. "
          f"Re-measure latency on this machine (thoughtjax registry calibrate --latency-only)"
        )
      pa, pb, da, db = pa + p.a, pb + p.b, da + d.a, db + d.b
    seen: dict[str, int] = {}
    draft = getattr(c, "draft", None)
    for u in (*c.units, *(() if draft is None else draft.units)):  # a draft's own units are restored too
      seen.setdefault(u.ref, u.nbytes)
    costs = _Costs(
      LinearCost(pa, pb),
      LinearCost(da + self.params.step_ms, db),
      tuple(seen.items()),
      # A speculative program compiles the draft's layers beside the full path's.
      sum(u.layers for u in c.units) + (0 if draft is None else draft.layers),
      c.program,
    )
    self._costs[c.path_hash] = costs
    return costs

  def _compile_fit(self, prompt_bucket: int) -> LinearCost:
    fits = self.params.compile
    got = fits.get(prompt_bucket)
    if got is None:  # nearest measured bucket (in log2 distance), the smaller one on a tie
      key = min(fits, key=lambda b: (abs(math.log2(b) - math.log2(prompt_bucket)), b))
      got = fits[key]
    return got

  @classmethod
  def warm_residency(cls, candidates, prompt_tokens: int, max_tokens: int) -> Residency:
    """Every one of ``candidates`` restored and its program compiled at these shape buckets: a warm process."""
    return Residency(
      {r for c in candidates for r in c.refs},
      {cls.program_key(c.program, prompt_tokens, max_tokens) for c in candidates},
    )

  @staticmethod
  def program_key(program: str, prompt_tokens: int, max_tokens: int) -> str:
    """The compiled-program key of a path layout at a request's shape buckets."""
    return f"{program}|T{bucket(prompt_tokens)}|N{bucket(max_tokens)}"

  # ---- contexts
  def context_for(self, candidate: Candidate, context: LatencyContext | None = None) -> LatencyContext:
    """The context ``candidate`` runs in: ``context`` (default: the model's), except that a speculative
    candidate always runs its own speculative program, alone."""
    ctx = context or self.context
    if getattr(candidate, "draft", None) is not None and ctx.engine != "speculative":
      ctx = dataclasses.replace(ctx, engine="speculative", batch=1)
    return ctx

  def learned(self) -> dict[str, Learned]:
    """Context key -> what it has learned (records, as of the last update there)."""
    return dict(self._learned)

  def _weight(self, rec: Learned, now: float) -> float:
    """How much of a context's learned deviation still counts: halves every ``half_life_s`` of silence."""
    return 0.5 ** (max(0.0, now - rec.updated) / self.half_life_s)

  def _hint_bases(self, path_hash: str, hints: Sequence[str]) -> dict[str, float]:
    """stage -> the largest factor the calibration measured for ``path_hash`` on one of ``hints``' requests."""
    out: dict[str, float] = {}
    for hint in hints:
      for s, r in self._base_hints.get(hint, {}).get(path_hash, {}).items():
        out[s] = max(out.get(s, 0.0), r)
    return out

  def _bases(self, path_hash: str, stage: str) -> tuple[float, float]:
    return self._base_global.get(stage, 1.0), self._base_paths.get(path_hash, {}).get(stage, 1.0)

  def _factor_from(
    self, path_hash: str, stage: str, ctx: LatencyContext, now: float | None = None
  ) -> tuple[float, str, int]:
    """(g * r clipped, "path" when the path has a factor of its own, else "global", observations behind it).

    g and r decay toward the calibration's (1 unless calibration measured one) in log space: a factor
    learned ``t`` seconds ago counts as ``base * (learned / base) ** 0.5 ** (t / half_life_s)``."""
    base_g, base_r = self._bases(path_hash, stage)
    own_base = stage in self._base_paths.get(path_hash, {})
    rec = self._learned.get(ctx.key)
    if rec is None:
      return _clip(base_g * base_r), "path" if own_base else "global", 0
    w = self._weight(rec, self.clock() if now is None else now)
    g = base_g * (rec.glob.get(stage, base_g) / base_g) ** w
    own = rec.paths.get(path_hash, {})
    if stage in own:
      r = base_r * (own[stage] / base_r) ** w
      return _clip(g * r), "path", rec.n_paths.get(path_hash, {}).get(stage, 0)
    return _clip(g * base_r), "path" if own_base else "global", rec.n_glob.get(stage, 0)

  def factor(self, path_hash: str, stage: str, context: LatencyContext | None = None) -> float:
    return self._factor_from(path_hash, stage, context or self.context)[0]

  def predict(
    self,
    candidate: Candidate,
    prompt_tokens: int,
    max_tokens: int,
    residency: Residency = COLD,
    context: LatencyContext | None = None,
    constrained: bool = False,
    load: Load = IDLE,
    hints: Sequence[str] = (),
  ) -> Prediction:
    """Stage latencies (ms) of ``candidate`` for a prompt of ``prompt_tokens`` and ``max_tokens`` decode
    steps, given what ``residency`` says is already restored and compiled, with the corrections learned in
    the context it runs in (:meth:`context_for`) and no other. ``constrained``: the request decodes one step
    per call under an output constraint, each step :data:`MASKED_STEP_MS` dearer (a ``masked`` context always
    is). ``load``: the slot engines decoding now (module docstring; a speculative candidate decodes alone beside
    them). ``hints``: the request's; where the calibration measured the path per hint, the largest of their
    factors stands for the path's own (:class:`LatencyParams`)."""
    c = self._candidate_costs(candidate)
    ctx = self.context_for(candidate, context)
    T, n = prompt_tokens, max_tokens
    resident = residency.resident
    r = self.params.restore
    restore = sum(r.a + r.b * nbytes for ref, nbytes in c.units if ref not in resident)
    key = self.program_key(c.program, T, n)
    compile_ = 0.0 if key in residency.compiled else self._compile_fit(bucket(T))(c.layers)
    A, B = c.decode.a, c.decode.b
    if constrained or ctx.engine == "masked":
      A += MASKED_STEP_MS
    S = bucket(T) + bucket(n)
    h = candidate.path_hash
    now = self.clock()
    fs = {s: self._factor_from(h, s, ctx, now) for s in STAGES}
    hint_scale = {s: r / self._bases(h, s)[1] for s, r in self._hint_bases(h, hints).items()}
    for s, scale in hint_scale.items():  # what was learned moves the hints' base as it moves the path's
      f, _, count = fs[s]
      fs[s] = (_clip(f * scale), "path", count)
    load_factor, W = 1.0, 1
    if load.engines:
      load_factor, S, W = self._under_load(candidate, (A, B), S, load, fs["decode"][0])
    raw = {
      "synthesis": self.params.synthesis_ms,
      "restore": restore,
      "compile": compile_,
      "prefill": c.prefill(bucket(T)),
      "decode": max(n - 1, 0) * (A + B * S) * load_factor,
    }
    applied = [s for s in STAGES if fs[s][0] != 1.0 and raw[s] > 0]
    rec = self._learned.get(ctx.key)
    return Prediction(
      h,
      T,
      n,
      *(raw[s] * fs[s][0] for s in STAGES),
      raw=raw,
      decode_terms=(A, B),
      decode_factor=fs["decode"][0],
      program_key=key,
      cache_len=S,
      corrections={s: fs[s][:2] for s in applied},
      context=ctx,
      observations={s: fs[s][2] for s in applied},
      correction_age_s=None if rec is None else max(0.0, now - rec.updated),
      load_factor=load_factor,
      load=load if load.engines else IDLE,
      width=W,
      hint_scale=hint_scale,
    )

  def rows_factor(self, path_hash: str, rows: float) -> float:
    """A decode step of ``rows`` rows (a mean may be fractional) of ``path_hash`` over its one-row step: the
    calibration's measured fit, the
    full path's (``rows["default"]``) for a path it did not measure, or ``rows`` (no gain from batching)."""
    fit = self.params.rows.get(path_hash) or self.params.rows.get(ROWS_DEFAULT)
    return float(rows) if fit is None else max(fit(rows), 1.0)

  def _under_load(
    self, candidate, terms: tuple[float, float], S: int, load: Load, factor: float
  ) -> tuple[float, int, int]:
    """(a raw step under ``load`` over an idle one, the cache the request attends over, the rows of its step);
    ``terms``: its raw step's ``(A, B)``; ``factor``: the decode factor the prediction applies (a measured step
    enters the raw decode divided by it)."""
    h = candidate.path_hash
    # A speculative plan decodes alone beside the engines; any other joins its path's engine when its ring fits.
    own = None if getattr(candidate, "draft", None) is not None else load.of(h, S)
    if own is None:
      return 1.0 + CONTENTION * len(load.engines), S, 1
    W = width(own.rows + 1, load.slots)
    idle = terms[0] + terms[1] * own.cache_len
    if own.step_ms is None:  # not stepped yet: the fits at the width it will compute
      return self.rows_factor(h, W), own.cache_len, W
    step = own.step_ms * self.rows_factor(h, W) / self.rows_factor(h, own.width)
    return step / (idle * factor), own.cache_len, W

  # ---- learning
  def update(self, trace: Any) -> dict[str, float]:
    """Move the correction factors of the context the run ran in toward what it measured; returns the
    observed ratios used.

    ``trace`` has ``prediction`` (:class:`Prediction`), ``actual_ms`` (stage -> ms) and optionally
    ``tokens_out`` (tokens actually produced; the raw decode is re-evaluated for that count), ``compiled``
    (the run compiled its program: its prefill and decode are not learned from), ``context`` (where it
    ran; default the prediction's) and ``width`` (the mean rows of its steps in a slot engine: the raw decode is
    scaled by the batching fit from the predicted width to that one).
    """
    p: Prediction = trace.prediction
    actual = trace.actual_ms
    unknown = set(actual) - set(STAGES)
    if unknown:
      raise LatencyModelError(f"trace actual_ms: unknown stages {sorted(unknown)}; expected some of {list(STAGES)}")
    ctx = getattr(trace, "context", None) or p.context
    raw = dict(p.raw)
    tokens = getattr(trace, "tokens_out", None)
    if tokens is not None:
      raw["decode"] = p.raw_decode(int(tokens))
    ran_width = getattr(trace, "width", None)
    if ran_width is not None and math.isfinite(ran_width) and ran_width >= 1 and ran_width != p.width:
      # Its steps computed another width than predicted (streams joined or left after it was planned): learn
      # against the decode it would have been predicted at that width, so the load's change is not the model's.
      h = p.path_hash
      raw["decode"] *= self.rows_factor(h, ran_width) / self.rows_factor(h, p.width)
    first_run = bool(getattr(trace, "compiled", False))
    ratios = {}
    for s, ms in actual.items():
      if ms is None or not math.isfinite(ms) or ms < 0:
        raise LatencyModelError(f"trace actual_ms[{s}]: expected a finite time >= 0, got {ms!r}")
      if first_run and s in ("prefill", "decode"):
        continue  # a first run's device time includes one-off costs (allocation, first execution)
      if raw[s] > 0:  # in the path's own terms: a hint's measured difference is the calibration's, not learned
        ratios[s] = _clip(ms / raw[s] / p.hint_scale.get(s, 1.0))
    h = p.path_hash
    with self._lock:
      now = self.clock()
      rec = self._learned.get(ctx.key) or Learned(updated=now)
      w = self._weight(rec, now)
      # What silence already took back is made permanent before this observation moves the factors on.
      glob = {s: self._bases("", s)[0] * (f / self._bases("", s)[0]) ** w for s, f in rec.glob.items()}
      paths = {
        ph: {s: self._bases(ph, s)[1] * (f / self._bases(ph, s)[1]) ** w for s, f in fs.items()}
        for ph, fs in rec.paths.items()
      }
      own = dict(paths.get(h, {}))
      n_glob = dict(rec.n_glob)
      n_own = dict(rec.n_paths.get(h, {}))
      for s, q in ratios.items():
        base_g, base_r = self._bases(h, s)
        g = glob.get(s, base_g)
        path_f = _clip(g * own.get(s, base_r))
        path_f = _clip((1 - self.alpha) * path_f + self.alpha * q)  # this path's factor, smoothed
        glob[s] = _clip((1 - self.global_alpha) * g + self.global_alpha * q)
        own[s] = _clip(path_f / glob[s])  # kept relative to the machine-wide factor
        n_glob[s] = n_glob.get(s, 0) + 1
        n_own[s] = n_own.get(s, 0) + 1
      if ratios:
        paths[h] = own
      self._learned = {
        **self._learned,
        ctx.key: Learned(
          glob,
          paths,
          n_glob,
          {**rec.n_paths, h: n_own} if ratios else dict(rec.n_paths),
          rec.observations + 1,
          now,
        ),
      }
      self._dirty.add(ctx.key)
      self.updates += 1
    return ratios

  def take_changed(self) -> dict[str, Learned]:
    """The contexts that learned since the last call (what a store must write), and forget that they did."""
    with self._lock:
      keys, self._dirty = self._dirty, set()
      return {k: self._learned[k] for k in keys if k in self._learned}

  def to_params(self) -> LatencyParams:
    """The parameters with the corrections the model's own context has now (calibration's and learned,
    decayed to this moment), e.g. to store beside the calibration."""
    now = self.clock()
    rec = self._learned.get(self.context.key)
    glob = dict(self._base_global)
    paths = {h: dict(f) for h, f in self._base_paths.items()}
    if rec is not None:
      w = self._weight(rec, now)
      for s, f in rec.glob.items():
        base = self._base_global.get(s, 1.0)
        glob[s] = _clip(base * (f / base) ** w)
      for h, fs in rec.paths.items():
        for s, f in fs.items():
          base = self._base_paths.get(h, {}).get(s, 1.0)
          paths.setdefault(h, {})[s] = _clip(base * (f / base) ** w)
    corrections = {}
    if glob:
      corrections["global"] = glob
    if any(paths.values()):
      corrections["paths"] = {h: f for h, f in paths.items() if f}
    return dataclasses.replace(self.params, corrections=corrections)

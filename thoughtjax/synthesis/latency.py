"""The latency model: what a path will cost on this machine, stage by stage, before it runs.

A request's latency is predicted as five stages (milliseconds)::

    synthesis  planning overhead (a measured constant)
    restore    sum over the path's thoughtlets not yet resident of  r.a + r.b * bytes
               (r.a: fixed cost per restore, 1 / r.b: measured restore bandwidth in bytes/ms)
    compile    0 when the program key is compiled, else  c[bucket].a + c[bucket].b * layers_run
               (one fit per prompt-length bucket; the nearest measured bucket serves others)
    prefill    sum over the executed thoughtlets of  p[u].a + p[u].b * P          (P = bucket(T))
    decode     (N - 1) * (step_ms + sum over units of  d[u].a + d[u].b * S)      (S = bucket(T) + bucket(N))

for a prompt of T tokens and N new tokens. The shapes are those the program runs (``program.py``): the
prefill runs over the prompt left-padded to its bucket P and yields the first token; each of the N - 1
decode steps attends over the whole KV cache of S slots (masked), whatever the context so far. So prefill
cost steps at bucket edges and a decode step costs the same throughout one request.

Units are counted as executed, so a repeated span costs twice in prefill and decode but is
restored once. Each linear cost is fitted by least squares from measurements at several sizes
(:func:`fit_linear`) and is non-negative by construction, so decode cost is non-decreasing in the
number of tokens and "how many tokens fit the budget" is a monotone search.

Learning from traces (:meth:`LatencyModel.update`): the model keeps multiplicative corrections per
stage: a global factor g (how this machine runs now: load, clocks) and, per path hash, a relative factor r
(how that path deviates from the rest); a path's factor is g * r (r = 1 for a path never traced). An
observed ratio q = ``actual / raw`` moves g toward q (step ``global_alpha``) and the path's own factor
g * r toward q (step ``alpha``), stored as r relative to the new g. Because load moves g for every path at once, a path that has run is not made to
look slower than one that has not merely because the machine got busier. Ratios and factors are clipped
to ``[1/4, 4]`` so one outlier cannot swing a plan by more than 4x. Stages predicted at
zero (already resident, already compiled) carry no information and are not learned from, and a run that
compiled its program teaches only restore and compile: its prefill and decode carry one-off first-run
costs that a warm request never pays (``LatencyTrace.compiled``).
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
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from thoughtjax.errors import UserError
from thoughtjax.program import bucket

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
  factor is g * r; see the module docstring).
  """

  prefill: Mapping[str, LinearCost]
  decode: Mapping[str, LinearCost]
  restore: LinearCost
  compile: Mapping[int, LinearCost]
  step_ms: float = 0.0
  synthesis_ms: float = 0.0
  corrections: Mapping[str, Any] = dataclasses.field(default_factory=dict)

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
    }

  @classmethod
  def from_json(cls, d: Any, where: str = "latency") -> LatencyParams:
    keys = {"prefill", "decode", "restore", "compile", "step_ms", "synthesis_ms", "corrections"}
    if not isinstance(d, Mapping):
      raise LatencyModelError(f"{where}: expected an object, got {type(d).__name__}")
    if set(d) - keys or {"prefill", "decode", "restore", "compile"} - set(d):
      raise LatencyModelError(
        f"{where}: expected keys {sorted(keys)} (corrections, step_ms, synthesis_ms optional), got {sorted(d)}"
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
  if not isinstance(d, Mapping) or set(d) - {"global", "paths"}:
    raise LatencyModelError(
      f"{where}: expected {{\"global\": {{stage: f}}, \"paths\": {{path_hash: {{stage: f}}}}}}, got {d!r}"
    )
  paths = d.get("paths", {})
  if not isinstance(paths, Mapping):
    raise LatencyModelError(f"{where}.paths: expected an object, got {paths!r}")
  out: dict = {}
  if d.get("global"):
    out["global"] = _stage_factors(d["global"], f"{where}.global")
  if paths:
    out["paths"] = {h: _stage_factors(f, f"{where}.paths[{h}]") for h, f in paths.items()}
  return out


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
class Prediction:
  """Predicted ms per stage for one path and request (corrections applied), and the raw model values.

  ``decode_terms = (A, B)``: one decode step over a cache of ``cache_len`` slots costs ``A + B * cache_len``
  raw ms, before the decode factor ``decode_factor``; this lets :meth:`tokens_within` and trace learning
  re-evaluate decode for another token count (the cache is that of the request's program).
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
  # stage -> (factor, "path" or "global"): the learned corrections this prediction applied (factor != 1).
  corrections: Mapping[str, tuple[float, str]] = dataclasses.field(default_factory=dict)

  @property
  def total(self) -> float:
    return self.synthesis + self.restore + self.compile + self.prefill + self.decode

  def stage(self, name: str) -> float:
    return getattr(self, name)

  def raw_decode(self, tokens: int) -> float:
    """Raw decode ms until ``tokens`` tokens are out: the prefill gives the first, each other is one step."""
    A, B = self.decode_terms
    return max(int(tokens) - 1, 0) * (A + B * self.cache_len)

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
  (any subset of :data:`STAGES`), the tokens it produced (``None``: as predicted) and whether it compiled
  its program (then its prefill and decode are not learned from)."""

  prediction: Prediction
  actual_ms: Mapping[str, float]
  tokens_out: int | None = None
  compiled: bool = False


@dataclasses.dataclass(frozen=True)
class _Costs:
  """Per-candidate sums, computed once: prefill and decode coefficients, distinct units, layers."""

  prefill: LinearCost
  decode: LinearCost
  units: tuple[tuple[str, int], ...]  # distinct (ref, bytes)
  layers: int
  program: str


class LatencyModel:
  """Predicts stage latencies from :class:`LatencyParams` and learns corrections from traces.

  Thread-safe for concurrent ``predict`` and ``update`` (updates replace factor dicts under a lock).
  """

  def __init__(self, params: LatencyParams, *, alpha: float = 0.3, global_alpha: float = 0.1):
    for name, v in (("alpha", alpha), ("global_alpha", global_alpha)):
      if not 0 < v <= 1:
        raise LatencyModelError(f"LatencyModel {name}: expected a step in (0, 1], got {v!r}")
    self.params = params
    self.alpha, self.global_alpha = alpha, global_alpha
    corr = _corrections_json(params.corrections, "latency.corrections")
    self._global: dict[str, float] = dict(corr.get("global", {}))
    self._paths: dict[str, dict[str, float]] = {h: dict(f) for h, f in corr.get("paths", {}).items()}
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

  @staticmethod
  def program_key(program: str, prompt_tokens: int, max_tokens: int) -> str:
    """The compiled-program key of a path layout at a request's shape buckets."""
    return f"{program}|T{bucket(prompt_tokens)}|N{bucket(max_tokens)}"

  def factor(self, path_hash: str, stage: str) -> float:
    return self._factor_from(path_hash, stage)[0]

  def _factor_from(self, path_hash: str, stage: str) -> tuple[float, str]:
    """(g * r clipped, "path" when the path has a relative factor of its own, else "global")."""
    g = self._global.get(stage, 1.0)
    own = self._paths.get(path_hash)
    if own is not None and stage in own:
      lo, hi = FACTOR_BOUNDS
      return min(hi, max(lo, g * own[stage])), "path"
    return g, "global"

  def predict(
    self, candidate: Candidate, prompt_tokens: int, max_tokens: int, residency: Residency = COLD
  ) -> Prediction:
    """Stage latencies (ms) of ``candidate`` for a prompt of ``prompt_tokens`` and ``max_tokens`` decode
    steps, given what ``residency`` says is already restored and compiled."""
    c = self._candidate_costs(candidate)
    T, n = prompt_tokens, max_tokens
    resident = residency.resident
    r = self.params.restore
    restore = sum(r.a + r.b * nbytes for ref, nbytes in c.units if ref not in resident)
    key = self.program_key(c.program, T, n)
    compile_ = 0.0 if key in residency.compiled else self._compile_fit(bucket(T))(c.layers)
    A, B = c.decode.a, c.decode.b
    S = bucket(T) + bucket(n)
    raw = {
      "synthesis": self.params.synthesis_ms,
      "restore": restore,
      "compile": compile_,
      "prefill": c.prefill(bucket(T)),
      "decode": max(n - 1, 0) * (A + B * S),
    }
    h = candidate.path_hash
    fs = {s: self._factor_from(h, s) for s in STAGES}
    f = {s: v[0] for s, v in fs.items()}
    return Prediction(
      h,
      T,
      n,
      *(raw[s] * f[s] for s in STAGES),
      raw=raw,
      decode_terms=(A, B),
      decode_factor=f["decode"],
      program_key=key,
      cache_len=S,
      corrections={s: fs[s] for s in STAGES if fs[s][0] != 1.0 and raw[s] > 0},
    )

  # ---- learning
  def update(self, trace: Any) -> dict[str, float]:
    """Move the correction factors toward what a run measured; returns the observed ratios used.

    ``trace`` has ``prediction`` (:class:`Prediction`), ``actual_ms`` (stage -> ms) and optionally
    ``tokens_out`` (tokens actually produced; the raw decode is re-evaluated for that count) and
    ``compiled`` (the run compiled its program: its prefill and decode are not learned from).
    """
    p: Prediction = trace.prediction
    actual = trace.actual_ms
    unknown = set(actual) - set(STAGES)
    if unknown:
      raise LatencyModelError(f"trace actual_ms: unknown stages {sorted(unknown)}; expected some of {list(STAGES)}")
    raw = dict(p.raw)
    tokens = getattr(trace, "tokens_out", None)
    if tokens is not None:
      raw["decode"] = p.raw_decode(int(tokens))
    first_run = bool(getattr(trace, "compiled", False))
    lo, hi = FACTOR_BOUNDS
    ratios = {}
    for s, ms in actual.items():
      if ms is None or not math.isfinite(ms) or ms < 0:
        raise LatencyModelError(f"trace actual_ms[{s}]: expected a finite time >= 0, got {ms!r}")
      if first_run and s in ("prefill", "decode"):
        continue  # a first run's device time includes one-off costs (allocation, first execution)
      if raw[s] > 0:
        ratios[s] = min(hi, max(lo, ms / raw[s]))
    with self._lock:
      glob = dict(self._global)
      own = dict(self._paths.get(p.path_hash, {}))
      for s, q in ratios.items():
        g = glob.get(s, 1.0)
        path_f = min(hi, max(lo, g * own.get(s, 1.0)))
        path_f = min(hi, max(lo, (1 - self.alpha) * path_f + self.alpha * q))  # this path's factor, smoothed
        glob[s] = min(hi, max(lo, (1 - self.global_alpha) * g + self.global_alpha * q))
        own[s] = min(hi, max(lo, path_f / glob[s]))  # kept relative to the machine-wide factor
      self._global = glob
      self._paths = {**self._paths, p.path_hash: own}
      self.updates += 1
    return ratios

  def to_params(self) -> LatencyParams:
    """The parameters with the learned corrections, to store beside the calibration."""
    corrections = {}
    if self._global:
      corrections["global"] = dict(self._global)
    if self._paths:
      corrections["paths"] = {h: dict(f) for h, f in self._paths.items() if f}
    return dataclasses.replace(self.params, corrections=corrections)

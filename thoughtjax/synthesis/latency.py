"""The latency model: what a path will cost on this machine, stage by stage, before it runs.

A request's latency is predicted as five stages (milliseconds)::

    synthesis  planning overhead (a measured constant)
    restore    sum over the path's thoughtlets not yet resident of  r.a + r.b * bytes
               (r.a: fixed cost per restore, 1 / r.b: measured restore bandwidth in bytes/ms)
    compile    0 when the program key is compiled, else its measured load when the persistent compilation cache
               holds it (``Residency.cached``, no correction), else  c[bucket].a + c[bucket].b * layers_run
               (one fit per prompt-length bucket; the nearest measured bucket serves others)
    prefill    sum over the executed thoughtlets of  p[u].a + p[u].b * P          (P = bucket(T))
    decode     (N - 1) * (step_ms + sum over units of  d[u].a + d[u].b * S)      (S = bucket(T) + bucket(N))

for a prompt of T tokens and N new tokens. The shapes are those the program runs (``decode/program.py``): the
prefill runs over the prompt left-padded to its bucket P and yields the first token; each of the N - 1
decode steps attends over the whole KV cache of S slots (masked), whatever the context so far. So prefill
cost steps at bucket edges and a decode step costs the same throughout one request.

Under load (:class:`~thoughtjax.synthesis.latency_load.Load`, a server's slot engines with the streams they decode
now), a request that joins its path's busy engine pays that engine's step, as the engine measured it over its latest
chunks, at the width it computes with one row more (scaled by ``rows[path]``, how the path batches, measured at
calibration: :attr:`~thoughtjax.synthesis.latency_params.LatencyParams.rows`); an engine that has not stepped yet is
priced by the fits at that width. A request in an engine of its own shares the cores with every busy engine: its
step costs ``1 + CONTENTION * k`` idle steps beside ``k`` of them. So a variant alone beside a busy engine can cost
far less per token than joining that engine.

Units are counted as executed, so a repeated span costs twice in prefill and decode but is restored once. Each
linear cost is fitted by least squares from measurements at several sizes
(:func:`~thoughtjax.synthesis.latency_params.fit_linear`) and is non-negative by construction, so decode cost is
non-decreasing in the number of tokens and "how many tokens fit the budget" is a monotone search.

Learning from traces (:meth:`LatencyModel.update`): the model keeps multiplicative corrections per stage, **per
execution context** (:class:`~thoughtjax.synthesis.latency_context.LatencyContext`: engine — plain, speculative or a
slot engine —, weight form, batch width, kernels). A correction belongs to the context that taught it and a
prediction applies only its own context's: a server's slot engine, slower per stream and under load, never moves the
prediction of a command line's plain program. Within a context: a global factor g (how this machine runs now: load,
clocks) and, per path hash, a relative factor r (how that path deviates from the rest); a path's factor is g * r
(r = 1 for a path never traced). An observed ratio q = ``actual / raw`` moves g toward q (step ``global_alpha``) and
the path's own factor g * r toward q (step ``alpha``), stored as r relative to the new g: an observation's weight
halves after about 7 later ones (g) or 2 (a path's own). Because load moves g for every path at once, a path that
has run is not made to look slower than one that has not merely because the machine got busier. Corrections also
decay with age: a context's factors relax halfway back to the calibration's every
:data:`~thoughtjax.synthesis.latency_context.HALF_LIFE_S` (6 hours) without an observation there, and a context
silent for :data:`~thoughtjax.synthesis.latency_context.MAX_AGE_S` is dropped. Ratios and factors are clipped to
``[1/4, 4]`` so one outlier cannot swing a plan by more than 4x. Stages predicted at zero (already resident, already
compiled) carry no information and are not learned from, and a run that compiled its program teaches only restore
and compile: its prefill and decode carry one-off first-run costs that a warm request never pays
(``LatencyTrace.compiled``). A run in a slot engine is learned at the width its steps computed
(``LatencyTrace.width``, the mean over its steps): streams that joined or left its engine after it was planned scale
its raw decode by the path's batching fit, so a burst of requests, each planned before the next arrived, does not
teach the model that every path got slower. A candidate whose cost is not the sum of its units (a speculative plan:
draft and verify in one program) starts from a per-path factor that calibration measured, stored in ``corrections``:
its units are the full path's, so its raw decode is the full path's, and its decode factor is its measured decode
time per token over the full path's, on the calibration text (acceptance included). Its draft's own units add to
restore, and the draft's layers to compile.

Layout: this module is the model (:class:`LatencyModel`, its :class:`Prediction` and the :class:`LatencyTrace` it
learns from). The fitted costs and their file form are :mod:`~thoughtjax.synthesis.latency_params`; where a
correction belongs and what a context learned, :mod:`~thoughtjax.synthesis.latency_context`; what is warm and what
slot engines decode now, :mod:`~thoughtjax.synthesis.latency_load`. Each imports only those before it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from thoughtjax.decode.program import bucket
from thoughtjax.serving.slot_program import width
from thoughtjax.synthesis.latency_context import HALF_LIFE_S, LatencyContext, Learned
from thoughtjax.synthesis.latency_load import COLD, IDLE, Load, Residency
from thoughtjax.synthesis.latency_params import (
  FACTOR_BOUNDS,
  ROWS_DEFAULT,
  STAGES,
  LatencyModelError,
  LatencyParams,
  LinearCost,
  corrections_json,
)

if TYPE_CHECKING:
  from thoughtjax.synthesis.candidate import Candidate

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
  # compile priced as a load from the persistent compilation cache (the ledger's measured price): the compile
  # correction neither applies to it nor learns from it
  compile_cached: bool = False

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
    corr = corrections_json(params.corrections, "latency.corrections")
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
    draft = c.draft
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
    if candidate.draft is not None and ctx.engine != "speculative":
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
    cached = key not in residency.compiled and key in residency.cached
    if key in residency.compiled:
      compile_ = 0.0
    elif cached:  # a load from the persistent cache, measured on this machine: no correction applies
      compile_ = residency.cached[key]
    else:
      compile_ = self._compile_fit(bucket(T))(c.layers)
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
    if cached:
      fs["compile"] = (1.0, "global", 0)
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
      compile_cached=cached,
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
    own = None if candidate.draft is not None else load.of(h, S)
    if own is None:
      return 1.0 + CONTENTION * len(load.engines), S, 1
    W = width(own.rows + 1, load.slots)
    idle = terms[0] + terms[1] * own.cache_len
    if own.step_ms is None:  # not stepped yet: the fits at the width it will compute
      return self.rows_factor(h, W), own.cache_len, W
    step = own.step_ms * self.rows_factor(h, W) / self.rows_factor(h, own.width)
    return step / (idle * factor), own.cache_len, W

  # ---- learning
  def update(self, trace: LatencyTrace) -> dict[str, float]:
    """Move the correction factors of the context the run ran in toward what it measured; returns the
    observed ratios used.

    ``trace`` (:class:`LatencyTrace`) has ``prediction`` (:class:`Prediction`), ``actual_ms`` (stage -> ms) and
    optionally ``tokens_out`` (tokens actually produced; the raw decode is re-evaluated for that count), ``compiled``
    (the run compiled its program: its prefill and decode are not learned from), ``context`` (where it
    ran; default the prediction's) and ``width`` (the mean rows of its steps in a slot engine: the raw decode is
    scaled by the batching fit from the predicted width to that one).
    """
    p: Prediction = trace.prediction
    actual = trace.actual_ms
    unknown = set(actual) - set(STAGES)
    if unknown:
      raise LatencyModelError(f"trace actual_ms: unknown stages {sorted(unknown)}; expected some of {list(STAGES)}")
    ctx = trace.context or p.context
    raw = dict(p.raw)
    tokens = trace.tokens_out
    if tokens is not None:
      raw["decode"] = p.raw_decode(int(tokens))
    ran_width = trace.width
    if ran_width is not None and math.isfinite(ran_width) and ran_width >= 1 and ran_width != p.width:
      # Its steps computed another width than predicted (streams joined or left after it was planned): learn
      # against the decode it would have been predicted at that width, so the load's change is not the model's.
      h = p.path_hash
      raw["decode"] *= self.rows_factor(h, ran_width) / self.rows_factor(h, p.width)
    first_run = trace.compiled
    ratios = {}
    for s, ms in actual.items():
      if ms is None or not math.isfinite(ms) or ms < 0:
        raise LatencyModelError(f"trace actual_ms[{s}]: expected a finite time >= 0, got {ms!r}")
      if s == "compile" and p.compile_cached:
        continue  # a load's time is the ledger's to record, not the compile fit's to learn
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

"""GetOptimalPath: from a request's hints and latency budget to the best calibrated path, with reasons.

Rule (DESIGN.md "GetOptimalPath", issue 8 item 5):

1. A candidate is *eligible* when it meets every requested hint's floor. Floors are checked on the
   **calibration split**; the plan reports quality on the **held-out split**, so a reader sees whether
   the floor generalizes. A candidate not calibrated on a hint is not eligible for it (the full path is
   lossless by definition and always eligible).
2. *Best quality* across hints is lexicographic in hint priority order: higher top-1 agreement, then
   lower mean KL, on the calibration split (the split quality is selected on; held-out is only reported).
   Ties go to the lower predicted latency, then the smaller path hash, so a plan is deterministic. A
   speculative candidate has the full path's quality, so it is chosen exactly when it is the fastest of
   the lossless choices that fit; its plan names the draft (``Plan.draft``).
3. The plan is the best eligible candidate whose predicted total (synthesis + restore + compile +
   prefill + decode, given what is resident and compiled) is within ``max_latency_ms``. In a server the
   prediction is made under its load (the slot engines' streams now, :class:`~thoughtjax.synthesis.latency_load.Load`):
   the path an idle machine would get is kept while it still fits under the load; when it does not and another
   path is chosen, the reason (or, for ``budget``, a note) says so and names the idle choice (``Plan.idle_path``),
   counted as ``moved_by_load``.
4. Degradation ladder, always ``degraded=True``, with the reason, and counted in :class:`PlannerCounters`:
   no eligible candidate fits → the fastest eligible one, reason ``"budget"``, with ``tokens_that_fit``;
   a thoughtlet the best choice needs failed verification or restore → the best candidate that avoids it,
   reason ``"unavailable: <ref> failed <why>"``; nothing eligible left → :class:`NoPathError`.
   A failed thoughtlet is never replaced by another version: candidates are pinned to the versions of
   the calibration's registry sequence, the planner never rewrites a ref, and a failure of ``name@v``
   blocks every candidate that uses any version of ``name``.
5. ``pin_sequence``: a calibration made against another registry sequence is refused
   (:class:`SequenceMismatchError`); the same request with the same pin gives the same plan.

Speed: per-hint floor checks, rejection texts and the quality order for a hint tuple are computed once
per (calibration, floors); a request only predicts latencies down the order until one fits.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from thoughtjax.defaults import MAX_HINTS
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import VARIANTS
from thoughtjax.synthesis.calibration import Calibration, PathQuality
from thoughtjax.synthesis.candidate import DraftPlan
from thoughtjax.synthesis.latency import LatencyModel, Prediction
from thoughtjax.synthesis.latency_context import LatencyContext
from thoughtjax.synthesis.latency_load import COLD, IDLE, Load, Residency

BUDGET = "budget"

# A failed-thoughtlet report: refs (``name@version``, or a bare name for every version of it) that
# failed, a mapping ref -> why ("verification: hash mismatch"), or a callback ref -> why or None.
Unavailable = AbstractSet[str] | Mapping[str, str] | Callable[[str], str | None] | None


def _name(ref: str) -> str:
  """The thoughtlet name of a ref: ``blocks[0:2)@3fa2`` -> ``blocks[0:2)``, ``blocks[0:2)@int8@3fa2`` ->
  ``blocks[0:2)@int8`` (a weight variant is a thoughtlet of its own: its failure blocks only its users)."""
  base, at, last = ref.rpartition("@")
  return ref if not at or last in VARIANTS else base


class PlanError(UserError, ValueError):
  """A plan cannot be made for this request; the message says why and what to change."""


class SequenceMismatchError(PlanError):
  """The request pins a registry sequence the calibration was not made against."""


class NoPathError(PlanError):
  """No candidate meets every floor and avoids every failed thoughtlet."""


# ------------------------------------------------------------------------------ inputs
@dataclasses.dataclass(frozen=True)
class Floor:
  """A hint's quality floor: ``top1_agreement`` at least, ``mean_kl`` and ``delta_nll`` at most."""

  top1_agreement: float = 0.0
  mean_kl: float = math.inf
  delta_nll: float | None = None

  def miss(self, q: PathQuality) -> str | None:
    """Why ``q`` is below this floor (first failing measure, value vs floor), or ``None``."""
    if q.top1_agreement < self.top1_agreement:
      return f"top1_agreement {q.top1_agreement:.4g} < floor {self.top1_agreement:.4g}"
    if q.mean_kl > self.mean_kl:
      return f"mean_kl {q.mean_kl:.4g} > floor {self.mean_kl:.4g}"
    if self.delta_nll is not None and q.delta_nll > self.delta_nll:
      return f"delta_nll {q.delta_nll:.4g} > floor {self.delta_nll:.4g}"
    return None


def as_floor(obj: Any, hint: str) -> Floor:
  """A :class:`Floor` from a ``Floor``, a mapping or an object with ``top1_agreement``/``mean_kl``
  (/``delta_nll``) fields, such as the synthesis dictionary's floors."""
  if isinstance(obj, Floor):
    return obj
  if hasattr(obj, "floors"):  # a dictionary entry (HintSpec)
    obj = obj.floors
  get = obj.get if isinstance(obj, Mapping) else (lambda k, d=None: getattr(obj, k, d))
  vals = {k: get(k) for k in ("top1_agreement", "mean_kl", "delta_nll")}
  if all(v is None for v in vals.values()):
    raise PlanError(
      f"floor of hint {hint!r}: expected top1_agreement, mean_kl and/or delta_nll, got {obj!r}; "
      f"pass the synthesis dictionary's floors"
    )
  for k, v in vals.items():
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v)):
      raise PlanError(f"floor of hint {hint!r}: {k} must be a number, got {v!r}; fix the synthesis dictionary")
  return Floor(
    float(vals["top1_agreement"] or 0.0),
    math.inf if vals["mean_kl"] is None else float(vals["mean_kl"]),
    None if vals["delta_nll"] is None else float(vals["delta_nll"]),
  )


def floors_of(dictionary: Any) -> dict[str, Floor]:
  """Hint name -> :class:`Floor` of a synthesis dictionary (an iterable of entries with ``name``, ``floors``)."""
  return {h.name: as_floor(h.floors, h.name) for h in dictionary}


@dataclasses.dataclass(frozen=True)
class PlanRequest:
  """Hints already normalized (1..3, priority order), the corrections made to them (given -> hint,
  passed through to the plan), prompt length in tokens, decode steps wanted and the latency budget."""

  hints: tuple[str, ...]
  prompt_tokens: int
  max_tokens: int
  max_latency_ms: float
  corrections: tuple[tuple[str, str], ...] = ()
  # The output constraint in words (e.g. "JSON schema (412 characters)"), or None. Alone, a constrained request
  # decodes one step per call (its mask depends on the token before), so it is predicted so (in the ``masked``
  # latency context); in a server's slot engine it decodes in the engine's chunks (in the engine's context).
  # Never planned speculatively (a drafted run would not see the grammar's masks).
  constraint: str | None = None

  def __post_init__(self):
    hints = (self.hints,) if isinstance(self.hints, str) else tuple(self.hints)
    object.__setattr__(self, "hints", hints)
    corr = self.corrections.items() if isinstance(self.corrections, Mapping) else self.corrections
    object.__setattr__(self, "corrections", tuple((str(a), str(b)) for a, b in corr))
    if not 1 <= len(hints) <= MAX_HINTS:
      raise PlanError(
        f"a plan takes 1 to {MAX_HINTS} hints in priority order, got {len(hints)} ({list(hints)}); "
        f"drop hints, or route a request without hints first"
      )
    if len(set(hints)) != len(hints) or not all(isinstance(h, str) and h for h in hints):
      raise PlanError(f"hints must be distinct non-empty strings (normalize them first), got {list(hints)}")
    for name, lo in (("prompt_tokens", 1), ("max_tokens", 1)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise PlanError(f"plan request {name}: expected an integer >= {lo}, got {v!r}")
    b = self.max_latency_ms
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0 or math.isnan(b):
      raise PlanError(f"plan request max_latency_ms: expected a number > 0 (inf for no budget), got {b!r}")


# ----------------------------------------------------------------------------- outputs
@dataclasses.dataclass(frozen=True)
class Rejection:
  """A candidate the planner passed over: ``why`` is ``floor``, ``budget`` or ``unavailable``."""

  path: str
  path_hash: str
  why: str
  detail: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """The chosen path and why. ``quality``: held-out per hint; ``quality_calibration``: the split the
  floors were checked on. ``tokens_that_fit``: decode tokens within the budget when degraded for it.
  ``notes``: the details of a degradation, including a failure that mattered when the reason is ``budget``.
  ``idle_path``: planned under load (``predicted.load``), the path an idle machine would have been given instead.
  """

  path: str
  refs: tuple[str, ...]
  path_hash: str
  kind: str
  predicted: Prediction
  quality: Mapping[str, PathQuality]
  quality_calibration: Mapping[str, PathQuality]
  hints: tuple[str, ...]
  corrected_hints: tuple[tuple[str, str], ...]
  sequence: int
  degraded: bool
  reason: str
  rejected: tuple[Rejection, ...]
  max_latency_ms: float
  max_tokens: int
  tokens_that_fit: int | None = None
  notes: tuple[str, ...] = ()
  draft: DraftPlan | None = None  # a speculative plan's draft: ``path`` verifies what it proposes
  idle_path: str | None = None  # under load, the path an idle machine would have got, when it differs

  @property
  def speculative(self) -> bool:
    return self.draft is not None

  def to_json(self) -> dict:
    """The plan as the command line's ``--json`` object."""
    return {
      "path": self.path,
      "refs": list(self.refs),
      "path_hash": self.path_hash,
      "kind": self.kind,
      "speculative": self.speculative,
      "draft": None
      if self.draft is None
      else {"path": self.draft.path, "draft_tokens": self.draft.draft_tokens, "vocab": self.draft.vocab},
      "hints": list(self.hints),
      "corrected_hints": dict(self.corrected_hints),
      "predicted_ms": self.predicted.to_json(),
      "quality": {h: q.to_json() for h, q in self.quality.items()},
      "degraded": self.degraded,
      "reason": self.reason,
      "notes": list(self.notes),
      "registry_sequence": self.sequence,
      "max_tokens": self.max_tokens,
      "tokens_that_fit": self.tokens_that_fit,
      "max_latency_ms": None if math.isinf(self.max_latency_ms) else self.max_latency_ms,
      "rejected": [dataclasses.asdict(r) for r in self.rejected],
      # Latency corrections the prediction applied: stage -> factor, whose (this path's or all paths'), how many
      # runs in the prediction's execution context taught it (0: measured by calibration) and that context.
      "corrections": {
        s: {
          "factor": f,
          "from": src,
          "observations": self.predicted.observations.get(s, 0),
          "context": self.predicted.context.key,
        }
        for s, (f, src) in self.predicted.corrections.items()
      },
      "latency_context": self.predicted.context.key,
      "load": self.predicted.load.describe(),
      "idle_path": self.idle_path,
    }


class PlannerCounters:
  """Counts of plans, of each degradation and of plans the load moved off an idle machine's choice (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.plans = self.degraded_budget = self.degraded_unavailable = self.no_path = self.moved_by_load = 0
    self.unavailable: collections.Counter[str] = collections.Counter()  # failed ref -> plans it degraded

  def _add(self, *, budget=False, unavailable: Sequence[str] = (), no_path=False, moved=False) -> None:
    with self._lock:
      self.plans += not no_path
      self.moved_by_load += moved
      self.no_path += no_path
      self.degraded_budget += budget
      self.degraded_unavailable += bool(unavailable) and not no_path
      self.unavailable.update(unavailable)

  def snapshot(self) -> dict:
    with self._lock:
      return {
        "plans": self.plans,
        "degraded_budget": self.degraded_budget,
        "degraded_unavailable": self.degraded_unavailable,
        "no_path": self.no_path,
        "moved_by_load": self.moved_by_load,
        "unavailable": dict(self.unavailable),
      }


# ----------------------------------------------------------------------------- planner
@dataclasses.dataclass(frozen=True)
class _Order:
  """Precomputed for one hint tuple: eligible candidates grouped by equal quality, best group first,
  and the static floor rejections."""

  groups: tuple[tuple[int, ...], ...]
  eligible: frozenset[int]
  floor_rejections: tuple[Rejection, ...]
  floor_misses: tuple[str, ...]


class Planner:
  """GetOptimalPath over one calibration and one set of hint floors (precomputed once)."""

  def __init__(self, calibration: Calibration, floors: Mapping[str, Any]):
    self.calibration = calibration
    self.floors = {h: as_floor(f, h) for h, f in floors.items()}
    self.counters = PlannerCounters()
    cands = calibration.candidates
    self._cands = cands
    self._full = next(i for i, c in enumerate(cands) if c.path_hash == calibration.full.path_hash)
    # Per hint: calibration-split quality of each candidate (None: not calibrated) and floor misses.
    self._q: dict[str, list[PathQuality | None]] = {}
    self._heldout: dict[str, list[PathQuality | None]] = {}
    self._miss: dict[str, dict[int, str]] = {}
    for hint, floor in self.floors.items():
      hq = [calibration.hint_quality(c.path_hash, hint) for c in cands]
      self._q[hint] = [q and q.calibration for q in hq]
      self._heldout[hint] = [q and q.heldout for q in hq]
      miss = {}
      for i, q in enumerate(self._q[hint]):
        why = "not calibrated on this hint" if q is None else floor.miss(q)
        if why:
          miss[i] = f"hint {hint}: {why} (calibration split)"
      self._miss[hint] = miss
    self._users: dict[str, list[int]] = collections.defaultdict(list)  # ref and bare name -> candidates
    for i, c in enumerate(cands):
      for ref in c.refs:
        self._users[ref].append(i)
        name = _name(ref)
        if ref != name and i not in self._users[name][-1:]:
          self._users[name].append(i)
    self._orders: dict[tuple[str, ...], _Order] = {}
    self._models: dict[int, LatencyModel] = {}

  def _order(self, hints: tuple[str, ...]) -> _Order:
    got = self._orders.get(hints)
    if got is not None:
      return got
    cands, rejections, misses, keyed = self._cands, [], [], []
    for i, c in enumerate(cands):
      why = next((self._miss[h][i] for h in hints if i in self._miss[h]), None)
      if why:
        rejections.append(Rejection(c.path, c.path_hash, "floor", why))
        misses.append(why)
        continue
      key = tuple(x for h in hints for x in (-self._q[h][i].top1_agreement, self._q[h][i].mean_kl))
      keyed.append((key, c.path_hash, i))
    keyed.sort()
    groups: list[list[int]] = []
    last = None
    for key, _, i in keyed:
      if key != last:
        groups.append([])
        last = key
      groups[-1].append(i)
    got = _Order(tuple(map(tuple, groups)), frozenset(i for _, _, i in keyed), tuple(rejections), tuple(misses))
    if len(self._orders) < 256:  # at most 6P3 + 6P2 + 6 tuples for a six-hint dictionary
      self._orders[hints] = got
    return got

  def _failed(self, unavailable: Unavailable) -> dict[int, tuple[str, str]]:
    """Candidate index -> (failed ref, why) for the first failed thoughtlet it needs."""
    if not unavailable:
      return {}
    if callable(unavailable) and not isinstance(unavailable, Mapping):
      reports = {}
      for ref in self._users:
        if _name(ref) != ref:  # a pinned ref, not a bare name
          why = unavailable(ref)
          if why:
            reports[ref] = str(why)
    elif isinstance(unavailable, Mapping):
      reports = {str(r): str(w) for r, w in unavailable.items()}
    else:
      reports = {str(r): "verification or restore" for r in unavailable}
    out: dict[int, tuple[str, str]] = {}
    for ref in sorted(reports):
      # Every version of a failed thoughtlet's name is blocked: another version is never used in its place.
      for i in self._users.get(_name(ref), ()):
        out.setdefault(i, (ref, reports[ref]))
    return out

  def _check(self, request: PlanRequest, pin_sequence: int | None) -> None:
    seq = self.calibration.sequence
    if pin_sequence is not None and pin_sequence != seq:
      raise SequenceMismatchError(
        f"the request pins registry sequence {pin_sequence}, but the calibration was made against sequence "
        f"{seq}; pin {seq}, or calibrate the registry at sequence {pin_sequence} (thoughtjax registry "
        f"calibrate DIR) and plan with that calibration"
      )
    unknown = [h for h in request.hints if h not in self.floors]
    if unknown:
      raise PlanError(
        f"hints {unknown} have no floor in the synthesis dictionary; known hints: "
        f"{sorted(self.floors)}. Normalize hints against the dictionary first"
      )

  def plan(
    self,
    request: PlanRequest,
    latency_model: LatencyModel | None = None,
    residency: Residency | None = None,
    *,
    pin_sequence: int | None = None,
    unavailable: Unavailable = None,
    load: Load = IDLE,
    context: LatencyContext | None = None,
    count: bool = True,
  ) -> Plan:
    """The plan for ``request`` (see the module docstring for the rule). ``load``: the slot engines decoding now
    (a server's), predicted in ``context`` (default: the latency model's); the reason says when the load moved
    the choice away from an idle machine's. ``count=False``: a what-if plan, left out of :attr:`counters`."""
    self._check(request, pin_sequence)
    if latency_model is None:
      latency_model = self._models.get(0) or self._models.setdefault(0, LatencyModel(self.calibration.latency))
    residency = COLD if residency is None else residency
    hints, budget = request.hints, request.max_latency_ms
    T, n = request.prompt_tokens, request.max_tokens
    order = self._order(hints)
    failed = self._failed(unavailable)
    cands = self._cands
    drafted, constrained = set(), request.constraint is not None
    if constrained:
      # Alone, a constrained request runs the plain program one step per call (its own ``masked`` context); in
      # a server's slot engine it stays in the engine's context, each step dearer by the mask's cost.
      base = context or latency_model.context
      if base.engine != "slots":
        context = dataclasses.replace(base, engine="masked", batch=1)
      drafted = {i for i, c in enumerate(cands) if c.draft is not None}

    def predict(i: int, under: Load) -> Prediction:
      return latency_model.predict(cands[i], T, n, residency, context, constrained, under, hints)

    chosen, seen, rejected, best_ignoring_failures = self._choose(order, drafted, failed, budget, load, predict)
    idle = None  # under load: what an idle machine would have chosen (compared with the choice below)
    if load.engines:
      got = self._choose(order, drafted, failed, budget, IDLE, predict)[0]
      idle = None if got is None else got[0]
      if idle is not None and chosen is not None and idle != chosen[0]:
        # Kept while it still fits under the load: an equal-quality path never swaps in on the load alone.
        kept = predict(idle, load)
        if kept.total <= budget:
          chosen = (idle, kept)
    for i in sorted(drafted & order.eligible, key=lambda i: cands[i].path_hash):
      detail = "speculative: its draft would not see the output constraint's masks; constrained output decodes alone"
      rejected.append(Rejection(cands[i].path, cands[i].path_hash, "unavailable", detail))
    for i in sorted(failed, key=lambda i: cands[i].path_hash):
      if i not in order.eligible:
        continue
      ref, why = failed[i]
      uses = next(r for r in cands[i].refs if _name(r) == _name(ref))
      detail = (
        f"needs {ref}, which failed {why}"
        if uses == ref or _name(ref) == ref
        else f"uses {uses} where the current {ref} failed {why}; another version is never used in its place"
      )
      rejected.append(Rejection(cands[i].path, cands[i].path_hash, "unavailable", detail))

    if chosen is None and not seen:
      if count:
        self.counters._add(no_path=True)
      raise NoPathError(self._no_path_message(request, order, failed))

    notes: list[str] = []
    degraded_refs: list[str] = []
    if best_ignoring_failures is not None and (chosen is None or best_ignoring_failures != chosen[0]):
      ref, why = failed[best_ignoring_failures]
      degraded_refs.append(ref)
      notes.append(f"{ref} failed {why}; every path that needs it was passed over (never another version in its place)")
    tokens_that_fit = None
    if chosen is None:  # nothing fits: the fastest eligible path, told how many tokens fit
      total, h, i, p = min(seen)
      chosen = (i, p)
      rejected = [r for r in rejected if r.path_hash != h]
      tokens_that_fit = p.tokens_within(budget)
      reason = BUDGET
      notes.insert(
        0,
        f"no path meeting every floor fits {budget:.4g} ms; the fastest is predicted at "
        f"{total:.4g} ms; {tokens_that_fit} of {n} tokens fit the budget",
      )
    elif degraded_refs:
      ref, why = failed[best_ignoring_failures]
      reason = f"unavailable: {ref} failed {why}"
    elif chosen[0] == self._full and order.eligible - failed.keys() == {self._full}:
      reason = "only the full path meets every floor within the budget"
    else:
      reason = "best quality meeting every floor within the budget"
    if idle == chosen[0]:
      idle = None
    if idle is not None:
      moved = f"under load ({load.describe()}), idle it would be {cands[idle].path}"
      if reason == BUDGET:
        notes.append(moved)
      else:
        reason = f"{reason} {moved}"
    elif load.engines:
      notes.append(f"predicted under load ({load.describe()}); idle the choice is the same")
    if count:
      self.counters._add(budget=reason == BUDGET, unavailable=degraded_refs, moved=idle is not None)

    i, p = chosen
    c = cands[i]
    if c.draft is not None:
      notes.append(f"speculative: {c.path} verifies what {c.draft.label} drafts (the full path's tokens)")
    if request.constraint is not None:
      notes.append(
        f"output constrained by a {request.constraint}: every sampled token keeps it a prefix of the language; "
        f"decoded one step per call, each with its allowed-token mask"
      )
    return Plan(
      path=c.path,
      refs=c.refs,
      path_hash=c.path_hash,
      kind=c.kind.value,
      predicted=p,
      quality={h: self._heldout[h][i] for h in hints},
      quality_calibration={h: self._q[h][i] for h in hints},
      hints=hints,
      corrected_hints=request.corrections,
      sequence=self.calibration.sequence,
      degraded=reason == BUDGET or bool(degraded_refs),
      reason=reason,
      rejected=order.floor_rejections + tuple(rejected),
      max_latency_ms=budget,
      max_tokens=n,
      tokens_that_fit=tokens_that_fit,
      notes=tuple(notes),
      draft=c.draft,
      idle_path=None if idle is None else cands[idle].path,
    )

  def _choose(self, order: _Order, drafted, failed, budget: float, load: Load, predict):
    """Walk the quality order: (chosen (index, prediction) or None, eligible available predictions seen, budget
    rejections, the best choice had nothing failed or None)."""
    cands = self._cands
    rejected: list[Rejection] = []
    seen: list[tuple[float, str, int, Prediction]] = []  # eligible, available, predicted
    chosen: tuple[int, Prediction] | None = None
    best_ignoring_failures: int | None = None  # the choice had nothing failed
    for group in order.groups:
      preds = sorted((p.total, cands[i].path_hash, i, p) for i in group for p in (predict(i, load),))
      for total, h, i, p in preds:
        if i in drafted:
          continue
        if i in failed:
          if best_ignoring_failures is None and total <= budget:
            best_ignoring_failures = i
          continue
        seen.append((total, h, i, p))
        if total <= budget:
          chosen = (i, p)
          break
        rejected.append(Rejection(cands[i].path, h, BUDGET, f"predicted {total:.4g} ms > budget {budget:.4g} ms"))
      if chosen:
        break
    return chosen, seen, rejected, best_ignoring_failures

  def _no_path_message(self, request: PlanRequest, order: _Order, failed: dict[int, tuple[str, str]]) -> str:
    cands = self._cands
    lines = [f"no path for hints {list(request.hints)} at registry sequence {self.calibration.sequence}:"]
    if order.floor_misses:
      lines.append(f"{len(order.floor_misses)} of {len(cands)} candidates miss a floor")
    blocked = sorted({failed[i] for i in order.eligible if i in failed})
    for ref, why in blocked:
      lines.append(f"{ref} failed {why}")
    full_fail = failed.get(self._full)
    fix = (
      f"repair or republish {full_fail[0]} (thoughtjax registry verify DIR) so the full path is usable again"
      if full_fail
      else "loosen the hints' floors or calibrate more candidates"
    )
    return "; ".join(lines) + f". Fix: {fix}"


# ------------------------------------------------------------------------------ function
_PLANNERS: collections.OrderedDict[tuple[int, int], tuple[Calibration, Any, Planner]] = collections.OrderedDict()
_PLANNERS_LOCK = threading.Lock()


def planner_for(calibration: Calibration, dictionary_floors: Mapping[str, Any]) -> Planner:
  """The cached :class:`Planner` of this calibration and floors object (identity-keyed, a few kept)."""
  key = (id(calibration), id(dictionary_floors))
  with _PLANNERS_LOCK:
    got = _PLANNERS.get(key)
    if got is not None and got[0] is calibration and got[1] is dictionary_floors:
      _PLANNERS.move_to_end(key)
      return got[2]
  planner = Planner(calibration, dictionary_floors)
  with _PLANNERS_LOCK:
    _PLANNERS[key] = (calibration, dictionary_floors, planner)
    while len(_PLANNERS) > 8:
      _PLANNERS.popitem(last=False)
  return planner


def get_optimal_path(
  request: PlanRequest,
  calibration: Calibration,
  dictionary_floors: Mapping[str, Any],
  latency_model: LatencyModel | None,
  residency: Residency | None = None,
  *,
  pin_sequence: int | None = None,
  unavailable: Unavailable = None,
) -> Plan:
  """GetOptimalPath (see the module docstring); counts go to ``planner_for(calibration, floors).counters``."""
  return planner_for(calibration, dictionary_floors).plan(
    request, latency_model, residency, pin_sequence=pin_sequence, unavailable=unavailable
  )

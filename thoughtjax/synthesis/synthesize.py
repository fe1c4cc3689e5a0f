"""``synthesize``: a request's hints and latency budget -> a plan -> the plan run as one program -> a trace.

>>> from thoughtjax.registry import Registry
>>> from thoughtjax.synthesis.synthesize import Synthesizer
>>> syn = Synthesizer.open(Registry.open("build/registry"))       # the stored calibration, verified
>>> r = syn.synthesize("Write a haiku about rain", hints=["general_purpose"], max_latency_ms=2000)
>>> r.plan.path, r.plan.reason
>>> for delta in r: print(delta.text, end="")                    # streamed as produced
>>> r.trace.to_json()          # predicted vs actual ms per stage, tokens in/out, compute-seconds, path

A :class:`Synthesizer` holds one registry, its stored calibration (at the registry's current sequence),
the synthesis dictionary's floors, a :class:`~thoughtjax.synthesis.latency.LatencyModel` that learns from
every finished request, and what is warm: composed paths (their thoughtlets restored) and the program
keys it has run (compiled). Planning sees that residency, so a warm path predicts no restore or compile, and a
program that an earlier process put into the persistent compilation cache is priced as the load it then is
(:mod:`~thoughtjax.synthesis.program_ledger`), so a cold process plans as a warm one would where only loads differ.
What the latency model learns persists per machine and registry (:mod:`~thoughtjax.synthesis.corrections`),
per execution context: a request teaches the context it ran in (its own plain or speculative program, or the
slot engine a server's scheduler moved it into, :meth:`Synthesizer.ran_in`), and plans are predicted for
``context`` (default: a plain program of this registry's weight form and kernels), with that context's
corrections only. A new synthesizer starts from the corrections earlier ones learned; ``learned_corrections=False``
keeps them in process. ``learn=False`` keeps the latency model as loaded: for a given residency, the same request gets
the same plan (reproducible benchmarks and tests).

Stages as measured (milliseconds), the same definitions calibration fitted:
``startup`` (traced, not predicted) what the first request of a synthesizer pays once before planning:
importing the planning modules, loading the tokenizer, restoring the stored router for a request without
hints (0 afterwards); ``synthesis`` hint normalization + GetOptimalPath; ``restore`` reading the plan's missing thoughtlets and
composing the path; ``compile`` the program compile the first call of a new key pays (the engine's
trace); ``prefill`` and ``decode`` from the engine's trace. ``total`` is the wall time from the request to
the last token. ``compute_seconds`` is restore + compile + prefill + decode, in seconds.

A speculative plan (``plan.draft``) runs the speculative program (:mod:`thoughtjax.decode.speculative`): its draft
proposes, the plan's path verifies; the trace names the draft and counts drafted and accepted tokens.

Degradation: a thoughtlet of the plan that fails verification or restore is reported to the planner as
unavailable and the request is planned again (the best path avoiding it, ``degraded=True``, counted);
another version is never used in its place. With no hints, the registry's stored router picks the hint
(:func:`~thoughtjax.synthesis.router_store.route_hint`; without one, ``general_purpose``); the notes say which.

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``,
``registry``, ``synthesis.calibrate_latency``, ``synthesis.calibration_store``, ``synthesis.corrections``,
``synthesis.dictionary``, ``synthesis.hints``, ``synthesis.router_store``; the functions that need them do.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from thoughtjax import settings
from thoughtjax.constraint import Constraint
from thoughtjax.decode.request import RequestRun
from thoughtjax.decode.speculative import Draft
from thoughtjax.defaults import DEFAULT_MAX_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.kernels.dispatch import resolve as resolve_kernels
from thoughtjax.sampling import SamplingMode, SamplingParams
from thoughtjax.serving.slot_run import SlotRun
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.candidate import path_hash_of
from thoughtjax.synthesis.latency import LatencyModel, LatencyTrace
from thoughtjax.synthesis.latency_context import LatencyContext
from thoughtjax.synthesis.latency_load import IDLE, Load, Residency
from thoughtjax.synthesis.latency_params import STAGES
from thoughtjax.synthesis.planner import Plan, Planner, PlanRequest, floors_of

if TYPE_CHECKING:
  from thoughtjax.serving.pool import EnginePool

DEFAULT_HINT = "general_purpose"
STAGE_NAMES = ("restore", "compile", "prefill", "decode")


class SynthesisError(UserError, ValueError):
  """A synthesis request that cannot be served as given; the message says the fix."""


@dataclasses.dataclass
class SynthesisTrace:
  """Predicted vs actual latency per stage of one synthesized request, and what it ran."""

  path: str
  path_hash: str
  refs: tuple[str, ...]
  hints: tuple[str, ...]
  degraded: bool
  reason: str
  tokens_in: int
  predicted_ms: dict
  actual_ms: dict = dataclasses.field(default_factory=dict)
  tokens_out: int = 0
  finish_reason: str | None = None
  finished: bool = False
  kind: str = ""
  draft: str | None = None  # a speculative plan's draft (path, k, vocab); None: the path decoded alone
  drafted: int = 0  # speculative: tokens drafted, drafts accepted, verify passes
  accepted: int = 0
  verify_passes: int = 0

  @property
  def compute_seconds(self) -> float:
    return sum(self.actual_ms.get(s, 0.0) for s in STAGE_NAMES) / 1e3

  def to_json(self) -> dict:
    return {
      "path": self.path,
      "path_hash": self.path_hash,
      "refs": list(self.refs),
      "hints": list(self.hints),
      "degraded": self.degraded,
      "reason": self.reason,
      "tokens_in": self.tokens_in,
      "tokens_out": self.tokens_out,
      "predicted_ms": dict(self.predicted_ms),
      "actual_ms": dict(self.actual_ms),
      "compute_seconds": self.compute_seconds,
      "finish_reason": self.finish_reason,
      "kind": self.kind,
      "draft": self.draft,
      **({} if self.draft is None else {"drafted": self.drafted, "accepted": self.accepted}),
      **({} if self.draft is None else {"verify_passes": self.verify_passes}),
    }

  def table(self) -> str:
    """Predicted vs actual per stage, one line each (what the command line prints to stderr)."""
    lines = [
      f"path {self.path} ({self.path_hash}){'  DEGRADED: ' + self.reason if self.degraded else ''}",
      f"{'stage':<10}{'predicted ms':>14}{'actual ms':>12}",
    ]
    if self.actual_ms.get("startup"):  # one-off, not predicted: the first request of a process pays it
      lines.append(f"{'startup':<10}{'-':>14}{self.actual_ms['startup']:>12.2f}")
    for s in ("synthesis", *STAGE_NAMES, "total"):
      a = self.actual_ms.get(s)
      lines.append(f"{s:<10}{self.predicted_ms.get(s, 0.0):>14.2f}{'-' if a is None else f'{a:.2f}':>12}")
    lines.append(f"tokens in {self.tokens_in}, out {self.tokens_out}; compute {self.compute_seconds:.3f} s")
    if self.draft is not None:
      rate = self.accepted / self.drafted if self.drafted else 0.0
      lines.append(
        f"speculative: draft {self.draft}; accepted {self.accepted} of {self.drafted} drafted ({rate:.0%}), "
        f"{self.verify_passes} verify passes"
      )
    return "\n".join(lines)


class LoadBook(Protocol):
  """Where a server's plans come from one at a time: ``planning()`` holds other plans off while it gives the load
  now, and ``reserve(path_hash, tokens)`` counts the plan just made in the load of the plans after it until the
  returned reservation's ``release()``."""

  def planning(self) -> contextlib.AbstractContextManager[Load]: ...

  def reserve(self, path_hash: str, tokens: int) -> Any: ...


class SynthesisResult(RequestRun):
  """One synthesized request: ``plan``, ``request`` (the plan's checked
  :class:`~thoughtjax.decode.request.ModelRequest` on its composed path, not started) and ``trace`` (filled in
  as it runs; complete once the stream ends).

  The caller runs it (:class:`~thoughtjax.decode.request.RequestRun`): iterate it for deltas (the first
  ``next()`` starts the request alone), or hand ``request.slot()`` to a slot engine and that engine's stream to
  :meth:`run_in` (what a server's continuous scheduler does); ``cancel()``/``close()`` before or after it
  started."""

  def __init__(self, plan: Plan, request, trace: SynthesisTrace, on_done, t_request: float):
    super().__init__(request)
    self.plan, self.trace = plan, trace
    self.reservation = None  # the plan's row reserved in a server's engine pool (a LoadBook's), if any
    self._on_done, self._t0 = on_done, t_request
    self.token_ids: list[int] = []
    self.text = ""

  def __next__(self):
    try:
      d = super().__next__()
    except StopIteration:
      if self.generation is not None:
        self._finish()
      raise
    self.token_ids.extend(d.token_ids)
    self.text += d.text
    if d.finished:
      self.trace.finish_reason = d.finish_reason
    return d

  def _finish(self) -> None:
    if self.trace.finished:
      return
    t = self.generation.trace
    self.trace.actual_ms.update(
      {
        "compile": t.compile_s * 1e3,
        "prefill": (t.prefill_s or 0.0) * 1e3,
        "decode": (t.decode_s or 0.0) * 1e3,
        "total": ((t.end or time.perf_counter()) - self._t0) * 1e3,
      }
    )
    self.trace.tokens_out = t.tokens_out[0] if t.tokens_out else 0
    if self.trace.draft is not None:
      self.trace.drafted, self.trace.accepted, self.trace.verify_passes = t.drafted, t.accepted, t.verify_passes
    self.trace.finished = True
    self._on_done(self)

  def finish(self) -> SynthesisResult:
    """Run to the end (the trace is then complete); returns self."""
    for _ in self:
      pass
    return self

  def to_json(self) -> dict:
    """The plan's fields plus ``token_ids``, ``text``, ``actual_ms`` and the trace (the CLI's ``--json``)."""
    d = self.plan.to_json()
    d.update(
      {
        "token_ids": list(self.token_ids),
        "text": self.text,
        "actual_ms": dict(self.trace.actual_ms),
        "tokens_in": self.trace.tokens_in,
        "tokens_out": self.trace.tokens_out,
        "compute_seconds": self.trace.compute_seconds,
        "finish_reason": self.trace.finish_reason,
      }
    )
    return d


class Synthesizer:
  """Plans and runs requests over one registry and its stored calibration (see the module docstring)."""

  def __init__(
    self,
    registry,
    calibration: Calibration,
    dictionary=None,
    *,
    kernels: str | None = None,
    keep_paths: int = 4,
    learned_corrections: bool = True,
    learn: bool = True,
    context: LatencyContext | None = None,
  ):
    from thoughtjax.decode.program import compilation_cache_dir
    from thoughtjax.synthesis import corrections as corr_lib
    from thoughtjax.synthesis.calibrate_latency import machine_fingerprint
    from thoughtjax.synthesis.dictionary import load_dictionary
    from thoughtjax.synthesis.program_ledger import ledger_for

    if calibration.sequence != registry.sequence:
      raise SynthesisError(
        f"the calibration is of registry sequence {calibration.sequence}, the registry is at "
        f"{registry.sequence}; recalibrate (thoughtjax registry calibrate {registry.root})"
      )
    self.registry, self.calibration = registry, calibration
    self.dictionary = dictionary if dictionary is not None else load_dictionary()
    self.floors = floors_of(self.dictionary)
    self.planner = Planner(calibration, self.floors)
    params = calibration.latency
    self.corrections_key = corr_lib.corrections_key(registry.registry_id, machine_fingerprint(), params)
    path = corr_lib.corrections_path() if learned_corrections else None
    learned = corr_lib.load_corrections(self.corrections_key, path) if path is not None else {}
    # Plans are predicted for this process's own programs unless told otherwise (a server's slot engines).
    self.context = context or LatencyContext(
      "plain", getattr(registry, "weights", None) or "f32", 1, resolve_kernels(kernels)
    )
    self.latency = LatencyModel(params, context=self.context, learned=learned)
    self.corrections_loaded = learned
    # The programs the persistent compilation cache holds for this registry and calibration: a cold plan prices
    # them as the load they are, not as a full compile (kept in the process only without learned corrections, or
    # with THOUGHTJAX_PROGRAM_LEDGER=off).
    shared = learned_corrections and not settings.current().program_ledger_off
    self.ledger = ledger_for(self.corrections_key, compilation_cache_dir() if shared else None)
    self._store = corr_lib.CorrectionsStore(self.corrections_key, self.latency, path)
    weakref.finalize(self, self._store.flush)  # what the last requests taught, saved at exit
    self.kernels, self.keep_paths, self.learn = kernels, keep_paths, learn
    self._models: collections.OrderedDict[str, object] = collections.OrderedDict()
    self._compiled: set[str] = set()
    self._lock = threading.Lock()
    self.traces: list[SynthesisTrace] = []
    self._started: set[str] = set()  # one-off start-up costs this synthesizer has paid ("planning", "router")

  @classmethod
  def open(cls, registry, dictionary=None, *, sequence: int | None = None, **kwargs) -> Synthesizer:
    """A synthesizer over ``registry``'s stored calibration (verified; refused loudly when tampered)."""
    from thoughtjax.synthesis.calibration_store import read_calibration

    return cls(registry, read_calibration(registry, sequence), dictionary, **kwargs)

  # ---- residency ---------------------------------------------------------------------
  def residency(self) -> Residency:
    with self._lock:
      composed = {u.ref for h in self._models for c in self.calibration.candidates if c.path_hash == h for u in c.units}
      return Residency(set(self.registry.stats().resident) | composed, set(self._compiled), self.ledger.prices())

  def model_of(self, candidate):
    """The composed model of ``candidate``'s units (cached; a speculative candidate shares the full path's);
    each unit, a draft's too, restored alone, so a failure names its ref."""
    from thoughtjax.compose import compose
    from thoughtjax.registry import IntegrityError, RegistryError

    key = path_hash_of(candidate.units)
    with self._lock:
      got = self._models.get(key)
    if got is not None and candidate.draft is None:
      with self._lock:
        self._models.move_to_end(key)
      return got
    for u in dict.fromkeys(candidate.all_units):
      try:
        self.registry.restore(u.name, u.version)
      except IntegrityError as e:
        raise _Unavailable(u.ref, f"verification ({e.reason})") from e
      except RegistryError as e:
        raise _Unavailable(u.ref, "restore (not tampering: memory, sharding or I/O)") from e
    if got is not None:
      return got
    model = compose(", ".join(u.ref for u in candidate.units), self.registry, kernels=self.kernels)
    with self._lock:
      self._models[key] = model
      while len(self._models) > self.keep_paths:
        self._models.popitem(last=False)
    return model

  def drop_models(self, path_hashes=None) -> list:
    """Forget the composed models of ``path_hashes`` (their ``path_hash``; None: every one) and return them;
    requests running them keep theirs, the next one composes again (its weights from the registry)."""
    with self._lock:
      keys = [k for k, m in self._models.items() if path_hashes is None or m.path_hash in path_hashes]
      return [self._models.pop(k) for k in keys]

  def forget_compiled(self) -> None:
    """Plans predict a compile again for every program (the process dropped its compiled programs)."""
    with self._lock:
      self._compiled.clear()

  def models(self) -> list:
    """The composed models kept for the next requests (least recently used first)."""
    with self._lock:
      return list(self._models.values())

  def warm(
    self,
    hints: Sequence[str] | None = None,
    *,
    prompt_tokens: Sequence[int] = (16,),
    max_tokens: Sequence[int] = (DEFAULT_MAX_TOKENS,),
    pool: EnginePool | None = None,
    budgets: Sequence[float] = (math.inf,),
    modes: Sequence[SamplingMode] = (SamplingMode.GREEDY,),
  ) -> list[str]:
    """Restore and compile ahead of time the plans of ``hints`` (default: every calibrated hint) under each of
    ``budgets`` (ms; default a generous one), for the given shape buckets, so a first request pays no restore or
    compile. A plan is the one chosen on a warm process (every candidate restored and compiled): a budget the
    float32 full path does not fit warms the faster path it would get (the int8 full path, a cut path), which a
    cold process would never choose, as restoring and compiling it would not fit either.
    With ``pool`` (a server's slot engines), a plan that a slot engine would run is warmed where it will run:
    its engine in the pool is made and compiled in each sampling mode of ``modes`` (:meth:`EnginePool.warm
    <thoughtjax.serving.pool.EnginePool.warm>`) instead of the program a request running alone takes; a plan
    that runs alone (speculative) is run as without, and its path's engine is warmed too: a request of another
    shape, or planned while its drafted program is not compiled, runs that path in its slot engine. Returns the
    paths warmed."""
    warmed = []
    for hint in hints or self.calibration.hints:
      for T in prompt_tokens:
        for n in max_tokens:
          everything = self.latency.warm_residency(self.calibration.candidates, T, n)
          for budget in budgets:
            r = self._synthesize([3] * T, [hint], budget, n, False, None, everything, {"ignore_eos": True})
            if pool is None or r.request.slot() is None:
              r.finish()
            if pool is not None:  # a slot engine runs the plan's path (or its requests a drafted program misses)
              pool.warm(r.model, T, n, modes)
            if r.plan.path not in warmed:
              warmed.append(r.plan.path)
    return warmed

  # ---- requests ----------------------------------------------------------------------
  def plan(
    self,
    prompt: str | Sequence[int],
    hints: Sequence[str] | None = None,
    *,
    max_latency_ms: float,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    chat: bool = False,
    pin_sequence: int | None = None,
    unavailable=None,
    constraint: Constraint | None = None,
    load: Load | None = None,
    residency: Residency | None = None,
  ) -> Plan:
    """GetOptimalPath for this request (hints normalized and corrected against the dictionary); ``constraint``:
    the request's output constraint (planned without speculation, predicted one step per call); ``load``: a
    server's slot engines now (:meth:`context_under`); ``residency``: what the plan takes as restored and compiled
    (default: what this process holds now)."""
    return self._plan(
      prompt, hints, max_latency_ms, max_tokens, chat, pin_sequence, unavailable, constraint, residency, load
    )[0]

  def context_under(self, load: Load | None) -> LatencyContext:
    """Where a request planned under ``load`` runs: this synthesizer's context, or with ``load`` (a server with
    slot engines, idle or not) a slot engine of ``load.slots`` slots, whose learned corrections it then uses."""
    if load is None:
      return self.context
    return LatencyContext("slots", self.context.weights, load.slots, self.context.kernels)

  def prompt_ids(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
    if not isinstance(prompt, str):
      return [int(t) for t in prompt]
    codec = self.registry.codec
    text = codec.render_chat([{"role": "user", "content": prompt}]) if chat else prompt
    ids = codec.encode(text)
    if not ids:
      raise SynthesisError("the prompt is empty after tokenization; give at least one token")
    return ids

  def _startup(self, routing: bool) -> float:
    """Milliseconds of the one-off costs the first request pays before planning: importing the planning
    modules and loading the registry's tokenizer, and for a request without hints, restoring the stored router.
    Traced as the ``startup`` stage, so ``synthesis`` measures hint normalization and GetOptimalPath, the
    planning the latency model predicts (0.1 ms, where a first call used to show 100+ ms)."""
    need = ({"planning"} | ({"router"} if routing else set())) - self._started
    if not need:
      return 0.0
    t = time.perf_counter()
    if "planning" in need:
      # Imported here for start-up laziness (a plan needs them, opening a synthesizer does not); timed as start-up.
      import thoughtjax.synthesis.hints
      import thoughtjax.synthesis.router_store  # noqa: F401

      self.registry.codec  # noqa: B018  (loads and checks the tokenizer on first access)
    if "router" in need:
      from thoughtjax.synthesis.router_store import stored_router

      stored_router(self.registry)
    self._started |= need
    return (time.perf_counter() - t) * 1e3

  def _plan(
    self,
    prompt,
    hints,
    max_latency_ms,
    max_tokens,
    chat,
    pin_sequence,
    unavailable,
    constraint=None,
    residency=None,
    load=None,
  ):
    """(plan, prompt ids, synthesis ms, start-up ms); ``residency``: what to plan as warm (default: what is)."""
    startup = self._startup(routing=not hints)
    from thoughtjax.synthesis.hints import normalize_hints
    from thoughtjax.synthesis.router_store import route_hint

    t0 = time.perf_counter()
    routed = None if hints else route_hint(self.registry, prompt, DEFAULT_HINT)  # (hint, note)
    res = normalize_hints([routed[0]] if routed else list(hints), self.dictionary)
    ids = self.prompt_ids(prompt, chat)
    if max_latency_ms is None:
      max_latency_ms = math.inf
    req = PlanRequest(
      res.hints,
      len(ids),
      int(max_tokens),
      float(max_latency_ms),
      tuple((c.given, c.corrected) for c in res.corrections),
      constraint=None if constraint is None else constraint.describe(),
    )
    residency = self.residency() if residency is None else residency
    kw = dict(
      pin_sequence=pin_sequence,
      unavailable=unavailable,
      load=load or IDLE,
      context=None if load is None else self.context_under(load),
    )
    plan = self.planner.plan(req, self.latency, residency, **kw)
    notes = (routed[1],) if routed else ()
    everything = self.latency.warm_residency(self.calibration.candidates, len(ids), int(max_tokens))
    if not (everything.resident <= residency.resident and everything.compiled <= residency.compiled):
      # Not everything is warm here: would a process where it is choose otherwise? (a what-if, not counted)
      warm = self.planner.plan(req, self.latency, everything, count=False, **kw)
      if warm.path_hash != plan.path_hash:
        what = warm.kind + (f", {warm.draft.label} drafting" if warm.draft is not None else "")
        notes += (
          f"planned with what this process holds (restore {plan.predicted.restore:.0f} ms and compile "
          f"{plan.predicted.compile:.0f} ms priced); a process with every path restored and compiled would choose "
          f"{warm.path} ({what}, predicted {warm.predicted.total:.0f} ms)",
        )
    if notes:
      plan = dataclasses.replace(plan, notes=plan.notes + notes)
    return plan, ids, (time.perf_counter() - t0) * 1e3, startup

  def synthesize(
    self,
    prompt: str | Sequence[int],
    hints: Sequence[str] | None = None,
    *,
    max_latency_ms: float | None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    chat: bool = False,
    pin_sequence: int | None = None,
    load: Load | None = None,
    book: LoadBook | None = None,
    **sampling,
  ) -> SynthesisResult:
    """Plan, restore and compose, and return the plan with its checked request, not started: iterate the
    result for deltas (it then runs alone), or hand ``result.request.slot()`` to a slot engine
    (:meth:`SynthesisResult.run_in`).

    ``sampling``: :class:`~thoughtjax.sampling.SamplingParams` fields (temperature, top_k, top_p, seed,
    stop_strings, ...). A thoughtlet that fails verification or restore is planned around (degraded). ``load``:
    a server's slot engines now, which the request will join (planned in their context, :meth:`context_under`);
    ``book`` (instead of ``load``): a :class:`LoadBook` that gives the load under a lock and takes the plan's
    reservation (``result.reservation``, for the caller to release once the request is in its engine)."""
    if load is not None and book is not None:
      raise ValueError("give a request's load or the book it is planned under, not both")
    return self._synthesize(prompt, hints, max_latency_ms, max_tokens, chat, pin_sequence, None, sampling, load, book)

  def _synthesize(
    self, prompt, hints, max_latency_ms, max_tokens, chat, pin_sequence, residency, sampling, load=None, book=None
  ):
    t_request = time.perf_counter()
    params = SamplingParams(max_tokens=int(max_tokens), **sampling)  # refused before any planning
    unavailable: dict[str, str] = {}
    synthesis_ms = startup_ms = 0.0
    while True:
      reservation = None
      with book.planning() if book is not None else contextlib.nullcontext(load) as now:
        plan, ids, ms, startup = self._plan(
          prompt,
          hints,
          max_latency_ms,
          max_tokens,
          chat,
          pin_sequence,
          dict(unavailable) or None,
          params.constraint,
          residency,
          now,
        )
        candidate = next(c for c in self.calibration.candidates if c.path_hash == plan.path_hash)
        if book is not None and candidate.draft is None:  # a speculative plan decodes alone, in no engine
          reservation = book.reserve(plan.path_hash, len(ids) + int(max_tokens))
      synthesis_ms += ms
      startup_ms += startup
      t = time.perf_counter()
      try:
        model = self.model_of(candidate)
      except BaseException as e:  # the plan gives its reservation back; an unavailable path is planned around
        if reservation is not None:
          reservation.release()
        if not isinstance(e, _Unavailable) or e.ref in unavailable:  # the planner never returns a blocked path
          raise
        unavailable[e.ref] = e.why
        continue
      restore_ms = (time.perf_counter() - t) * 1e3
      break
    with self._lock:
      self._compiled.add(plan.predicted.program_key)
    # ids already carry the chat template: the path runs them as token ids.
    if candidate.draft is None:
      request = model.request([ids], params)
    else:  # the speculative program: the draft proposes, the full path verifies
      d = candidate.draft
      request = model.request([ids], params, draft=Draft(d.path, vocab=d.vocab), draft_tokens=d.draft_tokens)
    trace = SynthesisTrace(
      plan.path,
      plan.path_hash,
      plan.refs,
      plan.hints,
      plan.degraded,
      plan.reason,
      len(ids),
      plan.predicted.to_json(),
      {"startup": startup_ms, "synthesis": synthesis_ms, "restore": restore_ms},
      kind=plan.kind,
      draft=None if plan.draft is None else plan.draft.label,
    )
    result = SynthesisResult(plan, request, trace, self._learn, t_request)
    result.reservation = reservation
    return result

  def _learn(self, result: SynthesisResult) -> None:
    """Move the latency model toward what the finished request measured, in the context it ran in (unless
    ``learn=False``); keep the trace."""
    actual = {s: result.trace.actual_ms[s] for s in STAGES if s in result.trace.actual_ms}
    tokens = result.trace.tokens_out
    gen = result.generation.trace
    if gen.compile_s > 0 and not isinstance(result.generation, SlotRun) and _persistent_cache_on():
      # Its program compiled (or loaded) in this process, into the persistent cache: what the next process pays
      # for it. A slot engine's run compiled the engine's programs, not this one.
      self.ledger.record(result.plan.predicted.program_key, gen.compile_s * 1e3, loaded=gen.compile_misses == 0)
    if self.learn and tokens and not gen.cancelled:
      # compile_s > 0: this call traced or compiled its program (its first run in this process).
      run = result.generation
      width = run.mean_width if isinstance(run, SlotRun) else None  # a slot engine's run: the rows its steps computed
      trace = LatencyTrace(
        result.plan.predicted,
        actual,
        tokens,
        compiled=gen.compile_s > 0,
        context=self.ran_in(result),
        width=width,
      )
      self.latency.update(trace)
      self._store.learned()
    with self._lock:
      self.traces.append(result.trace)

  def ran_in(self, result: SynthesisResult) -> LatencyContext:
    """The context ``result`` ran in: the one its plan predicted for, or, when a server's scheduler moved it
    into a slot engine (its generation is then that engine's run), that engine's."""
    if isinstance(result.generation, SlotRun):
      engine = result.generation.engine
      return LatencyContext("slots", self.context.weights, engine.slots, engine.kernels or self.context.kernels)
    return result.plan.predicted.context

  def save_corrections(self) -> None:
    """Write the learned latency corrections now (otherwise at most once a second, and at exit)."""
    self._store.flush()


def _persistent_cache_on() -> bool:
  """Whether this process writes what it compiles to JAX's persistent compilation cache."""
  import jax

  return bool(jax.config.jax_compilation_cache_dir)


class _Unavailable(Exception):
  def __init__(self, ref: str, why: str):
    super().__init__(f"{ref} failed {why}")
    self.ref, self.why = ref, why


def synthesize(
  registry,
  prompt: str | Sequence[int],
  hints: Sequence[str] | None = None,
  *,
  max_latency_ms: float | None,
  max_tokens: int = DEFAULT_MAX_TOKENS,
  chat: bool = False,
  **sampling,
) -> SynthesisResult:
  """One request on ``registry``'s stored calibration (see :class:`Synthesizer` to keep what is warm)."""
  return Synthesizer.open(registry).synthesize(
    prompt, hints, max_latency_ms=max_latency_ms, max_tokens=max_tokens, chat=chat, **sampling
  )

"""GetOptimalPath on synthetic calibrations: floors, budgets, ties, pinning, each degradation, residency,
and the calibration record's canonical JSON (round trip, refused versions, tampering)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thoughtjax.synthesis.calibration import FORMAT_VERSION, Calibration, HintQuality, PathQuality
from thoughtjax.synthesis.candidate import CalibrationError, Candidate, Unit
from thoughtjax.synthesis.latency import LatencyModel, LatencyTrace
from thoughtjax.synthesis.latency_context import LatencyContext
from thoughtjax.synthesis.latency_load import COLD, EngineLoad, Load, Residency
from thoughtjax.synthesis.latency_params import LatencyParams, LinearCost
from thoughtjax.synthesis.planner import (
  Floor,
  NoPathError,
  Plan,
  PlanError,
  Planner,
  PlanRequest,
  SequenceMismatchError,
  floors_of,
  get_optimal_path,
  planner_for,
)

MB = 1 << 20
SEQUENCE = 7
FLOORS = {
  "general_purpose": Floor(0.6, 1.0),
  "legal_analysis": Floor(0.9, 0.3, delta_nll=0.2),
  "fast_draft": Floor(0.2, 10.0),
}


# ------------------------------------------------------------------------------ helpers
def block(a, b, version="v1", key="block"):
  return Unit(f"blocks[{a}:{b})", version, 4 * MB * (b - a), b - a, key)


EMBED, HEAD = Unit("embed", "v1", 30 * MB, 0, "embed"), Unit("head", "v1", 1 * MB, 0, "head")
SPANS = [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]


def path_of(units):
  return Candidate.build(", ".join(u.name for u in units), "manual", units).path


def make(kind, blocks, **kw):
  units = [EMBED, *blocks, HEAD]
  return Candidate.build(kw.get("path", path_of(units)), kind, units)


CANDIDATES = {
  "full": make("full", [block(a, b) for a, b in SPANS]),
  "exit8": make("exit", [block(a, b) for a, b in SPANS[:4]]),
  "exit4": make("exit", [block(a, b) for a, b in SPANS[:2]]),
  "skip": make("skip", [block(a, b) for a, b in SPANS[:2] + SPANS[3:]]),
  "int8": make("variant", [Unit("blocks[0:12).int8", "v1", 12 * MB, 12, "block8")]),
}


def latency_params() -> LatencyParams:
  return LatencyParams(
    prefill={
      "embed": LinearCost(0.1, 0.001),
      "block": LinearCost(1.0, 0.01),
      "block8": LinearCost(3.0, 0.03),
      "head": LinearCost(0.5, 0.004),
    },
    decode={
      "embed": LinearCost(0.05),
      "block": LinearCost(0.5, 0.001),
      "block8": LinearCost(1.5, 0.003),
      "head": LinearCost(0.3),
    },
    restore=LinearCost(2.0, 1e-5),
    compile={16: LinearCost(100.0, 10.0)},
    step_ms=0.2,
    synthesis_ms=0.05,
  )


def q(top1, kl, dnll=0.1, tokens=500):
  return PathQuality(top1, kl, dnll, tokens)


def hq(cal, held=None):
  """(top1, kl) on the calibration split, and on held-out (default: slightly worse)."""
  held = held or (max(0.0, cal[0] - 0.02), cal[1] + 0.05)
  return HintQuality(q(*cal), q(*held))


DEFAULT_QUALITY = {
  "exit8": {"general_purpose": hq((0.8, 0.5)), "legal_analysis": hq((0.7, 0.9)), "fast_draft": hq((0.8, 0.5))},
  "exit4": {"general_purpose": hq((0.5, 2.0)), "legal_analysis": hq((0.3, 3.0)), "fast_draft": hq((0.5, 2.0))},
  "skip": {"general_purpose": hq((0.9, 0.2)), "legal_analysis": hq((0.95, 0.1)), "fast_draft": hq((0.9, 0.2))},
  "int8": {"general_purpose": hq((0.97, 0.05)), "legal_analysis": hq((0.96, 0.08)), "fast_draft": hq((0.97, 0.05))},
}


def calibration(quality=None, candidates=None, *, sequence=SEQUENCE, current=None) -> Calibration:
  cands = dict(CANDIDATES if candidates is None else candidates)
  quality = DEFAULT_QUALITY if quality is None else quality
  return Calibration(
    sequence,
    "cpu:test",
    tuple(cands.values()),
    {cands[n].path_hash: per for n, per in quality.items() if n in cands},
    latency_params(),
    current or {},
  )


def totals(cal, T, n, residency=COLD):
  m = LatencyModel(cal.latency)
  return {name: m.predict(c, T, n, residency).total for name, c in CANDIDATES.items()}


def name_of(plan: Plan) -> str:
  return next(n for n, c in CANDIDATES.items() if c.path_hash == plan.path_hash)


def plan(cal, hints, budget, *, T=40, n=16, residency=None, **kw) -> Plan:
  return Planner(cal, FLOORS).plan(PlanRequest(tuple(hints), T, n, budget), None, residency, **kw)


# ------------------------------------------------------------------------------ budgets
def test_generous_budget_picks_the_best_quality():
  p = plan(calibration(), ["general_purpose"], 1e9)
  assert name_of(p) == "full" and not p.degraded
  assert p.reason == "best quality meeting every floor within the budget"
  assert p.quality["general_purpose"] == PathQuality(1.0, 0.0, 0.0, 0)


def test_tight_budget_picks_a_faster_path_that_meets_the_floors():
  cal = calibration()
  t = totals(cal, 40, 16)
  assert t["int8"] < t["full"]
  budget = (t["int8"] + t["full"]) / 2
  p = plan(cal, ["general_purpose"], budget)
  assert name_of(p) == "int8" and not p.degraded and p.predicted.total <= budget
  full = [r for r in p.rejected if r.path_hash == CANDIDATES["full"].path_hash]
  assert len(full) == 1 and full[0].why == "budget"
  assert f"predicted {t['full']:.4g} ms > budget {budget:.4g} ms" == full[0].detail
  # Quality is reported on the held-out split.
  assert p.quality["general_purpose"] == DEFAULT_QUALITY["int8"]["general_purpose"].heldout


def test_only_the_full_path_is_an_honest_answer():
  strict = {"legal_analysis": Floor(0.999, 0.001)}
  p = Planner(calibration(), strict).plan(PlanRequest(("legal_analysis",), 40, 16, 1e9))
  assert name_of(p) == "full" and not p.degraded
  assert p.reason == "only the full path meets every floor within the budget"
  assert {r.why for r in p.rejected} == {"floor"} and len(p.rejected) == 4


@pytest.mark.parametrize("budget", [1.0, 200.0])
def test_impossible_budget_gives_the_fastest_floor_meeting_path_and_the_tokens_that_fit(budget):
  cal = calibration()
  planner = Planner(cal, FLOORS)
  t = totals(cal, 40, 64)
  eligible = ["full", "skip", "int8"]  # legal_analysis floors: top1 >= 0.9, kl <= 0.3, dnll <= 0.2
  assert min(t[e] for e in eligible) > budget
  p = planner.plan(PlanRequest(("legal_analysis",), 40, 64, budget))
  fastest = min(eligible, key=lambda e: (t[e], CANDIDATES[e].path_hash))
  assert name_of(p) == fastest and p.degraded and p.reason == "budget"
  pred = p.predicted
  fixed = pred.total - pred.decode
  want = max([k for k in range(65) if fixed + pred.raw_decode(k) <= budget], default=0)
  assert p.tokens_that_fit == want and 0 <= want < 64
  assert {r.path_hash for r in p.rejected if r.why == "budget"} == {CANDIDATES[e].path_hash for e in eligible} - {
    p.path_hash
  }
  assert planner.counters.snapshot()["degraded_budget"] == 1


def test_tokens_that_fit_when_only_decode_overflows():
  cal = calibration()
  m = LatencyModel(cal.latency)
  eligible = [CANDIDATES[e] for e in ("full", "exit8", "skip", "int8")]  # general_purpose floors
  fastest = min((m.predict(c, 40, 128) for c in eligible), key=lambda p: p.total)
  budget = fastest.total - fastest.decode + fastest.raw_decode(50) + 1e-9  # exactly 50 decode steps fit
  p = plan(cal, ["general_purpose"], budget, n=128)
  assert p.path_hash == fastest.path_hash and p.degraded and p.reason == "budget"
  assert p.tokens_that_fit == 50


# ------------------------------------------------------------------------------- floors
def test_a_path_below_one_hints_floor_is_rejected_naming_the_hint_and_values():
  cal = calibration()
  p = plan(cal, ["general_purpose", "legal_analysis"], 1e9)
  by = {r.path_hash: r for r in p.rejected}
  exit8 = by[CANDIDATES["exit8"].path_hash]  # meets general_purpose (0.8 >= 0.6), fails legal (0.7 < 0.9)
  assert exit8.why == "floor"
  assert exit8.detail == "hint legal_analysis: top1_agreement 0.7 < floor 0.9 (calibration split)"
  exit4 = by[CANDIDATES["exit4"].path_hash]  # fails the first hint already: that one is named
  assert exit4.detail == "hint general_purpose: top1_agreement 0.5 < floor 0.6 (calibration split)"


def test_kl_and_delta_nll_floors_and_uncalibrated_hints():
  quality = {
    "skip": {"legal_analysis": HintQuality(q(0.95, 0.5), q(0.95, 0.5))},
    "int8": {"legal_analysis": HintQuality(q(0.95, 0.1, dnll=0.4), q(0.95, 0.1))},
  }
  p = plan(calibration(quality), ["legal_analysis"], 1e9)
  by = {r.path_hash: r.detail for r in p.rejected}
  assert by[CANDIDATES["skip"].path_hash] == "hint legal_analysis: mean_kl 0.5 > floor 0.3 (calibration split)"
  assert by[CANDIDATES["int8"].path_hash] == "hint legal_analysis: delta_nll 0.4 > floor 0.2 (calibration split)"
  assert by[CANDIDATES["exit8"].path_hash] == "hint legal_analysis: not calibrated on this hint (calibration split)"


def test_floors_are_checked_on_the_calibration_split_and_quality_reported_held_out():
  quality = {"int8": {"general_purpose": HintQuality(q(0.7, 0.5), q(0.4, 1.5))}}  # held-out misses the floor
  cal = calibration(quality)
  t = totals(cal, 40, 16)
  p = plan(cal, ["general_purpose"], (t["int8"] + t["full"]) / 2)
  assert name_of(p) == "int8"
  assert p.quality["general_purpose"] == q(0.4, 1.5) and p.quality_calibration["general_purpose"] == q(0.7, 0.5)


def test_dictionary_floor_objects_and_mappings_are_accepted():
  cal = calibration()
  as_obj = {"general_purpose": types.SimpleNamespace(top1_agreement=0.6, mean_kl=1.0, delta_nll=None)}
  as_map = {"general_purpose": {"top1_agreement": 0.6, "mean_kl": 1.0}}
  r = PlanRequest(("general_purpose",), 40, 16, 1e9)
  assert Planner(cal, as_obj).plan(r) == Planner(cal, as_map).plan(r) == Planner(cal, FLOORS).plan(r)
  with pytest.raises(PlanError, match=r"floor of hint 'x': mean_kl must be a number, got 'low'"):
    Planner(cal, {"x": {"mean_kl": "low"}})
  with pytest.raises(PlanError, match=r"floor of hint 'x': expected top1_agreement, mean_kl"):
    Planner(cal, {"x": object()})  # never a silent "no floor"


def test_the_synthesis_dictionary_floors_plug_in():
  from thoughtjax.synthesis.dictionary import Floors

  spec = types.SimpleNamespace(name="general_purpose", floors=Floors(0.6, 1.0))
  floors = floors_of([spec])
  assert floors == {"general_purpose": Floor(0.6, 1.0)}
  r = PlanRequest(("general_purpose",), 40, 16, 1e9)
  assert Planner(calibration(), {"general_purpose": Floors(0.6, 1.0)}).plan(r) == Planner(calibration(), floors).plan(r)
  assert Planner(calibration(), {"general_purpose": spec}).plan(r) == Planner(calibration(), floors).plan(r)


def test_hint_priority_is_lexicographic():
  quality = {
    "skip": {"general_purpose": hq((0.95, 0.3)), "fast_draft": hq((0.7, 0.9))},
    "exit8": {"general_purpose": hq((0.9, 0.3)), "fast_draft": hq((0.99, 0.1))},
  }
  cal = calibration(quality, {k: CANDIDATES[k] for k in ("full", "skip", "exit8")})
  t = totals(cal, 40, 16)
  budget = (max(t["skip"], t["exit8"]) + t["full"]) / 2
  a = plan(cal, ["general_purpose", "fast_draft"], budget)
  b = plan(cal, ["fast_draft", "general_purpose"], budget)
  assert (name_of(a), name_of(b)) == ("skip", "exit8")


# -------------------------------------------------------------------------- ties, pinning
def twins():
  """Two different paths with the same quality and the same predicted latency."""
  x = make("manual", [block(0, 2), block(2, 4, "v1"), block(6, 8)])
  y = make("manual", [block(0, 2), block(4, 6), block(6, 8)])
  same = {"general_purpose": hq((0.9, 0.2))}
  return x, y, same


def test_ties_go_to_lower_latency_then_path_hash_whatever_the_order():
  x, y, same = twins()
  plans = []
  for order in ([x, y], [y, x]):
    cands = {"full": CANDIDATES["full"], **{c.path_hash: c for c in order}}
    cal = Calibration(SEQUENCE, "cpu:test", tuple(cands.values()), {c.path_hash: same for c in order}, latency_params())
    t = LatencyModel(cal.latency).predict(x, 40, 16).total
    assert t == LatencyModel(cal.latency).predict(y, 40, 16).total
    plans.append(Planner(cal, FLOORS).plan(PlanRequest(("general_purpose",), 40, 16, t + 1)))
  assert plans[0].path_hash == plans[1].path_hash == min(x.path_hash, y.path_hash)


def test_a_lossless_faster_candidate_wins_the_tie_with_the_full_path():
  # A speculative plan: a bridged early exit drafts, the full path verifies; lossless. Its decode is not
  # the sum of its units: calibration stores its measured speed as a per-path factor.
  from thoughtjax.synthesis.candidate import DraftPlan

  bridge = Unit("bridge[8]", "v1", 1 * MB, 0, "bridge")
  full = CANDIDATES["full"]
  prefix = [u for u in full.units if u.layers][:1]
  draft = DraftPlan(", ".join(u.ref for u in (EMBED, *prefix, bridge, HEAD)), 4, None, (bridge,), prefix[0].layers)
  spec = Candidate.build(full.path, "speculative", full.units, draft)
  lat = dataclasses.replace(latency_params(), corrections={"paths": {spec.path_hash: {"decode": 0.5}}})
  cands = {**CANDIDATES, "spec": spec}
  lossless = {h: HintQuality(q(1.0, 0.0, 0.0), q(1.0, 0.0, 0.0)) for h in FLOORS}
  cal = Calibration(SEQUENCE, "cpu:test", tuple(cands.values()), {spec.path_hash: lossless}, lat)
  p = Planner(cal, FLOORS).plan(PlanRequest(("legal_analysis",), 40, 64, 1e9))
  assert p.path_hash == spec.path_hash and p.kind == "speculative" and not p.degraded and p.draft == draft
  assert "bridge[8]@v1" in p.refs  # the draft's own units are the plan's too (restored, and a failure blocks it)


def test_a_draft_from_the_text_is_chosen_for_the_hints_it_pays_on_and_not_for_the_others():
  """Calibration measures an n-gram draft per hint (its acceptance follows the text): at a generous budget the
  hint it speeds up gets it, a hint it slows down gets the full path, and a request with both hints is priced at
  the slower of the two; the per-hint factors survive the calibration's JSON."""
  from thoughtjax.synthesis.candidate import DraftPlan
  from thoughtjax.synthesis.latency_params import LatencyParams

  full = CANDIDATES["full"]
  spec = Candidate.build(full.path, "speculative", full.units, DraftPlan("ngram:3:2", 4))
  corrections = {
    "paths": {spec.path_hash: {"decode": 1.05}},  # on the calibration text: a little slower than plain
    "hints": {
      "legal_analysis": {spec.path_hash: {"decode": 0.6}},
      "general_purpose": {spec.path_hash: {"decode": 1.2}},
    },
  }
  lat = dataclasses.replace(latency_params(), corrections=corrections)
  assert LatencyParams.from_json(lat.to_json(), "t").corrections == corrections
  cands = {**CANDIDATES, "spec": spec}
  lossless = {h: HintQuality(q(1.0, 0.0, 0.0), q(1.0, 0.0, 0.0)) for h in FLOORS}
  cal = Calibration(SEQUENCE, "cpu:test", tuple(cands.values()), {spec.path_hash: lossless}, lat)
  planner = Planner(cal, FLOORS)
  code = planner.plan(PlanRequest(("legal_analysis",), 40, 64, 1e9))
  prose = planner.plan(PlanRequest(("general_purpose",), 40, 64, 1e9))
  both = planner.plan(PlanRequest(("legal_analysis", "general_purpose"), 40, 64, 1e9))
  assert code.path_hash == spec.path_hash and code.draft.path == "ngram:3:2" and not code.degraded
  assert prose.path_hash == both.path_hash == full.path_hash
  plain = LatencyModel(cal.latency).predict(full, 40, 64)
  assert code.predicted.decode == pytest.approx(0.6 * plain.decode)
  model = LatencyModel(cal.latency)
  assert model.predict(spec, 40, 64, hints=("general_purpose", "legal_analysis")).decode == pytest.approx(
    1.2 * plain.decode
  )
  assert model.predict(spec, 40, 64, hints=("comparative_reasoning",)).decode == pytest.approx(1.05 * plain.decode)


@pytest.mark.parametrize(
  "hints",
  [
    ["not an object"],
    {"code_generation": ["h"]},
    {"code_generation": {"h": {"no_stage": 1.0}}},
    {"code_generation": {"h": {"decode": 1e9}}},
  ],
)
def test_a_malformed_per_hint_factor_is_refused_by_name(hints):
  """A calibration whose ``corrections.hints`` is not hint -> path -> stage -> bounded factor is refused, naming it."""
  from thoughtjax.synthesis.latency_params import LatencyModelError, LatencyParams

  good = latency_params().to_json()
  with pytest.raises(LatencyModelError, match="corrections"):
    LatencyParams.from_json({**good, "corrections": {"hints": hints}}, "t")


def test_a_run_on_one_hints_text_teaches_the_path_without_moving_the_other_hints_by_its_difference():
  """A run that decodes as fast as calibration measured for its hint teaches nothing new: the other hints keep
  their own factors (learning divides the hint's calibrated difference out); a run faster than that moves all."""

  from thoughtjax.synthesis.candidate import DraftPlan

  full = CANDIDATES["full"]
  spec = Candidate.build(full.path, "speculative", full.units, DraftPlan("ngram:3:2", 4))
  corrections = {
    "paths": {spec.path_hash: {"decode": 1.05}},
    "hints": {
      "legal_analysis": {spec.path_hash: {"decode": 0.6}},
      "general_purpose": {spec.path_hash: {"decode": 1.2}},
    },
  }
  model = LatencyModel(dataclasses.replace(latency_params(), corrections=corrections))
  raw = model.predict(spec, 40, 64).raw["decode"]
  legal = model.predict(spec, 40, 64, hints=("legal_analysis",))
  assert legal.decode == pytest.approx(0.6 * raw) and legal.hint_scale == {"decode": pytest.approx(0.6 / 1.05)}
  for _ in range(5):
    model.update(LatencyTrace(legal, {"decode": 0.6 * raw}))
  assert model.predict(spec, 40, 64, hints=("general_purpose",)).decode == pytest.approx(1.2 * raw, rel=1e-6)
  model.update(LatencyTrace(legal, {"decode": 0.3 * raw}))  # twice as fast as measured
  assert model.predict(spec, 40, 64, hints=("general_purpose",)).decode < 1.2 * raw * 0.99


def test_a_constrained_request_is_planned_without_speculation_in_the_masked_context():
  """A draft never sees the grammar's masks: a constrained request gets the best plan without one, predicted one
  step per call (its own latency context, with the mask's cost), and the plan says the output is constrained."""
  from thoughtjax.synthesis.candidate import DraftPlan
  from thoughtjax.synthesis.latency import MASKED_STEP_MS
  from thoughtjax.synthesis.latency_context import LatencyContext

  bridge = Unit("bridge[8]", "v1", 1 * MB, 0, "bridge")
  full = CANDIDATES["full"]
  prefix = [u for u in full.units if u.layers][:1]
  draft = DraftPlan(", ".join(u.ref for u in (EMBED, *prefix, bridge, HEAD)), 4, None, (bridge,), prefix[0].layers)
  spec = Candidate.build(full.path, "speculative", full.units, draft)
  lat = dataclasses.replace(latency_params(), corrections={"paths": {spec.path_hash: {"decode": 0.5}}})
  cands = {**CANDIDATES, "spec": spec}
  lossless = {h: HintQuality(q(1.0, 0.0, 0.0), q(1.0, 0.0, 0.0)) for h in FLOORS}
  cal = Calibration(SEQUENCE, "cpu:test", tuple(cands.values()), {spec.path_hash: lossless}, lat)
  planner = Planner(cal, FLOORS)
  free = planner.plan(PlanRequest(("legal_analysis",), 40, 64, 1e9))
  assert free.kind == "speculative" and free.predicted.context.engine == "speculative"
  bound = planner.plan(PlanRequest(("legal_analysis",), 40, 64, 1e9, constraint="JSON schema (120 characters)"))
  assert bound.draft is None and bound.path_hash == full.path_hash and not bound.degraded
  assert bound.predicted.context.engine == "masked" and bound.predicted.context.batch == 1
  assert any("constrained by a JSON schema (120 characters)" in n for n in bound.notes)
  assert [r.why for r in bound.rejected if r.path_hash == spec.path_hash] == ["unavailable"]
  alone = LatencyModel(cal.latency).predict(full, 40, 64)
  assert bound.predicted.decode == pytest.approx(alone.decode + 63 * MASKED_STEP_MS)
  # In a server's slot engine the request stays in the engine's context (it runs, and teaches, there).
  slots = LatencyContext("slots", "f32", 4, "xla")
  served = planner.plan(
    PlanRequest(("legal_analysis",), 40, 64, 1e9, constraint="regular expression (9 characters)"),
    LatencyModel(cal.latency, context=slots),
  )
  assert served.draft is None and served.predicted.context == slots
  free = LatencyModel(cal.latency, context=slots).predict(full, 40, 64)
  assert served.predicted.decode == pytest.approx(free.decode + 63 * MASKED_STEP_MS)


def test_same_pin_same_plan_and_another_sequence_is_refused():
  cal = calibration()
  r = PlanRequest(("general_purpose", "fast_draft"), 100, 32, 800.0, corrections={"genral_purpose": "general_purpose"})
  floors = dict(FLOORS)
  a = get_optimal_path(r, cal, floors, None, COLD, pin_sequence=SEQUENCE)
  b = get_optimal_path(r, cal, floors, None, COLD, pin_sequence=SEQUENCE)
  assert a == b and a.to_json() == b.to_json() and a.sequence == SEQUENCE
  assert a.corrected_hints == (("genral_purpose", "general_purpose"),)
  assert planner_for(cal, floors).counters.snapshot()["plans"] == 2
  with pytest.raises(
    SequenceMismatchError,
    match=rf"pins registry sequence 8, but the calibration was made "
    rf"against sequence {SEQUENCE}; pin {SEQUENCE}, or calibrate",
  ):
    get_optimal_path(r, cal, floors, None, COLD, pin_sequence=8)


# --------------------------------------------------------------------------- degradation
def test_a_failed_thoughtlet_gives_the_best_path_avoiding_it_counted():
  cal = calibration()
  planner = Planner(cal, FLOORS)
  r = PlanRequest(("general_purpose",), 40, 16, 1e9)
  assert name_of(planner.plan(r)) == "full"
  bad = "blocks[8:10)@v1"  # the full path needs it; skip does too; int8 does not
  p = planner.plan(r, unavailable={bad: "verification: sha3-512 mismatch in checkpoint"})
  assert name_of(p) == "int8" and p.degraded
  assert p.reason == f"unavailable: {bad} failed verification: sha3-512 mismatch in checkpoint"
  assert bad not in p.refs and not any(ref.startswith("blocks[8:10)@") for ref in p.refs)
  un = {r.path_hash: r.detail for r in p.rejected if r.why == "unavailable"}
  assert set(un) == {CANDIDATES["full"].path_hash, CANDIDATES["skip"].path_hash}
  assert planner.counters.snapshot() == {
    "plans": 2,
    "degraded_budget": 0,
    "degraded_unavailable": 1,
    "no_path": 0,
    "moved_by_load": 0,
    "unavailable": {bad: 1},
  }


def test_a_failure_that_leaves_nothing_within_budget_is_budget_with_the_failure_noted():
  cal = calibration()
  planner = Planner(cal, FLOORS)
  t = totals(cal, 40, 16)
  budget = (t["int8"] + t["exit8"]) / 2  # among general_purpose paths only int8 fits
  p = planner.plan(PlanRequest(("general_purpose",), 40, 16, budget), unavailable={"blocks[0:12).int8@v1"})
  assert name_of(p) == "exit8" and p.degraded and p.reason == "budget"
  assert any("blocks[0:12).int8@v1 failed verification or restore" in note for note in p.notes)
  c = planner.counters.snapshot()
  assert (c["degraded_budget"], c["degraded_unavailable"], c["unavailable"]) == (1, 1, {"blocks[0:12).int8@v1": 1})


@pytest.mark.parametrize(
  "unavailable",
  [
    {"blocks[0:12).int8@v1"},  # a set of refs
    {"blocks[0:12).int8": "restore: checkpoint file missing"},  # a bare name: every version of it
    lambda ref: "restore: I/O error" if ref == "blocks[0:12).int8@v1" else None,  # a callback
  ],
)
def test_every_form_of_failure_report_is_honoured(unavailable):
  cal = calibration()
  t = totals(cal, 40, 16)
  budget = (t["skip"] + t["full"]) / 2  # int8 fits, and skip, the next best, fits as well
  assert name_of(plan(cal, ["general_purpose"], budget)) == "int8"
  p = plan(cal, ["general_purpose"], budget, unavailable=unavailable)
  assert name_of(p) == "skip" and p.degraded and p.reason.startswith("unavailable: blocks[0:12).int8")


def test_a_failure_that_does_not_change_the_choice_is_not_a_degradation():
  cal = calibration()
  planner = Planner(cal, FLOORS)
  p = planner.plan(PlanRequest(("general_purpose",), 40, 16, 1e9), unavailable={"blocks[0:12).int8@v1"})
  assert name_of(p) == "full" and not p.degraded
  assert planner.counters.snapshot()["degraded_unavailable"] == 0


def test_nothing_left_is_a_named_error():
  cal = calibration()
  planner = Planner(cal, {"legal_analysis": Floor(0.999, 0.001)})  # only the full path meets it
  with pytest.raises(
    NoPathError,
    match=r"embed@v1 failed verification: bad signature.*Fix: repair or republish "
    r"embed@v1",
  ):
    planner.plan(PlanRequest(("legal_analysis",), 40, 16, 1e9), unavailable={"embed@v1": "verification: bad signature"})
  assert planner.counters.snapshot()["no_path"] == 1


def test_an_older_version_is_never_a_candidate():
  old = make("exit", [block(0, 2, version="v0"), *(block(a, b) for a, b in SPANS[1:4])])
  cands = {"full": CANDIDATES["full"], "old": old}
  with pytest.raises(
    CalibrationError,
    match=r"needs blocks\[0:2\)@v0, but the current version of blocks\[0:2\) "
    r"at registry sequence 7 is 'v1'.*Recalibrate",
  ):
    calibration({}, cands, current={"blocks[0:2)": "v1"})


def test_a_failed_thoughtlet_is_never_replaced_by_another_version():
  # A calibration without a record of current versions that still lists an older blocks[0:2).
  old = make("exit", [block(0, 2, version="v0"), *(block(a, b) for a, b in SPANS[1:4])])
  cands = {**CANDIDATES, "old": old}
  quality = {**DEFAULT_QUALITY, "old": {"general_purpose": hq((0.99, 0.01))}}
  cal = calibration(quality, cands)
  t = totals(cal, 40, 16)
  budget = (t["int8"] + t["full"]) / 2
  assert plan(cal, ["general_purpose"], budget).path_hash == old.path_hash  # best when nothing failed
  p = plan(cal, ["general_purpose"], budget, unavailable={"blocks[0:2)@v1": "verification: bad signature"})
  assert name_of(p) == "int8" and p.degraded and not any(r.startswith("blocks[0:2)@") for r in p.refs)
  detail = next(r.detail for r in p.rejected if r.path_hash == old.path_hash)
  assert detail == (
    "uses blocks[0:2)@v0 where the current blocks[0:2)@v1 failed verification: bad signature; "
    "another version is never used in its place"
  )


# ----------------------------------------------------------------------------- residency
def test_a_resident_compiled_path_predicts_no_restore_or_compile():
  cal = calibration()
  cold = plan(cal, ["general_purpose"], 1e9)
  warm = Residency(frozenset(cold.refs), frozenset({cold.predicted.program_key}))
  p = plan(cal, ["general_purpose"], 1e9, residency=warm)
  assert p.path_hash == cold.path_hash
  assert (p.predicted.restore, p.predicted.compile) == (0.0, 0.0) and cold.predicted.restore > 0
  # Warm, the full path fits a budget it did not fit cold.
  budget = (p.predicted.total + cold.predicted.total) / 2
  assert name_of(plan(cal, ["general_purpose"], budget)) != "full"
  assert name_of(plan(cal, ["general_purpose"], budget, residency=warm)) == "full"


# ------------------------------------------------------------------------------ requests
@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(hints=("a", "b", "c", "d")), r"1 to 3 hints in priority order, got 4"),
    (dict(hints=()), r"got 0"),
    (dict(hints=("general_purpose", "general_purpose")), r"distinct"),
    (dict(prompt_tokens=0), r"prompt_tokens: expected an integer >= 1, got 0"),
    (dict(max_tokens=2.5), r"max_tokens: expected an integer >= 1, got 2.5"),
    (dict(max_latency_ms=0), r"max_latency_ms: expected a number > 0"),
  ],
)
def test_bad_requests_are_refused(kw, match):
  base = dict(hints=("general_purpose",), prompt_tokens=10, max_tokens=8, max_latency_ms=100.0)
  with pytest.raises(PlanError, match=match):
    PlanRequest(**{**base, **kw})


def test_an_unknown_hint_is_refused_with_the_known_list():
  with pytest.raises(
    PlanError,
    match=r"\['poetry'\] have no floor.*known hints: \['fast_draft', "
    r"'general_purpose', 'legal_analysis'\]",
  ):
    plan(calibration(), ["general_purpose", "poetry"], 1e9)


def test_plan_json_has_the_command_line_contract():
  d = plan(calibration(), ["general_purpose"], float("inf")).to_json()  # no budget
  assert {"path", "path_hash", "hints", "corrected_hints", "predicted_ms", "quality", "degraded", "reason"} <= set(d)
  assert set(d["predicted_ms"]) == {"total", "synthesis", "restore", "compile", "prefill", "decode"}
  json.dumps(d, allow_nan=False)
  assert d["max_latency_ms"] is None and d["degraded"] is False


# ---------------------------------------------------------------------------------------- under load
SLOTS = LatencyContext("slots", "f32", 8, "xla")
TWO = {k: CANDIDATES[k] for k in ("full", "int8")}
WARM = LatencyModel.warm_residency(TWO.values(), 40, 16)  # a server's warm paths: decode is what load moves


def _busy_full(step_ms: float) -> Load:
  """Seven streams in the full path's engine (a 512-slot ring), its latest steps at ``step_ms``."""
  return Load((EngineLoad(CANDIDATES["full"].path_hash, 7, 512, 8, step_ms),), slots=8)


def test_under_load_a_request_moves_to_the_variant_beside_the_busy_engine():
  planner, model = Planner(calibration(candidates=TWO), FLOORS), LatencyModel(latency_params(), context=SLOTS)
  idle = {k: model.predict(c, 40, 16, WARM).total for k, c in TWO.items()}
  assert idle["int8"] < idle["full"]
  budget = idle["full"] * 1.1  # idle, the full path fits: the best quality
  req = PlanRequest(("fast_draft",), 40, 16, budget)
  calm = planner.plan(req, model, WARM)
  assert name_of(calm) == "full" and calm.idle_path is None and calm.predicted.load == Load()
  # Its engine busy at 10 ms a step: joining it costs 15 such steps, more than the budget; int8 in an engine of
  # its own shares the cores with it and fits.
  load = _busy_full(10.0)
  busy = {k: model.predict(c, 40, 16, WARM, load=load).total for k, c in TWO.items()}
  assert busy["full"] > budget > busy["int8"]
  got = planner.plan(req, model, WARM, load=load)
  assert name_of(got) == "int8" and not got.degraded and got.predicted.total == pytest.approx(busy["int8"])
  assert got.reason == (
    "best quality meeting every floor within the budget under load (7 streams decoding in 1 engine), "
    f"idle it would be {CANDIDATES['full'].path}"
  )
  assert got.idle_path == CANDIDATES["full"].path and planner.counters.snapshot()["moved_by_load"] == 1
  d = got.to_json()
  assert d["load"] == "7 streams decoding in 1 engine" and d["idle_path"] == CANDIDATES["full"].path
  assert d["latency_context"] == SLOTS.key
  # With the load gone the same request gets the idle plan again.
  assert name_of(planner.plan(req, model, WARM, load=Load(slots=8))) == "full"


def test_a_load_that_does_not_change_the_choice_says_so_in_a_note():
  planner, model = Planner(calibration(candidates=TWO), FLOORS), LatencyModel(latency_params(), context=SLOTS)
  load = _busy_full(10.0)
  got = planner.plan(PlanRequest(("general_purpose",), 40, 16, 1e9), model, WARM, load=load)
  assert name_of(got) == "full" and got.idle_path is None
  assert got.reason == "best quality meeting every floor within the budget"
  assert got.notes == ("predicted under load (7 streams decoding in 1 engine); idle the choice is the same",)
  assert got.predicted.load == load and got.predicted.decode == pytest.approx(15 * 10.0)


def test_under_load_the_budget_fallback_is_the_fastest_there_noted():
  strict = {"legal_analysis": Floor(0.999, 0.001)}  # only the full path meets it
  planner, model = Planner(calibration(candidates=TWO), strict), LatencyModel(latency_params(), context=SLOTS)
  idle = model.predict(CANDIDATES["full"], 40, 16, WARM).total
  req = PlanRequest(("legal_analysis",), 40, 16, idle * 1.1)
  assert name_of(planner.plan(req, model, WARM)) == "full"
  got = planner.plan(req, model, WARM, load=_busy_full(10.0))
  assert name_of(got) == "full" and got.degraded and got.reason == "budget" and got.idle_path is None


def test_under_load_an_equal_quality_path_never_swaps_in_while_the_idle_choice_still_fits():
  x, y, _ = twins()
  lossless = {h: hq((1.0, 0.0), (1.0, 0.0)) for h in ("general_purpose",)}  # the full path's quality, faster
  cal = calibration({"x": lossless, "y": lossless}, {"full": CANDIDATES["full"], "x": x, "y": y})
  planner, model = Planner(cal, FLOORS), LatencyModel(latency_params(), context=SLOTS)
  warm = LatencyModel.warm_residency([x, y], 40, 16)
  req = PlanRequest(("general_purpose",), 40, 16, 1e9)
  idle = planner.plan(req, model, warm)
  other = y if idle.path_hash == x.path_hash else x
  # The idle choice's engine is busy and slow; the twin in an engine of its own is predicted faster.
  load = Load((EngineLoad(idle.path_hash, 3, 512, 4, 50.0),), slots=8)
  assert (
    model.predict(other, 40, 16, warm, load=load).total
    < model.predict(next(c for c in (x, y) if c.path_hash == idle.path_hash), 40, 16, warm, load=load).total
  )
  got = planner.plan(req, model, warm, load=load)
  assert got.path_hash == idle.path_hash and got.idle_path is None and got.predicted.load == load
  # With a budget the busy engine no longer fits, the twin is taken, and the reason says why.
  tight = dataclasses.replace(req, max_latency_ms=model.predict(other, 40, 16, warm, load=load).total * 1.01)
  moved = planner.plan(tight, model, warm, load=load)
  assert moved.path_hash == other.path_hash and moved.idle_path is not None and "under load" in moved.reason


# ------------------------------------------------------------------------ calibration JSON
def test_calibration_json_is_canonical_and_round_trips():
  cal = calibration(current={"embed": "v1"})
  blob = cal.to_json()
  assert blob == json.dumps(json.loads(blob), sort_keys=True, separators=(",", ":")).encode()
  back = Calibration.from_json(blob)
  assert back.to_json() == blob and back.digest() == cal.digest()
  r = PlanRequest(("legal_analysis", "general_purpose"), 64, 32, 700.0)
  assert Planner(back, FLOORS).plan(r) == Planner(cal, FLOORS).plan(r)


def _doc(**edit):
  d = json.loads(calibration().to_json())
  for k, v in edit.items():
    d[k] = v
  return d


@pytest.mark.parametrize(
  "doc, match",
  [
    (b"{not json", r"not valid JSON"),
    (
      _doc(version=FORMAT_VERSION + 1),
      rf"expected format 'thoughtjax.calibration' version {FORMAT_VERSION}, got "
      rf"format 'thoughtjax.calibration' version {FORMAT_VERSION + 1}",
    ),
    (_doc(format="other"), r"got format 'other'"),
    (_doc(extra=1), r"unknown \['extra'\]"),
    (_doc(sequence=-1), r"calibration.sequence: expected an integer >= 0, got -1"),
  ],
)
def test_malformed_or_wrong_version_documents_are_refused(doc, match):
  with pytest.raises(CalibrationError, match=match):
    Calibration.from_json(doc if isinstance(doc, bytes) else json.dumps(doc))


def test_field_errors_name_the_field():
  d = _doc()
  d["candidates"][1]["kind"] = "teleport"
  with pytest.raises(
    CalibrationError, match=r"candidates\[1\].*kind: expected one of \[.*'speculative'.*got 'teleport'"
  ):
    Calibration.from_json(d)
  d = _doc()
  h = next(iter(d["quality"]))
  d["quality"][h]["general_purpose"]["heldout"]["top1_agreement"] = 1.5
  with pytest.raises(
    CalibrationError,
    match=rf"quality\[{h}\]\[general_purpose\]\.heldout\.top1_agreement: "
    r"expected a finite number in \[0.0, 1.0\], got 1.5",
  ):
    Calibration.from_json(d)


def test_a_tampered_candidate_is_refused():
  d = _doc()
  d["candidates"][1]["units"][1]["version"] = "v9"  # same hash, another thoughtlet version
  with pytest.raises(CalibrationError, match=r"path_hash .* does not match its units"):
    Calibration.from_json(d)


def test_structural_rules():
  with pytest.raises(CalibrationError, match=r"exactly one full path"):
    calibration({}, {"exit8": CANDIDATES["exit8"]})
  with pytest.raises(CalibrationError, match=r"unknown path hashes \['deadbeef'\]"):
    Calibration(1, "cpu", (CANDIDATES["full"],), {"deadbeef": {}}, latency_params())
  lat = dataclasses.replace(
    latency_params(), decode={"embed": LinearCost(1.0), "block": LinearCost(1.0), "head": LinearCost(1.0)}
  )
  with pytest.raises(CalibrationError, match=r"blocks\[0:12\)\.int8@v1.*'block8'.*--latency-only"):
    Calibration(1, "cpu", tuple(CANDIDATES.values()), {}, lat)


# ------------------------------------------------------------------------------ property
quality_st = st.tuples(st.floats(0, 1), st.floats(0, 3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  quals=st.lists(st.tuples(quality_st, quality_st), min_size=4, max_size=4),
  floors=st.tuples(quality_st, quality_st),
  budget=st.floats(1, 3000),
  T=st.integers(1, 400),
  n=st.integers(1, 128),
  warm=st.booleans(),
  failed=st.sets(st.sampled_from(["embed@v1", "blocks[2:4)@v1", "blocks[0:12).int8@v1"]), max_size=1),
)
def test_property_plans_meet_floors_and_budgets(quals, floors, budget, T, n, warm, failed):
  names = ["exit8", "exit4", "skip", "int8"]
  hints = ("general_purpose", "fast_draft")
  quality = {nm: {h: hq(qq) for h, qq in zip(hints, qs)} for nm, qs in zip(names, quals)}
  cal = calibration(quality)
  fl = {h: Floor(*f) for h, f in zip(hints, floors)}
  residency = Residency(frozenset(r for c in cal.candidates for r in c.refs)) if warm else COLD
  model = LatencyModel(cal.latency)

  def ok(c):
    meets = all(
      fl[h].miss(cal.hint_quality(c.path_hash, h).calibration) is None
      for h in hints
      if cal.hint_quality(c.path_hash, h) is not None
    ) and all(cal.hint_quality(c.path_hash, h) is not None for h in hints)
    return meets and not set(c.refs) & failed

  eligible = [c for c in cal.candidates if ok(c)]
  request = PlanRequest(hints, T, n, budget)
  try:
    p = Planner(cal, fl).plan(request, model, residency, unavailable=failed)
  except NoPathError:
    assert not eligible
    return
  chosen = next(c for c in cal.candidates if c.path_hash == p.path_hash)
  assert chosen in eligible  # always meets every floor, never needs a failed thoughtlet
  fits = [c for c in eligible if model.predict(c, T, n, residency).total <= budget]
  if p.reason == "budget":
    assert p.degraded and not fits
    assert p.predicted.total == min(model.predict(c, T, n, residency).total for c in eligible)
    assert p.tokens_that_fit == p.predicted.tokens_within(budget)
  else:
    assert p.predicted.total <= budget and chosen in fits

"""Speculative plans in synthesis: calibration adds the full path verifying its best prefix draft, with the full
path's quality and a decode factor measured on the calibration text; the planner picks it exactly when it is the
fastest lossless choice, and running it uses the speculative program (the tokens are plain greedy's). The same
for the n-gram draft, which looks its tokens up in the text and needs no weights."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.synthesis.tiny_synthesis import FULL, HINTS, tiny_setup
from thoughtjax.compose import compose
from thoughtjax.registry import Registry
from thoughtjax.synthesis.calibrate import load
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.candidate import CalibrationError, Candidate, CandidateKind
from thoughtjax.synthesis.derived_candidates import speculative_candidates
from thoughtjax.synthesis.latency import LatencyModel
from thoughtjax.synthesis.latency_load import Residency
from thoughtjax.synthesis.latency_params import FACTOR_BOUNDS, STAGES
from thoughtjax.synthesis.planner import Floor, Planner, PlanRequest
from thoughtjax.synthesis.synthesize import Synthesizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reg():
  with Registry.open(tiny_setup().registry) as r:
    yield r


@pytest.fixture(scope="module")
def cal(reg):
  return load(reg)


def _spec(cal: Calibration) -> Candidate:
  """The speculative candidate with a prefix draft."""
  (c,) = [c for c in cal.candidates if c.kind is CandidateKind.SPECULATIVE and not c.draft.path.startswith("ngram")]
  return c


def _ngram(cal: Calibration) -> Candidate:
  (c,) = [c for c in cal.candidates if c.kind is CandidateKind.SPECULATIVE and c.draft.path.startswith("ngram")]
  return c


def _with_factor(cal: Calibration, factor: float, ngram: float = FACTOR_BOUNDS[1]) -> Calibration:
  """``cal`` with every stage of its prefix-draft candidate corrected by ``factor``, of its n-gram one by
  ``ngram`` (by default the slowest), and nothing else."""
  paths = {_spec(cal).path_hash: {s: factor for s in STAGES}, _ngram(cal).path_hash: {s: ngram for s in STAGES}}
  return dataclasses.replace(cal, latency=dataclasses.replace(cal.latency, corrections={"paths": paths}))


def test_calibration_adds_a_speculative_candidate_with_the_full_paths_quality(cal):
  spec, full = _spec(cal), cal.full
  assert spec.path == FULL and spec.units == full.units and spec.path_hash != full.path_hash
  assert spec.program != full.program  # another compiled program than the plain full path's
  # The draft is the prefix candidate that agrees most with the full path on the first hint.
  drafts = [
    c
    for c in cal.candidates
    if c.kind in (CandidateKind.EXIT, CandidateKind.BRIDGED) and c.units[0] == full.units[0] and c is not full
  ]
  best = max(drafts, key=lambda c: cal.hint_quality(c.path_hash, HINTS[0]).calibration.top1_agreement)
  assert spec.draft.path == ", ".join(u.ref for u in best.units)
  assert spec.draft.layers == sum(u.layers for u in best.units) and spec.draft.units == ()
  assert speculative_candidates(cal.candidates, cal.quality, HINTS[0]) == [spec, _ngram(cal)]  # derived again
  for hint in HINTS:
    assert cal.hint_quality(spec.path_hash, hint) == cal.hint_quality(full.path_hash, hint)
  # Its decode factor was measured (not assumed): within the bounds, and it is what the prediction applies.
  factor = cal.latency.corrections["paths"][spec.path_hash]["decode"]
  assert FACTOR_BOUNDS[0] <= factor <= FACTOR_BOUNDS[1]
  report = tiny_setup().report.speculative
  assert [r["path_hash"] for r in report] == [spec.path_hash, _ngram(cal).path_hash]
  assert report[0]["factor"] == pytest.approx(factor)
  assert 0 < report[0]["acceptance"] <= 1
  model = LatencyModel(cal.latency)
  warm = lambda c: Residency(set(c.refs), {model.program_key(c.program, 16, 32)})  # noqa: E731
  a, b = model.predict(full, 16, 32, warm(full)), model.predict(spec, 16, 32, warm(spec))
  assert b.decode == pytest.approx(a.decode * factor) and b.prefill == pytest.approx(a.prefill)
  # Cold, its program compiles the draft's layers beside the full path's (the per-layer slope is measured, so
  # the difference is exactly the slope times the draft's layers, which may be 0 on a noisy machine).
  slope = model._compile_fit(16).b
  cold_spec, cold_full = model.predict(spec, 16, 32).compile, model.predict(full, 16, 32).compile
  assert cold_spec == pytest.approx(cold_full + slope * spec.draft.layers) and slope >= 0


def test_a_speculative_candidate_survives_json_and_a_forged_one_is_refused(cal):
  again = Calibration.from_json(cal.to_json())
  assert _spec(again) == _spec(cal) and again.digest() == cal.digest()
  # The attack: call a lossy exit "speculative" so it borrows the full path's quality.
  spec = _spec(cal)
  exit_ = next(c for c in cal.candidates if c.kind is CandidateKind.EXIT)
  forged = Candidate.build(exit_.path, CandidateKind.SPECULATIVE, exit_.units, spec.draft)
  with pytest.raises(CalibrationError, match="only the full path verifies losslessly"):
    Calibration(cal.sequence, cal.fingerprint, (*cal.candidates, forged), cal.quality, cal.latency, cal.current)
  with pytest.raises(CalibrationError, match="a draft is given exactly for kind 'speculative'"):
    Candidate.build(FULL, CandidateKind.FULL, spec.units, spec.draft)


def _lossless_plan(cal: Calibration, max_tokens: int):
  planner = Planner(cal, {h: Floor(top1_agreement=1.0, mean_kl=0.0) for h in cal.hints})
  model = LatencyModel(cal.latency)
  warm = Residency({r for c in cal.candidates for r in c.refs}, set())
  plan = planner.plan(PlanRequest((HINTS[0],), 8, max_tokens, math.inf), model, warm)
  lossless = [
    c
    for c in cal.candidates
    if cal.hint_quality(c.path_hash, HINTS[0]).calibration.top1_agreement == 1.0
    and cal.hint_quality(c.path_hash, HINTS[0]).calibration.mean_kl == 0.0
  ]
  fastest = min(lossless, key=lambda c: (model.predict(c, 8, max_tokens, warm).total, c.path_hash))
  return plan, fastest


def test_the_planner_picks_the_speculative_plan_exactly_when_it_is_the_fastest_lossless_choice(cal):
  spec = _spec(cal)
  fast, slow = _with_factor(cal, FACTOR_BOUNDS[0]), _with_factor(cal, FACTOR_BOUNDS[1])
  plan, fastest = _lossless_plan(fast, 32)
  assert fastest.path_hash == spec.path_hash  # the setup: this latency model makes it the fastest
  assert plan.path_hash == spec.path_hash and plan.kind == "speculative" and plan.draft == spec.draft
  assert plan.speculative and plan.path == FULL and not plan.degraded
  assert any(n.startswith("speculative:") and spec.draft.path in n for n in plan.notes)
  assert plan.to_json()["draft"] == {"path": spec.draft.path, "draft_tokens": spec.draft.draft_tokens, "vocab": None}
  # A failed draft-only thoughtlet would block it; its refs include the draft's.
  assert set(spec.refs) >= {u.ref for u in spec.units}
  plan, fastest = _lossless_plan(slow, 32)
  assert fastest.path_hash != spec.path_hash
  assert plan.path_hash == fastest.path_hash and plan.kind != "speculative" and plan.draft is None


def test_a_speculative_plan_runs_the_speculative_program_and_streams_plain_greedy_tokens(reg, cal):
  syn = Synthesizer(reg, _with_factor(cal, FACTOR_BOUNDS[0]), learned_corrections=False)
  r = syn.synthesize(PROMPT, [HINTS[0]], max_latency_ms=math.inf, max_tokens=12, ignore_eos=True)
  assert r.plan.kind == "speculative"
  deltas = list(r)
  ids = syn.prompt_ids(PROMPT)
  plain = compose(FULL, reg).generate(ids, max_tokens=12, ignore_eos=True)
  assert r.token_ids == plain.token_ids and "".join(d.text for d in deltas) == plain.text
  t = r.trace
  assert t.finished and t.kind == "speculative" and t.draft == _spec(cal).draft.label
  assert t.verify_passes > 0 and t.drafted > 0 and 0 <= t.accepted <= t.drafted  # the speculative program ran
  j = t.to_json()
  assert j["draft"] == t.draft and j["drafted"] == t.drafted and "speculative: draft" in t.table()
  assert r.generation.trace.verify_passes == t.verify_passes
  # Sampled, it runs too (the full path's distribution is tested in tests/decode/test_speculative.py).
  s = syn.synthesize(PROMPT, [HINTS[0]], max_latency_ms=math.inf, max_tokens=6, temperature=0.8, seed=3).finish()
  assert s.plan.kind == "speculative" and 1 <= s.trace.tokens_out <= 6


def test_calibration_adds_the_ngram_draft_with_the_full_paths_quality_and_a_measured_factor(cal):
  ngram, full = _ngram(cal), cal.full
  assert ngram.path == FULL and ngram.units == full.units and ngram.draft.path == "ngram:3:2"
  assert ngram.draft.units == () and ngram.draft.layers == 0 and ngram.draft.label == "ngram:3:2 (k=4)"
  assert len({ngram.program, _spec(cal).program, full.program}) == 3  # a program of its own
  assert set(ngram.refs) == {u.ref for u in full.units}  # no thoughtlet of its own to restore
  for hint in HINTS:
    assert cal.hint_quality(ngram.path_hash, hint) == cal.hint_quality(full.path_hash, hint)
  factor = cal.latency.corrections["paths"][ngram.path_hash]["decode"]
  assert FACTOR_BOUNDS[0] <= factor <= FACTOR_BOUNDS[1]
  (row,) = [r for r in tiny_setup().report.speculative if r["path_hash"] == ngram.path_hash]
  assert row["draft"] == "ngram:3:2 (k=4)" and row["factor"] == pytest.approx(factor) and 0 <= row["acceptance"] <= 1
  again = Calibration.from_json(cal.to_json())
  assert _ngram(again) == ngram and again.digest() == cal.digest()


def test_the_planner_picks_the_ngram_plan_exactly_when_it_is_the_fastest_and_it_streams_plain_greedy(reg, cal):
  ngram = _ngram(cal)
  lo, hi = FACTOR_BOUNDS
  plan, fastest = _lossless_plan(_with_factor(cal, hi, ngram=lo), 32)
  assert fastest.path_hash == ngram.path_hash  # the setup: this latency model makes it the fastest
  assert plan.path_hash == ngram.path_hash and plan.kind == "speculative" and plan.draft == ngram.draft
  assert plan.path == FULL and any(n.startswith("speculative:") and "ngram:3:2" in n for n in plan.notes)
  assert plan.to_json()["draft"] == {"path": "ngram:3:2", "draft_tokens": 4, "vocab": None}
  plan, fastest = _lossless_plan(_with_factor(cal, lo, ngram=hi), 32)
  assert plan.path_hash == fastest.path_hash == _spec(cal).path_hash
  syn = Synthesizer(reg, _with_factor(cal, hi, ngram=lo), learned_corrections=False, learn=False)
  text = "one two three one two three one two three one two"  # text that repeats: drafts to look up
  r = syn.synthesize(text, [HINTS[0]], max_latency_ms=math.inf, max_tokens=12, ignore_eos=True)
  assert r.plan.path_hash == ngram.path_hash
  r.finish()
  plain = compose(FULL, reg).generate(syn.prompt_ids(text), max_tokens=12, ignore_eos=True)
  assert r.token_ids == plain.token_ids
  t = r.trace
  assert t.kind == "speculative" and t.draft == "ngram:3:2 (k=4)" and t.verify_passes > 0
  assert t.drafted == 4 * t.verify_passes and 0 <= t.accepted <= t.drafted


def test_warming_a_speculative_plan_with_a_pool_also_warms_its_paths_slot_engine(reg, cal):
  """A request of another shape, or one planned while the drafted program is not compiled, runs the plan's path in
  its slot engine: the warm-up makes and compiles that engine too, so the first such request traces nothing."""
  from thoughtjax.serving.pool import EnginePool

  syn = Synthesizer(reg, _with_factor(cal, FACTOR_BOUNDS[0]), learned_corrections=False)
  pool = EnginePool(slots=2, max_engines=2)
  try:
    assert syn.warm([HINTS[0]], prompt_tokens=(8,), max_tokens=(8,), pool=pool) == [FULL]
    plan = syn.plan(PROMPT, [HINTS[0]], max_latency_ms=math.inf, max_tokens=8)
    assert plan.kind == "speculative" and pool.stats()["engines"] == 1
    (driver,) = pool.drivers()
    assert driver.engine.model.path_hash == compose(FULL, reg).path_hash and driver.engine.program.slots == 2
  finally:
    pool.close()

"""Speculative candidates where a calibration had none, and drafts in other weights.

A latency-only recalibration of a table made before speculative candidates existed (like the shipped default
table) adds them: the drafts are chosen from its stored quality as a full calibration chooses them, and timed
here. The full path in a registry's int8 variant drafts as a candidate of its own: its draft names its weights,
it round-trips through the signed calibration JSON, and the planner picks it exactly when its corrected latency
is the lowest of the lossless choices.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.synthesis.tiny_synthesis import FULL, HINTS, IDENTITY_SKIP, SETTINGS, make_model, registry_copy, tiny_setup
from thoughtjax.compose import compose
from thoughtjax.registry import Registry, build
from thoughtjax.synthesis.calibrate import first_hint, load, recalibrate_latency
from thoughtjax.synthesis.calibrate_settings import CalibrateError, CalibrateReport, SpeculativeSettings
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.calibration_store import read_calibration, write_calibration
from thoughtjax.synthesis.candidate import CalibrationError, Candidate, CandidateKind, Unit
from thoughtjax.synthesis.derived_candidates import missing_speculative, speculative_candidates
from thoughtjax.synthesis.latency import LatencyModel
from thoughtjax.synthesis.latency_load import Residency
from thoughtjax.synthesis.latency_params import FACTOR_BOUNDS, STAGES
from thoughtjax.synthesis.planner import Floor, Planner, PlanRequest
from thoughtjax.synthesis.synthesize import Synthesizer

PROMPT = "The quick brown fox"
NO_NGRAM = SpeculativeSettings(ngram=(), variants=("int8",))  # the int8 tests: the prefix draft and the variant only


def _without_speculative(cal: Calibration, sequence: int | None = None) -> Calibration:
  """``cal`` as a calibration made before speculative candidates: its other candidates, quality and fits."""
  return Calibration(
    cal.sequence if sequence is None else sequence,
    cal.fingerprint,
    [c for c in cal.candidates if c.draft is None],
    cal.quality,
    dataclasses.replace(cal.latency, corrections={}),
    cal.current,
  )


def _specs(cal: Calibration) -> list[Candidate]:
  return [c for c in cal.candidates if c.kind is CandidateKind.SPECULATIVE]


@pytest.fixture(scope="module")
def original():
  with Registry.open(tiny_setup().registry) as r:
    return load(r)


@pytest.fixture(scope="module")
def int8(tmp_path_factory, original):
  """The tiny registry with an int8 variant of every block published on top, its table without speculative
  candidates recalibrated (latency only), stored signed: (registry root, calibration, report)."""
  setup = tiny_setup()
  root = registry_copy(tmp_path_factory.mktemp("int8") / "reg")
  model = make_model(identity=2)  # the tiny registry's model: its blocks keep their versions
  build(
    root,
    setup.root / "mapping.yaml",
    model.module,
    codec=model.codec,
    sign_key=setup.key,
    settings=None,
    source="tiny-identity2",
    variants=("int8",),
  )
  report = CalibrateReport()
  with Registry.open(root) as reg:
    assert reg.sequence > original.sequence and all(reg.current[n] == v for n, v in original.current.items())
    cal = recalibrate_latency(
      reg, _without_speculative(original, reg.sequence), SETTINGS.latency, speculative=NO_NGRAM, report=report
    )
    write_calibration(reg, cal, sign_key=setup.key)
  return root, cal, report


def test_recalibrating_a_table_without_speculative_candidates_adds_the_one_calibration_chose(original, tmp_path):
  stored = _without_speculative(original)
  assert not _specs(stored) and first_hint(stored.hints) == HINTS[0]  # the dictionary's order, as calibrate
  report = CalibrateReport()
  with Registry.open(registry_copy(tmp_path / "reg")) as reg:
    again = recalibrate_latency(reg, stored, SETTINGS.latency, report=report)
    write_calibration(reg, again, sign_key=tiny_setup().key)
    assert read_calibration(reg).digest() == again.digest()
  # The stored candidates and quality are kept; the speculative candidates are the ones the full calibration made
  # (the prefix draft, then the n-gram one).
  spec, ngram = _specs(again)
  assert [c.path_hash for c in again.candidates] == [c.path_hash for c in stored.candidates] + [
    spec.path_hash,
    ngram.path_hash,
  ]
  assert again.quality == stored.quality
  assert [(c.path_hash, c.draft) for c in _specs(again)] == [(c.path_hash, c.draft) for c in _specs(original)]
  assert spec.draft.draft_tokens == ngram.draft.draft_tokens == SpeculativeSettings().draft_tokens
  assert ngram.draft.path == "ngram:3:2"
  for hint in HINTS:
    assert again.hint_quality(spec.path_hash, hint) == again.hint_quality(again.full.path_hash, hint)
  # Timed here, against the plain full path on the calibration text (its acceptance in it).
  factor = again.latency.corrections["paths"][spec.path_hash]["decode"]
  assert FACTOR_BOUNDS[0] <= factor <= FACTOR_BOUNDS[1]
  row, ngram_row = report.speculative
  assert row["path_hash"] == spec.path_hash and row["factor"] == pytest.approx(factor) and 0 < row["acceptance"] <= 1
  assert ngram_row["path_hash"] == ngram.path_hash and 0 <= ngram_row["acceptance"] <= 1
  # Recalibrated again, nothing is lacking: no candidate is added twice.
  assert missing_speculative(again.candidates, again.quality, HINTS[0]) == []


def test_the_full_path_in_int8_weights_drafts_as_a_candidate_of_its_own(int8):
  root, cal, report = int8
  with Registry.open(root) as reg:
    current = reg.current
  prefix, variant = _specs(cal)  # the prefix draft of highest agreement first, then the variant
  assert prefix.draft.weights == () and variant.draft.weights == ("int8",) and "weights=int8" in variant.draft.label
  assert variant.path == FULL and variant.units == cal.full.units
  blocks = [u for u in cal.full.units if u.layers]
  assert [u.name for u in variant.draft.units] == [f"{u.name}@int8" for u in blocks]
  assert all(u.version == current[u.name] != current[u.name.removesuffix("@int8")] for u in variant.draft.units)
  assert variant.draft.layers == sum(u.layers for u in blocks)
  assert set(variant.refs) == {u.ref for u in cal.full.units} | {u.ref for u in variant.draft.units}
  # Another compiled program than the full path's and the prefix draft's; the quality is the full path's.
  assert len({variant.program, prefix.program, cal.full.program}) == 3
  for hint in HINTS:
    assert cal.hint_quality(variant.path_hash, hint) == cal.hint_quality(cal.full.path_hash, hint)
  # Both timed in one run; the int8 full path agrees with the f32 one far more than a cut path does.
  rows = {r["path_hash"]: r for r in report.speculative}
  assert set(rows) == {prefix.path_hash, variant.path_hash}
  assert rows[variant.path_hash]["acceptance"] > rows[prefix.path_hash]["acceptance"]
  for c in (prefix, variant):
    assert cal.latency.corrections["paths"][c.path_hash]["decode"] == pytest.approx(rows[c.path_hash]["factor"])


def test_an_int8_draft_round_trips_through_the_signed_json_and_a_forged_one_is_refused(int8):
  root, cal, _ = int8
  with Registry.open(root) as reg:
    stored = read_calibration(reg)
  assert stored.digest() == cal.digest() and _specs(stored) == _specs(cal)
  again = Calibration.from_json(cal.to_json())
  assert again.digest() == cal.digest() and _specs(again)[1].draft.weights == ("int8",)
  # The attack: the draft's int8 blocks swapped for the f32 ones under the same path hash.
  doc = cal.to_dict()
  i = next(i for i, c in enumerate(doc["candidates"]) if c.get("draft") and "@int8@" in c["draft"]["path"])
  doc["candidates"][i]["draft"]["path"] = ", ".join(u.ref for u in cal.full.units)
  with pytest.raises(CalibrationError, match="path_hash .* does not match its units"):
    Calibration.from_json(doc)
  # A weight form that does not exist is no unit name.
  with pytest.raises(CalibrationError, match=r"a name may end in one weight variant: @int8"):
    Unit("blocks[0:2)@fp4", "3fa2")
  with pytest.raises(CalibrationError, match="unit version"):
    Unit("blocks[0:2)@int8", "int8@3fa2")
  with pytest.raises(CalibrateError, match="SpeculativeSettings.variants"):
    SpeculativeSettings(variants=("fp4",))
  with pytest.raises(CalibrateError, match="SpeculativeSettings.variants"):
    SpeculativeSettings(variants="int8")
  for bad, why in (
    ("3", "got '3'"),
    ((3,), "got \\(3,\\)"),
    (("0",), "got '0'"),
    (("17",), "got '17'"),
    (("3:4",), "got '4'"),
  ):
    with pytest.raises(CalibrateError, match=rf"SpeculativeSettings.ngram: expected a tuple of n-gram specs.*{why}"):
      SpeculativeSettings(ngram=bad)
  assert SpeculativeSettings(ngram=["3", "3:2", "3"]).ngram == ("3", "3:2")


def _factors(cal: Calibration, factors: dict[str, float]) -> Calibration:
  """``cal`` with every stage of the given candidates corrected by the given factor (and nothing else)."""
  paths = {h: {s: f for s in STAGES} for h, f in factors.items()}
  return dataclasses.replace(cal, latency=dataclasses.replace(cal.latency, corrections={"paths": paths}))


def _plan(cal: Calibration, unavailable=None):
  """A lossless plan with every thoughtlet resident, and the fastest lossless candidate by prediction."""
  planner = Planner(cal, {h: Floor(top1_agreement=1.0, mean_kl=0.0) for h in cal.hints})
  model = LatencyModel(cal.latency)
  warm = Residency({r for c in cal.candidates for r in c.refs}, set())
  plan = planner.plan(PlanRequest((HINTS[0],), 8, 32, math.inf), model, warm, unavailable=unavailable)
  lossless = [
    c
    for c in cal.candidates
    if cal.hint_quality(c.path_hash, HINTS[0]).calibration.top1_agreement == 1.0
    and cal.hint_quality(c.path_hash, HINTS[0]).calibration.mean_kl == 0.0
  ]
  fastest = min(lossless, key=lambda c: (model.predict(c, 8, 32, warm).total, c.path_hash))
  return plan, fastest


def test_the_planner_picks_the_int8_draft_exactly_when_its_corrected_latency_is_lowest(int8):
  _, cal, _ = int8
  prefix, variant = _specs(cal)
  lo, hi = FACTOR_BOUNDS
  plan, fastest = _plan(_factors(cal, {variant.path_hash: lo, prefix.path_hash: hi}))
  assert fastest.path_hash == variant.path_hash  # the setup: this latency model makes it the fastest
  assert plan.path_hash == variant.path_hash and plan.draft == variant.draft and not plan.degraded
  assert plan.to_json()["draft"]["path"] == variant.draft.path
  plan, fastest = _plan(_factors(cal, {variant.path_hash: hi, prefix.path_hash: lo}))
  assert fastest.path_hash == prefix.path_hash and plan.path_hash == prefix.path_hash
  plan, fastest = _plan(_factors(cal, {variant.path_hash: hi, prefix.path_hash: hi}))
  assert plan.path_hash == fastest.path_hash and plan.draft is None
  # A failed int8 block blocks the int8 draft only (a variant is a thoughtlet of its own), loudly.
  fast = _factors(cal, {variant.path_hash: lo, prefix.path_hash: hi})
  bad = variant.draft.units[0].ref
  for failed in ({bad: "verification: hash mismatch"}, {variant.draft.units[0].name}):
    plan, _ = _plan(fast, failed)
    assert plan.path_hash != variant.path_hash and plan.degraded
    assert plan.path_hash in {c.path_hash for c in cal.candidates if bad not in c.refs}
    assert any(r.path_hash == variant.path_hash and r.why == "unavailable" for r in plan.rejected)
  # A failed f32 block of the full path blocks every plan that verifies with it, the int8 one too: what is
  # left is the lossless skip of the identity block.
  skipped = next(u.ref for u in cal.full.units if u.name == "blocks[2:3)")
  plan, _ = _plan(fast, {skipped: "restore (OSError)"})
  assert plan.path == IDENTITY_SKIP and plan.degraded and skipped not in plan.refs


def test_an_int8_speculative_plan_runs_and_streams_plain_greedy_tokens(int8):
  root, cal, _ = int8
  prefix, variant = _specs(cal)
  with Registry.open(root) as reg:
    syn = Synthesizer(
      reg,
      _factors(cal, {variant.path_hash: FACTOR_BOUNDS[0], prefix.path_hash: 1.0}),
      learned_corrections=False,
      learn=False,
    )
    r = syn.synthesize(PROMPT, [HINTS[0]], max_latency_ms=math.inf, max_tokens=12, ignore_eos=True)
    assert r.plan.path_hash == variant.path_hash
    r.finish()
    plain = compose(FULL, reg).generate(syn.prompt_ids(PROMPT), max_tokens=12, ignore_eos=True)
  assert r.token_ids == plain.token_ids
  t = r.trace
  assert t.draft == variant.draft.label and "weights=int8" in t.draft and t.verify_passes > 0
  assert 0 < t.accepted <= t.drafted
  assert set(t.refs) >= {u.ref for u in variant.draft.units}  # its int8 blocks were restored with the plan


def test_speculative_candidates_are_derived_again_from_the_same_inputs(int8, original):
  root, cal, _ = int8
  plain = [c for c in cal.candidates if c.draft is None]
  with Registry.open(root) as reg:
    assert speculative_candidates(plain, cal.quality, HINTS[0], NO_NGRAM, registry=reg) == _specs(cal)
    no_variant = SpeculativeSettings(variants=(), ngram=())
    assert speculative_candidates(plain, cal.quality, HINTS[0], no_variant, registry=reg) == [_specs(cal)[0]]
  # Without a registry (or one without variants) the prefix draft and the n-gram one: the tiny table's.
  assert speculative_candidates(plain, cal.quality, HINTS[0]) == _specs(original)


def test_the_default_registry_recalibrates_a_stored_calibration_made_before_speculative_candidates(original):
  from thoughtjax.synthesis.default_registry import _lacks_speculative

  with Registry.open(tiny_setup().registry) as reg:
    assert _lacks_speculative(reg, _without_speculative(original))
    assert not _lacks_speculative(reg, original)
    # One made before n-gram drafts existed lacks one too.
    before_ngram = dataclasses.replace(
      original, candidates=[c for c in original.candidates if c.draft is None or c.draft.path != "ngram:3:2"]
    )
    assert len(before_ngram.candidates) == len(original.candidates) - 1 and _lacks_speculative(reg, before_ngram)
    # One with no calibrated hint of the dictionary has no text to time a draft on: nothing to add.
    foreign = Calibration(
      original.sequence,
      original.fingerprint,
      [c for c in original.candidates if c.draft is None],
      {h: {"not_a_hint": per[HINTS[0]]} for h, per in original.quality.items()},
      dataclasses.replace(original.latency, corrections={}),
      original.current,
    )
    assert not _lacks_speculative(reg, foreign)


@pytest.mark.slow
def test_the_default_registry_calibration_has_a_speculative_candidate():
  """After ensure_default the default registry's calibration holds the full path verifying the exit the shipped
  table rates best, with the full path's quality and a decode factor measured on this machine, and the full path
  in int8 and in int8a8 weights as candidates of their own, their quality measured on every calibrated hint."""
  from thoughtjax.synthesis.default_registry import ensure_default, speculative_settings

  with ensure_default() as reg:
    cal = read_calibration(reg)
    plain = [c for c in cal.candidates if c.draft is None]
    want = speculative_candidates(plain, cal.quality, first_hint(cal.hints), speculative_settings(), registry=reg)
  specs = _specs(cal)
  assert specs and all(c.units == cal.full.units for c in specs)
  for c in specs:
    assert cal.hint_quality(c.path_hash, "general_purpose") == cal.hint_quality(cal.full.path_hash, "general_purpose")
    assert FACTOR_BOUNDS[0] <= cal.latency.corrections["paths"][c.path_hash]["decode"] <= FACTOR_BOUNDS[1]
  assert specs == want and not any(c.draft.weights for c in specs)  # no int8 draft: int8 is a path of its own
  variants = {c.path: c for c in cal.candidates if c.kind is CandidateKind.VARIANT}
  assert set(variants) == {"embed, blocks[0:30)@int8, head", "embed, blocks[0:30)@int8a8, head"}
  for variant in variants.values():
    assert all(cal.hint_quality(variant.path_hash, h) is not None for h in cal.hints)
    assert set(cal.latency.corrections["paths"][variant.path_hash]) == {"prefill", "decode"}
  # int8 activations cost quality on top of int8 weights.
  int8, int8a8 = (
    cal.hint_quality(variants[f"embed, blocks[0:30)@{v}, head"].path_hash, "general_purpose")
    for v in ("int8", "int8a8")
  )
  assert int8a8.heldout.top1_agreement < int8.heldout.top1_agreement


def test_the_full_path_in_int8_weights_is_a_lossy_candidate_of_its_own(int8):
  """A registry holding the int8 variant of every block gets the whole full path in int8 as a candidate (kind
  ``variant``) from the recalibration: its quality measured per hint against the float32 full path (lossy, not
  the full path's), its prefill and decode priced by factors timed against the full path; the planner picks it
  exactly when the float32 path does not fit the budget and the variant meets the floors, and it runs."""
  root, cal, report = int8
  (variant,) = [c for c in cal.candidates if c.kind is CandidateKind.VARIANT]
  assert variant.path == FULL.replace(")", ")@int8")  # every block range in int8
  assert [u.name for u in variant.units if u.layers] == [f"{u.name}@int8" for u in cal.full.units if u.layers]
  assert variant.draft is None and variant.path_hash not in cal.lossless
  for hint in HINTS:
    q = cal.hint_quality(variant.path_hash, hint)
    assert q is not None and q.heldout.tokens > 0 and 0 < q.heldout.top1_agreement <= 1
    assert q != cal.hint_quality(cal.full.path_hash, hint) and q.calibration.mean_kl > 0
  factors = cal.latency.corrections["paths"][variant.path_hash]
  assert set(factors) == {"prefill", "decode"}
  assert all(FACTOR_BOUNDS[0] <= f <= FACTOR_BOUNDS[1] for f in factors.values())
  (row,) = report.variants
  assert row["path_hash"] == variant.path_hash and row["factors"] == factors

  # Priced at half the full path's compute (as if int8 were twice as fast here), the planner's choice:
  half = dict(cal.latency.corrections["paths"], **{variant.path_hash: {"prefill": 0.5, "decode": 0.5}})
  priced = dataclasses.replace(cal, latency=dataclasses.replace(cal.latency, corrections={"paths": half}))
  hint = HINTS[0]
  q = priced.hint_quality(variant.path_hash, hint).calibration
  floors = {h: Floor(top1_agreement=0.0) for h in HINTS}
  floors[hint] = Floor(top1_agreement=q.top1_agreement - 1e-9)
  planner, model = Planner(priced, floors), LatencyModel(priced.latency)
  warm = Residency(
    {r for c in priced.candidates for r in c.refs}, {model.program_key(c.program, 8, 16) for c in priced.candidates}
  )
  var_ms = model.predict(variant, 8, 16, warm).total

  def top1(c) -> float:
    return priced.hint_quality(c.path_hash, hint).calibration.top1_agreement

  # The cheapest plan of better quality (the full path, a lossless skip, a speculative plan) costs more.
  better_ms = min(model.predict(c, 8, 16, warm).total for c in priced.candidates if top1(c) > q.top1_agreement)
  assert var_ms < better_ms
  generous = planner.plan(PlanRequest((hint,), 8, 16, math.inf), model, warm)
  assert generous.path_hash != variant.path_hash and top1(generous) == 1.0  # lossless when it fits
  tight = planner.plan(PlanRequest((hint,), 8, 16, (var_ms + better_ms) / 2), model, warm)
  assert tight.path_hash == variant.path_hash and "@int8" in tight.path and not tight.degraded
  if q.top1_agreement < 1.0:  # a floor the variant misses: never chosen, a better path degraded instead
    strict = {**floors, hint: Floor(top1_agreement=min(1.0, q.top1_agreement + 1e-6))}
    plan = Planner(priced, strict).plan(PlanRequest((hint,), 8, 16, (var_ms + better_ms) / 2), model, warm)
    assert plan.path_hash != variant.path_hash and plan.degraded
  with Registry.open(root) as reg:
    ran = compose(variant.path, reg, compile_cache=False).generate([5, 6, 7], max_tokens=4, ignore_eos=True)
  assert len(ran.token_ids) == 4


def test_a_full_calibration_measures_the_int8_full_path_with_the_other_candidates(int8):
  """``calibrate`` on a registry with int8 variants: the variant candidate is measured with the cut paths (one
  quality per calibrated hint) and priced by its factors; ``variants=()`` leaves it out."""
  from thoughtjax.synthesis.calibrate import calibrate

  root, recal, _ = int8
  with Registry.open(root) as reg:
    cal = calibrate(reg, settings=dataclasses.replace(SETTINGS, speculative=NO_NGRAM))
    without = calibrate(reg, settings=dataclasses.replace(SETTINGS, speculative=NO_NGRAM, variants=()))
  (variant,) = [c for c in cal.candidates if c.kind is CandidateKind.VARIANT]
  assert variant.path_hash == next(c for c in recal.candidates if c.kind is CandidateKind.VARIANT).path_hash
  assert set(cal.quality[variant.path_hash]) == set(HINTS)
  assert set(cal.latency.corrections["paths"][variant.path_hash]) == {"prefill", "decode"}
  assert not [c for c in without.candidates if c.kind is CandidateKind.VARIANT]
  with pytest.raises(CalibrateError, match="CalibrateSettings.variants"):
    dataclasses.replace(SETTINGS, variants=("fp4",))


def test_warming_a_tight_budget_restores_and_compiles_the_int8_path_a_cold_process_would_not_choose(int8):
  """Cold, the int8 full path never fits a tight budget (restoring and compiling it would not either), so the
  planner degrades to the warm float32 path; ``warm(budgets=...)`` warms the plan a warm process chooses at that
  budget, and after it the same request gets the int8 path."""
  root, cal, _ = int8
  (variant,) = [c for c in cal.candidates if c.kind is CandidateKind.VARIANT]
  half = dict(cal.latency.corrections["paths"], **{variant.path_hash: {"prefill": 0.5, "decode": 0.5}})
  priced = dataclasses.replace(cal, latency=dataclasses.replace(cal.latency, corrections={"paths": half}))
  with Registry.open(root) as reg:
    syn = Synthesizer(reg, priced, learned_corrections=False, learn=False)
    floor = syn.floors["fast_draft"].top1_agreement
    assert priced.hint_quality(variant.path_hash, "fast_draft").calibration.top1_agreement >= floor
    model = syn.latency
    warm = model.warm_residency(priced.candidates, 16, 16)
    var_ms = model.predict(variant, 16, 16, warm).total
    others = [
      model.predict(c, 16, 16, warm).total
      for c in priced.candidates
      if priced.hint_quality(c.path_hash, "fast_draft").calibration.top1_agreement
      > priced.hint_quality(variant.path_hash, "fast_draft").calibration.top1_agreement
    ]
    budget = (var_ms + min(others)) / 2
    syn.warm(["fast_draft"], prompt_tokens=(16,), max_tokens=(16,))  # the generous plan only: the variant stays cold
    cold = syn.plan([3] * 16, ["fast_draft"], max_latency_ms=budget, max_tokens=16)
    assert cold.path_hash != variant.path_hash and cold.degraded
    # The plan says why, and what a process with every path warm would choose (paths --max-latency-ms shows that).
    assert [n for n in cold.notes if "every path restored and compiled would choose " + variant.path in n], cold.notes
    warmed = syn.warm(["fast_draft"], prompt_tokens=(16,), max_tokens=(16,), budgets=(math.inf, budget))
    assert variant.path in warmed
    hot = syn.plan([3] * 16, ["fast_draft"], max_latency_ms=budget, max_tokens=16)
    assert hot.path_hash == variant.path_hash and not hot.degraded
    assert not [n for n in hot.notes if "would choose" in n], hot.notes


def test_drafts_from_the_text_are_timed_per_hint_on_its_router_prompts(original, tmp_path):
  """With ``hint_prompts``, the n-gram candidate's decode is also measured on each calibrated hint's own requests
  (the shipped router prompts): one factor per hint, within the bounds, stored beside the path's own and reported
  with its hint; the other candidates get none."""
  report = CalibrateReport()
  settings = dataclasses.replace(SETTINGS.latency, hint_prompts=1, hint_tokens=8)
  with Registry.open(registry_copy(tmp_path / "reg")) as reg:
    again = recalibrate_latency(reg, original, settings, report=report)
    write_calibration(reg, again, sign_key=tiny_setup().key)
    assert read_calibration(reg).latency.corrections == again.latency.corrections
  (ngram,) = [c for c in _specs(again) if c.draft.path.startswith("ngram:")]
  per_hint = again.latency.corrections["hints"]
  assert set(per_hint) == set(HINTS)
  for hint in HINTS:
    assert set(per_hint[hint]) == {ngram.path_hash}
    assert FACTOR_BOUNDS[0] <= per_hint[hint][ngram.path_hash]["decode"] <= FACTOR_BOUNDS[1]
  rows = [r for r in report.speculative if "hint" in r]
  assert sorted(r["hint"] for r in rows) == sorted(HINTS) and {r["path_hash"] for r in rows} == {ngram.path_hash}
  # Without it (the library default) nothing is measured per hint.
  assert "hints" not in original.latency.corrections


def test_kept_ratios_are_not_measured_again_and_what_is_lacking_is(original, tmp_path):
  """``keep_ratios`` (the default registry's first use, from the shipped table): the times are measured here, the
  stored ratios (a drafted or variant path's factor, the per-hint factors, how a path batches) are kept as they
  were, and a candidate the stored table holds no ratio for is timed."""
  settings = dataclasses.replace(SETTINGS.latency, hint_prompts=1, hint_tokens=8)
  with Registry.open(registry_copy(tmp_path / "reg")) as reg:
    measured = recalibrate_latency(reg, original, settings)
    per_hint, paths = measured.latency.corrections["hints"], measured.latency.corrections["paths"]
    assert per_hint and paths and measured.latency.rows
    report = CalibrateReport()
    kept = recalibrate_latency(reg, measured, settings, report=report, keep_ratios=True)
    assert kept.latency.corrections == measured.latency.corrections
    assert kept.latency.rows == measured.latency.rows
    assert report.speculative == [] and report.variants == [] and report.rows == []  # nothing ratio-timed again
    assert report.latency_runs  # the times themselves are measured here
    # One drafted path's factor dropped from the stored table: that one alone is timed; the others are kept.
    (spec, ngram) = _specs(measured)
    lacking = dataclasses.replace(
      measured.latency,
      corrections={"paths": {h: f for h, f in paths.items() if h != spec.path_hash}, "hints": per_hint},
    )
    report = CalibrateReport()
    again = recalibrate_latency(
      reg, dataclasses.replace(measured, latency=lacking), settings, report=report, keep_ratios=True
    )
    assert [r["path_hash"] for r in report.speculative] == [spec.path_hash]
    assert again.latency.corrections["paths"][ngram.path_hash] == paths[ngram.path_hash]
    assert FACTOR_BOUNDS[0] <= again.latency.corrections["paths"][spec.path_hash]["decode"] <= FACTOR_BOUNDS[1]
    assert again.latency.corrections["hints"] == per_hint

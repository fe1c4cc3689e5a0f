"""The latency model on synthetic measurements: fits recover known costs, predictions follow the
formulas and the residency, tokens-that-fit is exact, and traces move predictions toward what happened."""

from __future__ import annotations

import math

import numpy as np
import pytest

from thoughtjax.serving.slot_program import width
from thoughtjax.synthesis.candidate import Candidate, Unit
from thoughtjax.synthesis.latency import CONTENTION, LatencyModel, LatencyTrace
from thoughtjax.synthesis.latency_context import HALF_LIFE_S, LatencyContext, Learned
from thoughtjax.synthesis.latency_load import COLD, IDLE, EngineLoad, Load, Residency
from thoughtjax.synthesis.latency_params import (
  FACTOR_BOUNDS,
  ROWS_DEFAULT,
  LatencyModelError,
  LatencyParams,
  LinearCost,
  Measurements,
  fit_linear,
)

MB = 1 << 20


def params(**over) -> LatencyParams:
  base = dict(
    prefill={"embed": LinearCost(0.1, 0.001), "block": LinearCost(1.0, 0.02), "head": LinearCost(0.5, 0.004)},
    decode={"embed": LinearCost(0.05, 0.0), "block": LinearCost(0.4, 0.001), "head": LinearCost(0.3, 0.0)},
    restore=LinearCost(2.0, 1e-5),
    compile={16: LinearCost(100.0, 10.0), 256: LinearCost(300.0, 20.0)},
    step_ms=0.2,
    synthesis_ms=0.05,
  )
  base.update(over)
  return LatencyParams(**base)


def blocks(spans, version="v1"):
  return [Unit(f"blocks[{a}:{b})", version, 4 * MB, b - a, "block") for a, b in spans]


def candidate(spans, kind="manual") -> Candidate:
  units = [Unit("embed", "v1", 30 * MB, 0, "embed"), *blocks(spans), Unit("head", "v1", 1 * MB, 0, "head")]
  path = ", ".join(u.name for u in units)
  return Candidate.build(path, kind, units)


def test_fit_recovers_line_from_noisy_points():
  rng = np.random.default_rng(0)
  x = np.array([16, 32, 64, 128, 256, 512] * 5, dtype=float)
  y = 1.5 + 0.03 * x + rng.normal(0, 0.01, x.shape)
  fit = fit_linear(zip(x, y), "prefill[block]")
  assert fit.a == pytest.approx(1.5, abs=0.02) and fit.b == pytest.approx(0.03, rel=0.01)


def test_fit_keeps_costs_non_negative():
  assert fit_linear([(10, 5.0), (10, 7.0)], "one size") == LinearCost(6.0, 0.0)  # one size: a constant
  flat = fit_linear([(10, 5.2), (100, 4.8), (1000, 5.0)], "flat")  # noise slopes down: refit a constant
  assert flat.b == 0.0 and flat.a == pytest.approx(5.0)
  origin = fit_linear([(100, 1.0), (200, 3.0)], "steep")  # intercept would be -1: a line through 0
  assert origin.a == 0.0 and origin.b > 0
  with pytest.raises(LatencyModelError, match=r"restore: no measurements"):
    fit_linear([], "restore")
  with pytest.raises(LatencyModelError, match=r"finite and >= 0"):
    fit_linear([(1, -2.0)], "decode[x]")


def test_params_fit_recovers_every_stage():
  rng = np.random.default_rng(1)

  def line(a, b, xs):
    return [(x, a + b * x + rng.normal(0, 1e-4)) for x in xs for _ in range(3)]

  m = Measurements(
    prefill={"block": line(1.0, 0.02, [16, 64, 256, 1024])},
    decode={"block": line(0.4, 0.001, [32, 128, 512, 2048])},
    restore=line(2.0, 1e-5, [1e5, 1e6, 4e6]),
    compile={16: line(100.0, 10.0, [2, 10, 30])},
    step=[0.2, 0.2],
    synthesis=[0.05],
  )
  p = LatencyParams.fit(m)
  assert p.prefill["block"].a == pytest.approx(1.0, abs=1e-3) and p.prefill["block"].b == pytest.approx(0.02, rel=1e-3)
  assert p.decode["block"].b == pytest.approx(0.001, rel=1e-2)
  assert 1 / p.restore.b == pytest.approx(1e5, rel=1e-2)  # restore bandwidth, bytes per ms
  assert p.compile[16].a == pytest.approx(100.0, abs=1e-2) and p.compile[16].b == pytest.approx(10.0, rel=1e-3)
  assert p.step_ms == pytest.approx(0.2)


def test_cold_prediction_follows_the_formulas():
  p = params()
  c = candidate([(0, 2), (2, 4), (2, 4), (4, 6)], kind="repeat")  # blocks[2:4) runs twice, restored once
  T, n = 40, 12
  got = LatencyModel(p).predict(c, T, n, COLD)
  distinct = {u.ref: u.nbytes for u in c.units}
  assert got.restore == pytest.approx(sum(2.0 + 1e-5 * b for b in distinct.values()))
  # bucket(40) = 64 is not measured; 16 and 256 are equally near in log2, the smaller one serves; 8 layers.
  assert got.compile == pytest.approx(100.0 + 10.0 * 8)
  # The program's shapes: the prompt padded to bucket(40) = 64; n - 1 decode steps (the prefill gives the
  # first token), each over the whole cache of 64 + bucket(12) = 80 slots.
  assert got.prefill == pytest.approx(sum(p.prefill[u.cost_key](64) for u in c.units))
  step = p.step_ms + sum(p.decode[u.cost_key](64 + 16) for u in c.units)
  assert got.decode == pytest.approx((n - 1) * step) and got.cache_len == 80
  assert got.synthesis == p.synthesis_ms
  assert got.total == pytest.approx(got.synthesis + got.restore + got.compile + got.prefill + got.decode)


def test_prefill_steps_at_bucket_edges_and_a_decode_step_costs_the_same_throughout():
  m = LatencyModel(params())
  c = candidate([(0, 2), (2, 4)])
  assert m.predict(c, 17, 8).prefill == m.predict(c, 32, 8).prefill > m.predict(c, 16, 8).prefill
  one = m.predict(c, 20, 64)
  assert one.raw_decode(1) == 0.0  # the first token comes from the prefill
  assert one.raw_decode(33) == pytest.approx(2 * one.raw_decode(17))  # linear in steps: one cache size
  assert m.predict(c, 20, 65).raw_decode(17) > one.raw_decode(17)  # a larger max_tokens bucket: a larger cache


def test_nearest_compile_bucket_is_used():
  m = LatencyModel(params())
  c = candidate([(0, 2)])
  assert m.predict(c, 10, 4).compile == pytest.approx(100.0 + 10.0 * 2)  # bucket 16, measured
  assert m.predict(c, 200, 4).compile == pytest.approx(300.0 + 20.0 * 2)  # bucket 256, measured
  assert m.predict(c, 1000, 4).compile == pytest.approx(300.0 + 20.0 * 2)  # bucket 1024 -> nearest 256


def test_resident_and_compiled_path_predicts_zero_restore_and_compile():
  m = LatencyModel(params())
  c = candidate([(0, 2), (2, 4)])
  cold = m.predict(c, 30, 8, COLD)
  warm = m.predict(c, 30, 8, Residency(frozenset(c.refs), frozenset({cold.program_key})))
  assert cold.restore > 0 and cold.compile > 0
  assert warm.restore == 0.0 and warm.compile == 0.0
  assert (warm.prefill, warm.decode) == (cold.prefill, cold.decode)
  half = m.predict(c, 30, 8, Residency(frozenset(c.refs[:2])))
  missing = [u for u in c.units[2:]]
  assert half.restore == pytest.approx(sum(2.0 + 1e-5 * u.nbytes for u in missing))
  other_shape = m.predict(c, 30, 200, Residency(frozenset(c.refs), frozenset({cold.program_key})))
  assert other_shape.compile > 0  # another new-token bucket is another program


@pytest.mark.parametrize("budget", [0.0, 150.0, 250.0, 400.0, 1e9])
def test_tokens_within_is_the_largest_count_that_fits(budget):
  m = LatencyModel(params())
  c = candidate([(0, 2), (2, 4), (4, 6)])
  pred = m.predict(c, 64, 100)
  fixed = pred.total - pred.decode
  brute = max([k for k in range(101) if fixed + pred.decode_factor * pred.raw_decode(k) <= budget], default=0)
  assert pred.tokens_within(budget) == brute
  assert pred.raw_decode(100) == pytest.approx(pred.raw["decode"])


def test_missing_cost_key_is_named():
  c = candidate([(0, 2)])
  p = params(decode={"embed": LinearCost(0.1), "head": LinearCost(0.1)})
  with pytest.raises(LatencyModelError, match=r"blocks\[0:2\)@v1.*'block'.*decode.*--latency-only"):
    LatencyModel(p).predict(c, 10, 4)


def test_update_moves_predictions_toward_observed_times():
  m = LatencyModel(params(), alpha=0.3, global_alpha=0.1)
  c, other = candidate([(0, 2), (2, 4)]), candidate([(0, 2)])
  before = m.predict(c, 50, 32)
  target = 2.0 * before.decode
  errors = []
  for _ in range(20):
    p = m.predict(c, 50, 32)
    errors.append(abs(p.decode - target))
    m.update(LatencyTrace(p, {"decode": target, "prefill": p.raw["prefill"]}))
  assert all(b < a for a, b in zip(errors, errors[1:]))  # strictly closer every time
  assert m.predict(c, 50, 32).decode == pytest.approx(target, rel=0.01)
  assert m.predict(c, 50, 32).prefill == pytest.approx(before.prefill)
  # A path never traced uses the global correction: moved the same way, by less.
  o_before = LatencyModel(params()).predict(other, 50, 32).decode
  o_after = m.predict(other, 50, 32).decode
  assert o_before < o_after < 2.0 * o_before


def test_a_path_factor_is_relative_to_the_machine_and_follows_it():
  """A path traced while the machine was busy does not keep its busy factor once other paths show the
  machine is quiet again: its factor is the machine-wide one times its own deviation."""
  m = LatencyModel(params(), alpha=0.3, global_alpha=0.1)
  busy, other = candidate([(0, 2)]), candidate([(0, 2), (2, 4)])
  for _ in range(15):
    p = m.predict(busy, 20, 8)
    m.update(LatencyTrace(p, {"decode": 2.0 * p.raw["decode"]}))
  before = m.factor(busy.path_hash, "decode")
  assert before == pytest.approx(2.0, rel=0.02)
  for _ in range(40):  # the machine is quiet again: another path runs as the raw model says
    p = m.predict(other, 20, 8)
    m.update(LatencyTrace(p, {"decode": p.raw["decode"]}))
  after = m.factor(busy.path_hash, "decode")
  assert after < 0.75 * before and m.factor(other.path_hash, "decode") == pytest.approx(1.0, rel=0.05)
  assert m.predict(busy, 20, 8).corrections["decode"][1] == "path"


def test_update_is_bounded_and_skips_zero_stages():
  m = LatencyModel(params(), alpha=0.3)
  c = candidate([(0, 2)])
  warm = Residency(frozenset(c.refs))
  p = m.predict(c, 20, 8, warm)
  m.update(LatencyTrace(p, {"decode": 1000 * p.raw["decode"]}))
  assert m.factor(c.path_hash, "decode") == pytest.approx(0.7 + 0.3 * 4.0)  # a 1000x outlier counts as 4x
  for _ in range(50):
    p = m.predict(c, 20, 8, warm)
    ratios = m.update(LatencyTrace(p, {"decode": 1000 * p.raw["decode"], "restore": 5.0}))
    assert "restore" not in ratios  # predicted 0: nothing to scale
  lo, hi = FACTOR_BOUNDS
  assert m.factor(c.path_hash, "decode") <= hi and m.factor(c.path_hash, "decode") == pytest.approx(hi)
  assert m.factor(c.path_hash, "restore") == 1.0
  with pytest.raises(LatencyModelError, match="unknown stages"):
    m.update(LatencyTrace(p, {"queue": 1.0}))
  with pytest.raises(LatencyModelError, match=r"actual_ms\[decode\]"):
    m.update(LatencyTrace(p, {"decode": math.nan}))


def test_a_run_that_compiled_teaches_restore_and_compile_only():
  m = LatencyModel(params())
  c = candidate([(0, 2)])
  p = m.predict(c, 20, 8)
  ratios = m.update(
    LatencyTrace(p, {s: 3 * p.raw[s] for s in ("restore", "compile", "prefill", "decode")}, compiled=True)
  )
  assert set(ratios) == {"restore", "compile"}
  assert m.factor(c.path_hash, "prefill") == m.factor(c.path_hash, "decode") == 1.0
  assert m.factor(c.path_hash, "compile") > 1.0


def test_update_uses_tokens_actually_produced():
  m = LatencyModel(params())
  c = candidate([(0, 2)])
  p = m.predict(c, 20, 64)
  # The run stopped after 8 tokens, exactly as fast as the model says for 8: no correction.
  ratios = m.update(LatencyTrace(p, {"decode": p.raw_decode(8)}, tokens_out=8))
  assert ratios["decode"] == pytest.approx(1.0)
  assert m.predict(c, 20, 64).decode == pytest.approx(p.decode)


def test_params_json_round_trip_keeps_learned_corrections():
  m = LatencyModel(params())
  c = candidate([(0, 2)])
  p = m.predict(c, 20, 8)
  m.update(LatencyTrace(p, {"prefill": 1.5 * p.raw["prefill"]}))
  learned = m.to_params()
  back = LatencyParams.from_json(learned.to_json())
  assert back == learned
  assert LatencyModel(back).predict(c, 20, 8).prefill == pytest.approx(m.predict(c, 20, 8).prefill)


@pytest.mark.parametrize(
  "mutate, match",
  [
    (lambda d: d.pop("restore"), r"expected keys"),
    (lambda d: d["prefill"].update(block={"a": -1.0, "b": 0.0}), r"prefill\[block\]\.a: expected a finite number >= 0"),
    (lambda d: d.update(compile={"x": {"a": 1.0, "b": 0.0}}), r"compile: keys are prompt buckets"),
    (lambda d: d.update(compile={}), r"no compile fit"),
    (lambda d: d.update(corrections={"global": {"decode": 9.0}}), r"correction factor in \[0.25, 4.0\]"),
  ],
)
def test_malformed_params_are_refused(mutate, match):
  d = params().to_json()
  mutate(d)
  with pytest.raises(LatencyModelError, match=match):
    LatencyParams.from_json(d)


# ----------------------------------------------------------------------------- execution contexts
PLAIN = LatencyContext("plain", "f32", 1, "xla")
SLOTS = LatencyContext("slots", "f32", 8, "xla")


class Clock:
  """Unix seconds that move only when a test says so."""

  def __init__(self, t: float = 1_000_000.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


def test_corrections_learned_in_one_context_never_move_another():
  """A slot engine under load teaches its own context: the plain program's prediction stays as calibrated,
  while a prediction for the slot engine carries what it learned."""
  m = LatencyModel(params(), context=PLAIN)
  c = candidate([(0, 2)])
  warm = Residency(frozenset(c.refs))
  calibrated = m.predict(c, 20, 8, warm)
  for _ in range(20):
    p = m.predict(c, 20, 8, warm, context=SLOTS)
    m.update(LatencyTrace(p, {"decode": 3.5 * p.raw["decode"], "prefill": 2.0 * p.raw["prefill"]}))
  plain = m.predict(c, 20, 8, warm)
  assert (plain.decode, plain.prefill, plain.total) == (calibrated.decode, calibrated.prefill, calibrated.total)
  assert not plain.corrections and plain.context == PLAIN
  busy = m.predict(c, 20, 8, warm, context=SLOTS)
  assert busy.decode == pytest.approx(3.5 * calibrated.decode, rel=0.02) and busy.context == SLOTS
  assert busy.observations == {"prefill": 20, "decode": 20} and busy.corrections["decode"][1] == "path"
  # A trace predicted for the plain program but run in a slot engine teaches the slot engine's context.
  m.update(LatencyTrace(plain, {"decode": 4.0 * plain.raw["decode"]}, context=SLOTS))
  assert m.predict(c, 20, 8, warm).decode == calibrated.decode
  assert set(m.learned()) == {SLOTS.key} and m.learned()[SLOTS.key].observations == 21


def test_a_speculative_candidate_is_predicted_in_its_own_context():
  m = LatencyModel(params(), context=SLOTS)
  full = candidate([(0, 4)])
  from thoughtjax.synthesis.candidate import DraftPlan

  spec = Candidate.build(full.path, "speculative", full.units, DraftPlan("embed, blocks[0:2), head", 3))
  assert m.predict(spec, 20, 8).context == LatencyContext("speculative", "f32", 1, "xla")
  assert m.predict(full, 20, 8).context == SLOTS


def test_learned_corrections_decay_with_age_toward_the_calibration():
  clock = Clock()
  m = LatencyModel(params(), context=PLAIN, clock=clock)
  c = candidate([(0, 2)])
  for _ in range(40):
    p = m.predict(c, 20, 8)
    m.update(LatencyTrace(p, {"decode": 4.0 * p.raw["decode"]}))
  learned = m.factor(c.path_hash, "decode")
  assert learned == pytest.approx(4.0, rel=0.02)
  clock.t += HALF_LIFE_S  # one half-life of silence: half the deviation (in log space) is gone
  assert m.factor(c.path_hash, "decode") == pytest.approx(math.sqrt(learned), rel=1e-6)
  clock.t += 10 * HALF_LIFE_S
  assert m.factor(c.path_hash, "decode") == pytest.approx(1.0, abs=0.01)
  # A new observation continues from the decayed factor, not from the old one.
  p = m.predict(c, 20, 8)
  m.update(LatencyTrace(p, {"decode": p.raw["decode"]}))
  assert m.factor(c.path_hash, "decode") == pytest.approx(1.0, abs=0.01)


def test_the_calibrations_own_factor_is_the_base_every_context_decays_to():
  c = candidate([(0, 2)])
  clock = Clock()
  m = LatencyModel(params(corrections={"paths": {c.path_hash: {"decode": 0.5}}}), context=PLAIN, clock=clock)
  p = m.predict(c, 20, 8)
  assert p.corrections == {"decode": (0.5, "path")} and p.observations == {"decode": 0}
  assert m.predict(c, 20, 8, context=SLOTS).decode_factor == 0.5  # a context with nothing learned
  for _ in range(30):
    p = m.predict(c, 20, 8)
    m.update(LatencyTrace(p, {"decode": p.raw["decode"]}))  # runs at the raw speed: factor -> 1
  assert m.factor(c.path_hash, "decode") == pytest.approx(1.0, rel=0.05)
  clock.t += 20 * HALF_LIFE_S
  assert m.factor(c.path_hash, "decode") == pytest.approx(0.5, rel=0.01)


def test_learned_records_round_trip_and_malformed_ones_are_refused():
  m = LatencyModel(params(), context=PLAIN)
  c = candidate([(0, 2)])
  p = m.predict(c, 20, 8)
  m.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  rec = m.learned()[PLAIN.key]
  assert Learned.from_json(rec.to_json(), "x") == rec
  again = LatencyModel(params(), context=PLAIN, learned={PLAIN.key: rec}, clock=lambda: rec.updated)
  assert again.predict(c, 20, 8).decode == pytest.approx(m.predict(c, 20, 8).decode)
  with pytest.raises(LatencyModelError, match=r"x\.global\.decode\.factor: expected a correction factor"):
    Learned.from_json({"updated": 1.0, "global": {"decode": {"factor": 9.0, "observations": 1}}}, "x")
  with pytest.raises(LatencyModelError, match="expected 'engine|weights|b<batch>|kernels'"):
    LatencyModel(params(), learned={"plain": rec})
  with pytest.raises(LatencyModelError, match="engine: expected one of"):
    LatencyContext("turbo")


# ------------------------------------------------------------------------------------------ under load
def _step(p: LatencyParams, c: Candidate, S: int) -> float:
  return p.step_ms + sum(p.decode[u.cost_key](S) for u in c.units)


def test_a_slot_engine_computes_the_next_power_of_two_of_its_streams_within_its_slots():
  assert [width(r, 8) for r in (0, 1, 2, 3, 4, 5, 8, 9, 20)] == [1, 1, 2, 4, 4, 8, 8, 8, 8]
  assert width(3, 2) == 2


def test_joining_a_busy_engine_costs_its_measured_step_scaled_to_its_new_width():
  full = candidate([(0, 4)])
  fit = fit_linear([(1, 1.0), (8, 2.4)], "rows")
  m = LatencyModel(params(rows={full.path_hash: fit}))
  idle = m.predict(full, 20, 8, COLD)
  # Three streams at width 4, 30 ms a step: a fourth stays at width 4, the same step.
  same = m.predict(full, 20, 8, COLD, load=Load((EngineLoad(full.path_hash, 3, 96, 4, 30.0),), slots=8))
  assert same.decode == pytest.approx(7 * 30.0) and same.cache_len == 96
  # Four streams: a fifth makes width 8, the step grows as the path's measured batching says.
  wider = m.predict(full, 20, 8, COLD, load=Load((EngineLoad(full.path_hash, 4, 96, 4, 30.0),), slots=8))
  assert wider.decode == pytest.approx(7 * 30.0 * fit(8) / fit(4))
  # Everything else is as idle; the raw decode re-evaluated for fewer tokens keeps the load.
  assert (same.prefill, same.restore, same.compile) == (idle.prefill, idle.restore, idle.compile)
  assert same.raw_decode(3) == pytest.approx(2 * 30.0)


def test_a_measured_step_is_not_corrected_twice():
  full = candidate([(0, 4)])
  m = LatencyModel(params(corrections={"paths": {full.path_hash: {"decode": 2.0}}}))
  load = Load((EngineLoad(full.path_hash, 1, 64, 1, 12.0),), slots=4)
  got = m.predict(full, 20, 8, COLD, load=load)
  # A one-row step measured at 12 ms, two rows without a measured fit cost twice that; the factor is not reapplied.
  assert got.decode_factor == 2.0 and got.decode == pytest.approx(7 * 24.0)


def test_a_path_measured_without_a_fit_of_its_own_batches_as_the_full_path():
  full, cut = candidate([(0, 4)]), candidate([(0, 2)])
  m = LatencyModel(params(rows={full.path_hash: LinearCost(0.5, 0.5), ROWS_DEFAULT: LinearCost(0.5, 0.5)}))
  assert m.rows_factor(cut.path_hash, 4) == pytest.approx(2.5) == m.rows_factor(full.path_hash, 4)
  assert LatencyModel(params()).rows_factor(cut.path_hash, 4) == 4.0  # nothing measured: no gain assumed


def test_an_engine_that_has_not_stepped_is_priced_by_the_fits_at_its_width():
  full = candidate([(0, 4)])
  p = params(rows={full.path_hash: LinearCost(0.5, 0.5)})  # width W costs (1 + W) / 2 one-row steps
  got = LatencyModel(p).predict(full, 20, 8, COLD, load=Load((EngineLoad(full.path_hash, 2, 64),), slots=8))
  assert got.load_factor == pytest.approx(2.5) and got.decode == pytest.approx(7 * _step(p, full, 64) * 2.5)


def test_an_engine_of_its_own_shares_the_cores_with_every_busy_engine():
  full, short = candidate([(0, 4)]), candidate([(0, 2)])
  m = LatencyModel(params())
  idle = m.predict(full, 20, 8, COLD)
  load = Load((EngineLoad(short.path_hash, 5, 64, 8, 40.0), EngineLoad("ffff", 2, 32)), slots=8)
  got = m.predict(full, 20, 8, COLD, load=load)
  assert got.load_factor == pytest.approx(1 + 2 * CONTENTION) and got.cache_len == idle.cache_len
  assert got.decode == pytest.approx(idle.decode * (1 + 2 * CONTENTION))
  # A path's own engine too short for the request is not joined: it is one more engine beside it.
  own_short = Load((EngineLoad(full.path_hash, 3, 16, 4, 30.0),), slots=8)
  assert m.predict(full, 20, 8, COLD, load=own_short).load_factor == pytest.approx(1 + CONTENTION)


def test_the_engine_joined_is_the_busiest_of_the_paths_engines_whose_ring_holds_the_request():
  full = candidate([(0, 4)])
  short = EngineLoad(full.path_hash, 5, 16, 8, 50.0)  # too short a ring for 20 + 8 tokens
  small, big = EngineLoad(full.path_hash, 1, 64, 1, 10.0), EngineLoad(full.path_hash, 2, 256, 2, 20.0)
  load = Load((short, small, big), slots=8)
  assert load.of(full.path_hash, 32) == big and load.of(full.path_hash, 300) is None and load.of("other") is None
  got = LatencyModel(params()).predict(full, 20, 8, COLD, load=load)
  assert got.cache_len == 256 and got.decode == pytest.approx(7 * 20.0 * 4 / 2)  # width 2 -> 4, no measured fit


def test_a_speculative_candidate_decodes_alone_beside_the_engines():
  from thoughtjax.synthesis.candidate import DraftPlan

  full = candidate([(0, 4)])
  spec = Candidate.build(full.path, "speculative", full.units, DraftPlan("embed, blocks[0:2), head", 3))
  got = LatencyModel(params()).predict(spec, 20, 8, COLD, load=Load((EngineLoad(full.path_hash, 2, 64),), slots=4))
  assert got.load_factor == pytest.approx(1 + CONTENTION)


def test_an_idle_load_predicts_as_no_load():
  full = candidate([(0, 4)])
  m = LatencyModel(params())
  empty = Load((EngineLoad(full.path_hash, 0, 64),), slots=8)
  assert empty.engines == () and empty.describe() == "idle"
  assert m.predict(full, 20, 8, COLD, load=empty) == m.predict(full, 20, 8, COLD)
  assert m.predict(full, 20, 8, COLD).load == IDLE


def test_a_trace_that_ran_as_predicted_under_load_leaves_the_factors_where_they_are():
  full = candidate([(0, 4)])
  m = LatencyModel(params())
  p = m.predict(full, 20, 8, COLD, load=Load((EngineLoad(full.path_hash, 3, 64, 4, 25.0),), slots=8))
  m.update(LatencyTrace(p, {"decode": p.decode}))
  assert m.factor(full.path_hash, "decode") == pytest.approx(1.0)


def test_a_run_whose_engine_filled_after_it_was_planned_teaches_nothing_of_the_load():
  """Planned alone (width 1), the request then shared its steps with streams that arrived after it: its decode
  took what the batching fit says 8 rows take. Learned at the width it ran, the factors stay; learned as if it
  ran at the predicted width, the model would take the load for its own error."""
  full = candidate([(0, 4)])
  fit = LinearCost(0.75, 0.25)  # 8 rows cost 2.75 one-row steps
  m = LatencyModel(params(rows={full.path_hash: fit}), context=SLOTS)
  p = m.predict(full, 20, 8, COLD)
  assert p.width == 1
  ran = {"decode": p.raw["decode"] * fit(8)}
  m.update(LatencyTrace(p, ran, width=8.0))
  assert m.factor(full.path_hash, "decode") == pytest.approx(1.0)
  m.update(LatencyTrace(p, ran))
  assert m.factor(full.path_hash, "decode") > 1.2
  # Joining a busy engine predicts the width it will compute; a run at that width is as predicted.
  joined = m.predict(full, 20, 8, COLD, load=Load((EngineLoad(full.path_hash, 3, 64, 4, 25.0),), slots=8))
  assert joined.width == 4


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: EngineLoad("a", -1, 64), "rows"),
    (lambda: EngineLoad("a", 1, 0), "cache_len"),
    (lambda: EngineLoad("a", True, 64), "rows"),
    (lambda: EngineLoad("a", 1, 64, 2, 0.0), "step_ms"),
    (lambda: EngineLoad("a", 1, 64, 0, 5.0), "step_ms"),
    (lambda: EngineLoad("a", 1, 64, 2, float("nan")), "step_ms"),
    (lambda: Load((), slots=0), "slots"),
  ],
)
def test_malformed_loads_are_refused(make, match):
  with pytest.raises(LatencyModelError, match=match):
    make()


def test_rows_fits_round_trip_and_malformed_ones_are_refused():
  full = candidate([(0, 4)])
  p = params(rows={full.path_hash: LinearCost(0.8, 0.2)})
  assert LatencyParams.from_json(p.to_json()) == p
  assert "rows" not in params().to_json()  # parameters without fits read as before
  bad = {**p.to_json(), "rows": {full.path_hash: {"a": -1, "b": 0}}}
  with pytest.raises(LatencyModelError, match=r"rows\["):
    LatencyParams.from_json(bad)

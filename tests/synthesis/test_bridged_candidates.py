"""Bridged paths are candidates: a bridge published by heal puts the path it heals, with the bridge at its
cut, among the calibrated candidates, measured like any other (quality checked here against the composed
bridged path run on its own) and choosable by the planner."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.synthesis.tiny_synthesis import HINTS, SETTINGS, registry_copy, tiny_setup
from thoughtjax.assembly import full_path
from thoughtjax.compose import compose
from thoughtjax.registry import Registry
from thoughtjax.synthesis.calibrate import _token_docs, calibrate
from thoughtjax.synthesis.candidate import CandidateKind
from thoughtjax.synthesis.candidates import bridged_proposals
from thoughtjax.synthesis.dictionary import load_dictionary
from thoughtjax.synthesis.heal import HealSettings, heal, publish_bridge
from thoughtjax.synthesis.latency import LatencyModel
from thoughtjax.synthesis.latency_load import Residency
from thoughtjax.synthesis.planner import Floor, Planner, PlanRequest
from thoughtjax.thoughtlet import ProfileSettings

CUT = "embed, blocks[0:3), head"  # the tiny model's first three layers (block 2 is an identity)
BRIDGED = "embed, blocks[0:3), bridge.3-6, head"
HEAL = HealSettings(rank=8, steps=40, learning_rate=1e-2, batch=4, window=32, seed=0, generated=8, generated_tokens=48)


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
  """A copy of the tiny registry with a bridge healing CUT published, then calibrated (not stored)."""
  root = registry_copy(tmp_path_factory.mktemp("bridged") / "reg")
  with Registry.open(root) as reg:
    docs = load_dictionary()[HINTS[0]].documents("calibration")
    params, report = heal(reg, CUT, HEAL, documents=docs)
    assert report.bridged_path == BRIDGED
    publish_bridge(
      reg, params, report, sign_key=tiny_setup().key, settings=ProfileSettings(context=16, reps=1, warmup=0)
    )
  reg = Registry.open(root)
  # Only the exits the tiny settings propose; the cut path itself is one of them (exit after 3 layers).
  cal = calibrate(reg, settings=SETTINGS)
  yield reg, cal, report
  reg.close()


def test_a_published_bridge_proposes_the_path_it_heals(healed):
  reg, _, report = healed
  (p,) = bridged_proposals(reg, 6)
  assert p.path == BRIDGED and p.kind is CandidateKind.BRIDGED and p.layers == (0, 1, 2, -1)
  assert "bridge.3-6 heals embed, blocks[0:3), head" in p.why and "held-out top-1" in p.why


def test_the_bridged_path_is_calibrated_like_any_other(healed):
  reg, cal, _ = healed
  (c,) = [c for c in cal.candidates if c.kind is CandidateKind.BRIDGED]
  assert c.path == BRIDGED and [u.name for u in c.units][-2:] == ["bridge.3-6", "head"]
  assert all(u.ref.partition("@")[2] == reg.current[u.name] for u in c.units)  # current versions only
  cut = next(x for x in cal.candidates if x.path == CUT)
  # Quality on each hint's calibration split equals the composed bridged path run alone against the full path.
  full, bridged = compose(full_path(reg), reg), compose(BRIDGED, reg)
  for hint in HINTS:
    docs = _token_docs(
      full.codec, load_dictionary()[hint].documents("calibration"), SETTINGS.window, SETTINGS.max_windows
    )
    agree = kl = n = 0.0
    for ids in docs:
      p = _log_softmax(np.asarray(full.logits(ids), np.float64))[:-1]
      q = _log_softmax(np.asarray(bridged.logits(ids), np.float64))[:-1]
      agree += float(np.sum(p.argmax(-1) == q.argmax(-1)))
      kl += float(np.sum(np.exp(p) * (p - q)))
      n += len(p)
    got = cal.hint_quality(c.path_hash, hint).calibration
    assert got.tokens == n and got.top1_agreement == pytest.approx(agree / n, abs=1e-9)
    assert got.mean_kl == pytest.approx(kl / n, rel=1e-3, abs=1e-5)
    # The bridge was trained to heal the cut: it moves the output back toward the full path.
    assert got.mean_kl < cal.hint_quality(cut.path_hash, hint).calibration.mean_kl
  # Its latency: the cut path's plus a bridge, far less than a block.
  model = LatencyModel(cal.latency)
  warm = lambda x: Residency(set(x.refs), {model.program_key(x.program, 16, 8)})  # noqa: E731
  a, b = model.predict(cut, 16, 8, warm(cut)), model.predict(c, 16, 8, warm(c))
  three = next(x for x in cal.candidates if x.path == "embed, blocks[0:2), blocks[3:6), head")  # one layer more
  assert a.total < b.total < model.predict(three, 16, 8, warm(three)).total


def test_the_planner_may_pick_the_bridged_path(healed):
  _, cal, _ = healed
  (c,) = [c for c in cal.candidates if c.kind is CandidateKind.BRIDGED]
  q = cal.hint_quality(c.path_hash, HINTS[0]).calibration
  # A floor the healed path meets and the raw cut does not; a budget the bridged path fits.
  floor = Floor(top1_agreement=0.0, mean_kl=q.mean_kl * 1.0001)
  planner = Planner(cal, {h: floor for h in cal.hints})
  model = LatencyModel(cal.latency)
  budget = model.predict(c, 16, 8).total * 1.0001
  plan = planner.plan(PlanRequest((HINTS[0],), 16, 8, budget), model, Residency())
  meets = [x for x in cal.candidates if floor.miss(cal.hint_quality(x.path_hash, HINTS[0]).calibration) is None]
  faster = [x for x in meets if model.predict(x, 16, 8).total <= budget]
  assert c in faster
  best = max(faster, key=lambda x: cal.hint_quality(x.path_hash, HINTS[0]).heldout.top1_agreement)
  assert plan.path_hash == best.path_hash and not plan.degraded and math.isfinite(plan.predicted.total)
  # Here it is the only path that meets the floor within the budget: the cut alone misses the floor, and
  # every path that meets it runs more layers.
  assert [x.path for x in faster] == [BRIDGED] and plan.path == BRIDGED and plan.kind == "bridged"


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))

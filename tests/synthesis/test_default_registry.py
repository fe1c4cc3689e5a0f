"""The default registry of an earlier thoughtjax, without one of today's weight variants, is upgraded in place:
the build adds the missing variant thoughtlets (every other version unchanged), the calibration stored before
carries over to the new sequence, and the latency recalibration that adds the new candidates starts from it."""

from __future__ import annotations

import dataclasses

from tests.synthesis.tiny_synthesis import make_model, tiny_setup
from thoughtjax import fetch as fetch_lib
from thoughtjax.registry import Registry, build
from thoughtjax.synthesis import calibrate as cal_lib
from thoughtjax.synthesis import default_registry
from thoughtjax.synthesis.calibrate_latency import machine_fingerprint
from thoughtjax.synthesis.calibration_store import read_calibration, write_calibration


def test_a_default_registry_without_a_variant_gets_it_in_place(tmp_path, monkeypatch):
  setup = tiny_setup()
  model = make_model(identity=2)  # the tiny registry's model: the same content, the same versions
  root = tmp_path / "default"
  build(root, setup.root / "mapping.yaml", model.loaded, settings=None, variants=("int8",))  # before int8a8
  with Registry.open(setup.registry) as signed:
    tiny_cal = read_calibration(signed)
  with Registry.open(root) as reg:
    before = dict(reg.current)
    assert not [n for n in reg.names if n.endswith("@int8a8")]
    assert {n: before[n] for n in tiny_cal.current} == dict(tiny_cal.current)
    write_calibration(reg, dataclasses.replace(tiny_cal, sequence=reg.sequence))
    old_sequence = reg.sequence

  monkeypatch.setattr(fetch_lib, "DEFAULT_MODEL", model.loaded)
  monkeypatch.setattr(default_registry, "_mapping_path", lambda: setup.root / "mapping.yaml")
  seen = []

  def recalibrate(reg, stored, **kw):  # what it is handed; the measurement itself is tested elsewhere
    seen.append((reg.sequence, stored, kw["variants"]))
    return stored

  monkeypatch.setattr(cal_lib, "recalibrate_latency", recalibrate)
  stages = []
  reg = default_registry.ensure_default(lambda stage, done, total, item: stages.append(stage), root=root)
  with reg:
    added = [n for n in reg.names if n.endswith("@int8a8")]
    assert len(added) == len([n for n in before if n.endswith("@int8")]) > 0
    assert {n: reg.current[n] for n in before} == before  # nothing else changed version
    assert reg.sequence > old_sequence
    ((sequence, stored, variants),) = seen
    # Recalibrated at the upgraded sequence; the router (trained after) is one publish more.
    assert sequence == reg.sequence - 1 and "router" in reg.names and variants == default_registry.VARIANTS
    # The calibration of the sequence before, carried over: the same candidates and quality, not the shipped table.
    assert stored.sequence == sequence and stored.candidates == tiny_cal.candidates
    assert stored.quality == tiny_cal.quality
    assert read_calibration(reg).candidates == tiny_cal.candidates  # stored at the new sequence
  assert any(s.startswith("upgrade: adding the int8a8 variant") for s in stages)


def test_the_default_registry_holds_a_router_so_a_request_without_hints_is_routed(tmp_path, monkeypatch):
  """First use trains the hint router on the shipped prompts and publishes it (the calibration moves to the new
  sequence unchanged); a later use finds it and trains nothing; a plan without hints names the router's choice."""
  from thoughtjax.synthesis import router_store
  from thoughtjax.synthesis.synthesize import Synthesizer

  setup = tiny_setup()
  model = make_model(identity=2)
  root = tmp_path / "default"
  build(root, setup.root / "mapping.yaml", model.loaded, settings=None, variants=default_registry.VARIANTS)
  with Registry.open(setup.registry) as signed:
    tiny_cal = read_calibration(signed)
  with Registry.open(root) as reg:
    write_calibration(reg, dataclasses.replace(tiny_cal, sequence=reg.sequence, fingerprint=machine_fingerprint()))
    assert router_store.ROUTER_NAME not in reg.names
  monkeypatch.setattr(default_registry, "_lacks_speculative", lambda reg, cal: False)
  stages = []
  with default_registry.ensure_default(lambda stage, done, total, item: stages.append((stage, item)), root=root) as reg:
    assert router_store.ROUTER_NAME in reg.names
    cal = read_calibration(reg)
    assert cal.sequence == reg.sequence and cal.candidates == tiny_cal.candidates
    plan = Synthesizer(reg, cal).plan("Write a Python function that reverses a list", max_latency_ms=1e9)
    routed = [n for n in plan.notes if n.startswith("no hints given")]
    assert routed and "the router picked" in routed[0] and plan.hints[0] in routed[0], plan.notes
  assert [s for s, _ in stages].count("router") == 2 and "held-out accuracy" in stages[-1][1]
  trained = []
  monkeypatch.setattr(router_store, "train_registry_router", lambda *a, **k: trained.append(1))
  with default_registry.ensure_default(root=root) as reg:
    assert router_store.ROUTER_NAME in reg.names and not trained  # found, not trained again

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
    assert sequence == reg.sequence and variants == default_registry.VARIANTS
    # The calibration of the sequence before, carried over: the same candidates and quality, not the shipped table.
    assert stored.sequence == reg.sequence and stored.candidates == tiny_cal.candidates
    assert stored.quality == tiny_cal.quality
    assert read_calibration(reg).candidates == tiny_cal.candidates  # stored at the new sequence
  assert any(s.startswith("upgrade: adding the int8a8 variant") for s in stages)

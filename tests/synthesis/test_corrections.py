"""Learned latency corrections persist per machine and registry: a new synthesizer predicts with what an
earlier one learned, the plan says a correction applied, and a damaged file is named and ignored."""

from __future__ import annotations

import json
import math

import pytest

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.registry import Registry
from thoughtjax.synthesis import corrections as corr
from thoughtjax.synthesis.latency import LatencyTrace
from thoughtjax.synthesis.synthesize import Synthesizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reg():
  with Registry.open(tiny_setup().registry) as r:
    yield r


@pytest.fixture
def store(tmp_path, monkeypatch):
  path = tmp_path / "latency-corrections.json"
  monkeypatch.setenv(corr.ENV, str(path))
  return path


def _plan(syn):
  return syn.plan(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9)


def test_a_new_synthesizer_predicts_with_what_an_earlier_one_learned(reg, store):
  first = Synthesizer.open(reg)
  assert first.corrections_loaded == {} and not _plan(first).predicted.corrections
  for _ in range(2):  # the first run compiles (teaches compile only); the second is warm
    first.synthesize(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9, ignore_eos=True).finish()
  first.save_corrections()
  ran = next(c for c in first.calibration.candidates if c.path_hash == first.traces[-1].path_hash)
  learned = first.latency.predict(ran, 12, 9)  # cold, as a new synthesizer sees it
  assert {"prefill", "decode"} <= set(learned.corrections)  # the warm run moved them
  assert learned.corrections["decode"][1] == "path"

  doc = json.loads(store.read_text())
  assert doc["format"] == corr.FORMAT and list(doc["entries"]) == [first.corrections_key]
  assert first.corrections_key.startswith(f"{reg.registry_id}|")

  second = Synthesizer.open(reg)
  assert second.corrections_loaded
  again = second.latency.predict(ran, 12, 9)
  assert again.corrections == learned.corrections
  assert (again.prefill, again.decode, again.compile) == pytest.approx(
    (learned.prefill, learned.decode, learned.compile)
  )
  plan = second.plan(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9)
  j = plan.to_json()["corrections"]  # the plan says which corrections it applied
  assert j and set(j) == set(plan.predicted.corrections) and all(v["from"] in ("path", "global") for v in j.values())
  # Without the file, the calibration alone.
  fresh = Synthesizer.open(reg, learned_corrections=False).latency.predict(ran, 12, 9)
  assert not fresh.corrections and fresh.decode != pytest.approx(learned.decode)


def test_the_plan_text_shows_the_applied_correction(reg, store):
  from thoughtjax.cli.synthesis import _plan_text

  syn = Synthesizer.open(reg)
  p = _plan(syn).predicted
  syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  text = _plan_text(_plan(syn), explain=False)
  assert "corrected   decode x" in text and "this path" in text


@pytest.mark.parametrize(
  "content, named",
  [
    (b"{not json", "is not JSON"),
    (b'{"format": "something-else", "version": 1}', "expected format"),
    (b'{"format": "thoughtjax.latency-corrections", "version": 2, "entries": []}', "'entries'"),
    (
      b'{"format": "thoughtjax.latency-corrections", "version": 2, "entries": {"k": {"updated": 1, '
      b'"corrections": {"global": {"decode": 99.0}}}}}',
      "entry 'k'",
    ),
  ],
)
def test_a_damaged_file_is_named_ignored_and_replaced_at_the_next_save(reg, store, content, named):
  store.write_bytes(content)
  with pytest.warns(corr.LatencyCorrectionsWarning, match=rf"{store}.*{named}.*ignored") as caught:
    syn = Synthesizer.open(reg)
  assert len(caught) == 1
  assert syn.corrections_loaded == {} and not _plan(syn).predicted.corrections
  p = _plan(syn).predicted
  syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  with pytest.warns(corr.LatencyCorrectionsWarning):  # the save reads the damaged file once more
    syn.save_corrections()
  assert list(json.loads(store.read_text())["entries"]) == [syn.corrections_key]
  assert not list(store.parent.glob(f".{store.name}.*"))  # no temporary file left behind


def test_a_file_of_an_older_version_is_ignored_quietly_and_replaced(reg, store, recwarn):
  store.write_text(json.dumps({"format": corr.FORMAT, "version": 1, "entries": {"x": {"updated": 1}}}))
  syn = Synthesizer.open(reg)
  assert syn.corrections_loaded == {} and not recwarn.list
  p = _plan(syn).predicted
  syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  syn.save_corrections()
  assert json.loads(store.read_text())["version"] == corr.FORMAT_VERSION


def test_the_file_is_bounded_and_keeps_the_most_recent_entries(store):
  paths = {"paths": {f"h{i:04d}": {"decode": 1.5} for i in range(corr.MAX_PATHS + 40)}, "global": {"decode": 1.2}}
  for i in range(corr.MAX_ENTRIES + 5):
    corr.save_corrections(f"reg{i}|fp|d", paths, i, store)
  entries = json.loads(store.read_text())["entries"]
  assert (
    len(entries) == corr.MAX_ENTRIES and "reg0|fp|d" not in entries and f"reg{corr.MAX_ENTRIES + 4}|fp|d" in entries
  )
  last = entries[f"reg{corr.MAX_ENTRIES + 4}|fp|d"]["corrections"]
  assert len(last["paths"]) == corr.MAX_PATHS and f"h{corr.MAX_PATHS + 39:04d}" in last["paths"]


def test_re_measured_latency_starts_from_fresh_factors(reg):
  import dataclasses

  from thoughtjax.registry.calibration_store import read_calibration
  from thoughtjax.synthesis.latency import LinearCost

  cal = read_calibration(reg)
  other = dataclasses.replace(cal.latency, restore=LinearCost(cal.latency.restore.a + 1.0, cal.latency.restore.b))
  assert corr.corrections_key(reg.registry_id, "fp", cal.latency) != corr.corrections_key(reg.registry_id, "fp", other)
  assert corr.corrections_key(reg.registry_id, "fp", cal.latency) == corr.corrections_key(
    reg.registry_id, "fp", dataclasses.replace(cal.latency, corrections={"global": {"decode": 2.0}})
  )


def test_off_keeps_corrections_in_process(reg, tmp_path, monkeypatch):
  monkeypatch.setenv(corr.ENV, "off")
  syn = Synthesizer.open(reg)
  p = _plan(syn).predicted
  syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  syn.save_corrections()
  assert corr.corrections_path() is None and syn._store.saves == 0

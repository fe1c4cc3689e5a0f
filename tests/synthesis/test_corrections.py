"""Learned latency corrections persist per machine, registry and execution context: a new synthesizer predicts
with what an earlier one learned in its own context and nothing learned elsewhere (a server's slot engine), the
plan says which applied and from how many observations, a damaged file is named and ignored, and
``thoughtjax corrections --reset`` forgets them."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.registry import Registry
from thoughtjax.synthesis import corrections as corr
from thoughtjax.synthesis.latency import LatencyTrace
from thoughtjax.synthesis.latency_context import MAX_AGE_S, LatencyContext, Learned
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

  assert list(doc["entries"][first.corrections_key]["contexts"]) == [first.context.key]
  assert first.context.engine == "plain" and first.context.batch == 1

  second = Synthesizer.open(reg)
  assert second.corrections_loaded
  again = second.latency.predict(ran, 12, 9)
  # The same factors, less what the seconds between the two took back (6-hour half-life).
  assert {s: src for s, (_, src) in again.corrections.items()} == {
    s: src for s, (_, src) in learned.corrections.items()
  }
  assert (again.prefill, again.decode, again.compile) == pytest.approx(
    (learned.prefill, learned.decode, learned.compile), rel=1e-4
  )
  # One warm run taught decode, or two when an earlier test in this process had compiled the program already.
  assert again.observations == learned.observations and again.observations["decode"] in (1, 2)
  plan = second.plan(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9)
  j = plan.to_json()  # the plan says which corrections it applied, from how many runs, in which context
  assert j["corrections"] and set(j["corrections"]) == set(plan.predicted.corrections)
  assert all(v["from"] in ("path", "global") for v in j["corrections"].values())
  # The plan may be a speculative one (its own context: only calibration's factor) or the plain one that ran.
  assert j["latency_context"] == plan.predicted.context.key
  assert all(v["context"] == j["latency_context"] for v in j["corrections"].values())
  assert {s: v["observations"] for s, v in j["corrections"].items()} == dict(plan.predicted.observations)
  if plan.predicted.context == first.context:
    assert j["corrections"]["decode"]["observations"] == again.observations["decode"]
  # Without the file, the calibration alone.
  fresh = Synthesizer.open(reg, learned_corrections=False).latency.predict(ran, 12, 9)
  assert not fresh.corrections and fresh.decode != pytest.approx(learned.decode)


def test_the_plan_text_shows_the_applied_correction_its_observations_and_what_is_not_applied(reg, store):
  from thoughtjax.cli.synthesis import _plan_text

  syn = Synthesizer.open(reg)
  p = _plan(syn).predicted
  for _ in range(3):
    syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  slots = LatencyContext("slots", syn.context.weights, 8, syn.context.kernels)
  syn.latency.update(LatencyTrace(p, {"decode": 3 * p.raw["decode"]}, context=slots))
  text = _plan_text(_plan(syn), explain=False)
  assert "corrected   decode x" in text and "this path, 3 observations" in text and "in this context" in text
  explained = _plan_text(_plan(syn), explain=True, latency=syn.latency)
  assert f"context     plain program, {syn.context.weights} weights, batch 1" in explained
  assert f"not applied corrections of {slots.key}: 1 observations" in explained


@pytest.mark.parametrize(
  "content, named",
  [
    (b"{not json", "is not JSON"),
    (b'{"format": "something-else", "version": 1}', "expected format"),
    (b'{"format": "thoughtjax.latency-corrections", "version": 3, "entries": []}', "'entries'"),
    (
      b'{"format": "thoughtjax.latency-corrections", "version": 3, "entries": {"k": {"updated": 1, "contexts": '
      b'{"plain|f32|b1|xla": {"updated": 1, "global": {"decode": {"factor": 99.0, "observations": 1}}}}}}}',
      "entry 'k'",
    ),
    (
      b'{"format": "thoughtjax.latency-corrections", "version": 3, "entries": {"k": {"updated": 1, "contexts": '
      b'{"plain": {"updated": 1}}}}}',
      "entry 'k'.*engine\\|weights",
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
  """Version 2 mixed every context's corrections (a slot engine's x3.45 decode taught the plain program): such
  a file is not read, so the first plan after an upgrade is the calibration's."""
  syn = Synthesizer.open(reg, learned_corrections=False)
  key = syn.corrections_key
  old = {"updated": 1e9, "updates": 40, "corrections": {"global": {"decode": 3.45}}}
  store.write_text(json.dumps({"format": corr.FORMAT, "version": 2, "entries": {key: old}}))
  syn = Synthesizer.open(reg)
  assert syn.corrections_loaded == {} and not recwarn.list
  p = _plan(syn).predicted
  syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  syn.save_corrections()
  assert json.loads(store.read_text())["version"] == corr.FORMAT_VERSION


def _learned(updated: float, paths: int = 1) -> Learned:
  f = {"decode": {"factor": 1.5, "observations": 2}}
  return Learned.from_json({"updated": updated, "global": f, "paths": {f"h{i:04d}": f for i in range(paths)}}, "t")


def test_the_file_is_bounded_and_keeps_the_most_recent_entries_contexts_and_paths(store):
  now = time.time()
  ctx = {"plain|f32|b1|xla": _learned(now, corr.MAX_PATHS + 40)}
  for i in range(corr.MAX_ENTRIES + 5):
    corr.save_corrections(f"reg{i}|fp|d", ctx, i, store)
  entries = json.loads(store.read_text())["entries"]
  assert (
    len(entries) == corr.MAX_ENTRIES and "reg0|fp|d" not in entries and f"reg{corr.MAX_ENTRIES + 4}|fp|d" in entries
  )
  last = entries[f"reg{corr.MAX_ENTRIES + 4}|fp|d"]["contexts"]["plain|f32|b1|xla"]
  assert len(last["paths"]) == corr.MAX_PATHS and f"h{corr.MAX_PATHS + 39:04d}" in last["paths"]
  # Contexts: at most MAX_CONTEXTS, the most recently updated; one silent past MAX_AGE_S is dropped.
  many = {f"slots|f32|b{i + 1}|xla": _learned(now - i) for i in range(corr.MAX_CONTEXTS + 3)}
  many["plain|f32|b1|xla"] = _learned(now - MAX_AGE_S - 60)
  corr.save_corrections("one|fp|d", many, 1, store)
  kept = json.loads(store.read_text())["entries"]["one|fp|d"]["contexts"]
  assert set(kept) == {f"slots|f32|b{i + 1}|xla" for i in range(corr.MAX_CONTEXTS)}


def test_a_writer_replaces_only_the_contexts_it_learned_in(store):
  """The command line and a server share one entry: each keeps the other's contexts."""
  now = time.time()
  corr.save_corrections("reg|fp|d", {"slots|f32|b8|xla": _learned(now)}, 5, store)
  corr.save_corrections("reg|fp|d", {"plain|f32|b1|xla": _learned(now)}, 1, store)
  assert set(corr.load_corrections("reg|fp|d", store)) == {"slots|f32|b8|xla", "plain|f32|b1|xla"}


def test_re_measured_latency_starts_from_fresh_factors(reg):
  import dataclasses

  from thoughtjax.synthesis.calibration_store import read_calibration
  from thoughtjax.synthesis.latency_params import LinearCost

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


def test_corrections_learned_in_a_slot_engine_do_not_change_a_plain_programs_prediction(reg, store):
  """A request a server's scheduler moved into a slot engine (its generation replaced by the engine's run,
  as server/scheduling.py does) teaches the slot engine's context; the command line's plain program predicts
  as calibrated, in this process and in the next."""
  from thoughtjax.sampling import SamplingParams
  from thoughtjax.serving import SlotEngine

  syn = Synthesizer.open(reg)
  planned = _plan(syn)
  candidate = next(c for c in syn.calibration.candidates if c.path_hash == planned.path_hash)
  calibrated = syn.latency.predict(candidate, planned.predicted.prompt_tokens, 9)  # cold
  engine = SlotEngine(syn.model_of(candidate), 4, cache_len=64)
  for _ in range(3):  # the first teaches compile only; the others prefill and decode too
    r = syn.synthesize(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9, ignore_eos=True)
    run = engine.insert(syn.prompt_ids(PROMPT), SamplingParams(max_tokens=9, ignore_eos=True))
    r.run_in(run)
    while engine.active:
      engine.step()
    r.finish()
    assert syn.ran_in(r) == LatencyContext("slots", syn.context.weights, 4, syn.context.kernels)
  slots = syn.ran_in(r)
  assert set(syn.latency.learned()) == {slots.key} and syn.latency.learned()[slots.key].observations == 3
  syn.save_corrections()
  assert list(json.loads(store.read_text())["entries"][syn.corrections_key]["contexts"]) == [slots.key]

  for s in (syn, Synthesizer.open(reg)):  # this process, and a new one reading the file
    plan = _plan(s).predicted
    assert not plan.corrections and plan.context == syn.context
    assert (plan.prefill, plan.decode) == (calibrated.prefill, calibrated.decode)
    plain = s.latency.predict(candidate, plan.prompt_tokens, 9)
    assert plain.to_json() == calibrated.to_json()
    in_slots = s.latency.predict(candidate, plain.prompt_tokens, 9, context=slots)
    # Two warm runs taught decode, or three when an earlier test in this process had compiled the program.
    assert in_slots.corrections and in_slots.observations["decode"] in (2, 3) and in_slots.decode != plain.decode


def test_the_corrections_command_shows_and_resets_them(reg, store, capsys):
  from thoughtjax.cli import main

  syn = Synthesizer.open(reg)
  p = _plan(syn).predicted
  syn.latency.update(LatencyTrace(p, {"decode": 2 * p.raw["decode"]}))
  syn.save_corrections()
  corr.save_corrections("other-registry|fp|d", {"plain|f32|b1|xla": _learned(time.time())}, 1, store)
  assert main(["corrections", "--registry", str(reg.root)]) == 0
  out = capsys.readouterr().out
  assert syn.corrections_key in out and f"{syn.context.key}" in out and "1 observations" in out
  assert "other-registry" not in out
  assert main(["corrections", "--registry", str(reg.root), "--reset"]) == 0
  assert "forgot 1 learned context(s) in 1 entry" in capsys.readouterr().out
  assert list(json.loads(store.read_text())["entries"]) == ["other-registry|fp|d"]  # others' are kept
  assert not _plan(Synthesizer.open(reg)).predicted.corrections
  assert main(["corrections", "--reset"]) == 0  # every registry's
  assert json.loads(store.read_text())["entries"] == {}
  assert main(["corrections", "--json"]) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"file": str(store), "entries": {}}


def test_a_corrections_file_that_cannot_be_rewritten_is_a_named_error_for_reset(reg, store, capsys, monkeypatch):
  from thoughtjax.cli import main

  corr.save_corrections("r|fp|d", {"plain|f32|b1|xla": _learned(time.time())}, 1, store)
  before = store.read_bytes()

  def refuse(*a, **k):  # what a read-only folder answers (root ignores the mode bits, so say it here)
    raise PermissionError(13, "Permission denied")

  monkeypatch.setattr(corr.tempfile, "mkstemp", refuse)
  assert main(["corrections", "--reset"]) == 2
  err = capsys.readouterr().err
  assert "CorrectionsFileError" in err and str(store) in err and "writable" in err and "Permission denied" in err
  assert store.read_bytes() == before

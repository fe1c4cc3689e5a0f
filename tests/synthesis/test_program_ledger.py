"""The program ledger: what a cold process pays for a program the persistent compilation cache already holds."""

from __future__ import annotations

import json
import math

import pytest

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.registry import Registry
from thoughtjax.synthesis.program_ledger import FILE_NAME, LOAD_SHARE, MAX_PROGRAMS, ProgramLedger, ledger_for

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reg():
  with Registry.open(tiny_setup().registry) as r:
    yield r


def test_a_program_is_priced_from_its_compile_until_a_load_is_measured_then_by_its_latest_load(tmp_path):
  ledger = ledger_for("reg|machine|fit", tmp_path)
  assert ledger.prices() == {}
  ledger.record("full|T16|N64", 4000.0, loaded=False)  # the run that compiled it into the cache
  assert ledger.prices() == {"full|T16|N64": 4000.0 * LOAD_SHARE}
  ledger.record("full|T16|N64", 900.0, loaded=True)  # a later process loaded it
  assert ledger.prices() == {"full|T16|N64": 900.0}
  ledger.record("full|T16|N64", 1100.0, loaded=True)
  assert ledger.prices() == {"full|T16|N64": 1100.0}
  ledger.record("full|T16|N64", 5000.0, loaded=False)  # the cache was cleared: compiled again, loads as before
  assert ledger.prices() == {"full|T16|N64": 1100.0}
  ledger.record("other|T16|N64", 700.0, loaded=True)  # found in the cache before any run here compiled it
  assert ledger.prices()["other|T16|N64"] == 700.0


def test_the_ledger_outlives_its_process_per_entry_and_sits_in_the_cache_folder(tmp_path):
  ledger_for("a", tmp_path).record("p|T16|N64", 2000.0, loaded=False)
  ledger_for("b", tmp_path).record("q|T32|N64", 3000.0, loaded=False)
  assert (tmp_path / FILE_NAME).is_file()
  assert ledger_for("a", tmp_path).prices() == {"p|T16|N64": 2000.0 * LOAD_SHARE}
  assert ledger_for("b", tmp_path).prices() == {"q|T32|N64": 3000.0 * LOAD_SHARE}
  assert ledger_for("c", tmp_path).prices() == {}  # another registry or calibration learns nothing from them
  # Removing the cache folder's files removes what the ledger said about them.
  (tmp_path / FILE_NAME).unlink()
  assert ledger_for("a", tmp_path).prices() == {}


def test_a_damaged_file_prices_nothing_and_the_next_record_rewrites_it(tmp_path):
  (tmp_path / FILE_NAME).write_text("{not json")
  ledger = ledger_for("a", tmp_path)
  assert ledger.prices() == {}
  ledger.record("p|T16|N64", 100.0, loaded=False)
  assert json.loads((tmp_path / FILE_NAME).read_text())["entries"]["a"]["programs"]["p|T16|N64"]["compile_ms"] == 100
  # Values that are not times are dropped on read, not trusted.
  doc = json.loads((tmp_path / FILE_NAME).read_text())
  doc["entries"]["a"]["programs"]["bad|T16|N64"] = {"compile_ms": -5}
  doc["entries"]["a"]["programs"]["nan|T16|N64"] = {"compile_ms": "NaN", "load_ms": None}
  doc["entries"]["b"] = ["not", "an", "entry"]
  (tmp_path / FILE_NAME).write_text(json.dumps(doc))
  assert set(ledger_for("a", tmp_path).prices()) == {"p|T16|N64"}


def test_not_a_time_is_not_recorded_and_an_entry_keeps_its_most_recent_programs(tmp_path):
  ledger = ledger_for("a", tmp_path)
  ledger.record("p|T16|N64", float("nan"), loaded=False)
  ledger.record("p|T16|N64", -1.0, loaded=True)
  assert ledger.prices() == {}
  for i in range(MAX_PROGRAMS + 3):
    ledger.record(f"p{i}|T16|N64", 10.0, loaded=False)
  kept = ledger_for("a", tmp_path).prices()
  assert len(kept) == MAX_PROGRAMS and "p0|T16|N64" not in kept and f"p{MAX_PROGRAMS + 2}|T16|N64" in kept


def test_an_in_memory_ledger_writes_nothing(tmp_path):
  ledger = ProgramLedger("a", None)
  ledger.record("p|T16|N64", 100.0, loaded=False)
  assert ledger.prices() == {"p|T16|N64": 100.0 * LOAD_SHARE} and list(tmp_path.iterdir()) == []


def test_a_cold_synthesizer_prices_a_program_an_earlier_one_compiled_as_its_load_and_does_not_learn_from_it(
  reg, monkeypatch
):
  from thoughtjax.decode.program import PROGRAMS
  from thoughtjax.synthesis.latency import LatencyTrace
  from thoughtjax.synthesis.latency_load import Residency
  from thoughtjax.synthesis.synthesize import Synthesizer

  monkeypatch.delenv("THOUGHTJAX_PROGRAM_LEDGER", raising=False)  # the suite's runs keep it off (tests/isolation.py)
  PROGRAMS.clear()  # this process has compiled nothing: the first run below pays its compile stage
  first = Synthesizer.open(reg, learn=False)
  run = first.synthesize(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9, ignore_eos=True)
  run.finish()
  key = run.plan.predicted.program_key
  assert run.trace.actual_ms["compile"] > 0 and key in first.ledger.prices()

  cold = Synthesizer.open(reg, learn=False)  # another process's view: nothing compiled, the ledger on disk
  price = cold.ledger.prices()[key]
  # The same plan priced in the cold process (not re-planned: which path wins depends on the compile time measured
  # above, a load on a busy machine can outweigh another path's whole compile).
  candidate = next(c for c in cold.calibration.candidates if c.path_hash == run.plan.path_hash)
  T = run.plan.predicted.prompt_tokens
  predicted = cold.latency.predict(candidate, T, 9, cold.residency())
  assert predicted.program_key == key
  assert predicted.compile_cached and predicted.compile == pytest.approx(price)
  unledgered = cold.latency.predict(candidate, T, 9, Residency(cold.residency().resident))
  assert not unledgered.compile_cached and unledgered.compile > 0 and unledgered.compile != predicted.compile
  # What the load took is the ledger's to record: the compile correction does not move.
  ratios = cold.latency.update(LatencyTrace(predicted, {"compile": 50 * price + 1.0}, 9, compiled=True))
  assert "compile" not in ratios
  assert "compile" in cold.latency.update(LatencyTrace(unledgered, {"compile": 50 * price + 1.0}, 9, compiled=True))


def test_turned_off_the_ledger_is_the_processs_own(reg, monkeypatch):
  from thoughtjax.synthesis.synthesize import Synthesizer

  monkeypatch.setenv("THOUGHTJAX_PROGRAM_LEDGER", "off")
  assert Synthesizer.open(reg, learn=False).ledger.path is None
  monkeypatch.delenv("THOUGHTJAX_PROGRAM_LEDGER")
  assert Synthesizer.open(reg, learn=False).ledger.path is not None
  assert Synthesizer.open(reg, learn=False, learned_corrections=False).ledger.path is None

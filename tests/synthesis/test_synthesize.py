"""synthesize(): plan over the stored calibration, run the plan as one program, trace predicted vs actual.

On the tiny registry the skip of the identity block ties the full path on quality and runs fewer layers,
so GetOptimalPath must choose it; tampering with that block must make the plan degrade to a path that
avoids it (never another version of it), counted.
"""

from __future__ import annotations

import contextlib
import math
import types

import pytest

from tests.synthesis.tiny_synthesis import FULL, IDENTITY_SKIP, registry_copy, tiny_setup
from thoughtjax.compose import compose
from thoughtjax.registry import Registry
from thoughtjax.synthesis.hints import UnknownHintError
from thoughtjax.synthesis.latency_load import IDLE
from thoughtjax.synthesis.latency_params import STAGES
from thoughtjax.synthesis.planner import NoPathError, SequenceMismatchError
from thoughtjax.synthesis.synthesize import DEFAULT_HINT, Synthesizer

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def reg():
  with Registry.open(tiny_setup().registry) as r:
    yield r


@pytest.fixture(scope="module")
def syn(reg):
  return Synthesizer.open(reg)


def test_the_plan_is_the_lossless_skip_and_runs_as_that_path(syn, reg):
  r = syn.synthesize(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=9, ignore_eos=True)
  assert r.plan.path == IDENTITY_SKIP and not r.plan.degraded and r.plan.sequence == reg.sequence
  assert all(ref.partition("@")[2] == reg.current[ref.partition("@")[0]] for ref in r.plan.refs)
  text = "".join(d.text for d in r)
  # The same path composed by hand gives the same greedy tokens.
  ids = syn.prompt_ids(PROMPT)
  alone = compose(IDENTITY_SKIP, reg).generate(ids, max_tokens=9, ignore_eos=True)
  assert r.token_ids == alone.token_ids and r.text == text == alone.text
  t = r.trace
  assert t.finished and t.tokens_in == len(ids) and t.tokens_out == 9 and t.path_hash == r.plan.path_hash
  assert set(t.predicted_ms) == {"total", *STAGES} and set(t.actual_ms) == {"total", "startup", *STAGES}
  assert t.actual_ms["total"] >= t.actual_ms["prefill"] + t.actual_ms["decode"]
  assert t.compute_seconds > 0
  j = r.to_json()
  assert {
    "path",
    "path_hash",
    "hints",
    "corrected_hints",
    "predicted_ms",
    "quality",
    "degraded",
    "reason",
    "token_ids",
    "text",
    "actual_ms",
  } <= set(j)


def test_the_latency_model_learns_and_a_warm_path_predicts_no_restore_or_compile(syn):
  before = syn.latency.updates
  first = syn.synthesize(PROMPT, ["fast_draft"], max_latency_ms=math.inf, max_tokens=9, ignore_eos=True).finish()
  assert syn.latency.updates == before + 1 and syn.traces[-1] is first.trace
  again = syn.synthesize(PROMPT, ["fast_draft"], max_latency_ms=math.inf, max_tokens=9, ignore_eos=True)
  assert again.plan.predicted.restore == 0 and again.plan.predicted.compile == 0
  again.finish()
  assert syn.latency.updates == before + 2
  # The warm run (no compile) teaches prefill and decode.
  factors = {s: syn.latency.factor(first.plan.path_hash, s) for s in ("prefill", "decode")}
  assert any(f != 1.0 for f in factors.values())  # moved toward what was measured


def test_a_new_program_compiles_once_so_its_first_decode_chunk_pays_no_compile(reg, caplog):
  """A first run's decode time is decode only: the prefill call compiles the program and the decode chunks
  reuse it (an uncommitted first state used to compile it a second time inside the first chunk)."""
  import logging

  import jax

  model = compose(FULL, reg)
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    g = model.stream(list(range(5, 45)), max_tokens=20, ignore_eos=True)  # a shape no other test runs
    for _ in g:
      pass
  # The program runs as jitted (``_advance_impl``) or from its exported form (``call``; thoughtjax.exported).
  names = ("Compiling jit(_advance_impl)", "Compiling jit(call)")
  compiles = [r for r in caplog.records if r.getMessage().startswith(names)]
  assert g.trace.decode_chunks >= 2 and g.trace.compile_s > 0
  assert len(compiles) == 1, [r.getMessage()[:120] for r in compiles]


def test_a_budget_nothing_fits_degrades_to_the_fastest_and_says_how_many_tokens_fit(syn):
  before = syn.planner.counters.snapshot()["degraded_budget"]
  plan = syn.plan(PROMPT, ["general_purpose"], max_latency_ms=1e-3, max_tokens=9)
  assert plan.degraded and plan.reason == "budget" and plan.tokens_that_fit == 0
  assert plan.path == IDENTITY_SKIP  # the fastest floor-meeting path
  assert syn.planner.counters.snapshot()["degraded_budget"] == before + 1


def test_misspelt_hints_are_corrected_unknown_refused_none_defaults(syn):
  plan = syn.plan(PROMPT, ["Genral-Purpose"], max_latency_ms=math.inf)
  assert plan.hints == ("general_purpose",) and plan.corrected_hints == (("Genral-Purpose", "general_purpose"),)
  with pytest.raises(UnknownHintError, match="Valid hints: general_purpose"):
    syn.plan(PROMPT, ["poetry_in_klingon"], max_latency_ms=math.inf)
  plan = syn.plan(PROMPT, None, max_latency_ms=math.inf)
  assert plan.hints == (DEFAULT_HINT,) and any("no hints given" in n for n in plan.notes)


def test_pinning_another_sequence_is_refused_and_the_same_pin_gives_the_same_plan(syn, reg):
  with pytest.raises(SequenceMismatchError, match=f"pin {reg.sequence}"):
    syn.plan(PROMPT, ["fast_draft"], max_latency_ms=1e6, pin_sequence=reg.sequence + 1)
  a = syn.plan(PROMPT, ["fast_draft"], max_latency_ms=1e6, pin_sequence=reg.sequence)
  b = syn.plan(PROMPT, ["fast_draft"], max_latency_ms=1e6, pin_sequence=reg.sequence)
  assert (a.path_hash, a.reason) == (b.path_hash, b.reason)


def _tamper(root, name: str, version: str) -> None:
  vdir = root / "thoughtlets" / name.replace("[", "_").replace(":", "_").replace(")", "") / version
  victim = max((p for p in (vdir / "checkpoint").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0xFF
  victim.write_bytes(bytes(data))


def test_a_tampered_thoughtlet_no_floor_meeting_path_avoids_is_a_no_path_error(tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    version = reg.current["blocks[3:5)"]
    _tamper(root, "blocks[3:5)", version)  # both lossless paths (full, skip) need it; no exit meets the floor
    syn = Synthesizer.open(reg)
    with pytest.raises(NoPathError, match=f"blocks\\[3:5\\)@{version} failed verification"):
      syn.synthesize(PROMPT, ["general_purpose"], max_latency_ms=math.inf, max_tokens=4)
    assert reg.stats().integrity_failures == 1 and syn.planner.counters.snapshot()["no_path"] == 1


def _loose_fast_draft():
  """The shipped dictionary with fast_draft's floors opened, so the exits are eligible too."""
  import dataclasses

  from thoughtjax.synthesis.dictionary import Floors, load_dictionary

  d = load_dictionary()
  return dataclasses.replace(
    d, hints=tuple(dataclasses.replace(h, floors=Floors(0.0, 1e9)) if h.name == "fast_draft" else h for h in d.hints)
  )


def test_a_tampered_thoughtlet_degrades_to_the_best_path_avoiding_it_counted(tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    version = reg.current["blocks[5:6)"]
    _tamper(root, "blocks[5:6)", version)
    syn = Synthesizer.open(reg, _loose_fast_draft())
    r = syn.synthesize(PROMPT, ["fast_draft"], max_latency_ms=math.inf, max_tokens=4, ignore_eos=True)
    assert r.plan.degraded and r.plan.reason.startswith(f"unavailable: blocks[5:6)@{version} failed verification")
    assert all(not ref.startswith("blocks[5:6)") for ref in r.plan.refs)  # never another version in its place
    assert any(rej.why == "unavailable" and rej.path == FULL for rej in r.plan.rejected)
    # The best remaining path on quality: the deepest exit that avoids the failed block.
    assert r.plan.path == "embed, blocks[0:5), head"
    r.finish()
    assert r.trace.degraded and r.trace.tokens_out == 4
    snap = syn.planner.counters.snapshot()
    assert snap["degraded_unavailable"] == 1 and snap["unavailable"] == {f"blocks[5:6)@{version}": 1}
    assert reg.stats().integrity_failures == 1


class _Book:
  """A server's load book: plans inside its block one at a time, reservations it hands out."""

  def __init__(self):
    self.inside, self.plans, self.held = False, 0, []

  @contextlib.contextmanager
  def planning(self):
    assert not self.inside
    self.inside, self.plans = True, self.plans + 1
    try:
      yield IDLE
    finally:
      self.inside = False

  def reserve(self, path_hash: str, tokens: int):
    assert self.inside, "a reservation is made inside the planning block, before the next plan"
    r = types.SimpleNamespace(path_hash=path_hash, tokens=tokens, released=False)
    r.release = lambda: setattr(r, "released", True)
    self.held.append(r)
    return r


def test_a_load_book_plans_in_its_block_and_takes_the_reservation_of_a_failed_restore_back(tmp_path):
  """Attack: the planned path's block is tampered with. Under a load book the first plan reserves its row, its
  restore fails, that reservation is released and the plan made again (reserving the path that avoids the block),
  whose reservation the result carries for the caller to release once the request is in its engine."""
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    version = reg.current["blocks[5:6)"]
    _tamper(root, "blocks[5:6)", version)
    syn = Synthesizer.open(reg, _loose_fast_draft())
    book = _Book()
    r = syn.synthesize(PROMPT, ["fast_draft"], max_latency_ms=math.inf, max_tokens=4, ignore_eos=True, book=book)
    assert r.plan.degraded and r.plan.path == "embed, blocks[0:5), head" and book.plans == 2
    kept = [x for x in book.held if not x.released]
    assert kept == [r.reservation] and len(book.held) in (1, 2)  # the first plan reserved unless speculative
    assert r.reservation.path_hash == r.plan.path_hash and r.reservation.tokens == len(syn.prompt_ids(PROMPT)) + 4
    assert all(x.path_hash != r.plan.path_hash for x in book.held if x.released)
    r.finish()
    assert r.trace.tokens_out == 4


def test_cancel_stops_and_is_not_learned_from(syn):
  before = syn.latency.updates
  r = syn.synthesize(PROMPT, ["fast_draft"], max_latency_ms=math.inf, max_tokens=40, ignore_eos=True)
  next(r)
  r.cancel()
  r.finish()
  assert r.trace.finish_reason == "cancelled" and r.trace.tokens_out < 40
  assert syn.latency.updates == before


@pytest.mark.slow
def test_plans_and_runs_on_the_default_model(tmp_path, monkeypatch):
  """The default registry (built and calibrated on first use) plans and runs a general_purpose request."""
  from thoughtjax.synthesis.default_registry import open_default

  syn = open_default()
  r = syn.synthesize(
    "What is the capital of France?", ["general_purpose"], max_latency_ms=60_000, max_tokens=12, chat=True
  )
  r.finish()
  assert r.trace.tokens_out >= 1 and r.text.strip()
  assert r.plan.refs and r.trace.actual_ms["total"] > 0


def test_start_up_costs_are_their_own_stage_so_synthesis_measures_the_planner(reg):
  """The first request of a synthesizer pays importing the planning modules and loading the tokenizer (and the
  stored router without hints) once: traced as "startup", not inside "synthesis"; later requests pay none."""
  fresh = Synthesizer.open(reg)
  first = fresh.synthesize(PROMPT, None, max_latency_ms=math.inf, max_tokens=3, ignore_eos=True).finish()
  assert first.trace.actual_ms["startup"] > 0 and fresh._started == {"planning", "router"}
  again = fresh.synthesize(PROMPT, None, max_latency_ms=math.inf, max_tokens=3, ignore_eos=True).finish()
  assert again.trace.actual_ms["startup"] == 0.0 and "synthesis" in again.trace.actual_ms
  assert "startup" in first.trace.table() and "startup" not in again.trace.table()
  assert "startup" not in first.trace.predicted_ms  # not predicted: a warm process never pays it

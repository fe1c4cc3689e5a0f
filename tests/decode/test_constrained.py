"""Constrained decoding on tiny models: greedy under a constraint equals greedy of the unconstrained model with
the disallowed logits at -inf (an independent full-forward loop), every output is in the language, rows of one
batch and slots of one engine carry different constraints or none, and bad constraints are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from tests.tiny import tiny_engine
from thoughtjax.constraint import ConstraintError
from thoughtjax.decode.masks import grammars_for
from thoughtjax.decode.stream import RequestError
from thoughtjax.kernels.sample_stop import unpack_allowed
from thoughtjax.sampling import SamplingParams
from thoughtjax.serving import SlotDriver, SlotEngine, generate_in_slots

REGEX = r"(ab|ba)[a-c]{1,4}x"
SCHEMA = {
  "type": "object",
  "properties": {"k": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
  "required": ["k", "n"],
  "additionalProperties": False,
}
PROMPTS = [[7, 8, 9], list(range(40, 52)), [100, 101]]


@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", seed=5, chunk=4)


def masked_greedy(model, ids, params: SamplingParams, n: int) -> list[int]:
  """The reference: re-run the full forward each step, set what the matcher disallows to -inf, take the argmax;
  stop after an end-of-sequence id."""
  matcher = grammars_for(model.codec, model.config.vocab_size).matcher(params.constraint)
  words = np.zeros(matcher_words(model), np.uint32)
  ids, out = list(ids), []
  for _ in range(n):
    matcher.fill(words)
    allowed = np.asarray(unpack_allowed(words[None], model.config.vocab_size))[0]
    logits = np.where(allowed, model.logits(ids)[-1], -np.inf)
    tok = int(np.argmax(logits))
    out.append(tok)
    if tok in model.codec.eos_ids:
      break
    matcher.consume(tok)
    ids.append(tok)
  return out


def matcher_words(model) -> int:
  return grammars_for(model.codec, model.config.vocab_size).words


@pytest.mark.parametrize("kind", ["regex", "json_schema"])
def test_greedy_under_a_constraint_equals_the_masked_reference(model, kind):
  spec = {"regex": REGEX} if kind == "regex" else {"json_schema": SCHEMA}
  params = SamplingParams(max_tokens=40, **spec)
  got = model.generate(PROMPTS[0], max_tokens=40, **spec)
  assert got.token_ids == masked_greedy(model, PROMPTS[0], params, 40)
  if got.finish_reason == "stop":  # the language was completed and the end-of-sequence id taken
    if kind == "regex":
      assert re.fullmatch(REGEX, got.text)
    else:
      jsonschema.validate(json.loads(got.text), SCHEMA)


def test_a_bounded_language_always_finishes_in_it(model):
  """The regex admits at most 7 characters: the grammar must end the row with an end-of-sequence id."""
  for seed in range(6):
    got = model.generate(PROMPTS[seed % 3], max_tokens=16, regex=REGEX, temperature=1.3, seed=seed)
    assert got.finish_reason == "stop" and re.fullmatch(REGEX, got.text), (seed, got.text)


def test_unconstrained_output_leaves_the_language(model):
  """The check above is not vacuous: without the constraint the same requests do not match."""
  texts = [model.generate(p, max_tokens=16, temperature=1.3, seed=s).text for s, p in enumerate(PROMPTS)]
  assert not any(re.fullmatch(REGEX, t) for t in texts)


def test_rows_of_one_batch_carry_different_constraints_or_none(model):
  params = [
    SamplingParams(max_tokens=24, regex=REGEX),
    SamplingParams(max_tokens=24, ignore_eos=True),
    SamplingParams(max_tokens=24, json_schema=SCHEMA),
  ]
  batch = model.generate_batch(PROMPTS, params)
  for p, sp, got in zip(PROMPTS, params, batch, strict=True):
    alone = model.stream_batch([p], sp).result()
    assert got.token_ids == alone.token_ids
  assert batch[1].token_ids == model.generate(PROMPTS[1], max_tokens=24, ignore_eos=True).token_ids


def test_slots_carry_constraints_beside_unconstrained_neighbours(model):
  engine = SlotEngine(model, slots=3, cache_len=64)
  reqs = [
    (PROMPTS[0], SamplingParams(max_tokens=20, regex=REGEX)),
    (PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True)),
    (PROMPTS[2], SamplingParams(max_tokens=20, json_schema=SCHEMA)),
    (PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True)),
  ]
  runs = generate_in_slots(engine, reqs, arrivals=[0, 0, 1, 3])
  for (p, sp), run in zip(reqs, runs, strict=True):
    assert run.token_ids == model.stream_batch([p], sp).result().token_ids
  assert engine.active == 0


def test_a_slot_driver_prefills_constrained_requests_with_their_masks(model):
  """The server's path: requests submitted to a driver, prefilled together on its thread."""
  engine = SlotEngine(model, slots=2, cache_len=64)
  reqs = [
    (PROMPTS[2], SamplingParams(max_tokens=20, regex=REGEX)),
    (PROMPTS[1], SamplingParams(max_tokens=20, json_schema=SCHEMA)),
  ]
  driver = SlotDriver(engine)
  try:
    runs = [driver.submit(p, sp) for p, sp in reqs]
    got = [[t for d in run for t in d.token_ids] for run in runs]
  finally:
    driver.close()
  for (p, sp), ids in zip(reqs, got, strict=True):
    assert ids == model.stream_batch([p], sp).result().token_ids


def test_a_constraint_without_a_first_mask_fails_alone_in_its_prefill_batch(model, monkeypatch):
  """Attack: a pattern whose matcher runs past llguidance's limits at its first mask (hostile patterns do so on a
  large vocabulary; here the matchers of one pattern fail as those do) arrives in the same prefill batch as a plain
  request and a constrained one. Only its run ends, with its ConstraintError; the others give the tokens they give
  alone (the whole batch used to end with its error)."""
  from thoughtjax.constraint import Matcher

  hostile = "h+q"
  fill = Matcher.fill

  def past_the_limits(self, out):
    if self.constraint.source == hostile:
      raise ConstraintError("regex: after 0 output tokens the regular expression needs more than the matcher's limits")
    return fill(self, out)

  monkeypatch.setattr(Matcher, "fill", past_the_limits)
  engine = SlotEngine(model, slots=3, cache_len=64)
  prompt = list(range(40, 52))
  reqs = [
    (prompt, SamplingParams(max_tokens=12, ignore_eos=True)),
    (prompt, SamplingParams(max_tokens=12, regex=hostile)),
    (prompt, SamplingParams(max_tokens=12, regex=REGEX)),
  ]
  driver = SlotDriver(engine)
  try:
    with driver._cond:  # queued together: one prefill batch
      runs = [driver.submit(p, sp) for p, sp in reqs]
    got = []
    for run in runs:
      try:
        got.append([t for d in run for t in d.token_ids])
      except ConstraintError as e:
        got.append(e)
  finally:
    driver.close()
  assert runs[0].prefill_batch == 2  # the plain and the good constrained request, prefilled together
  assert isinstance(got[1], ConstraintError) and "limits" in str(got[1])
  for i in (0, 2):
    assert got[i] == model.stream_batch([reqs[i][0]], reqs[i][1]).result().token_ids


def test_two_constraints_at_once_are_refused_by_name():
  with pytest.raises(ConstraintError, match="regex") as e:
    SamplingParams(json_schema=SCHEMA, regex=REGEX)
  assert "json_schema" in str(e.value)


@pytest.mark.parametrize(
  ("spec", "named"),
  [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: ???"}, "grammar"),
  ],
)
def test_a_constraint_that_cannot_compile_is_refused_before_any_device_work(model, spec, named):
  with pytest.raises(ConstraintError, match=named):
    model.stream_batch([PROMPTS[0]], SamplingParams(max_tokens=4, **spec))


def test_speculation_with_a_constraint_is_refused(model):
  with pytest.raises(RequestError, match="draft"):
    model.stream_batch([PROMPTS[0]], SamplingParams(max_tokens=4, regex=REGEX), draft="embed, blocks[0:1), head")


def test_constrained_slots_decode_in_chunks_and_take_back_what_their_grammar_refuses(model):
  """A regex and a schema slot beside free ones in an engine of 4-step chunks: after a chunk's first step (under
  the mask) a constrained slot samples freely, and the tokens its grammar refuses are taken back (the tiny model's
  free choice often leaves these languages); every slot gives the tokens it gives alone (the constrained ones: the
  masked full-forward reference)."""
  engine = SlotEngine(model, slots=4, cache_len=64)
  assert engine.chunk == 4
  reqs = [
    (PROMPTS[0], SamplingParams(max_tokens=20, regex=REGEX)),
    (PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True)),
    (PROMPTS[2], SamplingParams(max_tokens=20, json_schema=SCHEMA)),
    (PROMPTS[1][:5], SamplingParams(max_tokens=13, ignore_eos=True)),
  ]
  runs = generate_in_slots(engine, reqs)
  assert engine.taken_back > 0 and engine.steps > engine.chunks
  for (p, sp), run in zip(reqs, runs, strict=True):
    assert run.token_ids == model.stream_batch([p], sp).result().token_ids
  assert runs[0].token_ids == masked_greedy(model, PROMPTS[0], reqs[0][1], 20)
  assert re.fullmatch(REGEX, runs[0].text)


def test_a_constrained_slot_whose_choices_stay_in_its_language_keeps_its_neighbours_chunks(model):
  """A constraint the tiny model's greedy output never leaves: the engine runs whole chunks beside it (it used to
  step once per call while any slot was constrained), so a free neighbour's 19 decode tokens take 6 chunks (the
  constrained slot tries 1, then 2, then 3 free tokens a chunk), not 19; nothing is taken back."""
  engine = SlotEngine(model, slots=4, cache_len=64)
  reqs = [
    (PROMPTS[0], SamplingParams(max_tokens=20, regex=r"[\s\S]*")),
    (PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True)),
  ]
  runs = generate_in_slots(engine, reqs)
  assert runs[1].chunks_at_free <= 6 and engine.taken_back == 0
  assert runs[0].token_ids == model.generate(PROMPTS[0], max_tokens=20).token_ids
  assert runs[1].token_ids == model.generate(PROMPTS[1], max_tokens=20, ignore_eos=True).token_ids


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_constrained_slots_beside_free_ones_stay_in_the_language(model, top_k):
  """Sampling with a temperature: a constrained slot keeps the free draws its grammar allows (top_k 0) or only
  its masked draw (top_k 5: the engine then steps once per call while it runs); either way each output is in the
  language and ends there, and the free neighbour runs its 16 tokens."""
  engine = SlotEngine(model, slots=4, cache_len=64)
  reqs = [
    (PROMPTS[s % 3], SamplingParams(max_tokens=16, regex=REGEX, temperature=1.3, top_k=top_k, seed=s)) for s in range(3)
  ] + [(PROMPTS[1], SamplingParams(max_tokens=16, ignore_eos=True))]
  runs = generate_in_slots(engine, reqs)
  for run in runs[:3]:
    assert run.finish_reason == "stop" and re.fullmatch(REGEX, run.text), run.text
  assert len(runs[3].token_ids) == 16

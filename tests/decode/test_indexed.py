"""The layer-indexed form (thoughtjax/decode/indexed.py): the same tokens as the unrolled program (greedy and
sampled, batches of different lengths, repeated layers, chat templates), paths of different lengths over the same
held blocks sharing one program, and the refusals."""

from __future__ import annotations

import pytest

from tests.tiny import greedy_reference, tiny_engine
from thoughtjax.decode import indexed
from thoughtjax.decode import program as program_lib
from thoughtjax.model import RequestError
from thoughtjax.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
  return tiny_engine("llama_gqa", seed=3)


def test_indexed_gives_the_unrolled_tokens(engine):
  fast = engine.with_layout("indexed")
  prompts = [[7, 8, 9], list(range(40, 61)), [100]]
  for params in (
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=4),
  ):
    want = [c.token_ids for c in engine.generate_batch(prompts, params)]
    assert [c.token_ids for c in fast.generate_batch(prompts, params)] == want
  assert fast.generate([3, 4, 5], max_tokens=8, ignore_eos=True).token_ids == greedy_reference(engine, [3, 4, 5], 8)


def test_repeated_layers_and_chat_prompts_run_indexed():
  chat = tiny_engine("qwen2_bias", seed=5, chat=True)
  for path in ((0, 1, 1), (1, 0)):
    unrolled = chat.with_path(path)
    ids = [3, 4, 5]
    assert unrolled.with_layout("indexed").generate(ids, max_tokens=6, ignore_eos=True).token_ids == (
      greedy_reference(unrolled, ids, 6)
    )
  text = "a short user message"
  want = chat.generate(text, chat=True, max_tokens=6, ignore_eos=True).token_ids
  assert chat.with_layout("indexed").generate(text, chat=True, max_tokens=6, ignore_eos=True).token_ids == want


def test_paths_of_different_lengths_over_the_same_blocks_share_one_program(engine):
  """(0, 1, 2, 2) and (0, 1, 2, 1, 0, 2) hold the same blocks and fit 6 positions: one compiled program, which
  the unrolled form cannot share (its shapes differ)."""
  short, long = (
    engine.with_path((0, 1, 2, 2)).with_layout("indexed"),
    engine.with_path((0, 1, 2, 1, 0, 2)).with_layout("indexed"),
  )
  ids = [11, 12, 13]
  short.generate(ids, max_tokens=5, ignore_eos=True)
  before = program_lib.PROGRAMS.stats()
  g = long.stream(ids, max_tokens=5, ignore_eos=True)
  got = g.completions()[0].token_ids
  after = program_lib.PROGRAMS.stats()
  assert (after.misses, after.hits) == (before.misses, before.hits + 1) and g.trace.compile_s == 0.0
  assert got == greedy_reference(engine.with_path((0, 1, 2, 1, 0, 2)), ids, 5)
  assert indexed.max_layers(4, 3) == indexed.max_layers(6, 3) == 6 and indexed.max_layers(3, 3) == 3


def test_bad_layouts_are_refused(engine):
  with pytest.raises(RequestError, match="layout is one of unrolled, indexed; got 'scan'"):
    engine.with_layout("scan")
  bridged = engine.parts._replace(blocks={**engine.parts.blocks, -1: {"down": None}})  # a bridge's slot
  with pytest.raises(ValueError, match="a path with a bridge has no layer-indexed form"):
    indexed.stack(bridged)


def test_a_path_string_keeps_the_layout_and_runs_its_own_layers(engine):
  fast = engine.with_layout("indexed")
  composed = fast.with_path("embed, blocks[0:2), head")
  assert composed.layout == "indexed" and composed.layers == (0, 1)
  assert engine.with_path("embed, blocks[0:2), head").layout == "unrolled"
  ids = [21, 22, 23]
  assert composed.generate(ids, max_tokens=6, ignore_eos=True).token_ids == greedy_reference(
    engine.with_path((0, 1)), ids, 6
  )


def test_a_path_over_fewer_of_the_models_blocks_runs_on_its_stack_and_compiles_nothing(engine):
  """A path composed over an indexed model's own weights that holds fewer blocks than the model (here 0 and 1 of
  0, 1, 2) runs on the model's stack, so its arguments have the same shapes and it compiles nothing."""
  fast = engine.with_layout("indexed")
  ids = [31, 32, 33]
  fast.generate(ids, max_tokens=5, ignore_eos=True)
  for other in (fast.with_path("embed, blocks[0:2), blocks[1:2), head"), fast.with_path((0, 1, 1))):
    g = other.stream(ids, max_tokens=5, ignore_eos=True)
    got = g.completions()[0].token_ids
    assert g.trace.compile_s == 0, g.trace.compile_s
    assert got == greedy_reference(engine.with_path((0, 1, 1)), ids, 5)

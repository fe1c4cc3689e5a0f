"""The generation program: batching, sampling controls, stops, streaming, one XLA program."""

from __future__ import annotations

import pytest

import thoughtjax
from thoughtjax import program as program_lib
from thoughtjax.loading import LoadedModel
from thoughtjax.sampling import SamplingParams
from thoughtjax.tokenizer import TextCodec
from tests.tiny import greedy_reference, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
  cfg, model = tiny_model("llama_gqa", seed=3)
  codec = TextCodec(tiny_tokenizer(), None, cfg.bos_id, cfg.eos_id)
  return thoughtjax.Model(LoadedModel(cfg, model, codec, "tiny", ""))


def test_cached_decode_matches_full_recompute(engine):
  ids = [10, 20, 30, 40, 50]
  got = engine.generate(ids, max_tokens=12, ignore_eos=True).token_ids
  assert got == greedy_reference(engine, ids, 12)


def test_eos_stops_by_default_and_ignore_eos_runs_on(engine):
  eos = engine.config.eos_id
  forced = {eos: 1e4}  # make EOS the greedy choice at every step
  assert engine.generate([4, 5], max_tokens=6, logit_bias=forced).token_ids == [eos]
  assert engine.generate([4, 5], max_tokens=6, logit_bias=forced, ignore_eos=True).token_ids == [eos] * 6


def test_batch_of_different_lengths_equals_single_runs(engine):
  prompts = [[7, 8, 9], list(range(40, 61)), [100], [5, 6, 7, 8, 9, 10, 11]]
  params = SamplingParams(max_tokens=10)
  batch = engine.generate_batch(prompts, params)
  for p, c in zip(prompts, batch):
    assert c.token_ids == engine.generate(p, max_tokens=10).token_ids


def test_sampling_is_reproducible_per_seed_and_row(engine):
  """Noise is keyed by (seed, step, row): a request at row 0 of a batch samples as alone."""
  kw = dict(max_tokens=12, temperature=1.0, top_k=50)
  a = engine.generate([1, 2, 3], seed=7, **kw).token_ids
  b = engine.generate([1, 2, 3], seed=7, **kw).token_ids
  c = engine.generate([1, 2, 3], seed=8, **kw).token_ids
  assert a == b and a != c
  batch = engine.generate_batch([[1, 2, 3], [9, 9]], [SamplingParams(seed=7, **kw), SamplingParams(seed=1, **kw)])
  assert batch[0].token_ids == a


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy(engine):
  greedy = engine.generate([4, 5, 6], max_tokens=8).token_ids
  assert engine.generate([4, 5, 6], max_tokens=8, temperature=1.5, top_k=1, seed=3).token_ids == greedy
  assert engine.generate([4, 5, 6], max_tokens=8, temperature=1.5, top_p=1e-6, seed=3).token_ids == greedy


def test_logit_bias_forces_a_token(engine):
  out = engine.generate([4, 5, 6], max_tokens=5, logit_bias={123: 1e4}).token_ids
  assert out == [123] * 5


def test_stop_token_ends_the_row_and_is_reported(engine):
  first = engine.generate([4, 5, 6], max_tokens=8, ignore_eos=True).token_ids
  stop_at = first[3]
  out = engine.generate([4, 5, 6], max_tokens=8, stop_token_ids=(stop_at,))
  assert out.token_ids == first[: first.index(stop_at) + 1]
  assert out.finish_reason == "stop"
  assert engine.generate([4, 5, 6], max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_stop_string_cuts_text(engine):
  # Sample among a few letters (equal large bias) so the text is varied and printable.
  letters = {t: 1e3 for t in engine.codec.encode("abcdefghij")}
  kw = dict(max_tokens=16, ignore_eos=True, temperature=5.0, seed=11, logit_bias=letters)
  full = engine.generate([4, 5, 6], **kw)
  text = full.text
  at = next(i for i in range(1, len(text) - 1) if text[i:i + 2] not in text[:i + 1] and "\ufffd" not in text[:i + 2])
  needle = text[at:at + 2]
  out = engine.generate([4, 5, 6], stop_strings=(needle,), **kw)
  assert out.finish_reason == "stop_string"
  assert out.text == full.text[: full.text.index(needle)]


def test_stream_yields_pieces_that_add_up(engine):
  deltas = list(engine.stream([4, 5, 6], max_tokens=20, ignore_eos=True))
  assert len(deltas) >= 2 and deltas[-1].finished
  assert sum((d.token_ids for d in deltas), []) == engine.generate([4, 5, 6], max_tokens=20, ignore_eos=True).token_ids


def test_callback_streaming_equals_chunked(engine):
  kw = dict(max_tokens=10, temperature=0.9, seed=5)
  a = engine.generate([4, 5, 6], stream_mode="chunks", **kw)
  b = engine.generate([4, 5, 6], stream_mode="callback", **kw)
  assert a.token_ids == b.token_ids and a.text == b.text


def test_chunked_program_has_no_host_callbacks(engine):
  """The chunked program runs wholly inside XLA: no host round trip in the decode loop."""
  import jax.numpy as jnp

  from thoughtjax.sampling import sampling_arrays

  key = program_lib.ProgramKey(engine.layers, 1, 16, 16, 4, program_lib.SamplingMode.SAMPLE, False)
  prog = program_lib.Program(key, engine._defs, engine.config)
  samp = sampling_arrays([SamplingParams(temperature=1.0)], 1, engine.config.vocab_size, 4, 2, False)
  hlo = prog.lower(engine.parts, jnp.zeros((1, 16), jnp.int32), jnp.zeros(1, jnp.int32), samp).as_text()
  assert "while" in hlo
  assert "callback" not in hlo.lower()


def test_bad_sampling_settings_are_rejected():
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0)
  with pytest.raises(ValueError, match="max_tokens"):
    SamplingParams(max_tokens=0)


def test_context_overflow_is_rejected(engine):
  with pytest.raises(ValueError, match="context"):
    engine.generate([1] * 200, max_tokens=100)


def test_repeated_and_skipped_layers_run(engine):
  skip = engine.with_path((0, 2))
  repeat = engine.with_path((0, 1, 1, 2))
  for m in (skip, repeat):
    ids = [3, 4, 5]
    got = m.generate(ids, max_tokens=6, ignore_eos=True).token_ids
    assert got == greedy_reference(m, ids, 6)
  # Layer 1 runs twice but its parameters are held once, shared with the full model, not copied.
  assert sorted(repeat.parts.blocks) == [0, 1, 2] and repeat.layers == (0, 1, 1, 2)
  assert repeat.parts.blocks[1]["attn"]["q"][...] is engine.parts.blocks[1]["attn"]["q"][...]


def test_forced_pallas_kernels_match_reference_in_the_program(engine):
  """The Pallas sampling kernel (interpreted on CPU) inside the whole program."""
  pallas = thoughtjax.Model(engine.loaded, kernels="pallas")
  xla = thoughtjax.Model(engine.loaded, kernels="xla")
  for kw in (dict(max_tokens=6), dict(max_tokens=6, temperature=0.9, top_k=40, seed=4)):
    assert pallas.generate([4, 5, 6], **kw).token_ids == xla.generate([4, 5, 6], **kw).token_ids


@pytest.mark.slow
def test_forced_pallas_kernels_give_identical_greedy_text_on_default_model(default_model):
  pallas = thoughtjax.Model(default_model.loaded, kernels="pallas")
  a = default_model.generate("What is the capital of France?", chat=True, max_tokens=16)
  b = pallas.generate("What is the capital of France?", chat=True, max_tokens=16)
  assert b.text == a.text and b.token_ids == a.token_ids


def test_chat_prompts_take_the_template_path_and_match_token_ids():
  from tests.tiny import CHAT_TEMPLATE

  cfg, model = tiny_model("qwen2_bias", seed=5)
  codec = TextCodec(tiny_tokenizer(), CHAT_TEMPLATE, cfg.bos_id, cfg.eos_id)
  loaded = LoadedModel(cfg, model, codec, "tiny-chat", "")
  prompts = ["hello there", "a much longer user message, with punctuation!"]
  for kernels in ("xla", "pallas"):
    m = thoughtjax.Model(loaded, kernels=kernels)
    chat = m.generate_batch(prompts, SamplingParams(max_tokens=6, ignore_eos=True), chat=True)
    assert chat[0].trace.program.template == m.chat_template().widths  # fused template embedding used
    tokens = m.generate_batch([m.prompt_ids(p, chat=True) for p in prompts],
                              SamplingParams(max_tokens=6, ignore_eos=True))
    assert tokens[0].trace.program.template is None
    for a, b in zip(chat, tokens):
      assert a.prompt_ids == b.prompt_ids and a.token_ids == b.token_ids

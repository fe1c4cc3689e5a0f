"""The generation program: batching, sampling controls, stops, streaming, one XLA program."""

from __future__ import annotations

import pytest

import thoughtjax
from tests.tiny import greedy_reference, tiny_engine, tiny_model
from thoughtjax.decode import program as program_lib
from thoughtjax.decode.interface import DecodeInputs
from thoughtjax.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
  return tiny_engine("llama_gqa", seed=3)


def test_cached_decode_matches_full_recompute(engine):
  ids = [10, 20, 30, 40, 50]
  got = engine.generate(ids, max_tokens=12, ignore_eos=True).token_ids
  assert got == greedy_reference(engine, ids, 12)


def test_eos_stops_by_default_and_ignore_eos_runs_on(engine):
  eos = engine.config.eos_id
  forced = {eos: 100.0}  # make EOS the greedy choice at every step
  assert engine.generate([4, 5], max_tokens=6, logit_bias=forced).token_ids == [eos]
  assert engine.generate([4, 5], max_tokens=6, logit_bias=forced, ignore_eos=True).token_ids == [eos] * 6


def test_batch_of_different_lengths_equals_single_runs(engine):
  prompts = [[7, 8, 9], list(range(40, 61)), [100], [5, 6, 7, 8, 9, 10, 11]]
  params = SamplingParams(max_tokens=10)
  batch = engine.generate_batch(prompts, params)
  for p, c in zip(prompts, batch, strict=True):
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


def test_kth_largest_is_the_sorted_threshold_without_a_sort():
  import jax
  import jax.numpy as jnp
  import numpy as np

  from thoughtjax.kernels.sample_stop import kth_largest

  rng = np.random.default_rng(0)
  y = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
  y[0, :6] = [-np.inf, -0.0, 0.0, 7.0, 7.0, -1e-40]  # infinities, signed zeros, ties, a denormal
  y[1] = np.round(y[1])  # many ties
  y[2, :] = -5.0  # one value everywhere
  for k in (1, 2, 3, 5, 40, 299, 300):
    ks = np.full(4, k, np.int32)
    want = np.sort(y, axis=-1)[:, 300 - k]
    got = np.asarray(jax.jit(kth_largest)(jnp.asarray(y), jnp.asarray(ks)))
    assert np.array_equal(got, want) or np.array_equal(np.abs(got), np.abs(want)), (k, got, want)
    assert np.array_equal(y >= got[:, None], y >= want[:, None])  # the same tokens are kept
  hlo = jax.jit(kth_largest).lower(jnp.asarray(y), jnp.ones(4, jnp.int32)).as_text()
  assert "sort" not in hlo


# Token streams of top-k sampling on the tiny engine, recorded with the sort-based threshold before
# kth_largest replaced it: the search keeps the same candidates, so the streams stay the same.
TOP_K_STREAMS = [
  (40, 7, 1.0, [246, 74, 243, 214, 46, 194, 136, 121, 70, 13, 247, 13, 13, 13, 13, 13]),
  (5, 11, 0.7, [30, 147, 153, 90, 153, 153, 118, 155, 58, 67, 67, 67, 75, 50, 50, 155]),
  (3, 2, 1.3, [136, 136, 136, 136, 136, 247, 153, 136, 136, 136, 136, 247, 121, 121, 136, 136]),
]


@pytest.mark.parametrize("top_k,seed,temperature,stream", TOP_K_STREAMS)
def test_top_k_sampling_streams_are_pinned(engine, top_k, seed, temperature, stream):
  kw = dict(max_tokens=16, temperature=temperature, top_k=top_k, seed=seed, ignore_eos=True)
  assert engine.generate([4, 5, 6], **kw).token_ids == stream


def test_logit_bias_forces_a_token(engine):
  out = engine.generate([4, 5, 6], max_tokens=5, logit_bias={123: 100.0}).token_ids
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
  letters = {t: 100.0 for t in engine.codec.encode("abcdefghij")}
  kw = dict(max_tokens=16, ignore_eos=True, temperature=5.0, seed=11, logit_bias=letters)
  full = engine.generate([4, 5, 6], **kw)
  text = full.text
  at = next(
    i for i in range(1, len(text) - 1) if text[i : i + 2] not in text[: i + 1] and "\ufffd" not in text[: i + 2]
  )
  needle = text[at : at + 2]
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
  prog = program_lib.Program(key, engine.defs, engine.config)
  samp = sampling_arrays([SamplingParams(temperature=1.0)], 1, engine.config.vocab_size, 4, 2, False)
  hlo = prog.lower(DecodeInputs(engine.parts, jnp.zeros((1, 16), jnp.int32), jnp.zeros(1, jnp.int32), samp)).as_text()
  assert "while" in hlo
  assert "callback" not in hlo.lower()


def test_bad_sampling_settings_are_rejected():
  from thoughtjax.errors import UserError
  from thoughtjax.sampling import SamplingError

  with pytest.raises(SamplingError, match="temperature") as info:
    SamplingParams(temperature=-1)
  assert isinstance(info.value, UserError)  # the CLI reports it in one line
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0)
  with pytest.raises(ValueError, match="max_tokens"):
    SamplingParams(max_tokens=0)


def test_context_overflow_is_rejected(engine):
  from thoughtjax.model import RequestError

  with pytest.raises(RequestError, match="exceeds the model's context of 256 tokens; shorten the prompt"):
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


def test_paths_of_one_shape_share_one_compiled_program(engine):
  """Weights are arguments: a path of the same shape as one that has run compiles nothing, and runs its own
  layers (checked against a full forward of that path, which is compiled for it alone)."""
  ids = [3, 4, 5]
  first, second = engine.with_path((0, 1, 1, 2)), engine.with_path((2, 0, 0, 1))
  first.generate(ids, max_tokens=6, ignore_eos=True)
  before = program_lib.PROGRAMS.stats()
  g = second.stream(ids, max_tokens=6, ignore_eos=True)
  got = g.completions()[0].token_ids
  after = program_lib.PROGRAMS.stats()
  assert (after.misses, after.hits) == (before.misses, before.hits + 1)
  assert g.trace.compile_s == 0.0
  assert got == greedy_reference(second, ids, 6)
  assert got != first.generate(ids, max_tokens=6, ignore_eos=True).token_ids  # not the first path's answer


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
  loaded = tiny_engine("qwen2_bias", seed=5, chat=True).loaded
  prompts = ["hello there", "a much longer user message, with punctuation!"]
  for kernels in ("xla", "pallas"):
    m = thoughtjax.Model(loaded, kernels=kernels)
    chat = m.generate_batch(prompts, SamplingParams(max_tokens=6, ignore_eos=True), chat=True)
    assert chat[0].trace.program.template == m.chat_template().widths  # fused template embedding used
    tokens = m.generate_batch(
      [m.prompt_ids(p, chat=True) for p in prompts], SamplingParams(max_tokens=6, ignore_eos=True)
    )
    assert tokens[0].trace.program.template is None
    for a, b in zip(chat, tokens, strict=True):
      assert a.prompt_ids == b.prompt_ids and a.token_ids == b.token_ids


# ---- one model shared between threads; cancelling and abandoning generations -----------------
PROMPTS = [[7, 8, 9], list(range(40, 52)), [100], [5, 6, 7, 8, 9, 10, 11], [3, 4], [200, 201, 202], [9], [60, 61]]


def _request(i: int) -> dict:
  """Request i of the concurrency test: even rows greedy, odd rows sampled with their own seed."""
  kw = dict(max_tokens=10, ignore_eos=True)
  return kw if i % 2 == 0 else kw | dict(temperature=1.0, top_k=40, seed=100 + i)


def test_eight_threads_sharing_one_model_match_each_request_alone(engine):
  import threading
  from concurrent.futures import ThreadPoolExecutor

  alone = [engine.generate(p, **_request(i)) for i, p in enumerate(PROMPTS)]
  start = threading.Barrier(len(PROMPTS))

  def run(i):
    start.wait()  # all eight enter generation together
    if i % 4 == 3:  # some consume the stream delta by delta
      return [t for d in engine.stream(PROMPTS[i], **_request(i)) for t in d.token_ids]
    return engine.generate(PROMPTS[i], **_request(i)).token_ids

  for _ in range(2):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
      together = list(pool.map(run, range(len(PROMPTS))))
    assert together == [c.token_ids for c in alone]
  assert not hasattr(engine, "last_timings")  # nothing per call lives on the model


def test_trace_counts_tokens_and_decode_chunks(engine):
  m = engine.with_chunk(4)
  g = m.stream([4, 5, 6], max_tokens=9, ignore_eos=True)
  deltas = list(g)
  t = g.trace
  assert t.tokens_in == [3] and t.tokens_out == [9] and sum(len(d.token_ids) for d in deltas) == 9
  assert t.decode_chunks == 2  # prefill gives token 1, two chunks of 4 give the other 8
  assert t.program.chunk == 4 and t.prompt_ids == [[4, 5, 6]] and not t.cancelled
  assert t.start <= t.device_start <= t.first_token <= t.end
  again = m.stream([4, 5, 6], max_tokens=9, ignore_eos=True)
  assert again.completions()[0].token_ids == [x for d in deltas for x in d.token_ids]
  assert again.trace.compile_s == 0.0  # a warm program: nothing traced or compiled


def test_cancel_stops_before_the_next_chunk(engine):
  m = engine.with_chunk(2)
  g = m.stream([4, 5, 6], max_tokens=64, ignore_eos=True)
  first = next(g)  # the prefill's token
  g.cancel()
  rest = list(g)
  assert g.trace.decode_chunks == 0 and g.trace.cancelled
  assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
  assert len(first.token_ids) == 1 and [t for d in rest for t in d.token_ids] == []
  assert g.trace.tokens_out == [1]
  early = m.stream([4, 5, 6], max_tokens=64, ignore_eos=True)
  early.cancel()  # before the first delta: not even the prefill runs
  assert [(d.token_ids, d.finish_reason) for d in early] == [([], "cancelled")]
  assert early.trace.device_start is None and early.trace.tokens_out == [0]
  done = m.generate([4, 5, 6], max_tokens=4, ignore_eos=True)  # the model is unaffected
  assert done.finish_reason == "length" and len(done.token_ids) == 4


def test_cancel_from_another_thread_stops_within_one_chunk(engine):
  import threading

  m = engine.with_chunk(2)
  g = m.stream([4, 5, 6], max_tokens=64, ignore_eos=True)
  reading, cancelled = threading.Event(), threading.Event()
  got: list = []

  def consume():
    for i, d in enumerate(g):
      got.append(d)
      if i == 2:
        reading.set()
        cancelled.wait()

  worker = threading.Thread(target=consume)
  worker.start()
  reading.wait()
  g.cancel()
  at_cancel = g.trace.decode_chunks
  cancelled.set()
  worker.join()
  assert g.trace.decode_chunks <= at_cancel + 1 and g.trace.cancelled
  assert got[-1].finish_reason == "cancelled" and sum(len(d.token_ids) for d in got) < 64


def test_abandoned_generation_stops_device_work(engine):
  import gc

  m = engine.with_chunk(2)
  g = m.stream([4, 5, 6], max_tokens=64, ignore_eos=True)
  trace = g.trace
  next(g), next(g)
  chunks = trace.decode_chunks
  del g
  gc.collect()
  assert trace.end is not None  # the runner was finalized
  assert trace.decode_chunks == chunks == 1 and trace.tokens_out == [3]
  with m.stream([4, 5, 6], max_tokens=64, ignore_eos=True) as g:
    next(g)
  assert g.trace.end is not None and g.trace.decode_chunks == 0
  with pytest.raises(StopIteration):
    next(g)


@pytest.mark.parametrize("stop", ["close", "cancel"])
def test_callback_stream_worker_stops_with_its_consumer(engine, stop):
  import threading

  from thoughtjax.model import CALLBACK_QUEUE_STEPS

  g = engine.stream([4, 5, 6], max_tokens=200, ignore_eos=True, stream_mode="callback")
  next(g)
  if stop == "close":
    g.close()
  else:
    g.cancel()
    assert list(g)[-1].finish_reason == "cancelled"
  assert not any(t.name == "thoughtjax-callback-stream" and t.is_alive() for t in threading.enumerate())
  # The device ran at most a full queue ahead of the consumer, not the 199 remaining steps.
  assert g.trace.decode_chunks <= CALLBACK_QUEUE_STEPS + 2
  assert g.trace.end is not None


def test_program_cache_is_a_bounded_counted_lru(engine):
  from thoughtjax.decode.program import ProgramCache, ProgramKey, SamplingMode
  from thoughtjax.transformer import GraphDefs

  cache = ProgramCache(capacity=2)
  keys = [ProgramKey(engine.layers, 1, 16, 16, 4, SamplingMode.GREEDY, False, chunk=c) for c in (1, 2, 3)]
  a = cache.get(keys[0], engine.defs, engine.config)
  cache.get(keys[1], engine.defs, engine.config)
  assert cache.get(keys[0], engine.defs, engine.config) is a  # a hit refreshes keys[0]
  cache.get(keys[2], engine.defs, engine.config)  # evicts keys[1], the least recently used
  s = cache.stats()
  assert (s.hits, s.misses, s.evictions, s.size, s.capacity) == (1, 3, 1, 2, 2)
  assert cache.get(keys[0], engine.defs, engine.config) is a
  cache.get(keys[1], engine.defs, engine.config)
  assert cache.stats().misses == 4 and cache.stats().evictions == 2 and len(cache) == 2
  # The graph definitions are part of the key: another model's graph gets its own program.
  other = GraphDefs.from_model(tiny_model("qwen2_bias")[1])
  assert cache.get(keys[1], other, engine.config) is not cache.get(keys[1], engine.defs, engine.config)
  with pytest.raises(ValueError, match="capacity"):
    ProgramCache(capacity=0)


def test_result_of_a_batch_points_to_completions(engine):
  g = engine.stream_batch([[4, 5], [6, 7]], SamplingParams(max_tokens=2))
  with pytest.raises(ValueError, match="completions"):
    g.result()
  assert all(1 <= len(c.token_ids) <= 2 for c in g.completions())

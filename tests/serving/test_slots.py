"""The slot engine on a tiny model: a request in a slot gives the tokens it gives alone (greedy), whoever its
neighbours are, whenever it joins and whoever it was prefilled with; slots are reused; cancel frees a slot
within one chunk; requests waiting together are prefilled in one call and a running stream waits for at most
one prefill call between its chunks; stop strings, stop ids and per-slot sampling settings hold per slot."""

from __future__ import annotations

import threading

import jax
import pytest

from tests.tiny import tiny_engine
from thoughtjax.decode.request import DecodeRequest
from thoughtjax.sampling import SamplingParams
from thoughtjax.serving import SlotDriver, SlotEngine, SlotRequestError, SlotsClosed, SlotsFull, generate_in_slots

# Prompts fit one prefill chunk and max_tokens one ring, so one prefill program per number of rows serves the tests.
PROMPTS = [[7, 8, 9], list(range(40, 52)), [100], [5, 6, 7, 8, 9, 10, 11], [3] * 15, [200, 201]]
MAX_TOKENS = [10, 16, 7, 13, 12, 16]
SLOTS = 3


@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", seed=3, chunk=4)


@pytest.fixture
def engine(model):
  return SlotEngine(model, slots=SLOTS, cache_len=64)


def alone(model, ids, **kw):
  return model.generate(ids, **kw)


def test_requests_in_slots_give_the_tokens_they_give_alone(model, engine):
  """Six requests through three slots, arriving at chunks 0, 0, 1, 2, 2, 5: staggered joins, different
  lengths, slots reused; every request's greedy tokens equal its alone run's."""
  reqs = [(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
  runs = generate_in_slots(engine, reqs, arrivals=[0, 0, 1, 2, 2, 5])
  for (p, params), run in zip(reqs, runs, strict=True):
    want = alone(model, p, max_tokens=params.max_tokens, ignore_eos=True)
    assert run.token_ids == want.token_ids and run.text == want.text
    assert run.finish_reason == "length" and run.finished and run.trace.tokens_out == [params.max_tokens]
  assert engine.active == 0 and engine.free == SLOTS and engine.freed_total == len(reqs)
  used = [r.slot for r in runs]
  assert len(set(used)) == SLOTS and len(used) > len(set(used))  # slots were reused


@pytest.mark.parametrize("layout", ["unrolled", "indexed"])
def test_both_layer_layouts_give_the_alone_tokens_with_joins_a_reused_prefix_and_cancels(model, layout):
  """The engine's programs in either layout (blocks traced one by one, or one loop over the stacked weights):
  staggered requests through reused slots, a prompt whose first blocks come from the prefix cache and a neighbour
  cancelled mid-stream leave every request's greedy tokens equal to its alone run's."""
  from thoughtjax.serving.prefix import PrefixCache

  cache = PrefixCache(4, 1 << 20)
  engine = SlotEngine(model, slots=SLOTS, cache_len=64, layout=layout, prefix_cache=cache, prefill_chunk=8)
  assert engine.program.key.layout == layout
  params = SamplingParams(max_tokens=9, ignore_eos=True)
  long = list(range(40, 60))
  first, victim = engine.insert_batch([(long, params), (PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))])
  engine.step()
  later = engine.insert(PROMPTS[3], params)  # joins mid-stream
  engine.step()
  victim.cancel()
  reused = engine.insert(long + [7], params)  # the victim's slot, and the first prompt's cached blocks
  while engine.active:
    engine.step()
  assert victim.finish_reason == "cancelled" and len(victim.token_ids) < 30
  assert reused.trace.prefix_cache_tokens >= 16
  for ids, run in ((long, first), (PROMPTS[3], later), (long + [7], reused)):
    assert run.token_ids == alone(model, ids, **_kw(params)).token_ids, layout


def test_indexed_engines_on_paths_of_different_lengths_share_one_program(model):
  """Layer-indexed, the path is data: engines on a two-block and a three-block path over one model run one slot
  program (unrolled, each path shape compiles its own), each its own path's alone tokens."""
  short, longer = model.with_path((0, 1)), model.with_path((2, 0, 1))
  a, b = (SlotEngine(path, slots=2, cache_len=64, layout="indexed") for path in (short, longer))
  assert a.program is b.program
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  for path, engine in ((short, a), (longer, b)):
    (run,) = generate_in_slots(engine, [(PROMPTS[1], params)])
    assert run.token_ids == alone(path, PROMPTS[1], **_kw(params)).token_ids


def test_a_request_joins_mid_stream_at_the_next_chunk(model, engine):
  first = engine.insert(PROMPTS[1], SamplingParams(max_tokens=16, ignore_eos=True))
  assert first.mean_width is None  # no decode step yet
  engine.step()
  engine.step()
  assert len(first.token_ids) == 1 + 2 * engine.chunk  # the prefill's token, then two chunks
  assert first.mean_width == 1.0 and first.steps_taken == 2 * engine.chunk
  second = engine.insert(PROMPTS[3], SamplingParams(max_tokens=13, ignore_eos=True))
  assert second.slot != first.slot and len(second.token_ids) == 1  # in its slot, not yet decoded
  new = engine.step()
  assert set(new) == {first.slot, second.slot} and len(new[second.slot]) == engine.chunk  # joined this chunk
  while engine.active:
    engine.step()
  assert first.token_ids == alone(model, PROMPTS[1], max_tokens=16, ignore_eos=True).token_ids
  assert second.token_ids == alone(model, PROMPTS[3], max_tokens=13, ignore_eos=True).token_ids
  # The first shared its later steps with the second (two rows each); the second ran beside it throughout, but
  # for the steps after the first ended.
  assert 1.0 < first.mean_width < 2.0 and 1.0 < second.mean_width <= 2.0


def test_cancel_frees_the_slot_within_one_chunk_and_neighbours_are_unchanged(model, engine):
  params = SamplingParams(max_tokens=16, ignore_eos=True)
  victim = engine.insert(PROMPTS[0], params)
  neighbour = engine.insert(PROMPTS[4], params)
  engine.step()
  victim.cancel()  # no chunk running: freed at once
  assert victim.finished and victim.chunks_at_free - victim.chunks_at_cancel == 0
  assert victim.finish_reason == "cancelled" and victim.trace.cancelled and len(victim.token_ids) < 16
  assert engine.runs()[victim.slot] is None and engine.free == SLOTS - 1
  reuse = engine.insert(PROMPTS[5], params)  # the freed slot is taken again
  assert reuse.slot == victim.slot
  while engine.active:
    engine.step()
  assert neighbour.token_ids == alone(model, PROMPTS[4], **_kw(params)).token_ids
  assert reuse.token_ids == alone(model, PROMPTS[5], **_kw(params)).token_ids


def test_cancel_from_another_thread_while_the_driver_steps(model, engine):
  """A driver thread steps; the cancel comes while chunks run: the slot is free by the end of the chunk
  running then (at most one more chunk), with a last ``cancelled`` delta, and the engine goes idle."""
  driver = SlotDriver(engine)
  try:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    seen, stepped, cancelled = [], threading.Event(), threading.Event()

    def on_delta(d):
      seen.append(d)
      if len(seen) == 2:  # its first decode chunk's delta, on the driver thread: the chunk waits for the cancel
        stepped.set()
        cancelled.wait(60)

    # The other request first: once ``run``'s chunk waits in on_delta (holding the engine), nothing can be placed.
    keep = driver.insert(engine.prefill(PROMPTS[2], SamplingParams(max_tokens=7, ignore_eos=True)))
    run = driver.insert(engine.prefill([9, 9, 9], params), on_delta=on_delta)
    assert stepped.wait(60)  # a decode chunk is running now, however slowly this thread was scheduled
    run.cancel()
    cancelled.set()
    deltas = list(iter(run))
    assert deltas[-1].finished and deltas[-1].finish_reason == "cancelled"
    assert run.freed.wait(60) and run.chunks_at_free - run.chunks_at_cancel <= 1
    assert len(run.token_ids) < 60
    assert list(keep)[-1].finish_reason == "length"
    assert keep.token_ids == alone(model, PROMPTS[2], max_tokens=7, ignore_eos=True).token_ids
  finally:
    driver.close()
  assert engine.active == 0


def test_a_paused_engine_frees_nothing_until_the_block_ends(model, engine):
  """``paused()`` holds the engine: a cancel from another thread (which frees at once when no chunk runs) is
  only recorded, and the slot is freed by the next step after the block; the neighbour keeps its alone tokens.
  ``state`` is the slots' device state, replaced by each step and by nothing else."""
  params = SamplingParams(max_tokens=16, ignore_eos=True)
  victim = engine.insert(PROMPTS[0], params)
  neighbour = engine.insert(PROMPTS[4], params)
  engine.step()
  with engine.paused():
    state = engine.state
    cancelling = threading.Thread(target=victim.cancel)
    cancelling.start()
    cancelling.join(60)
    assert not cancelling.is_alive() and victim.cancel_requested
    assert not victim.finished and engine.runs()[victim.slot] is victim and engine.active == 2
    assert engine.state is state
  engine.step()
  assert victim.finished and victim.finish_reason == "cancelled" and engine.runs()[victim.slot] is None
  assert engine.state is not state and all(isinstance(x, jax.Array) for x in jax.tree.leaves(engine.state))
  while engine.active:
    engine.step()
  assert neighbour.token_ids == alone(model, PROMPTS[4], **_kw(params)).token_ids


def test_closing_the_driver_ends_the_runs_it_held(engine):
  """The driver is held inside its first chunk's delivery; close() comes meanwhile: the run still in its slot
  ends with SlotsClosed instead of waiting for a step that never comes."""
  driver = SlotDriver(engine)
  inside, gate = threading.Event(), threading.Event()

  def hold(d):
    if driver.on_driver_thread():
      inside.set()
      gate.wait(60)

  run = driver.insert(engine.prefill([9, 9, 9], SamplingParams(max_tokens=60, ignore_eos=True)), on_delta=hold)
  assert inside.wait(60)
  closing = threading.Thread(target=driver.close)
  closing.start()
  for _ in iter(lambda: driver.closed, True):  # until close() has marked the driver (no timed wait)
    pass
  gate.set()
  closing.join(60)
  with pytest.raises(SlotsClosed, match="was closed"):
    list(run)
  assert run.finished and len(run.token_ids) < 60 and engine.active == 0


def test_stop_strings_stop_ids_and_eos_per_slot(model, engine):
  free = alone(model, PROMPTS[1], max_tokens=16, ignore_eos=True)
  stop = free.text[3:5]  # a string the free run produces: the stopped run ends just before it
  eos = model.config.eos_id
  reqs = [
    (PROMPTS[1], SamplingParams(max_tokens=16, stop_strings=(stop,), ignore_eos=True)),
    (PROMPTS[1], SamplingParams(max_tokens=16, stop_token_ids=(free.token_ids[5],), ignore_eos=True)),
    (PROMPTS[0], SamplingParams(max_tokens=16, logit_bias={eos: 100.0})),  # EOS at once: never takes a slot
    (PROMPTS[3], SamplingParams(max_tokens=9, ignore_eos=True)),
  ]
  runs = generate_in_slots(engine, reqs, arrivals=[0, 0, 1, 1])
  for (p, params), run in zip(reqs, runs, strict=True):
    want = alone(model, p, **_kw(params))
    assert (run.token_ids, run.text, run.finish_reason) == (want.token_ids, want.text, want.finish_reason)
  assert runs[0].finish_reason == "stop_string" and runs[0].text == free.text[: free.text.index(stop)]
  first = free.token_ids.index(free.token_ids[5])
  assert runs[1].finish_reason == "stop" and runs[1].token_ids == free.token_ids[: first + 1]
  assert runs[2].token_ids == [eos] and runs[2].slot is None
  assert engine.active == 0


def test_per_slot_bias_and_sampling_settings(model, engine):
  """Greedy and biased rows next to sampled ones: the greedy and biased rows match their alone runs; the
  sampled rows produce their max_tokens."""
  reqs = [
    (PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True)),
    (PROMPTS[3], SamplingParams(max_tokens=12, logit_bias={77: 100.0}, ignore_eos=True)),
    (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=5, ignore_eos=True)),
  ]
  runs = generate_in_slots(engine, reqs)
  assert runs[0].token_ids == alone(model, PROMPTS[0], max_tokens=12, ignore_eos=True).token_ids
  assert runs[1].token_ids == [77] * 12
  assert len(runs[2].token_ids) == 12


def test_requests_that_do_not_fit_are_refused_with_the_limit(model, engine):
  with pytest.raises(SlotRequestError, match="exceeds the slot engine's cache of 64 tokens"):
    engine.prefill(list(range(1, 60)), SamplingParams(max_tokens=16))
  with pytest.raises(SlotRequestError, match="stop_width"):
    engine.prefill([1, 2], SamplingParams(max_tokens=8, stop_token_ids=tuple(range(10, 30))))
  runs = [engine.insert([4, 5], SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(SLOTS)]
  with pytest.raises(SlotsFull, match=f"all {SLOTS} slots"):
    engine.insert([4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
  for r in runs:
    r.cancel()
  assert engine.active == 0


def test_requests_arriving_together_are_prefilled_in_one_chunked_call_whatever_their_lengths(model):
  """Three requests of 12, 20 and 7 tokens inserted together go through one prefill call, in chunks of 8 prompt
  tokens (the 20-token prompt ends in the third chunk, the others earlier); each still gives its alone tokens."""
  engine = SlotEngine(model, slots=SLOTS, cache_len=64, prefill_chunk=8)
  reqs = [
    (PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True)),
    (list(range(60, 80)), SamplingParams(max_tokens=9, ignore_eos=True)),
    (PROMPTS[3], SamplingParams(max_tokens=16, ignore_eos=True)),
  ]
  calls, rows = engine.prefill_calls, engine.prefill_rows
  runs = engine.insert_batch(reqs)
  assert engine.prefill_calls - calls == 1 and engine.prefill_rows - rows == 3
  assert [r.prefill_batch for r in runs] == [3, 3, 3] and len({r.slot for r in runs}) == 3
  while engine.active:
    engine.step()
  for (p, params), run in zip(reqs, runs, strict=True):
    assert run.token_ids == alone(model, p, **_kw(params)).token_ids and run.finish_reason == "length"


@pytest.mark.parametrize("layout", ["unrolled", "indexed"])
def test_a_prefill_computes_into_the_last_one_s_caches_and_never_reads_what_they_held(model, layout, monkeypatch):
  """A prefill hands its caches to the next one instead of allocating zeroed ones. Filled with 1e30 in between
  (keys no query may read), they still give each prompt, shorter or longer than the last, its alone tokens."""
  import jax.numpy as jnp

  engine = SlotEngine(model, slots=SLOTS, cache_len=64, prefill_chunk=8, layout=layout)
  params = SamplingParams(max_tokens=6, ignore_eos=True)
  engine.insert_batch([(list(range(60, 80)), params)])
  while engine.active:
    engine.step()
  made = []
  scratch = engine.program._scratch
  monkeypatch.setattr(engine.program, "_scratch", lambda rows: made.append(rows) or scratch(rows))
  prefiller = engine.prefiller
  prefiller._spare = jax.tree.map(lambda a: jnp.full_like(a, 1e30), prefiller._spare)
  reqs = [(PROMPTS[3], params), (list(range(90, 120)), params), (PROMPTS[0], params)]
  runs = [engine.insert_batch([r])[0] for r in reqs[:2]] + engine.insert_batch(reqs[2:])
  while engine.active:
    engine.step()
  assert made == []  # every prefill computed into the one before's caches
  for (p, kw), run in zip(reqs, runs, strict=True):
    assert run.token_ids == alone(model, p, **_kw(kw)).token_ids, layout


def test_the_driver_prefills_waiting_requests_together_and_a_stream_waits_at_most_one_prefill_chunk(model):
  """The driver is held inside a decode chunk while five requests of 3 to 40 tokens are submitted, one cancelled
  while it waits. Released, it prefills the first two together (two slots are free), the others once slots free,
  in chunks of 8 prompt tokens, never two prefill chunks between two decode chunks of the running stream; the
  cancelled one ends without a prefill or a slot; every other request gives its alone tokens."""
  engine = SlotEngine(model, slots=SLOTS, cache_len=64, prefill_chunk=8)
  driver = SlotDriver(engine)
  inside, gate = threading.Event(), threading.Event()
  seen = []

  def hold(d):
    seen.append(d)
    if len(seen) == 2 and driver.on_driver_thread():  # the first chunk's delta
      inside.set()
      gate.wait(60)

  try:
    long = driver.submit([9, 9, 9], SamplingParams(max_tokens=60, ignore_eos=True), on_delta=hold)
    assert inside.wait(60)
    rows, prefills, chunks = engine.prefill_rows, engine.prefill_calls, engine.prefill_chunks
    reqs = [
      (PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True)),
      (PROMPTS[3], SamplingParams(max_tokens=6, ignore_eos=True)),
      (list(range(60, 80)), SamplingParams(max_tokens=10, ignore_eos=True)),
      (list(range(100, 140)), SamplingParams(max_tokens=12, ignore_eos=True)),
    ]
    runs = [driver.submit(p, params) for p, params in reqs]
    dropped = driver.submit(PROMPTS[5], SamplingParams(max_tokens=8, ignore_eos=True))
    dropped.cancel()
    assert driver.waiting == 5 and engine.active == 1
    gate.set()
    assert list(dropped)[-1].finish_reason == "cancelled"
    for (p, params), run in zip(reqs, runs, strict=True):
      assert list(run)[-1].finish_reason == "length"
      assert run.token_ids == alone(model, p, **_kw(params)).token_ids
    list(long)
  finally:
    gate.set()
    driver.close()
  assert [r.prefill_batch for r in runs[:2]] == [2, 2] and engine.prefill_rows - rows == 4
  assert engine.prefill_chunks - chunks >= (engine.prefill_calls - prefills) + 4  # the 40-token prompt: 5 chunks
  assert dropped.prefill_batch is None and dropped.slot is None and dropped.token_ids == []
  assert (
    long.max_prefills_between_chunks == 1 and long.token_ids == alone(model, [9, 9, 9], **_kw(long.params)).token_ids
  )
  assert engine.active == 0 and driver.waiting == 0


def test_warm_compiles_the_prefill_of_every_batch_size(model, engine):
  """After warm(), requests prefilled together (3 rows: batch bucket 4), with a logit bias, compile nothing."""
  engine.warm()
  params = SamplingParams(max_tokens=4, logit_bias={5: 1.0}, ignore_eos=True)
  runs = engine.insert_batch([(PROMPTS[3], params), (PROMPTS[0], params), (PROMPTS[5], params)])
  assert [r.trace.compile_s for r in runs] == [0.0] * 3 and [r.prefill_batch for r in runs] == [3] * 3
  while engine.active:
    engine.step()
  assert runs[1].token_ids == alone(model, PROMPTS[0], **_kw(params)).token_ids


def test_closing_the_driver_ends_the_requests_still_waiting(engine):
  """Requests submitted to a driver whose slots are all held stay queued; close() ends them with SlotsClosed."""
  driver = SlotDriver(engine)
  inside, gate = threading.Event(), threading.Event()

  def hold(d):
    if driver.on_driver_thread() and not inside.is_set():
      inside.set()
      gate.wait(60)

  params = SamplingParams(max_tokens=60, ignore_eos=True)
  first = driver.submit([4, 5], params, on_delta=hold)
  assert inside.wait(60)
  waiting = [driver.submit([4, 5], params) for _ in range(SLOTS + 1)]
  closing = threading.Thread(target=driver.close)
  closing.start()
  for _ in iter(lambda: driver.closed, True):  # until close() has marked the driver (no timed wait)
    pass
  gate.set()
  closing.join(60)
  for run in [first, *waiting]:
    with pytest.raises(SlotsClosed, match="was closed"):
      list(run)
  assert engine.active == 0 and driver.waiting == 0
  with pytest.raises(SlotsClosed):
    driver.submit([4, 5], params)


def _kw(p: SamplingParams) -> dict:
  return dict(
    max_tokens=p.max_tokens,
    stop_strings=p.stop_strings,
    stop_token_ids=p.stop_token_ids,
    logit_bias=p.logit_bias,
    ignore_eos=p.ignore_eos,
  )


@pytest.mark.slow
def test_the_default_model_in_slots_gives_its_alone_tokens(default_model):
  """The real model (30 layers, 3 KV heads): chat prompts of different lengths joining at different chunks
  give the greedy tokens they give alone."""
  prompts = ["What is the capital of France?", "Write a haiku about rain.", "Count from one to five."]
  ids = [default_model.prompt_ids(p, chat=True) for p in prompts]
  params = [SamplingParams(max_tokens=n) for n in (12, 20, 16)]
  wants = [default_model.generate(i, max_tokens=p.max_tokens) for i, p in zip(ids, params, strict=True)]
  # Staggered (one prefill each) on two slots, then all three arriving together (prefilled together).
  for slots, arrivals in ((2, [0, 1, 2]), (3, [0, 0, 0])):
    engine = SlotEngine(default_model, slots=slots, cache_len=128)
    runs = generate_in_slots(engine, list(zip(ids, params, strict=True)), arrivals=arrivals)
    assert engine.prefill_calls == (3 if slots == 2 else 1)
    for want, run in zip(wants, runs, strict=True):
      assert (run.token_ids, run.text, run.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_a_chunk_computes_only_the_slots_in_use_and_each_gives_its_alone_tokens(model):
  """An 8-slot engine with 1, then 3 (staggered), requests computes 1, 2 and 4 rows per chunk, not 8, and
  every request's greedy tokens are its alone run's; when the slots fill, the chunk computes all 8."""
  engine = SlotEngine(model, slots=8, cache_len=64)
  params = SamplingParams(max_tokens=9, ignore_eos=True)
  (one,) = generate_in_slots(engine, [(PROMPTS[0], params)])
  assert one.token_ids == alone(model, PROMPTS[0], **_kw(params)).token_ids
  assert engine.rows_computed == engine.chunks  # one row per chunk
  chunks, rows = engine.chunks, engine.rows_computed
  reqs = [(PROMPTS[i], params) for i in (1, 2, 3)]
  runs = generate_in_slots(engine, reqs, arrivals=[0, 1, 1])
  for (ids, _), run in zip(reqs, runs, strict=True):
    assert run.token_ids == alone(model, ids, **_kw(params)).token_ids
  assert 2 <= (engine.rows_computed - rows) / (engine.chunks - chunks) <= 4
  many = [(PROMPTS[i % len(PROMPTS)], params) for i in range(8)]
  rows, chunks = engine.rows_computed, engine.chunks
  runs = generate_in_slots(engine, many)
  assert engine.rows_computed - rows == 8 * (engine.chunks - chunks)
  assert runs[5].token_ids == alone(model, many[5][0], **_kw(params)).token_ids


def test_slot_and_speculative_programs_live_in_the_one_bounded_program_cache(model, monkeypatch):
  """Every program family shares :data:`thoughtjax.decode.program.PROGRAMS`: its bound holds slot and speculative
  programs too, and its counts see them. An evicted slot program keeps serving the engine that holds it."""
  from thoughtjax.decode import program, speculative
  from thoughtjax.serving.slot_program import SlotProgram

  monkeypatch.setattr(program, "PROGRAMS", program.ProgramCache(capacity=1))
  a = SlotEngine(model, slots=2, cache_len=64)
  assert program.PROGRAMS.held(SlotProgram) == 1 and program.PROGRAMS.stats().misses == 1
  assert SlotEngine(model, slots=2, cache_len=64).program is a.program  # a hit: one layout, one program
  params = [SamplingParams(max_tokens=4, ignore_eos=True)]
  spec = speculative.prepare(model, DecodeRequest([PROMPTS[0]], params, [[]]), "embed, blocks[0:1), head")
  s = program.PROGRAMS.stats()
  assert (s.hits, s.misses, s.evictions, s.size) == (1, 2, 1, 1)  # the speculative program evicted the slot one
  assert program.PROGRAMS.held(SlotProgram) == 0 and isinstance(spec.program, speculative.SpecProgram)
  (run,) = generate_in_slots(a, [(PROMPTS[1], params[0])])  # the evicted program still runs its engine
  assert run.token_ids == alone(model, PROMPTS[1], **_kw(params[0])).token_ids
  assert SlotEngine(model, slots=2, cache_len=64).program is not a.program  # built again after its eviction


def test_engines_on_paths_of_one_shape_share_one_program_and_each_runs_its_own_layers(model):
  """The slot program is keyed by the path's shape: an engine on a second path of the same shape uses the
  first's program, and every request's tokens are its own path's alone tokens."""
  first, second = model.with_path((0, 1, 1, 2)), model.with_path((2, 0, 0, 1))
  a, b = SlotEngine(first, slots=2, cache_len=64), SlotEngine(second, slots=2, cache_len=64)
  assert a.program is b.program
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  for path, engine in ((first, a), (second, b)):
    (run,) = generate_in_slots(engine, [(PROMPTS[1], params)])
    assert run.token_ids == alone(path, PROMPTS[1], **_kw(params)).token_ids


def test_a_request_the_model_checked_is_not_checked_again_and_gives_its_alone_tokens(model, engine, monkeypatch):
  """submit_checked takes the model's checked request (a server's plan made it): the engine checks only its own
  limits, never the model's again, and the stream gives the alone tokens; a batch is refused by name, and the
  engine's limits still hold."""
  params = SamplingParams(max_tokens=9, ignore_eos=True)
  checked = model.request([PROMPTS[1]], params)
  calls = []
  real = type(model).request
  monkeypatch.setattr(type(model), "request", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
  driver = SlotDriver(engine)
  try:
    run = driver.submit_checked(checked)
    got = [t for d in run for t in d.token_ids]  # the stream, to its end
    assert calls == []  # the engine did not run the model's checks again
    assert got == run.token_ids == alone(model, PROMPTS[1], max_tokens=9, ignore_eos=True).token_ids
    with pytest.raises(SlotRequestError, match="one plain prompt on its own path"):
      driver.submit_checked(real(model, [PROMPTS[0], PROMPTS[2]], params))
    with pytest.raises(SlotRequestError, match="exceeds the slot engine's cache of 64 tokens"):
      driver.submit_checked(real(model, [PROMPTS[0]], SamplingParams(max_tokens=62)))
  finally:
    driver.close()


def test_a_short_prompt_decodes_while_the_long_one_prefilled_with_it_goes_on(model):
  """A 3-token and a 40-token prompt waiting together share one prefill (chunks of 8 tokens): the short one's first
  token comes after the first chunk and it takes its slot and decodes while the long one's later chunks run (before,
  it waited for all 5); those later chunks compute one row, not both. Both give their alone tokens."""
  engine = SlotEngine(model, slots=4, cache_len=64, prefill_chunk=8)
  driver = SlotDriver(engine)
  order = []
  short_p = (PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))
  long_p = (list(range(100, 140)), SamplingParams(max_tokens=4, ignore_eos=True))
  try:
    with engine.paused():  # both wait, so they are prefilled together
      short = driver.submit(*short_p, on_delta=lambda d: d is not None and order.append("short"))
      long = driver.submit(*long_p, on_delta=lambda d: d is not None and order.append("long"))
    assert list(short)[-1].finish_reason == "length" and list(long)[-1].finish_reason == "length"
  finally:
    driver.close()
  assert short.prefill_batch == long.prefill_batch == 2 and engine.prefill_calls == 1
  assert engine.prefill_chunks == 5 and engine.prefill_chunk_rows == 2 + 1 + 1 + 1 + 1  # 10 before
  assert order.index("long") >= 2  # the short one's first token and a decode chunk of it came first
  assert short.trace.first_token < long.trace.first_token
  assert short.token_ids == alone(model, short_p[0], **_kw(short_p[1])).token_ids
  assert long.token_ids == alone(model, long_p[0], **_kw(long_p[1])).token_ids

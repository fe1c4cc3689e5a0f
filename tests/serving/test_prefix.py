"""The prefix cache: the trie and its bound on plain arrays, then a slot engine with it on a tiny model, whose
outputs equal those of the same engine without it (greedy and seeded sampling) for a shared prefix, a prefix that
is the whole previous prompt, a prompt shorter than one block and prompts that share nothing; eviction keeps the
bound and a flood of distinct prefixes never holds more than it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny import tiny_engine
from thoughtjax.decode.interface import COMPILE_CLOCK
from thoughtjax.sampling import SamplingParams
from thoughtjax.serving import PrefixCache, PrefixCacheError, SlotDriver, SlotEngine, generate_in_slots

SYSTEM = list(range(10, 50))  # 40 tokens: two full blocks of 16, then 8 more
CACHE_LEN = 128
PREFILL_CHUNK = 32  # prompt tokens per prefill call: a hit is taken when it saves one


# ---- the cache alone ---------------------------------------------------------------------------------------
def _blocks(n: int, fill: float = 0.0) -> list[np.ndarray]:
  return [np.full((4,), fill + j, np.float32) for j in range(n)]  # 16 bytes each


def test_lookup_returns_the_longest_cached_prefix_in_whole_blocks_and_counts():
  cache = PrefixCache(block_tokens=4, max_bytes=1 << 20)
  ids = list(range(12))
  assert cache.lookup(ids, 11) == [] and cache.misses == 1 and cache.first_missing(ids) == 0
  assert cache.add(ids, 0, _blocks(3)) == 3 and cache.blocks == 3 and cache.nbytes == 48
  got = cache.lookup([*ids[:9], 99, 98, 97], 11)  # shares 9 tokens: two whole blocks
  assert [float(a[0]) for a in got] == [0.0, 1.0] and cache.hits == 1 and cache.tokens_reused == 8
  assert len(cache.lookup(ids, 11)) == 2  # the limit (11 tokens) leaves the last block out
  assert len(cache.lookup(ids + [5], 12)) == 3 and cache.peek(ids + [5], 12) == 12
  assert cache.lookup([1, *ids[1:]], 11) == []  # a different first token: nothing, whatever follows
  assert cache.first_missing(ids + [0, 1, 2, 3]) == 3


def test_equal_tokens_after_different_prefixes_are_different_blocks():
  cache = PrefixCache(block_tokens=2, max_bytes=1 << 20)
  cache.add([1, 2, 7, 7], 0, _blocks(2, 0.0))
  cache.add([3, 4, 7, 7], 0, _blocks(2, 10.0))
  assert [float(a[0]) for a in cache.lookup([3, 4, 7, 7, 0], 4)] == [10.0, 11.0]
  assert [float(a[0]) for a in cache.lookup([1, 2, 7, 7, 0], 4)] == [0.0, 1.0]


def test_scopes_never_share_a_block():
  cache = PrefixCache(block_tokens=2, max_bytes=1 << 20)
  ids = [1, 2, 3, 4, 5]
  cache.add(ids, 0, _blocks(2, 0.0), "tenant-a")
  assert cache.lookup(ids, 4) == [] and cache.peek(ids, 4, "tenant-b") == 0  # the shared scope, another tenant
  assert cache.first_missing(ids, "tenant-b") == 0 and cache.first_missing(ids, "tenant-a") == 2
  cache.add(ids, 0, _blocks(2, 10.0))  # the same tokens in the shared scope: blocks of their own
  assert [float(a[0]) for a in cache.lookup(ids, 4, "tenant-a")] == [0.0, 1.0]
  assert [float(a[0]) for a in cache.lookup(ids, 4)] == [10.0, 11.0] and cache.blocks == 4


def test_eviction_takes_the_least_recently_used_leaf_and_keeps_the_bound():
  cache = PrefixCache(block_tokens=2, max_bytes=4 * 16)  # room for four blocks
  shared = [1, 2, 3, 4]
  cache.add([*shared, 5, 6], 0, _blocks(3))  # A: 2 shared blocks + one of its own
  cache.add([*shared, 7, 8], 2, _blocks(1, 20.0))  # B: one block under the shared two
  assert cache.blocks == 4
  cache.lookup([*shared, 5, 6, 0], 6)  # A used: B's block is now the least recent leaf
  cache.add([9, 9], 0, _blocks(1, 30.0))
  assert cache.blocks == 4 and cache.evictions == 1 and cache.nbytes <= cache.max_bytes
  assert len(cache.lookup([*shared, 7, 8, 0], 6)) == 2  # B lost its own block, not the shared ones
  assert len(cache.lookup([*shared, 5, 6, 0], 6)) == 3


def test_a_chain_longer_than_the_bound_is_cut_not_made_to_evict_itself():
  cache = PrefixCache(block_tokens=2, max_bytes=3 * 16)
  assert cache.add(list(range(20)), 0, _blocks(10)) == 3
  assert cache.blocks == 3 and cache.nbytes == 48 and len(cache.lookup(list(range(21)), 20)) == 3


def test_a_flood_of_distinct_prefixes_never_holds_more_than_the_bound():
  """Attack: 2000 distinct prompts of 8 blocks each against room for 50 blocks; after every add the cache holds
  at most its bound, and the most recent prompt is still found whole."""
  cache = PrefixCache(block_tokens=4, max_bytes=50 * 16)
  rng = np.random.default_rng(0)
  for i in range(2000):
    ids = [i, *rng.integers(0, 50_000, 31).tolist()]
    cache.add(ids, cache.first_missing(ids), _blocks(8))
    assert cache.nbytes <= cache.max_bytes and cache.blocks <= 50
  assert len(cache.lookup(ids + [0], 32)) == 8 and cache.evictions >= 2000 * 8 - 50


def test_bad_settings_are_refused_by_name():
  with pytest.raises(PrefixCacheError, match="block_tokens: expected an integer in"):
    PrefixCache(block_tokens=0)
  with pytest.raises(PrefixCacheError, match="max_bytes: expected an integer >= 0"):
    PrefixCache(max_bytes=-1)


# ---- in a slot engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", seed=7, chunk=4)


def _engines(model, max_bytes: int = 1 << 24):
  plain = SlotEngine(model, slots=3, cache_len=CACHE_LEN, prefill_chunk=PREFILL_CHUNK)
  cached = SlotEngine(
    model, slots=3, cache_len=CACHE_LEN, prefix_cache=PrefixCache(16, max_bytes), prefill_chunk=PREFILL_CHUNK
  )
  return plain, cached


def _one_by_one(engine, reqs):
  return [generate_in_slots(engine, [r])[0] for r in reqs]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
CASES = {
  # name: (prompts in order, tokens each reuses)
  "shared system prompt": ([SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6, 7, 8], SYSTEM + list(range(60, 90))], [0, 32, 32]),
  # the third may reuse 16 of its 32 tokens (not the last one's block), which leaves one chunk to prefill all the same
  "whole previous prompt": ([SYSTEM[:32], SYSTEM[:32] + [7, 8, 9], SYSTEM[:32]], [0, 32, 0]),
  "shorter than one block": ([[5, 6, 7], [5, 6, 7, 8], SYSTEM[:15]], [0, 0, 0]),
  "nothing shared": ([SYSTEM, list(range(100, 140)), [3] + SYSTEM], [0, 0, 0]),
  # 60 tokens prefill in two chunks of 32; the 16 cached would leave 44, still two: not worth a call of its own
  "a hit that would not shrink the prefill": ([SYSTEM[:16] + [1] * 10, SYSTEM[:16] + list(range(60, 104))], [0, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_equal_those_without_the_cache(model, case):
  prompts, reused = CASES[case]
  plain, cached = _engines(model)
  want = _one_by_one(plain, [(p, GREEDY) for p in prompts])
  got = _one_by_one(cached, [(p, GREEDY) for p in prompts])
  assert [r.token_ids for r in got] == [r.token_ids for r in want]
  assert [r.text for r in got] == [r.text for r in want]
  assert [r.trace.prefix_cache_tokens for r in got] == reused
  assert [r.trace.prefix_cache_tokens for r in want] == [None] * len(prompts)  # no cache, nothing looked up
  c = cached.prefix_cache
  assert c.hits == sum(n > 0 for n in reused) and c.misses == sum(n == 0 for n in reused)
  assert c.tokens_reused == sum(reused)


def test_seeded_sampling_equals_the_same_engine_without_the_cache(model):
  """Sampled tokens depend on every logit: with the same seeds and the same engine history they are the same."""
  params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (11, 12, 13)]
  reqs = list(zip([SYSTEM + [1, 2], SYSTEM + [3, 4, 5], SYSTEM + [1, 2]], params, strict=True))
  plain, cached = _engines(model)
  want, got = _one_by_one(plain, reqs), _one_by_one(cached, reqs)
  assert [r.token_ids for r in got] == [r.token_ids for r in want]
  assert len({tuple(r.token_ids) for r in want}) == 3  # the seeds drew different tokens: the test can fail
  assert [r.trace.prefix_cache_tokens for r in got] == [0, 32, 32]


def test_the_keys_and_first_token_of_a_reused_prefix_equal_the_whole_prefill(model):
  plain, cached = _engines(model)
  cached.prefill(SYSTEM + [1], GREEDY)  # caches two blocks
  ids = SYSTEM + list(range(200, 230))
  want, got = plain.prefill(ids, GREEDY), cached.prefill(ids, GREEDY)
  assert got.trace.prefix_cache_tokens == 32 and want.trace.prefix_cache_tokens is None
  n = len(ids)
  for (wk, wv), (gk, gv) in zip(want.kv, got.kv, strict=True):
    for w, g in ((wk, gk), (wv, gv)):
      w, g = np.asarray(w)[want.row, :, -n:], np.asarray(g)[got.row, :, -n:]
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  assert int(np.asarray(got.token)[got.row]) == int(np.asarray(want.token)[want.row])


def test_requests_together_split_into_one_call_for_hits_and_one_for_misses(model):
  plain, cached = _engines(model)
  generate_in_slots(cached, [(SYSTEM + [1], GREEDY)])
  reqs = [(SYSTEM + [2, 3], GREEDY), (list(range(100, 130)), GREEDY), (SYSTEM + [9] * 5, GREEDY)]
  calls = cached.prefill_calls
  runs = cached.insert_batch(reqs)
  assert cached.prefill_calls - calls == 2 and [r.prefill_batch for r in runs] == [2, 1, 2]
  while cached.active:
    cached.step()
  want = [r.token_ids for r in generate_in_slots(plain, reqs)]
  assert [r.token_ids for r in runs] == want
  assert [r.trace.prefix_cache_tokens for r in runs] == [32, 0, 32]


def test_warm_also_compiles_the_prefill_after_a_repeated_prompt_s_prefix(model):
  """With a prefix cache, warm() also compiles what a prompt takes when it comes again (its cached blocks written
  into its prefill, the rest prefilled after them), at every batch size, and the insert of its keys: the repeats,
  prefilled together, compile nothing and give the tokens they give without the cache. (Its own layout, 4 slots
  and a 96-token ring, so no other test has compiled these programs in this process.) And the decode chunks of one
  and of all rows compile nothing."""
  prompt = SYSTEM[:35]  # a repeat reuses two blocks (32 tokens): 3 left, one prefill chunk instead of two
  cached = SlotEngine(model, slots=4, cache_len=96, prefix_cache=PrefixCache(16, 1 << 24), prefill_chunk=PREFILL_CHUNK)
  cached.warm()
  with COMPILE_CLOCK.measure() as compiled:
    first = generate_in_slots(cached, [(prompt, GREEDY)])[0]  # a miss: caches the two blocks; one-row chunks
    runs = cached.insert_batch([(prompt, GREEDY)] * 3)  # hits, prefilled together: batch bucket 4
    while cached.active:
      cached.step()  # three slots in use: chunks of all four rows
  assert [r.trace.prefix_cache_tokens for r in runs] == [32] * 3 and [r.prefill_batch for r in runs] == [3] * 3
  assert [first.trace.compile_s] + [r.trace.compile_s for r in runs] == [0.0] * 4
  assert compiled.seconds == 0.0  # nor did a decode chunk, a block cut or a transfer
  plain = SlotEngine(model, slots=4, cache_len=96, prefill_chunk=PREFILL_CHUNK)
  want = generate_in_slots(plain, [(prompt, GREEDY)])[0].token_ids
  assert first.token_ids == want and [r.token_ids for r in runs] == [want] * 3


def test_the_driver_groups_waiting_requests_by_the_program_they_need(model):
  _, cached = _engines(model)
  driver = SlotDriver(cached)
  try:
    first = driver.submit(SYSTEM + [1], GREEDY)
    list(first)
    runs = [driver.submit(SYSTEM + [k, k + 1], GREEDY) for k in (3, 5, 7)]
    for r in runs:
      list(r)
  finally:
    driver.close()
  for r, k in zip(runs, (3, 5, 7), strict=True):
    assert r.trace.prefix_cache_tokens == 32
    assert r.token_ids == model.generate(SYSTEM + [k, k + 1], max_tokens=12, ignore_eos=True).token_ids


def test_eviction_under_a_small_bound_keeps_outputs_exact(model):
  """Room for three blocks: prompts of two blocks each evict one another; every output is still the plain one."""
  block = len([i for i in model.layers if i >= 0]) * 2 * model.config.num_kv_heads * 16 * model.config.head_dim * 4
  plain, cached = _engines(model, max_bytes=3 * block)
  prompts = [[k] + SYSTEM[1:33] for k in (1, 2, 3, 1, 2)]  # 33 tokens: two full blocks each
  want = _one_by_one(plain, [(p, GREEDY) for p in prompts])
  got = _one_by_one(cached, [(p, GREEDY) for p in prompts])
  assert [r.token_ids for r in got] == [r.token_ids for r in want]
  c = cached.prefix_cache
  assert c.evictions > 0 and c.nbytes <= c.max_bytes and c.blocks <= 3
  assert [r.trace.prefix_cache_tokens for r in got] == [0, 0, 0, 0, 0]  # each was evicted before it came back


def test_a_flood_of_distinct_prompts_keeps_the_engine_s_cache_bounded_and_it_still_serves(model):
  """Attack: 40 distinct 48-token prompts through an engine with room for four blocks; the cache never holds
  more, and a request afterwards still gets the plain engine's tokens."""
  block = len([i for i in model.layers if i >= 0]) * 2 * model.config.num_kv_heads * 16 * model.config.head_dim * 4
  plain, cached = _engines(model, max_bytes=4 * block)
  rng = np.random.default_rng(1)
  params = SamplingParams(max_tokens=2, ignore_eos=True)
  for _ in range(40):
    generate_in_slots(cached, [(rng.integers(1, 250, 48).tolist(), params)])
    assert cached.prefix_cache.nbytes <= 4 * block and cached.prefix_cache.blocks <= 4
  ids = SYSTEM + [7]
  assert (
    generate_in_slots(cached, [(ids, GREEDY)])[0].token_ids == generate_in_slots(plain, [(ids, GREEDY)])[0].token_ids
  )


def test_a_constrained_request_on_a_reused_prefix_gets_its_alone_tokens(model):
  """The grammar mask of the first token is applied in the program that prefills only the rest."""
  _, cached = _engines(model)
  generate_in_slots(cached, [(SYSTEM + [1], GREEDY)])
  ids, params = SYSTEM + [2, 3], SamplingParams(max_tokens=12, regex=r"(ab|ba)[a-c]{1,4}x")
  run = generate_in_slots(cached, [(ids, params)])[0]
  assert run.trace.prefix_cache_tokens == 32
  assert run.token_ids == model.stream_batch([ids], params).result().token_ids


@pytest.mark.slow
def test_the_default_model_with_a_shared_system_prompt_gives_the_tokens_it_gives_without(default_model):
  """The real model (30 layers, 3 KV heads), chat prompts sharing a system prompt: greedy tokens with the cache
  equal those without, and the later prompts reuse the system prompt's blocks."""
  system = "You are a helpful assistant for a library. Answer briefly and politely, and cite the shelf number."
  questions = ["Where are the atlases?", "Can I renew a book online?", "Where are the atlases?"]
  ids = [default_model.prompt_ids(q, chat=True, system=system) for q in questions]
  params = SamplingParams(max_tokens=12)
  # Prefill chunks of one block: every block reused saves a chunk.
  plain = SlotEngine(default_model, slots=2, cache_len=128, prefill_chunk=16)
  cached = SlotEngine(default_model, slots=2, cache_len=128, prefix_cache=PrefixCache(16), prefill_chunk=16)
  want = _one_by_one(plain, [(i, params) for i in ids])
  got = _one_by_one(cached, [(i, params) for i in ids])
  assert [r.token_ids for r in got] == [r.token_ids for r in want]
  assert got[0].trace.prefix_cache_tokens == 0 and all(r.trace.prefix_cache_tokens >= 16 for r in got[1:])

"""The engine pool (thoughtjax/serving/pool.py): engines per path and ring length, requests join the busiest
engine that fits, and the eviction case: an engine handed to a request that has not submitted yet is never
evicted for another path; that path is refused by name, and the first request still gets its tokens."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_engine
from thoughtjax.sampling import SamplingParams
from thoughtjax.serving.pool import EnginePool, PoolFull


@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", seed=3, chunk=4)


def test_a_path_decodes_in_its_longest_ring_and_a_superseded_engine_closes_once_drained(model):
  """A short request gets a 64-token ring; a long one makes a 256-token ring, which from then on takes every
  request of the path, short ones too (one batch, not two engines stepping in turn). The 64-token engine finishes
  what it holds and is closed once its last lease is given back; nothing else is evicted."""
  pool = EnginePool(2, max_engines=4, cache_len=64)
  try:
    short = pool.lease(model, 20)
    assert short.engine.cache_len == 64 and pool.lease(model, 60) is short  # fits: no second engine
    long = pool.lease(model, 200)
    assert long.engine.cache_len == 256 and short.alive  # short still holds two leases
    assert pool.lease(model, 20) is long and pool.lease(model, 100) is long and pool.stats()["engines"] == 2
    pool.give_back(short)
    assert short.alive and pool.stats()["engines"] == 2  # one lease left on it
    pool.give_back(short)
    assert not short.alive and pool.drivers() == [long] and pool.stats()["engine_evictions"] == 0
    assert pool.lease(model, 20) is long
  finally:
    pool.close()


def test_an_engine_handed_out_before_its_request_submits_is_not_evicted_for_another_path(model):
  """Attack: one engine allowed, two paths. Request A is handed its engine and has not submitted yet when
  request B arrives on another path: B is refused with PoolFull (nothing evicted), A then submits and gets its
  alone tokens with no error. Once A's slot is free and its lease given back, B's path evicts the idle engine."""
  other = model.with_path((0, 2, 1))
  params = SamplingParams(max_tokens=8, ignore_eos=True)
  ids = [5, 6, 7, 8]
  pool = EnginePool(2, max_engines=1)
  try:
    a = pool.lease(model, len(ids) + params.max_tokens)
    with pytest.raises(PoolFull, match="none is idle; retry with backoff"):
      pool.lease(other, len(ids) + params.max_tokens)
    assert pool.drivers() == [a] and a.alive and pool.stats()["engine_evictions"] == 0
    run = a.submit(ids, params)
    assert [t for d in run for t in d.token_ids] == model.generate(ids, **_kw(params)).token_ids
    assert run.error is None and run.freed.wait(30)
    pool.give_back(a)
    b = pool.lease(other, len(ids) + params.max_tokens)
    assert b is not a and not a.alive and pool.drivers() == [b] and pool.stats()["engine_evictions"] == 1
    got = b.submit(ids, params)
    assert [t for d in got for t in d.token_ids] == other.generate(ids, **_kw(params)).token_ids
    pool.give_back(b)
  finally:
    pool.close()
  with pytest.raises(PoolFull, match="closed"):
    pool.lease(model, 8)


def _kw(p: SamplingParams) -> dict:
  return {"max_tokens": p.max_tokens, "ignore_eos": p.ignore_eos}


def test_a_reserved_request_counts_in_the_occupancy_of_the_engine_it_will_join(model):
  """A request planned onto a path counts in the pool's occupancy from its reservation: in the engine of its path it
  will join (the longest ring, when it holds it), or as an engine of its own (not stepped yet) when none does, which
  the path's shorter requests planned meanwhile join too; releasing takes it back out, once however often it is
  released."""
  pool = EnginePool(4, max_engines=2, cache_len=64)
  h = model.path_hash
  try:
    driver = pool.lease(model, 20)
    assert pool.occupancy() == [(h, 0, 64, None)]
    joins = pool.reserve(h, 30)
    assert pool.occupancy() == [(h, 1, 64, None)]
    own = pool.reserve(h, 200)  # no engine of this path holds 200 tokens
    also = pool.reserve(h, 100)  # joins the 256-token ring the reservation before it will make, and so does 30
    assert sorted(pool.occupancy(), key=lambda e: e[2]) == [(h, 0, 64, None), (h, 3, 256, None)]
    for r in (joins, own, also, joins):
      r.release()
    assert pool.occupancy() == [(h, 0, 64, None)] and joins.released
    pool.give_back(driver)
  finally:
    pool.close()

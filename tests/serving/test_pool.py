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


def test_engines_per_ring_length_and_requests_join_the_busiest_engine_that_fits(model):
  """A short request gets a 64-token ring, a long one a 256-token ring; a request joins the engine that fits it
  with the most leases on it (ties: the smallest ring) instead of making its own."""
  pool = EnginePool(2, max_engines=2)
  try:
    short, long = pool.lease(model, 20), pool.lease(model, 200)
    assert (short.engine.cache_len, long.engine.cache_len) == (64, 256)
    assert pool.lease(model, 60) is short and pool.leases(short) == 2
    assert pool.lease(model, 100) is long and pool.stats()["engines"] == 2  # no 128-token ring made
    pool.give_back(short)
    pool.give_back(short)  # the short requests ended: the long engine is the busier one that fits
    assert pool.lease(model, 20) is long and pool.stats()["engines"] == 2
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
  """A request planned onto a path counts in the pool's occupancy from its reservation: in the busiest engine of
  its path whose ring holds it, or as an engine of its own (not stepped yet) when none does; releasing takes it
  back out, once however often it is released."""
  pool = EnginePool(4, max_engines=2)
  h = model.path_hash
  try:
    driver = pool.lease(model, 20)
    assert pool.occupancy() == [(h, 0, 64, None)]
    joins = pool.reserve(h, 30)
    own = pool.reserve(h, 200)  # no engine of this path holds 200 tokens
    also = pool.reserve(h, 100)  # fits the 256-token ring the reservation before it will make
    assert sorted(pool.occupancy(), key=lambda e: e[2]) == [(h, 1, 64, None), (h, 2, 256, None)]
    for r in (joins, own, also, joins):
      r.release()
    assert pool.occupancy() == [(h, 0, 64, None)] and joins.released
    pool.give_back(driver)
  finally:
    pool.close()

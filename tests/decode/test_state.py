"""The decode state and the one decode step every pool runs: recording, stopping, the ring's positions and the
bound that keeps a plain program's ring from wrapping, on a stand-in path that needs no model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from thoughtjax.decode import state as state_lib
from thoughtjax.sampling import SamplingMode, SamplingParams, sampling_arrays

V = 64


def _samp(*params: SamplingParams):
  return sampling_arrays(list(params), len(params), V, 2, None, False)


def _echo_position(tokens, positions, caches, write_at, mask):
  """A stand-in path whose greedy next token is the query's RoPE position + 10; it writes nothing but checks the
  mask lets each query see the slot it writes."""
  assert mask.shape[:2] == tokens.shape
  logits = jnp.where(jnp.arange(V)[None, None, :] == positions[..., None] + 10, 1.0, 0.0)
  return logits, caches


def test_record_writes_each_live_rows_token_at_its_count_and_stops_it_at_max_new_or_a_stop_id():
  samp = _samp(SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, stop_token_ids=[7]))
  st = state_lib.empty((), 2, 3, free=False)
  st = state_lib.record(st, jnp.array([4, 5]), jnp.array([False, False]), samp, jnp.array([True, True]))
  st = state_lib.record(st, jnp.array([6, 7]), jnp.array([False, True]), samp, ~st.done)
  np.testing.assert_array_equal(st.out, [[4, 6, -1], [5, 7, -1]])
  np.testing.assert_array_equal(st.count, [2, 2])
  np.testing.assert_array_equal(st.done, [True, True])  # row 0 at its max_new, row 1 on its stop id
  before = st
  st = state_lib.record(st, jnp.array([8, 9]), jnp.array([False, False]), samp, ~st.done)  # no row live
  for a, b in zip(st, before, strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_free_slot_records_nothing_and_a_full_history_drops_the_extra_token():
  samp = _samp(SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True))
  st = state_lib.empty((), 2, 1, free=True)
  assert bool(st.done.all())
  st = state_lib.record(
    st._replace(done=jnp.array([False, True])),
    jnp.array([3, 3]),
    jnp.array([False] * 2),
    samp,
    jnp.array([True, False]),
  )
  st = state_lib.record(st, jnp.array([4, 4]), jnp.array([False] * 2), samp, jnp.array([True, False]))
  np.testing.assert_array_equal(st.out, [[3], [-1]])  # width 1: row 0's second token has no column
  np.testing.assert_array_equal(st.count, [2, 0])


def test_the_decode_step_takes_ring_positions_from_each_rows_start_and_stops_at_the_limit():
  samp = _samp(SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True))
  st = state_lib.empty((), 2, 8, free=False)
  # As after a prefill of T = 6 with row 1 padded by 2: the cursor at 6, one token out each.
  st = st._replace(start=jnp.array([0, 2]), cursor=jnp.int32(6), count=jnp.array([1, 1]), out=st.out.at[:, 0].set(1))
  st, steps = state_lib.decode_chunk(
    _echo_position, st, samp, jnp.array([True, True]), SamplingMode.GREEDY, None, steps=8, ring=16, limit=9
  )
  assert int(steps) == 3 and int(st.cursor) == 9  # writes at 6, 7, 8; 9 is the limit
  np.testing.assert_array_equal(st.out[:, :4], [[1, 16, 17, 18], [1, 14, 15, 16]])
  np.testing.assert_array_equal(st.count, [4, 4])
  assert not bool(st.done.any())


def test_the_decode_step_runs_only_active_rows_and_ends_when_none_runs():
  samp = _samp(SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True))
  st = state_lib.empty((), 2, 4, free=False)._replace(cursor=jnp.int32(4), count=jnp.array([1, 1]))
  st, steps = state_lib.decode_chunk(
    _echo_position, st, samp, jnp.array([True, False]), SamplingMode.GREEDY, None, steps=8, ring=8
  )
  assert int(steps) == 2  # row 0 reaches its 3 tokens; row 1 is not active
  np.testing.assert_array_equal(st.count, [3, 1])
  np.testing.assert_array_equal(st.done, [True, False])
  np.testing.assert_array_equal(st.out[0, 1:3], [14, 15])

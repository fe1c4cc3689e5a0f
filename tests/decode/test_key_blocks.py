"""A ring decode step that reads its caches by blocks (thoughtjax/decode/indexed.py ``run_blocks(by_blocks=True)``,
thoughtjax/transformer.py ``key_blocks``): the outputs and caches of reading the whole caches, under every pair
budget and the whole-cache fallback, and no read of a block its rows' masks leave out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import tiny_model
from thoughtjax.decode import indexed, layout
from thoughtjax.transformer import GraphDefs, PathParts, blocks_needed, key_blocks, rope_tables

ROWS, RING = 4, 64  # 16 blocks of 4 slots per row; budgets 8, 16 and 32 of the 64 pairs
CURSOR = 2 * RING + 5  # the ring has wrapped: a row's keys may straddle its end


def step(by_blocks: bool, caches, start):
  cfg, model = tiny_model("llama_gqa", seed=7)
  parts = PathParts.from_model(model, range(cfg.num_layers))
  stacked = indexed.stack(parts)
  sp = indexed.stacked_parts(parts, stacked, range(cfg.num_layers), cfg.num_layers)
  positions, mask, w = layout.ring_step(jnp.int32(CURSOR), start, RING)
  x = jax.random.normal(jax.random.key(1), (ROWS, 1, cfg.d_model))
  cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
  run = jax.jit(
    lambda c: indexed.run_blocks(
      GraphDefs.from_model(model), sp, x, cos, sin, c, w, mask, reads="blocks" if by_blocks else "all"
    )
  )
  return run(caches), mask


def ring_caches(fill=None):
  cfg, _ = tiny_model("llama_gqa", seed=7)
  shape = (cfg.num_layers, ROWS, cfg.num_kv_heads, RING, cfg.head_dim)
  keys, values = (np.asarray(jax.random.normal(jax.random.key(i), shape)) for i in (2, 3))
  return keys, values


@pytest.mark.parametrize(
  "spans",
  [
    (3, 5, 0, 1),  # a free row (nothing before the cursor) among short ones: the smallest budget
    (9, 14, 2, 20),
    (30, 40, 4, 17),
    (63, 64, 60, 50),  # more than half of all pairs: the whole caches
  ],
)
def test_reading_by_blocks_gives_what_reading_everything_gives_and_skips_what_no_row_sees(spans):
  start = jnp.asarray([CURSOR - s for s in spans], jnp.int32)
  keys, values = ring_caches()
  (want_x, ((want_k, want_v),)), mask = step(False, ((jnp.asarray(keys), jnp.asarray(values)),), start)
  written = CURSOR % RING
  reads = np.asarray(mask)[:, 0] & (np.arange(RING) != written)
  needed = reads.reshape(ROWS, 16, 4).any(-1)
  budgets = indexed.pair_budgets(ROWS, RING)
  assert budgets == (8, 16, 32) and int(blocks_needed(jnp.asarray(reads[:, None]), 16)) == needed.sum()
  if needed.sum() <= budgets[-1]:  # blocks no row reads hold NaN, which any read of them would spread
    hidden = (
      np.repeat(~needed, 4, axis=1)[None, :, None, :, None] & (np.arange(RING) != written)[None, None, None, :, None]
    )
    keys, values = np.where(hidden, np.nan, keys), np.where(hidden, np.nan, values)
  (got_x, ((got_k, got_v),)), _ = step(True, ((jnp.asarray(keys), jnp.asarray(values)),), start)
  np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-5)
  at = (slice(None), slice(None), slice(None), written)  # the step's new keys, the same either way
  np.testing.assert_allclose(np.asarray(got_k)[at], np.asarray(want_k)[at], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_v)[at], np.asarray(want_v)[at], rtol=1e-5, atol=1e-5)


def test_key_blocks_lists_the_pairs_a_mask_allows_in_order_and_pads_with_pairs_that_allow_nothing():
  mask = np.zeros((3, 1, 16), bool)
  mask[0, 0, [1, 9]] = True  # row 0: blocks 0 and 2 (of 4 slots)
  mask[2, 0, 15] = True  # row 1 sees nothing; row 2: block 3
  plan = key_blocks(jnp.asarray(mask), 4, 5)
  assert plan.rows.tolist() == [0, 0, 2, 0, 0] and plan.blocks.tolist() == [0, 2, 3, 0, 0]
  assert np.asarray(plan.allowed).tolist() == [
    [False, True, False, False],
    [False, True, False, False],
    [False, False, False, True],
    [False] * 4,
    [False] * 4,
  ]
  assert int(blocks_needed(jnp.asarray(mask), 4)) == 3
  assert indexed.pair_budgets(16, 512) == (32, 64, 128) and indexed.pair_budgets(1, 512) == (2, 4, 8)
  assert indexed.pair_budgets(4, 32) == ()  # too short a ring to read by blocks


@pytest.mark.parametrize(("at", "window"), [(0, 8), (4, 16), (12, 32), (40, RING)])
def test_a_prefill_chunk_reads_the_slots_before_its_end_only(at, window):
  """A chunk of 8 prompt tokens at slots [at, at + 8) reads the smallest window of leading slots that holds them:
  slots past it hold NaN, which any read of them would spread."""
  cfg, model = tiny_model("llama_gqa", seed=7)
  parts = PathParts.from_model(model, range(cfg.num_layers))
  sp = indexed.stacked_parts(parts, indexed.stack(parts), range(cfg.num_layers), cfg.num_layers)
  T = 8
  assert indexed.prefix_windows(T, RING) == (8, 16, 32)
  slots = jnp.broadcast_to(at + jnp.arange(T, dtype=jnp.int32)[None, :], (ROWS, T))
  positions, mask = layout.steps_at(jnp.zeros(ROWS, jnp.int32), slots, RING)
  x = jax.random.normal(jax.random.key(1), (ROWS, T, cfg.d_model))
  cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
  keys, values = ring_caches()

  def run(reads, k, v):
    f = jax.jit(
      lambda c: indexed.run_blocks(GraphDefs.from_model(model), sp, x, cos, sin, c, jnp.int32(at), mask, reads=reads)
    )
    return f(((jnp.asarray(k), jnp.asarray(v)),))

  want_x, ((want_k, want_v),) = run("all", keys, values)
  past = (np.arange(RING) >= window)[None, None, None, :, None]
  got_x, ((got_k, got_v),) = run("prefix", np.where(past, np.nan, keys), np.where(past, np.nan, values))
  np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-5, atol=1e-5)
  new = (slice(None), slice(None), slice(None), slice(at, at + T))
  np.testing.assert_allclose(np.asarray(got_k)[new], np.asarray(want_k)[new], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_v)[new], np.asarray(want_v)[new], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="reads is one of all, blocks, prefix; got 'some'"):
    indexed.run_blocks(
      GraphDefs.from_model(model), sp, x, cos, sin, ((keys, values),), jnp.int32(at), mask, reads="some"
    )

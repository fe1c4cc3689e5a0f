"""The attention layout (thoughtjax/decode/layout.py): each mask and position table against its definition
written as loops, and the layouts against each other through a tiny model (a left-padded prefill and the
decode steps after it give the logits of a causal pass over the unpadded tokens; a ring does too)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import TINY_CONFIGS, tiny_model
from thoughtjax.decode import layout
from thoughtjax.transformer import kv_cache_shape

PAD = np.array([0, 2, 5], np.int32)


def test_prefill_mask_and_positions_follow_their_definition():
  T, S = 6, 9
  positions, mask = map(np.asarray, layout.prefill(jnp.asarray(PAD), T, S))
  assert mask.shape == (3, T, S) and positions.shape == (3, T)
  for b, p in enumerate(PAD):
    for t in range(T):
      assert positions[b, t] == max(t - p, 0)
      want = [(p <= s <= t) or s == t for s in range(S)]  # a padding query sees itself only
      assert mask[b, t].tolist() == want, (b, t)


def test_steps_at_and_step_at_follow_their_definition():
  S = 12
  slots = np.array([[6, 7, 8], [6, 7, 8], [9, 10, 11]], np.int32)
  positions, mask = map(np.asarray, layout.steps_at(jnp.asarray(PAD), jnp.asarray(slots), S))
  for b, p in enumerate(PAD):
    for j, q in enumerate(slots[b]):
      assert positions[b, j] == q - p
      assert mask[b, j].tolist() == [p <= s <= q for s in range(S)]
  # One slot for every row (plain decoding) is the one-column case of the per-row form (speculation).
  one_pos, one_mask = layout.step_at(jnp.asarray(PAD), jnp.int32(7), S)
  per_pos, per_mask = layout.steps_at(jnp.asarray(PAD), jnp.full((3, 1), 7, jnp.int32), S)
  np.testing.assert_array_equal(one_pos, per_pos)
  np.testing.assert_array_equal(one_mask, per_mask)


def test_ring_step_sees_what_each_row_wrote_since_it_started():
  S = 5
  start = np.array([3, 0, 9], np.int32)  # row 2 has not started: a free row
  for cursor in (4, 7, 8):
    positions, mask, w = layout.ring_step(jnp.int32(cursor), jnp.asarray(start), S)
    assert int(w) == cursor % S
    behind = np.asarray(layout.ring_behind(jnp.int32(cursor), S))
    for b, st in enumerate(start):
      assert positions[b, 0] == max(cursor - st, 0)
      # Ring index i holds absolute time cursor - behind[i] (the index the cursor writes holds the cursor).
      held = [cursor - (behind[i] or 0) for i in range(S)]
      want = [held[i] >= st or i == cursor % S for i in range(S)]
      assert np.asarray(mask)[b, 0].tolist() == want, (cursor, b)


def test_empty_caches_give_bridges_a_placeholder():
  cfg = TINY_CONFIGS["llama_gqa"]
  caches = layout.empty_caches(cfg, (0, -1, 1), 2, 7)
  assert [k.shape for k, _ in caches] == [kv_cache_shape(cfg, 2, 7), (2, 1, 1, 1), kv_cache_shape(cfg, 2, 7)]
  assert all(not np.asarray(k).any() and not np.asarray(v).any() for k, v in caches)
  assert [k.shape for k, _ in layout.empty_caches(None, (-1, -2), 3, 7)] == [(3, 1, 1, 1)] * 2


@pytest.fixture(scope="module")
def model():
  return tiny_model("llama_gqa", seed=1)[1]


def _causal_logits(model, ids):
  positions, mask = layout.causal(1, len(ids))
  caches = layout.empty_caches(model.cfg, model.full_path(), 1, len(ids))
  return np.asarray(model.forward(jnp.asarray([ids], jnp.int32), positions, caches, jnp.int32(0), mask)[0])[0]


def test_left_padded_prefill_and_steps_give_the_causal_logits(model):
  """Rows of different lengths, left-padded, then two decode steps: every row's logits are those of a causal
  pass over its own tokens alone."""
  rows = [[5, 9, 2, 7, 1], [3, 4], [8, 6, 6]]
  more = [[11, 12], [13, 14], [15, 16]]
  T, S = 5, 7
  pad = np.array([T - len(r) for r in rows], np.int32)
  tokens = np.zeros((3, T), np.int32)
  for b, r in enumerate(rows):
    tokens[b, pad[b] :] = r
  caches = layout.empty_caches(model.cfg, model.full_path(), 3, S)
  positions, mask = layout.prefill(jnp.asarray(pad), T, S)
  logits, caches = model.forward(jnp.asarray(tokens), positions, caches, jnp.int32(0), mask)
  got = [np.asarray(logits)[:, -1]]
  for j in range(2):
    positions, mask = layout.step_at(jnp.asarray(pad), jnp.int32(T + j), S)
    step = jnp.asarray([[m[j]] for m in more], jnp.int32)
    logits, caches = model.forward(step, positions, caches, jnp.int32(T + j), mask)
    got.append(np.asarray(logits)[:, -1])
  for b, r in enumerate(rows):
    want = _causal_logits(model, r + more[b])
    for j in range(3):
      np.testing.assert_allclose(got[j][b], want[len(r) - 1 + j], rtol=1e-5, atol=1e-5)


def test_a_ring_gives_the_causal_logits_of_each_rows_own_tokens(model):
  """Two rows start at different times in a ring shorter than the run (the second row's keys wrap around it);
  each row's logits are those of a causal pass over its tokens alone."""
  S = 4
  feed = {0: [4, 8, 15, 16], 1: [42, 7, 9, 23]}
  start = np.array([0, 3], np.int32)
  caches = layout.empty_caches(model.cfg, model.full_path(), 2, S)
  got: dict[int, list[np.ndarray]] = {0: [], 1: []}
  for cursor in range(7):
    positions, mask, w = layout.ring_step(jnp.int32(cursor), jnp.asarray(start), S)
    live = [0 <= cursor - start[b] < len(feed[b]) for b in range(2)]
    tok = [feed[b][cursor - start[b]] if live[b] else 0 for b in range(2)]
    logits, caches = model.forward(jnp.asarray(tok, jnp.int32)[:, None], positions, caches, w, mask)
    for b in range(2):
      if live[b]:
        got[b].append(np.asarray(logits)[b, -1])
  for b in range(2):
    want = _causal_logits(model, feed[b][: len(got[b])])
    np.testing.assert_allclose(np.stack(got[b]), want, rtol=1e-5, atol=1e-5)

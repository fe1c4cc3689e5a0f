"""template_embed: kernel and reference against a layout built row by row in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thoughtjax.kernels.template_embed import template_embed, template_embed_reference


def expected_layout(prefix, suffix, table, ids, lengths, total_len, left_pad):
  """The documented layout, one row at a time."""
  prefix, suffix, table = (np.asarray(x, np.float32) for x in (prefix, suffix, table))
  ids, lengths = np.asarray(ids), np.asarray(lengths)
  out = np.zeros((ids.shape[0], total_len, table.shape[1]), np.float32)
  for b in range(ids.shape[0]):
    length = int(np.clip(lengths[b], 0, ids.shape[1]))
    user = table[np.clip(ids[b, :length], 0, table.shape[0] - 1)]
    content = np.concatenate([prefix, user, suffix])
    start = total_len - len(content) if left_pad else 0
    out[b, start : start + len(content)] = content
  return out


def make_inputs(rng, *, num_rows=4, prefix_len=3, suffix_len=2, max_user=7, vocab=50, dim=40, dtype=jnp.float32):
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return (
    normal(prefix_len, dim),
    normal(suffix_len, dim),
    normal(vocab, dim),
    jnp.asarray(rng.integers(0, vocab, (num_rows, max_user)), jnp.int32),
  )


def run_both(prefix, suffix, table, ids, lengths, *, total_len, left_pad=False, **blocks):
  kernel = jax.jit(
    lambda *a: template_embed(*a, total_len=total_len, left_pad=left_pad, implementation="pallas", **blocks)
  )(prefix, suffix, table, ids, lengths)
  reference = template_embed_reference(prefix, suffix, table, ids, lengths, total_len=total_len, left_pad=left_pad)
  assert kernel.dtype == reference.dtype and kernel.shape == reference.shape
  np.testing.assert_array_equal(np.asarray(kernel, np.float32), np.asarray(reference, np.float32))
  want = expected_layout(prefix, suffix, table, ids, lengths, total_len, left_pad)
  np.testing.assert_array_equal(np.asarray(kernel, np.float32), want)
  return kernel


@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layout_with_lengths_zero_to_full(rng, left_pad, dtype):
  prefix, suffix, table, ids = make_inputs(rng, dtype=dtype)
  lengths = jnp.asarray([0, 3, 7, 1], jnp.int32)  # 0 and U = 7 included
  # T = 17 is not a multiple of block_t, D = 40 not of block_d.
  out = run_both(prefix, suffix, table, ids, lengths, total_len=17, left_pad=left_pad, block_t=4, block_d=16)
  assert out.dtype == dtype


def test_exact_fit_and_default_blocks(rng):
  prefix, suffix, table, ids = make_inputs(rng, num_rows=3, dim=64)
  run_both(prefix, suffix, table, ids, jnp.asarray([7, 7, 0], jnp.int32), total_len=12)


@pytest.mark.parametrize("prefix_len, suffix_len, max_user", [(0, 2, 5), (3, 0, 5), (0, 0, 5), (2, 3, 0)])
def test_empty_parts(rng, prefix_len, suffix_len, max_user):
  prefix, suffix, table, ids = make_inputs(rng, prefix_len=prefix_len, suffix_len=suffix_len, max_user=max_user)
  lengths = jnp.asarray([0, max_user, max_user // 2, 1], jnp.int32)
  for left_pad in (False, True):
    run_both(prefix, suffix, table, ids, lengths, total_len=12, left_pad=left_pad, block_t=8, block_d=32)


def test_out_of_range_ids_and_lengths_are_clamped(rng):
  prefix, suffix, table, _ = make_inputs(rng, vocab=20)
  ids = jnp.asarray([[-5, 0, 19, 20, 1000, 3, 4]] * 4, jnp.int32)
  lengths = jnp.asarray([-2, 9, 7, 5], jnp.int32)
  out = run_both(prefix, suffix, table, ids, lengths, total_len=14, block_t=8, block_d=64)
  np.testing.assert_array_equal(out[1, 3:10], table[jnp.clip(ids[0], 0, 19)])
  np.testing.assert_array_equal(out[0, 3:5], suffix)  # length -2 counts as 0


def test_lengths_traced_under_jit(rng):
  prefix, suffix, table, ids = make_inputs(rng)
  f = jax.jit(
    lambda lengths: template_embed(
      prefix, suffix, table, ids, lengths, total_len=16, implementation="pallas", block_t=8, block_d=64
    )
  )
  for lengths in ([1, 2, 3, 4], [7, 0, 7, 0]):
    lengths = jnp.asarray(lengths, jnp.int32)
    want = expected_layout(prefix, suffix, table, ids, lengths, 16, False)
    np.testing.assert_array_equal(f(lengths), want)


def test_mixed_dtypes_promote(rng):
  prefix, suffix, table, ids = make_inputs(rng)
  out = run_both(
    prefix.astype(jnp.bfloat16),
    suffix,
    table.astype(jnp.bfloat16),
    ids,
    jnp.asarray([1, 2, 3, 4], jnp.int32),
    total_len=12,
    block_t=8,
    block_d=64,
  )
  assert out.dtype == jnp.float32


def test_model_sized_rows(rng):
  """D = 576 (SmolLM2) with the default blocks, a real chat-template shape."""
  prefix, suffix, table, ids = make_inputs(
    rng, num_rows=2, prefix_len=11, suffix_len=5, max_user=40, vocab=1000, dim=576
  )
  run_both(prefix, suffix, table, ids, jnp.asarray([40, 13], jnp.int32), total_len=64, left_pad=True)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(total_len=11), "total_len must be a static int >= P1 \\+ U \\+ P2"),
    (dict(prefix=np.zeros((3, 41))), "prefix_rows must be \\[P, D\\] with D=40"),
    (dict(table=np.zeros(40)), "table must be \\[V, D\\]"),
    (dict(ids=np.zeros((4, 7), np.float32)), "user_ids must be \\[B, U\\] integers"),
    (dict(lengths=np.zeros(3, np.int32)), "user_lengths must be \\[B\\]=\\[4\\]"),
    (dict(implementation="pallas", block_d=24), "block_d must be a power of two"),
  ],
)
def test_errors_name_the_argument(rng, change, message):
  prefix, suffix, table, ids = make_inputs(rng)
  args = dict(prefix=prefix, suffix=suffix, table=table, ids=ids, lengths=jnp.zeros(4, jnp.int32), total_len=12)
  args.update(change)
  with pytest.raises(ValueError, match=message):
    template_embed(
      args.pop("prefix"), args.pop("suffix"), args.pop("table"), args.pop("ids"), args.pop("lengths"), **args
    )

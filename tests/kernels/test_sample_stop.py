"""sample_stop: the Pallas kernel against the jnp reference and against first principles.

Shapes stay small (interpret mode runs the kernel as XLA loops on CPU) and the
kernel uses small vocabulary blocks so that several blocks and a ragged last block
are exercised; cases use the real vocabulary size with the default block, with and
without an allowed-token mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thoughtjax.errors import UserError
from thoughtjax.kernels.sample_stop import (
  AllowedMaskError,
  mask_words,
  pack_allowed,
  sample_stop,
  sample_stop_reference,
  unpack_allowed,
)

scipy_stats = pytest.importorskip("scipy.stats")


@functools.cache
def _compiled(implementation: str, block_v: int | None):
  def run(logits, temperature, top_k, seed, step, stop_ids, logit_bias, allowed):
    return sample_stop(
      logits,
      temperature=temperature,
      top_k=top_k,
      seed=seed,
      step=step,
      stop_ids=stop_ids,
      logit_bias=logit_bias,
      allowed=allowed,
      implementation=implementation,
      block_v=block_v,
    )

  return jax.jit(run)


def run(
  implementation,
  logits,
  *,
  temperature,
  top_k=0,
  seed=0,
  step=0,
  stop_ids=None,
  logit_bias=None,
  allowed=None,
  block_v=64,
):
  """Calls sample_stop under jit with per-row arguments broadcast to [B]; ``allowed`` is packed words."""
  num_rows = logits.shape[0]
  per_row = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (num_rows,))
  if stop_ids is None:
    stop_ids = jnp.full((num_rows, 0), -1, jnp.int32)
  tokens, stop = _compiled(implementation, block_v if implementation == "pallas" else None)(
    logits,
    per_row(temperature, jnp.float32),
    per_row(top_k, jnp.int32),
    per_row(seed, jnp.uint32),
    jnp.int32(step),
    jnp.asarray(stop_ids, jnp.int32),
    logit_bias,
    None if allowed is None else jnp.asarray(allowed),
  )
  return np.asarray(tokens), np.asarray(stop)


def run_both(logits, **kwargs):
  """Kernel and reference results; asserts they are identical."""
  kernel = run("pallas", logits, **kwargs)
  reference = run("xla", logits, **kwargs)
  np.testing.assert_array_equal(kernel[0], reference[0], err_msg="tokens differ")
  np.testing.assert_array_equal(kernel[1], reference[1], err_msg="stop flags differ")
  return kernel


def random_logits(rng, num_rows, vocab, dtype=jnp.float32, scale=3.0):
  return jnp.asarray(rng.normal(size=(num_rows, vocab)) * scale, dtype)


# ------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize(
  "num_rows, vocab, dtype",
  [(1, 100, jnp.float32), (3, 300, jnp.bfloat16), (64, 257, jnp.float32), (5, 64, jnp.bfloat16)],
)
def test_greedy_is_exact_argmax(rng, num_rows, vocab, dtype):
  logits = random_logits(rng, num_rows, vocab, dtype)
  expected = np.asarray(jnp.argmax(logits.astype(jnp.float32), axis=-1))
  stop_ids = np.full((num_rows, 3), -1, np.int32)
  stop_ids[::2, 1] = expected[::2]  # every other row stops
  tokens, stop = run_both(logits, temperature=0.0, stop_ids=stop_ids)
  np.testing.assert_array_equal(tokens, expected)
  np.testing.assert_array_equal(stop, np.arange(num_rows) % 2 == 0)


def test_negative_temperature_is_greedy(rng):
  logits = random_logits(rng, 4, 130)
  tokens, _ = run_both(logits, temperature=-1.0, seed=5, step=9)
  np.testing.assert_array_equal(tokens, np.asarray(jnp.argmax(logits, axis=-1)))


def test_greedy_with_bias(rng):
  logits = random_logits(rng, 4, 150)
  bias = np.zeros((4, 150), np.float32)
  bias[:, 149] = 100.0  # the ragged last block's last token wins
  bias[1, 3] = 200.0
  tokens, _ = run_both(logits, temperature=0.0, logit_bias=jnp.asarray(bias))
  np.testing.assert_array_equal(tokens, [149, 3, 149, 149])


# -------------------------------------------------------------------------------- ties
def test_ties_lowest_index_wins_across_blocks():
  vocab = 200  # blocks of 64: ties in blocks 1, 2 and the ragged block 3
  logits = np.zeros((4, vocab), np.float32)
  logits[0, [70, 150, 199]] = 5.0
  logits[1, [199, 130]] = 5.0
  logits[2, :] = 1.0  # all equal -> 0
  logits[3, :] = -np.inf  # nothing possible -> 0, like jnp.argmax
  tokens, _ = run_both(jnp.asarray(logits), temperature=0.0)
  np.testing.assert_array_equal(tokens, [70, 130, 0, 0])
  np.testing.assert_array_equal(tokens, np.asarray(jnp.argmax(logits, axis=-1)))


def test_bf16_rounding_ties_match_argmax():
  # Distinct in float32, equal once rounded to bfloat16.
  logits = np.zeros((1, 100), np.float32)
  logits[0, [10, 90]] = [1.0001, 1.0002]
  tokens, _ = run_both(jnp.asarray(logits, jnp.bfloat16), temperature=0.0)
  assert tokens[0] == 10


@settings(max_examples=25, deadline=None)
@given(
  st.lists(st.integers(-3, 3), min_size=2 * 97, max_size=2 * 97),
  st.integers(0, 2**32 - 1),
  st.integers(0, 100),
  st.integers(0, 97),
)
def test_many_ties_kernel_equals_reference(values, seed, step, top_k):
  """Small integer logits create ties everywhere, including at the k-th value."""
  logits = jnp.asarray(np.reshape(values, (2, 97)), jnp.float32)
  temperature = jnp.asarray([0.0, 0.9], jnp.float32)
  run_both(logits, temperature=temperature, top_k=top_k, seed=seed, step=step)


# ------------------------------------------------------------------------------- top-k
def test_top_k_one_always_gives_the_argmax(rng):
  logits = random_logits(rng, 16, 300, scale=0.1)  # nearly flat: sampling roams
  expected = np.asarray(jnp.argmax(logits, axis=-1))
  for step in range(3):
    tokens, _ = run_both(logits, temperature=5.0, top_k=1, seed=np.arange(16), step=step)
    np.testing.assert_array_equal(tokens, expected)


def test_top_k_keeps_only_the_k_largest(rng):
  logits = random_logits(rng, 32, 200, scale=0.05)
  top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
  seen = set()
  for step in range(4):
    tokens, _ = run_both(logits, temperature=10.0, top_k=5, seed=np.arange(32), step=step)
    for row, token in enumerate(tokens):
      assert token in top5[row], (row, token, top5[row])
      seen.add((row, int(token)))
  assert len(seen) > 32  # it does sample, not only take the max


def test_top_k_keeps_all_ties_at_the_kth_value():
  logits = np.full((64, 10), -5.0, np.float32)
  logits[:, [1, 4, 6, 8]] = [3.0, 2.0, 2.0, 2.0]  # k=2: the 2nd value is tied 3 times
  tokens, _ = run_both(jnp.asarray(logits), temperature=1.0, top_k=2, seed=np.arange(64), step=1, block_v=8)
  assert set(tokens.tolist()) == {1, 4, 6, 8}


@pytest.mark.parametrize("top_k", [0, -3, 150, 151, 10_000])
def test_top_k_off_or_at_least_vocab_keeps_everything(rng, top_k):
  logits = random_logits(rng, 8, 150)
  kernel, _ = run_both(logits, temperature=1.0, top_k=top_k, seed=np.arange(8), step=2)
  untouched, _ = run("xla", logits, temperature=1.0, top_k=0, seed=np.arange(8), step=2)
  np.testing.assert_array_equal(kernel, untouched)


def test_everything_masked_gives_token_zero(rng):
  """A row with no possible token (all -inf after bias) returns 0 like argmax."""
  logits = random_logits(rng, 3, 130)
  bias = jnp.full((3, 130), -jnp.inf)
  stop_ids = jnp.asarray([[0], [-1], [5]], jnp.int32)
  tokens, stop = run_both(
    logits, temperature=[0.0, 1.0, 1.0], top_k=[0, 0, 4], seed=1, logit_bias=bias, stop_ids=stop_ids
  )
  np.testing.assert_array_equal(tokens, [0, 0, 0])
  np.testing.assert_array_equal(stop, [True, False, False])


def test_top_k_among_infinities():
  logits = np.full((4, 70), -np.inf, np.float32)
  logits[:, [3, 66]] = [1.0, 2.0]  # fewer finite values than k
  logits[3, 40] = np.inf
  tokens, _ = run_both(jnp.asarray(logits), temperature=1.0, top_k=[5, 1, 2, 3], seed=np.arange(4), step=0)
  assert tokens[1] == 66 and tokens[3] == 40
  assert set(tokens[[0, 2]].tolist()) <= {3, 66}


# ---------------------------------------------------------------------------- stop ids
def test_empty_stop_set_never_stops(rng):
  logits = random_logits(rng, 6, 100)
  _, stop = run_both(logits, temperature=0.0, stop_ids=np.zeros((6, 0), np.int32))
  assert not stop.any()


def test_large_stop_sets(rng):
  num_rows, vocab, num_stop = 4, 100, 300  # 300 ids: two blocks of 256
  logits = random_logits(rng, num_rows, vocab)
  greedy = np.asarray(jnp.argmax(logits, axis=-1))
  stop_ids = np.full((num_rows, num_stop), -1, np.int32)
  stop_ids[0, 290] = greedy[0]  # in the second, ragged block
  stop_ids[1, :] = np.arange(num_stop)  # everything, and ids beyond V
  stop_ids[2, :vocab] = np.where(np.arange(vocab) == greedy[2], -1, np.arange(vocab))
  # row 3: only padding
  _, stop = run_both(logits, temperature=0.0, stop_ids=stop_ids)
  np.testing.assert_array_equal(stop, [True, True, False, False])


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sampling_bit_identical_to_reference(rng, dtype):
  num_rows, vocab = 8, 1000
  logits = random_logits(rng, num_rows, vocab, dtype)
  bias = jnp.asarray(rng.normal(size=(num_rows, vocab)), jnp.float32)
  temperature = np.array([0.0, 0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 0.0], np.float32)
  top_k = np.array([0, 0, 3, 40, 0, 999, 1000, 7], np.int32)
  stop_ids = np.full((num_rows, 4), -1, np.int32)
  stop_ids[:, 0] = rng.integers(0, vocab, num_rows)
  for step in range(3):
    run_both(
      logits,
      temperature=temperature,
      top_k=top_k,
      seed=rng.integers(0, 2**32, num_rows),
      step=step,
      stop_ids=stop_ids,
      logit_bias=bias,
      block_v=128,
    )


def test_real_vocabulary_default_block(rng):
  """V = 49152 (SmolLM2) with the default block: the shape the program runs."""
  num_rows, vocab = 8, 49152
  logits = random_logits(rng, num_rows, vocab)
  temperature = np.array([0, 1, 0.7, 1.3, 0, 1, 0.8, 0.5], np.float32)
  top_k = np.array([0, 0, 50, 1, 3, 0, 40, 0], np.int32)
  tokens, _ = run_both(
    logits, temperature=temperature, top_k=top_k, seed=np.arange(num_rows) * 7919, step=11, block_v=None
  )
  greedy = np.asarray(jnp.argmax(logits, axis=-1))
  np.testing.assert_array_equal(tokens[[0, 3, 4]], greedy[[0, 3, 4]])


def test_same_seed_step_row_same_token_across_batch_sizes(rng):
  logits = random_logits(rng, 16, 120, scale=0.5)
  seeds = rng.integers(0, 2**32, 16)
  for implementation in ("pallas", "xla"):
    big, _ = run(implementation, logits, temperature=1.0, seed=seeds, step=4)
    small, _ = run(implementation, logits[:5], temperature=1.0, seed=seeds[:5], step=4)
    again, _ = run(implementation, logits, temperature=1.0, seed=seeds, step=4)
    np.testing.assert_array_equal(big[:5], small)
    np.testing.assert_array_equal(big, again)
  other_step, _ = run("pallas", logits, temperature=1.0, seed=seeds, step=5)
  other_seed, _ = run("pallas", logits, temperature=1.0, seed=seeds + 1, step=4)
  assert (other_step != big).any() and (other_seed != big).any()


def test_eager_call_matches_jit(rng):
  logits = random_logits(rng, 3, 90)
  kwargs = dict(
    temperature=jnp.ones(3),
    top_k=jnp.asarray([0, 5, 0], jnp.int32),
    seed=jnp.arange(3, dtype=jnp.uint32),
    step=2,
    stop_ids=jnp.zeros((3, 1), jnp.int32),
  )
  eager = sample_stop(logits, implementation="pallas", **kwargs)
  reference = sample_stop_reference(logits, **kwargs)
  np.testing.assert_array_equal(eager[0], reference[0])
  np.testing.assert_array_equal(eager[1], reference[1])
  assert eager[0].dtype == jnp.int32 and eager[1].dtype == jnp.bool_


def test_traceable_inside_while_loop_with_traced_step(rng):
  """The decode loop calls the sampler with the loop counter as step."""
  num_rows, vocab, num_steps = 4, 80, 5
  logits = random_logits(rng, num_rows, vocab, scale=0.5)
  seed = jnp.arange(num_rows, dtype=jnp.uint32)
  stop_ids = jnp.full((num_rows, 2), -1, jnp.int32)

  def loop(implementation):
    def body(carry):
      step, tokens = carry
      token, _ = sample_stop(
        logits + step,
        temperature=jnp.ones(num_rows),
        top_k=jnp.zeros(num_rows, jnp.int32),
        seed=seed,
        step=step,
        stop_ids=stop_ids,
        implementation=implementation,
        block_v=32 if implementation == "pallas" else None,
      )
      return step + 1, tokens.at[:, step].set(token)

    init = (jnp.int32(0), jnp.zeros((num_rows, num_steps), jnp.int32))
    return jax.jit(lambda: jax.lax.while_loop(lambda c: c[0] < num_steps, body, init)[1])()

  kernel, reference = loop("pallas"), loop("xla")
  np.testing.assert_array_equal(kernel, reference)
  assert len(np.unique(np.asarray(kernel))) > num_steps  # steps draw fresh noise


# ------------------------------------------------------------------- allowed-token mask
def random_allowed(rng, num_rows, vocab, density):
  """A bool [B, V] mask with about ``density`` of the tokens allowed; "one" allows exactly one per row."""
  if density == "one":
    allowed = np.zeros((num_rows, vocab), bool)
    allowed[np.arange(num_rows), rng.integers(0, vocab, num_rows)] = True
    return allowed
  return rng.random((num_rows, vocab)) < density


def masked_argmax(logits, allowed, bias=None):
  """Greedy under a mask from first principles (numpy): argmax of the allowed scores, ties lowest."""
  scores = np.asarray(jnp.asarray(logits, jnp.float32)).astype(np.float32)
  if bias is not None:
    scores = scores + np.asarray(bias, np.float32)
  return np.argmax(np.where(allowed, scores, -np.inf), axis=-1)


# Vocabularies not a multiple of 32 nor of the kernel's block, one smaller than a word, one exact.
MASK_SHAPES = [(3, 100, 64), (2, 257, 32), (4, 13, 8), (2, 200, None), (3, 96, 16), (1, 1000, 128)]


@settings(max_examples=30, deadline=None)
@given(
  st.sampled_from(MASK_SHAPES),
  st.sampled_from(["one", 0.05, 0.3, 0.9, 1.0]),
  st.integers(0, 2**32 - 1),
  st.integers(0, 50),
  st.booleans(),
)
def test_masked_kernel_equals_reference(shape, density, seed, top_k, with_bias):
  """Greedy and sampled rows, top-k, bias and stops under random masks: bit-identical tokens."""
  num_rows, vocab, block_v = shape
  rng = np.random.default_rng(seed)
  logits = random_logits(rng, num_rows, vocab)
  allowed = random_allowed(rng, num_rows, vocab, density)
  bias = jnp.asarray(rng.normal(size=(num_rows, vocab)), jnp.float32) if with_bias else None
  temperature = rng.choice([0.0, 0.5, 1.0, 2.0], num_rows).astype(np.float32)
  stop_ids = rng.integers(-1, vocab, (num_rows, 3)).astype(np.int32)
  tokens, _ = run_both(
    logits,
    temperature=temperature,
    top_k=top_k,
    seed=rng.integers(0, 2**32, num_rows),
    step=int(rng.integers(0, 100)),
    stop_ids=stop_ids,
    logit_bias=bias,
    allowed=pack_allowed(allowed),
    block_v=block_v,
  )
  empty = ~allowed.any(axis=-1)  # sparse masks on small vocabularies leave rows empty: token 0
  np.testing.assert_array_equal(tokens[empty], 0)
  assert allowed[np.arange(num_rows), tokens][~empty].all()
  greedy = temperature <= 0
  np.testing.assert_array_equal(tokens[greedy], masked_argmax(logits, allowed, bias)[greedy])


@pytest.mark.parametrize("num_rows, vocab, block_v", MASK_SHAPES)
@pytest.mark.parametrize("density", ["one", 0.05, 0.5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_masked_greedy_is_argmax_of_allowed_logits(rng, num_rows, vocab, block_v, density, dtype):
  logits = random_logits(rng, num_rows, vocab, dtype)
  allowed = random_allowed(rng, num_rows, vocab, density)
  allowed[0, 0] = False  # the unmasked fallback token is not an answer
  allowed[0, rng.integers(1, vocab)] = True
  tokens, _ = run_both(logits, temperature=0.0, allowed=pack_allowed(allowed), block_v=block_v)
  np.testing.assert_array_equal(tokens, masked_argmax(logits, allowed))


def test_the_single_allowed_token_wins_even_when_it_is_the_least_likely(rng):
  vocab = 300
  logits = random_logits(rng, 8, vocab)
  worst = np.asarray(jnp.argmin(logits, axis=-1))
  allowed = np.zeros((8, vocab), bool)
  allowed[np.arange(8), worst] = True
  for temperature, top_k in [(0.0, 0), (1.0, 0), (3.0, 1), (1.0, 5)]:
    tokens, _ = run_both(
      logits, temperature=temperature, top_k=top_k, seed=np.arange(8), step=3, allowed=pack_allowed(allowed)
    )
    np.testing.assert_array_equal(tokens, worst)


def test_sampled_tokens_are_always_allowed(rng):
  """Nearly flat logits over many seeds and steps: sampling roams, and only over allowed tokens."""
  num_rows, vocab = 64, 203
  logits = random_logits(rng, num_rows, vocab, scale=0.1)
  allowed = random_allowed(rng, num_rows, vocab, 0.1)
  bias = jnp.asarray(np.where(allowed, 0.0, 50.0), jnp.float32)  # disallowed tokens would win unmasked
  seen = set()
  for step in range(4):
    tokens, _ = run_both(
      logits,
      temperature=1.5,
      seed=rng.integers(0, 2**32, num_rows),
      step=step,
      logit_bias=bias,
      allowed=pack_allowed(allowed),
    )
    assert allowed[np.arange(num_rows), tokens].all()
    seen |= {(row, int(token)) for row, token in enumerate(tokens)}
  assert len(seen) > 2 * num_rows  # it does sample, not only take the max


def test_top_k_under_a_mask_counts_only_allowed_tokens():
  """The k-th largest is taken among the allowed tokens: the top-k of all tokens are disallowed here."""
  num_rows, vocab, k = 128, 150, 3
  logits = np.full((num_rows, vocab), -4.0, np.float32)
  logits[:, 140:] = 10.0  # the 10 largest, all disallowed
  allowed = np.ones((num_rows, vocab), bool)
  allowed[:, 140:] = False
  favourites = [7, 64, 139]  # the 3 largest allowed, one per block of 64, nearly tied
  logits[:, favourites] = [1.0, 1.1, 0.9]
  logits[:, 100] = 0.5  # the 4th allowed: outside the top 3, never drawn
  tokens, _ = run_both(
    jnp.asarray(logits), temperature=1.0, top_k=k, seed=np.arange(num_rows), step=2, allowed=pack_allowed(allowed)
  )
  assert set(tokens.tolist()) == set(favourites)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_allowed_none_equals_an_all_ones_mask(rng, dtype):
  num_rows, vocab = 8, 333
  logits = random_logits(rng, num_rows, vocab, dtype)
  kwargs = dict(
    temperature=np.array([0.0, 0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 0.0], np.float32),
    top_k=np.array([0, 0, 3, 40, 0, 332, 333, 7], np.int32),
    seed=rng.integers(0, 2**32, num_rows),
    step=5,
    stop_ids=rng.integers(0, vocab, (num_rows, 2)),
    logit_bias=jnp.asarray(rng.normal(size=(num_rows, vocab)), jnp.float32),
  )
  ones = pack_allowed(np.ones((num_rows, vocab), bool))
  for implementation in ("pallas", "xla"):
    unmasked = run(implementation, logits, **kwargs)
    masked = run(implementation, logits, allowed=ones, **kwargs)
    np.testing.assert_array_equal(unmasked[0], masked[0])
    np.testing.assert_array_equal(unmasked[1], masked[1])


def test_a_row_with_nothing_allowed_gives_token_zero(rng):
  """Documented: an empty mask behaves like an all -inf row, token 0 (even though 0 is not allowed)."""
  logits = random_logits(rng, 4, 130)
  allowed = np.zeros((4, 130), bool)
  allowed[3, 77] = True  # one normal row beside the empty ones
  tokens, stop = run_both(
    logits,
    temperature=[0.0, 1.0, 1.0, 1.0],
    top_k=[0, 0, 4, 4],
    seed=1,
    stop_ids=[[0], [-1], [0], [0]],
    allowed=pack_allowed(allowed),
  )
  np.testing.assert_array_equal(tokens, [0, 0, 0, 77])
  np.testing.assert_array_equal(stop, [True, False, True, False])


def test_bits_past_the_vocabulary_are_ignored(rng):
  num_rows, vocab = 3, 70  # 3 words, 26 spare bits
  logits = random_logits(rng, num_rows, vocab)
  allowed = random_allowed(rng, num_rows, vocab, 0.2)
  allowed[:, 5] = True
  words = pack_allowed(allowed)
  words[:, -1] |= np.uint32(0xFFFFFFFF) << np.uint32(vocab % 32)
  for temperature in (0.0, 1.0):
    clean = run_both(logits, temperature=temperature, seed=np.arange(3), allowed=pack_allowed(allowed))
    dirty = run_both(logits, temperature=temperature, seed=np.arange(3), allowed=words)
    np.testing.assert_array_equal(clean[0], dirty[0])
    assert (clean[0] < vocab).all()


def test_masked_real_vocabulary_default_block(rng):
  """V = 49152 with the default block (2048 tokens = 64 mask words), 5 % allowed, as constrained decoding runs."""
  num_rows, vocab = 4, 49152
  logits = random_logits(rng, num_rows, vocab)
  allowed = random_allowed(rng, num_rows, vocab, 0.05)
  temperature = np.array([0, 1, 0.7, 0], np.float32)
  top_k = np.array([0, 0, 50, 3], np.int32)
  tokens, _ = run_both(
    logits,
    temperature=temperature,
    top_k=top_k,
    seed=np.arange(num_rows) * 7919,
    step=11,
    allowed=pack_allowed(allowed),
    block_v=None,
  )
  assert allowed[np.arange(num_rows), tokens].all()
  np.testing.assert_array_equal(tokens[[0, 3]], masked_argmax(logits, allowed)[[0, 3]])


def test_traceable_with_a_mask_inside_while_loop(rng):
  """A constraint's mask changes each step: it is an ordinary traced input of the loop body."""
  num_rows, vocab, num_steps = 3, 90, 4
  logits = random_logits(rng, num_rows, vocab, scale=0.5)
  masks = jnp.asarray(
    pack_allowed(random_allowed(rng, num_steps * num_rows, vocab, 0.2)).reshape(num_steps, num_rows, -1)
  )

  def loop(implementation):
    def body(carry):
      step, tokens = carry
      token, _ = sample_stop(
        logits,
        temperature=jnp.ones(num_rows),
        top_k=jnp.full(num_rows, 5, jnp.int32),
        seed=jnp.arange(num_rows, dtype=jnp.uint32),
        step=step,
        stop_ids=jnp.zeros((num_rows, 0), jnp.int32),
        allowed=masks[step],
        implementation=implementation,
        block_v=32 if implementation == "pallas" else None,
      )
      return step + 1, tokens.at[:, step].set(token)

    init = (jnp.int32(0), jnp.zeros((num_rows, num_steps), jnp.int32))
    return np.asarray(jax.jit(lambda: jax.lax.while_loop(lambda c: c[0] < num_steps, body, init)[1])())

  kernel, reference = loop("pallas"), loop("xla")
  np.testing.assert_array_equal(kernel, reference)
  unpacked = np.asarray(unpack_allowed(masks.reshape(num_steps * num_rows, -1), vocab)).reshape(num_steps, num_rows, -1)
  for step in range(num_steps):
    assert unpacked[step, np.arange(num_rows), kernel[:, step]].all()


# ------------------------------------------------------------------------ mask packing
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(0, 3), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_pack_unpack_round_trip(vocab, num_rows, seed, density):
  rng = np.random.default_rng(seed)
  shape = (num_rows, vocab) if num_rows else (vocab,)  # num_rows 0: one unbatched row [V]
  allowed = rng.random(shape) < density
  words = pack_allowed(allowed)
  assert words.dtype == np.uint32 and words.shape == (*shape[:-1], mask_words(vocab))
  # The layout, from first principles: token v is bit v & 31 of word v >> 5, bits past V are 0.
  for v in range(mask_words(vocab) * 32):
    bit = (words[..., v >> 5] >> np.uint32(v & 31)) & np.uint32(1)
    np.testing.assert_array_equal(bit.astype(bool), allowed[..., v] if v < vocab else False)
  np.testing.assert_array_equal(np.asarray(unpack_allowed(jnp.asarray(words), vocab)), allowed)
  np.testing.assert_array_equal(np.asarray(jax.jit(unpack_allowed, static_argnums=1)(words, vocab)), allowed)


@pytest.mark.parametrize("vocab, words", [(0, 0), (1, 1), (31, 1), (32, 1), (33, 2), (49152, 1536), (151_936, 4748)])
def test_mask_words(vocab, words):
  assert mask_words(vocab) == words


# ------------------------------------------------------------------------------- mask errors
@pytest.mark.parametrize(
  "allowed, given",
  [
    (np.ones((2, 10), bool), "shape \\(2, 10\\) dtype bool"),  # the unpacked mask
    (np.ones((2, 1), np.int32), "shape \\(2, 1\\) dtype int32"),  # right shape, wrong dtype
    (np.ones((2, 1), np.uint8), "shape \\(2, 1\\) dtype uint8"),
    (np.ones((1,), np.uint32), "shape \\(1,\\) dtype uint32"),  # one row for all: no broadcasting
    (np.ones((1, 1), np.uint32), "shape \\(1, 1\\) dtype uint32"),
    (np.ones((3, 1), np.uint32), "shape \\(3, 1\\) dtype uint32"),
    (np.ones((2, 2), np.uint32), "shape \\(2, 2\\) dtype uint32"),
    (np.ones((2, 1, 1), np.uint32), "shape \\(2, 1, 1\\) dtype uint32"),
  ],
)
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_a_wrong_mask_is_refused_at_trace_time(allowed, given, implementation):
  """No silent broadcast or cast: the error names allowed, the expected [B, W] uint32, and what came."""
  args = _valid_args()  # B = 2, V = 10: W = 1
  traced = []

  def f(allowed):
    traced.append(True)
    return sample_stop(
      args["logits"], **{k: v for k, v in args.items() if k != "logits"}, allowed=allowed, implementation=implementation
    )

  with pytest.raises(AllowedMaskError, match="allowed must be uint32 \\[B, W\\]=\\[2, 1\\]") as raised:
    jax.eval_shape(f, jax.ShapeDtypeStruct(allowed.shape, allowed.dtype))  # no data: refused while tracing
  assert traced
  assert all(isinstance(raised.value, kind) for kind in (UserError, ValueError, TypeError))
  assert raised.match(given) and raised.match("pack_allowed")
  with pytest.raises(AllowedMaskError, match=given):
    f(jnp.asarray(allowed))


@pytest.mark.parametrize(
  "allowed_bool, given",
  [
    (np.ones(10, np.uint8), "shape \\(10,\\) dtype uint8"),
    (np.ones((2, 10), np.float32), "dtype float32"),
    (np.ones((2, 3, 10), bool), "shape \\(2, 3, 10\\)"),
    (np.array(True), "shape \\(\\)"),
  ],
)
def test_pack_allowed_refuses_what_is_not_a_bool_mask(allowed_bool, given):
  with pytest.raises(AllowedMaskError, match="allowed_bool must be a bool array \\[B, V\\] or \\[V\\]") as raised:
    pack_allowed(allowed_bool)
  assert raised.match(given)


@pytest.mark.parametrize("words", [np.ones((2, 3), np.uint32), np.ones((2, 1), np.int32)])
def test_unpack_allowed_refuses_the_wrong_word_count_or_dtype(words):
  with pytest.raises(AllowedMaskError, match="W = ceil\\(10 / 32\\) = 1"):
    unpack_allowed(jnp.asarray(words), 10)


# ------------------------------------------------------------------------- statistics
def _chi_square_p_value(tokens: np.ndarray, probs: np.ndarray) -> float:
  """p-value of the sampled counts against probs, over the tokens with p > 0."""
  counts = np.bincount(tokens.ravel(), minlength=len(probs))
  assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
  support = probs > 0
  expected = probs[support] * tokens.size
  return float(scipy_stats.chisquare(counts[support], expected).pvalue)


def _expected_probs(logits, temperature, top_k, allowed=None):
  y = np.asarray(logits, np.float64) / temperature
  if allowed is not None:  # before top-k: the k largest allowed survive
    y = np.where(allowed, y, -np.inf)
  if top_k:
    y = np.where(y >= np.sort(y)[-top_k], y, -np.inf)
  p = np.exp(y - y.max())
  return p / p.sum()


def _draws(implementation, row_logits, *, temperature, top_k, num_rows, num_steps, seed0, allowed=None):
  """Samples num_rows * num_steps tokens of one distribution: seeds x steps (``allowed``: bool [V])."""
  logits = jnp.broadcast_to(jnp.asarray(row_logits, jnp.float32), (num_rows, len(row_logits)))
  if allowed is not None:
    allowed = jnp.asarray(np.broadcast_to(pack_allowed(allowed), (num_rows, mask_words(len(row_logits)))))
  seeds = jnp.arange(num_rows, dtype=jnp.uint32) + jnp.uint32(seed0)

  def one_step(step):
    return sample_stop(
      logits,
      temperature=jnp.full(num_rows, temperature),
      top_k=jnp.full(num_rows, top_k, jnp.int32),
      seed=seeds,
      step=step,
      stop_ids=jnp.zeros((num_rows, 0), jnp.int32),
      allowed=allowed,
      implementation=implementation,
    )[0]

  return np.asarray(jax.jit(lambda: jax.lax.map(one_step, jnp.arange(num_steps)))())


STAT_LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5], np.float32)


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 5), (2.0, 3)])
def test_reference_sampling_follows_softmax(temperature, top_k):
  tokens = _draws("xla", STAT_LOGITS, temperature=temperature, top_k=top_k, num_rows=256, num_steps=64, seed0=12345)
  assert _chi_square_p_value(tokens, _expected_probs(STAT_LOGITS, temperature, top_k)) > 1e-3


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 5)])
def test_kernel_sampling_follows_softmax(temperature, top_k):
  tokens = _draws("pallas", STAT_LOGITS, temperature=temperature, top_k=top_k, num_rows=64, num_steps=32, seed0=777)
  assert _chi_square_p_value(tokens, _expected_probs(STAT_LOGITS, temperature, top_k)) > 1e-3
  again = _draws("pallas", STAT_LOGITS, temperature=temperature, top_k=top_k, num_rows=64, num_steps=32, seed0=777)
  np.testing.assert_array_equal(tokens, again)


# The largest logit (token 0) is disallowed: the draws follow the softmax of what is left.
STAT_ALLOWED = np.array([False, True, True, False, True, True, True, True])


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 3)])
def test_masked_sampling_follows_the_softmax_of_the_allowed_tokens(implementation, temperature, top_k):
  num_rows, num_steps = (256, 64) if implementation == "xla" else (64, 32)
  tokens = _draws(
    implementation,
    STAT_LOGITS,
    temperature=temperature,
    top_k=top_k,
    num_rows=num_rows,
    num_steps=num_steps,
    seed0=4242,
    allowed=STAT_ALLOWED,
  )
  probs = _expected_probs(STAT_LOGITS, temperature, top_k, STAT_ALLOWED)
  assert _chi_square_p_value(tokens, probs) > 1e-3


# ---------------------------------------------------------------------------- errors
def _valid_args(num_rows=2, vocab=10):
  return dict(
    logits=jnp.zeros((num_rows, vocab)),
    temperature=jnp.ones(num_rows),
    top_k=jnp.zeros(num_rows, jnp.int32),
    seed=jnp.zeros(num_rows, jnp.uint32),
    step=0,
    stop_ids=jnp.zeros((num_rows, 1), jnp.int32),
  )


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(logits=jnp.zeros(10)), "logits must be \\[B, V\\]"),
    (dict(logits=jnp.zeros((2, 10), jnp.int32)), "logits must be float32 or bfloat16"),
    (dict(temperature=jnp.ones(3)), "temperature must be \\[B\\]=\\[2\\]"),
    (dict(top_k=jnp.ones(2)), "top_k must be an integer array"),
    (dict(step=jnp.zeros(2, jnp.int32)), "step must be a scalar integer"),
    (dict(stop_ids=jnp.zeros((3, 1), jnp.int32)), "stop_ids must be \\[B, M\\]"),
    (dict(logit_bias=jnp.zeros((2, 11))), "logit_bias must match logits"),
    (dict(implementation="cuda"), "implementation must be one of"),
    (dict(implementation="pallas", block_v=48), "block_v must be a power of two"),
  ],
)
def test_errors_name_the_argument(change, message):
  args = {**_valid_args(), **change}
  with pytest.raises((ValueError, TypeError), match=message):
    sample_stop(args.pop("logits"), **args)

"""sample_stop: the Pallas kernel against the jnp reference and against first principles.

Shapes stay small (interpret mode runs the kernel as XLA loops on CPU) and the
kernel uses small vocabulary blocks so that several blocks and a ragged last block
are exercised; one case uses the real vocabulary size with the default block.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thoughtjax.kernels.sample_stop import sample_stop, sample_stop_reference

scipy_stats = pytest.importorskip("scipy.stats")


@functools.cache
def _compiled(implementation: str, block_v: int | None):
  def run(logits, temperature, top_k, seed, step, stop_ids, logit_bias):
    return sample_stop(
      logits,
      temperature=temperature,
      top_k=top_k,
      seed=seed,
      step=step,
      stop_ids=stop_ids,
      logit_bias=logit_bias,
      implementation=implementation,
      block_v=block_v,
    )

  return jax.jit(run)


def run(implementation, logits, *, temperature, top_k=0, seed=0, step=0, stop_ids=None, logit_bias=None, block_v=64):
  """Calls sample_stop under jit with per-row arguments broadcast to [B]."""
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


# ------------------------------------------------------------------------- statistics
def _chi_square_p_value(tokens: np.ndarray, probs: np.ndarray) -> float:
  """p-value of the sampled counts against probs, over the tokens with p > 0."""
  counts = np.bincount(tokens.ravel(), minlength=len(probs))
  assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
  support = probs > 0
  expected = probs[support] * tokens.size
  return float(scipy_stats.chisquare(counts[support], expected).pvalue)


def _expected_probs(logits, temperature, top_k):
  y = np.asarray(logits, np.float64) / temperature
  if top_k:
    y = np.where(y >= np.sort(y)[-top_k], y, -np.inf)
  p = np.exp(y - y.max())
  return p / p.sum()


def _draws(implementation, row_logits, *, temperature, top_k, num_rows, num_steps, seed0):
  """Samples num_rows * num_steps tokens of one distribution: seeds x steps."""
  logits = jnp.broadcast_to(jnp.asarray(row_logits, jnp.float32), (num_rows, len(row_logits)))
  seeds = jnp.arange(num_rows, dtype=jnp.uint32) + jnp.uint32(seed0)

  def one_step(step):
    return sample_stop(
      logits,
      temperature=jnp.full(num_rows, temperature),
      top_k=jnp.full(num_rows, top_k, jnp.int32),
      seed=seeds,
      step=step,
      stop_ids=jnp.zeros((num_rows, 0), jnp.int32),
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

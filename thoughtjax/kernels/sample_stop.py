"""Fused sampling with stop-token detection: logits [B, V] -> (token [B], stop [B]).

One kernel does logit bias, an allowed-token mask, temperature, top-k, Gumbel-max
sampling (or argmax for greedy rows) and the stop-set lookup, one program per row.
Without top-k it reads each row (and its mask words) once; with top-k it first finds
the k-th largest value by a binary search over float order keys (about 32 counting
passes over the row, which stays in cache), then does the sampling pass. Three implementations of one contract
live here:

- ``sample_stop_reference``: pure ``jnp``, the CPU default and the ground truth;
- the Pallas kernel (``implementation="pallas"``), lowered through Pallas' Triton
  backend on NVIDIA GPUs and interpreted on CPU;
- ``sample_stop``: the public entry point that dispatches between them.

Contract, per row ``b`` (all arithmetic in float32):

    s[v]   = float32(logits[b, v]) + logit_bias[b, v]            # bias optional
    s[v]   = -inf where token v is not allowed                   # mask optional
    greedy = temperature[b] <= 0
    y[v]   = s[v] * (1 / temperature[b])      (y = s when greedy)
    top-k  : when 0 < top_k[b] < V and not greedy, keep v iff y[v] >= the
             top_k[b]-th largest y of the row (ties at that value are all
             kept, so more than k tokens can survive); other y[v] = -inf.
             top_k <= 0 or >= V keeps everything. Greedy rows skip top-k: it
             cannot change their argmax.
    score  = y              (greedy)
           = y + gumbel[v]  (sampling)
    token  = argmax(score), ties -> lowest index, exactly like ``jnp.argmax``
             (a row whose scores are all -inf gives token 0)
    stop   = token is in stop_ids[b, :] (entries < 0 are padding)

The allowed-token mask (``allowed``, optional) is a bitmask, uint32 [B, W] with
``W = mask_words(V) = ceil(V / 32)``: bit ``v & 31`` of word ``v >> 5`` set means
token ``v`` may be sampled; bits past V are ignored. ``pack_allowed`` builds it from
a bool mask on the host, ``unpack_allowed`` turns it back into bool [B, V] in jnp.
A disallowed token is -inf before temperature and top-k, exactly like a -inf
logit: top-k's k-th largest is taken among the allowed tokens, greedy rows take
the argmax of the allowed ones and sampled rows draw only allowed ones. A row with
no allowed token (or whose allowed tokens are all -inf) gives token 0, whether
token 0 is allowed or not: callers that can produce an empty mask must check for
it. ``allowed=None`` allows every token and adds no work to the program.

``gumbel[v] = -log(-log(u))`` with ``u`` in (0, 1) built from 23 bits of a
counter-based uint32 hash of ``(seed[b], step, b, v)``: no ``jax.random`` key, so
the kernel and the reference compute the same noise element by element and
return bit-identical tokens on a given backend. The same (seed, step, row)
gives the same token whatever the batch size. NaN logits are unsupported.

On CPU the kernel (interpreted) and the reference run the same XLA ``log`` and
agree bit for bit (tested). On NVIDIA the Triton kernel calls libdevice's
``__nv_logf``; should XLA's GPU ``log`` differ from it in the last ulp, a sampled
token could differ where two candidates' scores lie within an ulp. Greedy tokens
involve no ``log`` and always agree. The native GPU run of the tests checks this.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from thoughtjax.errors import UserError
from thoughtjax.kernels import dispatch

Implementation = Literal["pallas", "xla"]

_IMPLEMENTATIONS = ("pallas", "xla")
_MAX_BLOCK_V = 2048
_MAX_BLOCK_M = 256
_WORD_BITS = 32  # tokens per word of the allowed-token mask

# murmur3's 32-bit finalizer constants and a few odd constants (pi, golden
# ratio) to separate the inputs absorbed into the row key.
_FMIX_1 = np.uint32(0x85EBCA6B)
_FMIX_2 = np.uint32(0xC2B2AE35)
_SEED_SALT = np.uint32(0x243F6A88)
_STEP_MUL = np.uint32(0x9E3779B9)
_ROW_MUL = np.uint32(0x85EBCA77)
_VOCAB_MUL = np.uint32(0xC2B2AE3D)
_VOCAB_SALT = np.uint32(0x27D4EB2F)


# ----------------------------------------------------------------------------- noise
def _fmix32(h: jax.Array) -> jax.Array:
  """murmur3's avalanche finalizer on uint32 (a bijection)."""
  h = h ^ (h >> np.uint32(16))
  h = h * _FMIX_1
  h = h ^ (h >> np.uint32(13))
  h = h * _FMIX_2
  return h ^ (h >> np.uint32(16))


def _row_key(seed: jax.Array, step: jax.Array, row: jax.Array) -> jax.Array:
  """uint32 key of one (seed, step, row); all three are uint32 of one shape."""
  h = _fmix32(seed ^ _SEED_SALT)
  h = _fmix32(h ^ (step * _STEP_MUL))
  return _fmix32(h ^ (row * _ROW_MUL))


def _gumbel(row_key: jax.Array, vocab_index: jax.Array) -> jax.Array:
  """Gumbel(0, 1) noise, float32, shaped like ``broadcast(row_key, vocab_index)``.

  Uses only uint32 integer ops, an int->float conversion, exact scalings and
  two ``log`` calls, so any implementation doing the same ops agrees.
  """
  h = _fmix32(row_key ^ (vocab_index.astype(jnp.uint32) * _VOCAB_MUL))
  h = _fmix32(h + _VOCAB_SALT)
  # 23 random bits + 0.5 is exact in float32, so u is in [2^-24, 1 - 2^-24]:
  # never 0 or 1, whose logs would give infinite noise.
  mantissa = (h >> np.uint32(9)).astype(jnp.int32).astype(jnp.float32)
  u = (mantissa + np.float32(0.5)) * np.float32(2.0**-23)
  return -jnp.log(-jnp.log(u))


def _order_key(y: jax.Array) -> jax.Array:
  """int32 keys whose signed order is the float order of ``y`` (no NaN).

  -0.0 maps to the key of +0.0 so that key equality matches float equality.
  """
  bits = lax.bitcast_convert_type(y, jnp.int32)
  key = jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
  return jnp.where(y == 0, np.int32(0), key)


def kth_largest(y: jax.Array, k: jax.Array) -> jax.Array:
  """The k-th largest value of each row: y [B, V] f32, k [B] i32 in [1, V] -> [B] f32.

  Exact, without sorting the vocabulary: float32 values map to uint32 keys in the same order
  (negative floats: all bits flipped; others: the sign bit set), and the largest key t with
  ``count(key >= t) >= k`` is built one bit at a time from the top (32 passes that count over V,
  vs a full sort per row: measured 1.2 vs 36 ms for one row of 49152 on XLA:CPU). That key is
  the k-th largest's, so ``y >= kth_largest(y, k)`` keeps what a sort-based threshold keeps.
  """
  y = y.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
  key = jnp.where((bits >> 31) != 0, ~bits, bits | jnp.uint32(0x80000000))  # [B, V], monotone in y
  k = k.astype(jnp.int32)

  def bit(i, ans):  # ans [B]: the top i bits of the answer
    cand = ans | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    enough = jnp.sum(key >= cand[:, None], axis=-1, dtype=jnp.int32) >= k
    return jnp.where(enough, cand, ans)

  ans = jax.lax.fori_loop(0, 32, bit, jnp.zeros(y.shape[:1], jnp.uint32))
  back = jnp.where((ans >> 31) != 0, ans & jnp.uint32(0x7FFFFFFF), ~ans)
  return jax.lax.bitcast_convert_type(back, jnp.float32)


# ------------------------------------------------------------------ allowed-token mask
class AllowedMaskError(UserError, ValueError, TypeError):
  """An allowed-token mask of the wrong shape or dtype (a ValueError and a TypeError both)."""


def mask_words(vocab: int) -> int:
  """W, the number of uint32 words of one row's allowed-token mask: ceil(vocab / 32)."""
  if vocab < 0:
    raise ValueError(f"mask_words: vocab must be >= 0, got {vocab}.")
  return -(-vocab // _WORD_BITS)


def pack_allowed(allowed_bool: np.ndarray) -> np.ndarray:
  """Packs a bool mask [B, V] or [V] (True = may be sampled) into uint32 words [..., W].

  Host side (numpy). Bit ``v & 31`` of word ``v >> 5`` is token ``v``; bits past V are 0.
  """
  allowed_bool = np.asarray(allowed_bool)
  if allowed_bool.dtype != np.bool_ or allowed_bool.ndim not in (1, 2):
    raise AllowedMaskError(
      f"pack_allowed: allowed_bool must be a bool array [B, V] or [V], got shape {allowed_bool.shape} "
      f"dtype {allowed_bool.dtype}; build it with e.g. `ids == token` or np.zeros(V, bool)."
    )
  vocab = allowed_bool.shape[-1]
  num_bytes = 4 * mask_words(vocab)
  packed = np.packbits(allowed_bool, axis=-1, bitorder="little")  # [..., ceil(V / 8)] uint8
  padding = [(0, 0)] * (packed.ndim - 1) + [(0, num_bytes - packed.shape[-1])]
  # Little-endian words: byte j of a word holds bits 8j..8j+7, whatever the host's byte order.
  return np.ascontiguousarray(np.pad(packed, padding)).view("<u4").astype(np.uint32)


def unpack_allowed(words: jax.Array, vocab: int) -> jax.Array:
  """Unpacks uint32 words [..., W] into the bool mask [..., vocab] (jnp, traceable)."""
  words = jnp.asarray(words)
  if words.dtype != jnp.uint32 or words.ndim < 1 or words.shape[-1] != mask_words(vocab):
    raise AllowedMaskError(
      f"unpack_allowed: words must be uint32 [..., W] with W = ceil({vocab} / 32) = {mask_words(vocab)}, "
      f"got shape {words.shape} dtype {words.dtype}; pack a bool mask with pack_allowed."
    )
  # Explicit ranks: callers may run with jax_numpy_rank_promotion="raise".
  shifts = jnp.arange(_WORD_BITS, dtype=jnp.uint32).reshape((1,) * words.ndim + (_WORD_BITS,))
  bits = (words[..., None] >> shifts) & np.uint32(1)  # [..., W, 32]
  return bits.reshape(*words.shape[:-1], -1)[..., :vocab] != 0


def _check_allowed(allowed, num_rows: int, vocab: int) -> jax.Array:
  """``allowed`` as uint32 [B, W], or a named error: no broadcasting, no casting."""
  allowed = jnp.asarray(allowed)
  expected = (num_rows, mask_words(vocab))
  if allowed.dtype != jnp.uint32 or allowed.shape != expected:
    raise AllowedMaskError(
      f"sample_stop: allowed must be uint32 [B, W]={list(expected)} (W = ceil(V / 32) words for V={vocab}, "
      f"one bit per token), got shape {allowed.shape} dtype {allowed.dtype}; pack a bool [B, V] mask "
      f"with pack_allowed, or pass None to allow every token."
    )
  return allowed


# ------------------------------------------------------------------------ validation
class _Prepared(NamedTuple):
  """Validated inputs in the dtypes and shapes every implementation uses."""

  logits: jax.Array  # [B, V] as given (f32 | bf16)
  logit_bias: jax.Array | None  # [B, V] f32
  inv_temperature: jax.Array  # [B] f32, 1 for greedy rows
  greedy: jax.Array  # [B] i32, 1 = greedy
  top_k: jax.Array  # [B] i32, 0 = off, else in [1, V)
  seed: jax.Array  # [B] u32
  step: jax.Array  # [1] i32
  stop_ids: jax.Array  # [B, M] i32
  allowed: jax.Array | None = None  # [B, W] u32 bitmask, None = every token


def prepare_inputs(logits, temperature, top_k, seed, step, stop_ids, logit_bias, allowed=None) -> _Prepared:
  """Validates the arguments and puts them in the canonical form every
  implementation (reference, Pallas, the benchmark's CUDA C) consumes."""
  logits = jnp.asarray(logits)
  if logits.ndim != 2:
    raise ValueError(
      f"sample_stop: logits must be [B, V], got shape {logits.shape}; reshape to one row of logits per sequence."
    )
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(
      f"sample_stop: logits must be float32 or bfloat16, got {logits.dtype}; cast them with .astype(jnp.float32)."
    )
  num_rows, vocab = logits.shape

  def per_row(name, value, dtype):
    value = jnp.asarray(value)
    if value.ndim == 0:
      value = jnp.broadcast_to(value, (num_rows,))
    if value.shape != (num_rows,):
      raise ValueError(
        f"sample_stop: {name} must be [B]=[{num_rows}] (or a scalar), got "
        f"shape {value.shape}; pass one value per logits row."
      )
    if jnp.issubdtype(dtype, jnp.integer) and not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"sample_stop: {name} must be an integer array, got {value.dtype}.")
    if jnp.issubdtype(dtype, jnp.unsignedinteger) and value.dtype.itemsize == 4:
      return lax.bitcast_convert_type(value, dtype) if value.dtype != dtype else value
    return value.astype(dtype)

  temperature = per_row("temperature", temperature, jnp.float32)
  top_k = per_row("top_k", top_k, jnp.int32)
  seed = per_row("seed", seed, jnp.uint32)
  step = jnp.asarray(step)
  if step.ndim != 0 or not jnp.issubdtype(step.dtype, jnp.integer):
    raise ValueError(
      f"sample_stop: step must be a scalar integer, got shape {step.shape} "
      f"dtype {step.dtype}; pass the decode step as a 0-d int32."
    )
  stop_ids = jnp.asarray(stop_ids)
  if stop_ids.ndim != 2 or stop_ids.shape[0] != num_rows:
    raise ValueError(
      f"sample_stop: stop_ids must be [B, M]=[{num_rows}, M], got shape "
      f"{stop_ids.shape}; pad each row's stop set with -1 (M may be 0)."
    )
  if not jnp.issubdtype(stop_ids.dtype, jnp.integer):
    raise TypeError(f"sample_stop: stop_ids must be integers, got {stop_ids.dtype}.")
  if logit_bias is not None:
    logit_bias = jnp.asarray(logit_bias)
    if logit_bias.shape != logits.shape:
      raise ValueError(
        f"sample_stop: logit_bias must match logits [B, V]={logits.shape}, got "
        f"shape {logit_bias.shape}; pass None for no bias."
      )
    logit_bias = logit_bias.astype(jnp.float32)
  if allowed is not None:
    allowed = _check_allowed(allowed, num_rows, vocab)

  greedy = temperature <= 0
  # 1/T is computed here, outside the kernel, so every implementation scales by
  # the very same float (Triton's in-kernel division is approximate).
  inv_temperature = jnp.where(greedy, np.float32(1), 1 / jnp.where(greedy, np.float32(1), temperature))
  # Canonical top-k: 0 = off. Greedy rows never need it.
  top_k = jnp.where((top_k > 0) & (top_k < vocab) & ~greedy, top_k, 0)
  return _Prepared(
    logits=logits,
    logit_bias=logit_bias,
    inv_temperature=inv_temperature,
    greedy=greedy.astype(jnp.int32),
    top_k=top_k,
    seed=seed,
    step=step.astype(jnp.int32).reshape(1),
    stop_ids=stop_ids.astype(jnp.int32),
    allowed=allowed,
  )


# ------------------------------------------------------------------------- reference
def sample_stop_reference(
  logits: jax.Array,  # [B, V] f32 | bf16
  *,
  temperature: jax.Array,  # [B] f32
  top_k: jax.Array,  # [B] i32
  seed: jax.Array,  # [B] u32
  step: jax.Array | int,  # [] i32
  stop_ids: jax.Array,  # [B, M] i32, padded with -1
  logit_bias: jax.Array | None = None,  # [B, V] f32
  allowed: jax.Array | None = None,  # [B, W] u32
) -> tuple[jax.Array, jax.Array]:
  """Pure-jnp reference of ``sample_stop`` (see the module docstring).

  Returns ``(tokens [B] int32, stop [B] bool)``.
  """
  args = prepare_inputs(logits, temperature, top_k, seed, step, stop_ids, logit_bias, allowed)
  num_rows, vocab = logits.shape
  s = args.logits.astype(jnp.float32)
  if args.logit_bias is not None:
    s = s + args.logit_bias
  if args.allowed is not None:
    s = jnp.where(unpack_allowed(args.allowed, vocab), s, -jnp.inf)
  y = s * args.inv_temperature[:, None]  # [B, V]

  use_top_k = args.top_k > 0  # [B]

  def top_k_threshold(y):  # exact, no sort over V
    return kth_largest(y, jnp.clip(args.top_k, 1, vocab))

  # The threshold search is the expensive part of the reference; skip it when no row asks.
  threshold = lax.cond(jnp.any(use_top_k), top_k_threshold, lambda y: jnp.full((num_rows,), -jnp.inf, jnp.float32), y)
  keep = ~use_top_k[:, None] | (y >= threshold[:, None])
  y = jnp.where(keep, y, -jnp.inf)

  rows = jnp.arange(num_rows, dtype=jnp.uint32)
  step_u32 = jnp.broadcast_to(args.step[0].astype(jnp.uint32), (num_rows,))
  row_key = _row_key(args.seed, step_u32, rows)  # [B]

  def sampled(y):
    noise = _gumbel(row_key[:, None], jnp.arange(vocab, dtype=jnp.int32)[None, :])
    return jnp.where(args.greedy[:, None] != 0, y, y + noise)

  # The noise (a hash and two logs per entry) dominates the cost; all-greedy batches skip it.
  score = lax.cond(jnp.all(args.greedy != 0), lambda y: y, sampled, y)
  tokens = jnp.argmax(score, axis=-1).astype(jnp.int32)
  stop = jnp.any(args.stop_ids == tokens[:, None], axis=-1)
  return tokens, stop


# ---------------------------------------------------------------------------- kernel
def _sample_stop_kernel(
  *refs, vocab: int, block_v: int, num_stop: int, block_m: int, has_bias: bool, has_allowed: bool
):
  """One program per row: [top-k threshold search], argmax pass, stop lookup."""
  refs = list(refs)
  logits_ref = refs.pop(0)  # [B, V]
  bias_ref = refs.pop(0) if has_bias else None  # [B, V]
  allowed_ref = refs.pop(0) if has_allowed else None  # [B, W] u32
  inv_t_ref, greedy_ref, top_k_ref, seed_ref, step_ref = refs[:5]  # [B] x4, [1]
  refs = refs[5:]
  stop_ids_ref = refs.pop(0) if num_stop else None  # [B, M]
  token_ref, stop_ref = refs  # [B], [B]

  row = pl.program_id(0)
  inv_t = inv_t_ref[row]
  top_k = top_k_ref[row]
  num_blocks = pl.cdiv(vocab, block_v)
  num_words = pl.cdiv(vocab, _WORD_BITS)

  def load_allowed(i, cols):
    """Bool [block_v]: which tokens of vocab block i are allowed, from the block's mask words."""
    if block_v >= _WORD_BITS:
      # The block's block_v / 32 words, one load; each word's 32 bits spread along a new
      # minor axis whose row-major flattening is the block's token order.
      words_per_block = block_v // _WORD_BITS
      word_cols = i * words_per_block + jnp.arange(words_per_block, dtype=jnp.int32)
      words = pltriton.load(allowed_ref.at[row, word_cols], mask=word_cols < num_words, other=0)
      bits = words[:, None] >> jnp.arange(_WORD_BITS, dtype=jnp.uint32)[None, :]
      return (bits & np.uint32(1)).reshape(block_v) != 0
    # A block smaller than a word (tiny vocabularies) lies inside one word: blocks are aligned.
    word = allowed_ref[row, (i * block_v) // _WORD_BITS]
    return ((word >> (cols & (_WORD_BITS - 1)).astype(jnp.uint32)) & np.uint32(1)) != 0

  def load_y(i):
    """y for vocab block i (float32 [block_v]) and its in-vocabulary mask."""
    cols = i * block_v + jnp.arange(block_v, dtype=jnp.int32)
    in_vocab = cols < vocab
    s = pltriton.load(logits_ref.at[row, cols], mask=in_vocab, other=0).astype(jnp.float32)
    if bias_ref is not None:
      s = s + pltriton.load(bias_ref.at[row, cols], mask=in_vocab, other=0.0)
    if allowed_ref is not None:
      s = jnp.where(load_allowed(i, cols), s, -jnp.inf)
    return cols, in_vocab, s * inv_t

  def count_at_least(threshold):
    def body(i, count):
      _, in_vocab, y = load_y(i)
      hit = in_vocab & (_order_key(y) >= threshold)
      return count + jnp.sum(hit.astype(jnp.int32))

    return lax.fori_loop(0, num_blocks, body, np.int32(0))

  def top_k_threshold():
    """Key of the top_k-th largest y: binary search on the order keys."""

    def key_range(i, carry):
      lo, hi = carry
      _, in_vocab, y = load_y(i)
      key = _order_key(y)
      lo = jnp.minimum(lo, jnp.min(jnp.where(in_vocab, key, np.int32(2**31 - 1))))
      hi = jnp.maximum(hi, jnp.max(jnp.where(in_vocab, key, np.int32(-(2**31)))))
      return lo, hi

    lo, hi = lax.fori_loop(0, num_blocks, key_range, (np.int32(2**31 - 1), np.int32(-(2**31))))
    # Invariant: count(key >= lo) >= k > count(key >= hi). hi = max + 1 cannot
    # overflow for non-NaN keys; the midpoint is computed without overflow.
    hi = hi + 1

    def midpoint(lo, hi):
      return (lo >> 1) + (hi >> 1) + (lo & hi & 1)

    def cond(carry):
      lo, hi = carry
      return midpoint(lo, hi) > lo

    def body(carry):
      lo, hi = carry
      mid = midpoint(lo, hi)
      enough = count_at_least(mid) >= top_k
      return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, _ = lax.while_loop(cond, body, (lo, hi))
    return lo

  # Without top-k every key passes. The branch must return a computed value:
  # Triton's cond lowering cannot yield a literal.
  threshold = lax.cond(top_k > 0, lambda k: top_k_threshold(), lambda k: jnp.minimum(k, np.int32(-(2**31))), top_k)

  def argmax_pass(add_noise: bool):
    if add_noise:
      row_key = _row_key(seed_ref[row], step_ref[0].astype(jnp.uint32), row.astype(jnp.uint32))

    def body(i, carry):
      best, best_index = carry
      cols, in_vocab, y = load_y(i)
      keep = in_vocab & (_order_key(y) >= threshold)
      score = jnp.where(keep, y, -jnp.inf)
      if add_noise:
        score = score + _gumbel(row_key, cols)
      block_best = jnp.max(score)
      block_index = i * block_v + jnp.argmax(score).astype(jnp.int32)
      # Strictly greater: an earlier block wins ties, so the lowest index wins.
      better = block_best > best
      return (jnp.where(better, block_best, best), jnp.where(better, block_index, best_index))

    _, index = lax.fori_loop(0, num_blocks, body, (np.float32(-np.inf), np.int32(0)))
    return index

  token = lax.cond(greedy_ref[row] != 0, lambda: argmax_pass(False), lambda: argmax_pass(True))
  token_ref[row] = token

  hit = np.int32(0)
  if stop_ids_ref is not None:

    def stop_body(j, hit):
      cols = j * block_m + jnp.arange(block_m, dtype=jnp.int32)
      ids = pltriton.load(stop_ids_ref.at[row, cols], mask=cols < num_stop, other=-1)
      # A max over 0/1, not jnp.any: Triton has no lowering for reduce_or.
      return jnp.maximum(hit, jnp.max((ids == token).astype(jnp.int32)))

    hit = lax.fori_loop(0, pl.cdiv(num_stop, block_m), stop_body, hit)
  stop_ref[row] = hit


def _sample_stop_pallas(args: _Prepared, *, interpret: bool, block_v: int | None) -> tuple[jax.Array, jax.Array]:
  num_rows, vocab = args.logits.shape
  num_stop = args.stop_ids.shape[1]
  if block_v is None:
    block_v = min(pl.next_power_of_2(vocab), _MAX_BLOCK_V)
  block_m = min(pl.next_power_of_2(max(num_stop, 1)), _MAX_BLOCK_M)
  kernel = functools.partial(
    _sample_stop_kernel,
    vocab=vocab,
    block_v=block_v,
    num_stop=num_stop,
    block_m=block_m,
    has_bias=args.logit_bias is not None,
    has_allowed=args.allowed is not None,
  )
  inputs = [args.logits]
  if args.logit_bias is not None:
    inputs.append(args.logit_bias)
  if args.allowed is not None:
    inputs.append(args.allowed)
  inputs += [args.inv_temperature, args.greedy, args.top_k, args.seed, args.step]
  if num_stop:
    inputs.append(args.stop_ids)
  tokens, stop = pl.pallas_call(
    kernel,
    out_shape=(jax.ShapeDtypeStruct((num_rows,), jnp.int32), jax.ShapeDtypeStruct((num_rows,), jnp.int32)),
    grid=(num_rows,),
    # Explicit Triton params: without them current JAX lowers Pallas to
    # Mosaic GPU on NVIDIA.
    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="sample_stop",
  )(*inputs)
  return tokens, stop != 0


# -------------------------------------------------------------------------- dispatch
def sample_stop(
  logits: jax.Array,  # [B, V] f32 | bf16
  *,
  temperature: jax.Array,  # [B] f32
  top_k: jax.Array,  # [B] i32
  seed: jax.Array,  # [B] u32
  step: jax.Array | int,  # [] i32
  stop_ids: jax.Array,  # [B, M] i32, padded with -1
  logit_bias: jax.Array | None = None,  # [B, V] f32
  allowed: jax.Array | None = None,  # [B, W] u32
  implementation: Implementation | None = None,
  interpret: bool | None = None,
  block_v: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row and flags rows whose token is a stop token.

  See the module docstring for the exact contract. Traceable under ``jax.jit``
  and inside ``lax.while_loop`` bodies (``step`` may be traced).

  Args:
    logits: [B, V] float32 or bfloat16; V need not be a power of two.
    temperature: [B] float32; <= 0 means greedy. A scalar is broadcast.
    top_k: [B] int32; <= 0 or >= V keeps every token. A scalar is broadcast.
    seed: [B] uint32 (other integer dtypes are reinterpreted as uint32).
    step: scalar int32, the decode step.
    stop_ids: [B, M] int32 padded with -1; M may be 0.
    logit_bias: optional [B, V] float32, added before temperature.
    allowed: optional uint32 [B, W] bitmask, W = mask_words(V): bit v & 31 of word v >> 5 set
      means token v may be sampled (build it with pack_allowed). Disallowed tokens are -inf
      after the bias, before temperature and top-k; a row with none allowed gives token 0.
      None allows every token at no cost. Another shape or dtype raises AllowedMaskError.
    implementation: "pallas", "xla" or None (the default of kernels/dispatch.py).
    interpret: run the Pallas kernel interpreted; None means "unless on GPU".
    block_v: vocabulary block of the kernel, a power of two (default
      min(next_power_of_2(V), 2048)); a tuning knob, the result never depends on it.

  Returns:
    (tokens [B] int32, stop [B] bool).
  """
  implementation, interpret = resolve_dispatch(implementation, interpret)
  if implementation == "xla":
    return sample_stop_reference(
      logits,
      temperature=temperature,
      top_k=top_k,
      seed=seed,
      step=step,
      stop_ids=stop_ids,
      logit_bias=logit_bias,
      allowed=allowed,
    )
  if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
    raise ValueError(
      f"sample_stop: block_v must be a power of two (Triton block shapes are), "
      f"got {block_v}; pass e.g. {pl.next_power_of_2(max(block_v, 1))} or None."
    )
  args = prepare_inputs(logits, temperature, top_k, seed, step, stop_ids, logit_bias, allowed)
  return _sample_stop_pallas(args, interpret=interpret, block_v=block_v)


def resolve_dispatch(implementation: str | None, interpret: bool | None) -> tuple[str, bool]:
  """Resolves ``implementation``/``interpret`` defaults for the current backend (the rule: kernels/dispatch.py)."""
  interpret = dispatch.interpret_default() if interpret is None else bool(interpret)
  return dispatch.resolve(implementation, name="implementation"), interpret

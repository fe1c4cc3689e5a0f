"""Sampling settings (host side) and the in-program sampler.

The sampler applies logit bias, temperature, top-k (and top-p when asked), draws with
Gumbel-max from a counter-based RNG keyed by (seed, step, row) or takes the argmax,
and flags rows whose token is a stop token. The fused pass lives in
:mod:`thoughtjax.kernels.sample_stop` (Pallas kernel and pure-jnp reference); top-p
needs a sort over the vocabulary, so it is applied here as a mask before that pass.
Top-k needs no sort: the reference's :func:`~thoughtjax.kernels.sample_stop.kth_largest` finds each
row's k-th largest value exactly by a 32-step search over the float bits (the same threshold a sort
gives, so the same tokens).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.constraint import Constraint
from thoughtjax.defaults import DEFAULT_MAX_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.kernels.sample_stop import sample_stop, unpack_allowed

LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range): -100 bans a token, 100 forces it


class SamplingError(UserError, ValueError):
  """Sampling settings out of range; the message names the setting, its range and the value."""


class SamplingMode(enum.Enum):
  """What the compiled sampler must be able to do; part of a program's cache key."""

  GREEDY = "greedy"
  SAMPLE = "sample"
  SAMPLE_TOP_P = "sample_top_p"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick tokens for one request. temperature 0 is greedy."""

  max_tokens: int = DEFAULT_MAX_TOKENS
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  logit_bias: Mapping[int, float] | None = None
  stop_token_ids: Sequence[int] = ()
  stop_strings: Sequence[str] = ()
  ignore_eos: bool = False  # keep generating past the end-of-sequence token (benchmarks)
  # Constrained decoding, at most one: a JSON Schema (JSON text or a dict), a regular expression the whole
  # output matches, or a grammar (see :mod:`thoughtjax.constraint`). Each step samples only tokens
  # that keep the output a prefix of that language; end-of-sequence only once the output is complete.
  json_schema: str | Mapping | None = None
  regex: str | None = None
  grammar: str | None = None

  def __post_init__(self):
    # Every numeric setting is checked for its type's range here, so a value past int32 or a NaN is a
    # SamplingError naming it, never an overflow (or a silent garbage row) when the arrays are built.
    _int_in("max_tokens", self.max_tokens, 1, INT32_MAX, "ask for at least one token")
    if not _finite(self.temperature) or self.temperature < 0:
      raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
    _int_in("top_k", self.top_k, 0, INT32_MAX, "0 turns top-k off")
    if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
      raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
    _int_in("seed", self.seed, 0, 2**32 - 1, "seeds are 32-bit")
    for tok in self.stop_token_ids:
      _int_in("stop_token_ids", tok, 0, INT32_MAX, "send token ids of the model's vocabulary")
    for tok, bias in (self.logit_bias or {}).items():
      _int_in("logit_bias token", tok, 0, INT32_MAX, "send token ids of the model's vocabulary")
      if not _finite(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
        raise SamplingError(
          f"logit_bias[{tok}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] (OpenAI's range), "
          f"got {bias}; -100 bans a token, 100 forces it"
        )
    if isinstance(self.stop_strings, str):
      raise SamplingError(f"stop_strings must be a sequence of strings, got the string {self.stop_strings[:40]!r}")
    for i, s in enumerate(self.stop_strings):
      if not isinstance(s, str):
        raise SamplingError(f"stop_strings: each must be a string, got {s!r}")
      if not s:
        raise SamplingError(f"stop_strings[{i}]: an empty stop string would stop at once; drop it")
    # At most one constraint, each well-formed text (ConstraintError names which); compiling it against a
    # tokenizer happens where the model is known.
    object.__setattr__(self, "_constraint", Constraint.of(self.json_schema, self.regex, self.grammar))

  @property
  def constraint(self) -> Constraint | None:
    """The request's output constraint, or None."""
    return self._constraint

  def check_model(self, vocab_size: int) -> None:
    """Raise :class:`SamplingError` unless every id and count fits a model of ``vocab_size`` tokens (the rest of
    a request is checked against its model by :func:`thoughtjax.decode.request.check_request`)."""
    if self.top_k > vocab_size:
      raise SamplingError(
        f"top_k must be at most the vocabulary size {vocab_size} (0 = off), got {self.top_k}; send a smaller top_k"
      )
    bad = [t for t in (*self.stop_token_ids, *(self.logit_bias or {})) if not 0 <= int(t) < vocab_size]
    if bad:
      raise SamplingError(
        f"token id {bad[0]} (stop_token_ids or logit_bias) is outside the vocabulary [0, {vocab_size}); "
        f"send ids the model's tokenizer produces"
      )

  @property
  def mode(self) -> SamplingMode:
    if self.temperature == 0:
      return SamplingMode.GREEDY
    return SamplingMode.SAMPLE_TOP_P if self.top_p < 1.0 else SamplingMode.SAMPLE


INT32_MAX = 2**31 - 1  # the sampler's arrays are int32


def _finite(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def _int_in(name: str, v, lo: int, hi: int, fix: str) -> None:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
    raise SamplingError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}; {fix}")


def program_mode(params: Sequence[SamplingParams]) -> SamplingMode:
  """The least capable mode that serves every row of a batch."""
  modes = {p.mode for p in params}
  for m in (SamplingMode.SAMPLE_TOP_P, SamplingMode.SAMPLE):
    if m in modes:
      return m
  return SamplingMode.GREEDY


class SamplingArrays(NamedTuple):
  """Per-row sampling settings as arrays; padded rows are inert."""

  temperature: jax.Array  # [B] f32
  top_k: jax.Array  # [B] i32
  top_p: jax.Array  # [B] f32
  seed: jax.Array  # [B] u32
  max_new: jax.Array  # [B] i32
  stop_ids: jax.Array  # [B, M] i32, -1 padded
  logit_bias: jax.Array | None  # [B, V] f32
  allowed: jax.Array | None = None  # [B, ceil(V / 32)] u32 bitmask of the tokens each row may take (constraints)


def sampling_arrays(
  params: Sequence[SamplingParams], batch: int, vocab: int, stop_width: int, eos_id: int | None, with_bias: bool
) -> SamplingArrays:
  """Stack per-request settings into arrays for ``batch`` rows (extra rows: 1 greedy token)."""
  temp = np.zeros(batch, np.float32)
  top_k = np.zeros(batch, np.int32)
  top_p = np.ones(batch, np.float32)
  seed = np.zeros(batch, np.uint32)
  max_new = np.ones(batch, np.int32)
  stops = np.full((batch, stop_width), -1, np.int32)
  bias = np.zeros((batch, vocab), np.float32) if with_bias else None
  for i, p in enumerate(params):
    temp[i], top_k[i], top_p[i], seed[i], max_new[i] = p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens
    ids = stop_ids_for(p, eos_id)
    stops[i, : len(ids)] = ids
    for tok, b in (p.logit_bias or {}).items():
      if not 0 <= int(tok) < vocab:
        raise SamplingError(f"logit_bias names token {tok}, outside the vocabulary [0, {vocab})")
      bias[i, int(tok)] += b
  return SamplingArrays(
    # device_put, not jnp.asarray: no small program traced and compiled per array in a new process.
    *(jax.device_put(a) for a in (temp, top_k, top_p, seed, max_new, stops)),
    None if bias is None else jax.device_put(bias),
  )


def stop_ids_for(p: SamplingParams, eos_id: int | Sequence[int] | None) -> list[int]:
  """The request's stop ids, then every end-of-sequence id (one, or a codec's ``eos_ids``) unless
  ``ignore_eos``; de-duplicated, in order."""
  ids = list(dict.fromkeys(int(t) for t in p.stop_token_ids))
  eos = [] if eos_id is None or p.ignore_eos else [eos_id] if isinstance(eos_id, (int, np.integer)) else eos_id
  return list(dict.fromkeys(ids + [int(e) for e in eos]))


def top_p_mask(logits: jax.Array, s: SamplingArrays) -> jax.Array:
  """logits [B, V] with everything outside each row's nucleus set to -inf.

  The nucleus is taken over the biased, tempered, top-k-filtered distribution, as
  Hugging Face's warpers do (top-k before top-p); the fused sampler then re-applies
  bias, temperature and top-k, which leave the -inf entries at -inf.
  """
  x = logits.astype(jnp.float32)
  if s.logit_bias is not None:
    x = x + s.logit_bias
  if s.allowed is not None:  # the nucleus of what the constraint allows, as the fused sampler sees it
    x = jnp.where(unpack_allowed(s.allowed, x.shape[-1]), x, -jnp.inf)
  x = x / jnp.maximum(s.temperature, 1e-6)[:, None]
  order = jnp.sort(x, axis=-1)[:, ::-1]  # [B, V] descending
  V = x.shape[-1]
  k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)
  ranks = jnp.arange(V)[None, :]
  order = jnp.where(ranks < k[:, None], order, -jnp.inf)
  probs = jax.nn.softmax(order, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
  keep = before < s.top_p[:, None]
  keep = keep.at[:, 0].set(True)
  threshold = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1)  # [B]
  return jnp.where(x >= threshold[:, None], logits, -jnp.inf).astype(logits.dtype)


def sample(
  logits: jax.Array, s: SamplingArrays, step: jax.Array, mode: SamplingMode, implementation: str | None = None
) -> tuple[jax.Array, jax.Array]:
  """Token [B] i32 and stop flag [B] bool for logits [B, V]."""
  if mode is SamplingMode.SAMPLE_TOP_P:
    logits = top_p_mask(logits, s)
  temperature = jnp.zeros_like(s.temperature) if mode is SamplingMode.GREEDY else s.temperature
  return sample_stop(
    logits,
    temperature=temperature,
    top_k=s.top_k,
    seed=s.seed,
    step=step,
    stop_ids=s.stop_ids,
    logit_bias=s.logit_bias,
    allowed=s.allowed,
    implementation=implementation,
  )

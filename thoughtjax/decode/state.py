"""The decode state every row of a plain or slot program lives in, and the one decode step over it.

Plain generation is a pool whose rows are all filled by one prefill and never refilled; a slot engine's pool
refills a row when its request ends (continuous batching). Both keep their rows in one :class:`DecodeState` over
the ring layout of :mod:`thoughtjax.decode.layout` (a plain program's ring holds the prompt and every new token,
so it never wraps) and both decode with :func:`decode_chunk`: one traced step, one way to sample, record and stop.
Self-speculative decoding (:mod:`thoughtjax.decode.speculative`) keeps the same state after the same prefill
(:func:`prefilled`); its advance is a draft/verify iteration in which each row moves ahead by the tokens it
accepted, so there row b's next key goes to slot ``cursor + count[b] - 1``.

Row ``r``'s tokens are ``out[r, :count[r]]``: the prefill's token first, then one per step while the row runs.
Sampling draws step ``cursor - base``'s random numbers (``base``: the program's, see :func:`decode_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.decode import layout
from thoughtjax.sampling import SamplingArrays, SamplingMode, sample

_EVERY_TOKEN = np.uint32(0xFFFFFFFF)  # an allowed-token mask word that allows all 32 ids

# run(tokens [B, 1], positions [B, 1], caches, write_at, mask [B, 1, S]) -> (logits [B, 1, V], caches)
RunPath = Callable[..., tuple[jax.Array, tuple]]


class DecodeState(NamedTuple):
  """The device state of a pool's rows (the plain program's rows: the request's prompts; a slot engine's: slots)."""

  caches: tuple[tuple[jax.Array, jax.Array], ...]  # per path block: keys, values [B, K, S, E] (a bridge: [B, 1, 1, 1])
  token: jax.Array  # [B] i32, each row's last token
  start: jax.Array  # [B] i32, absolute time of each row's first prompt key
  cursor: jax.Array  # [] i32, absolute time the next step writes (at ring index cursor mod S)
  done: jax.Array  # [B] bool, the row stopped (or holds no request)
  count: jax.Array  # [B] i32, tokens generated per row (the prefill's included)
  out: jax.Array  # [B, W] i32, each row's tokens at [0, count), -1 after


def empty(caches, rows: int, width: int, *, free: bool) -> DecodeState:
  """A state of ``rows`` rows around empty ``caches``, each with room for ``width`` tokens; ``free``: every row
  holds no request yet (a slot engine's), else every row runs once its prompt is in (a plain program's)."""
  zeros = jnp.zeros(rows, jnp.int32)
  out = jnp.full((rows, width), -1, jnp.int32)
  return DecodeState(tuple(caches), zeros, zeros, jnp.zeros((), jnp.int32), jnp.full(rows, free), zeros, out)


def record(state: DecodeState, token, stop, samp: SamplingArrays, live) -> DecodeState:
  """``token`` [B] as the next token of every ``live`` row: written at its column ``count``; a row is done once
  it sampled a stop token or reached its ``max_new``. Other rows keep their token and count."""
  count = state.count + live.astype(jnp.int32)
  done = state.done | (live & (stop | (count >= samp.max_new)))
  B, W = state.out.shape
  out = state.out.at[jnp.arange(B), jnp.where(live, state.count, W)].set(token, mode="drop")
  return state._replace(token=jnp.where(live, token, state.token), done=done, count=count, out=out)


def prefilled(state: DecodeState, caches, pad, prompt_len: int, token, stop, samp: SamplingArrays) -> DecodeState:
  """``state`` after the prefill of left-padded prompts at ring slots [0, T) (row b's from ``pad[b]``, so it starts
  there; the cursor moves to T) gave ``caches`` and every row's first token, sampled as step 0."""
  state = state._replace(caches=tuple(caches), start=pad.astype(jnp.int32), cursor=jnp.asarray(prompt_len, jnp.int32))
  return record(state, token, stop, samp, ~state.done)


def decode_chunk(
  run: RunPath,
  state: DecodeState,
  samp: SamplingArrays,
  active: jax.Array,
  mode: SamplingMode,
  kernels: str | None,
  *,
  steps: int | jax.Array,
  ring: int,
  base: int = 0,
  limit: int | None = None,
) -> tuple[DecodeState, jax.Array]:
  """Up to ``steps`` decode steps of the ``active`` rows still running (traced code); returns the state and the
  steps run. ``ring``: the caches' slots. A step feeds every row's last token through ``run`` at the cursor (positions and mask:
  :func:`~thoughtjax.decode.layout.ring_step`), samples step ``cursor - base`` and :func:`record`\\ s the
  tokens. ``limit``: no step writes at or past this absolute time (a ring that must not wrap). ``samp.allowed``
  (the constrained rows' allowed-token masks) holds for the chunk's first step only, the one whose mask the host
  knew; later steps sample freely and a slot engine checks their tokens against each row's matcher
  (:meth:`~thoughtjax.serving.slots.SlotEngine.step`)."""

  def body(c):
    i, st = c
    live = active & ~st.done
    positions, mask, w = layout.ring_step(st.cursor, st.start, ring)
    logits, caches = run(st.token[:, None], positions, st.caches, w, mask)
    s = samp if samp.allowed is None else samp._replace(allowed=jnp.where(i == 0, samp.allowed, _EVERY_TOKEN))
    token, stop = sample(logits[:, -1], s, st.cursor - base, mode, kernels)
    st = record(st._replace(caches=tuple(caches), cursor=st.cursor + 1), token, stop, samp, live)
    return i + 1, st

  def cond(c):
    i, st = c
    go = (i < steps) & jnp.any(active & ~st.done)
    return go if limit is None else go & (st.cursor < limit)

  n, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
  return state, n

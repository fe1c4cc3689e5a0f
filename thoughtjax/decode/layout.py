"""The attention layout: where a row's keys sit in a KV cache, which RoPE position each query takes and which
cache slots each query sees.

Every program that decodes (plain, layer-indexed, self-speculative, a slot engine's ring) and every pass that
scores whole sequences (scoring, a thoughtlet's replay and profile) builds its positions and masks here, so the
layouts they share stay one definition. It builds on the model's config and cache shape alone, so the thoughtlet
package, which sits below the decode layer, may use it too.

Two cache layouts:

* **Left-padded rows** (plain and speculative programs; a slot engine's chunked prefill is the case ``pad = 0``).
  Row ``b``'s prompt sits in slots ``[pad[b], T)`` of a cache of ``S >= T`` slots and every generated token follows it in order, so a key's
  slot is also its time; its RoPE position is ``slot - pad[b]``. A query at slot ``q`` sees slots
  ``[pad[b], q]``. A padding query sees itself only, so no softmax row is empty (no NaN).
* **A ring** (a slot engine's decode). All rows share one cursor (absolute time) and row ``b`` started at
  ``start[b]``; absolute time ``c`` is written at ring index ``c % S``, its RoPE position is ``c - start[b]``, and a
  query sees every ring index whose key is not older than the row's start.

Masks are ``[B, T, S]`` bool (query rows by cache slots), positions ``[B, T]`` int32: what
:func:`~thoughtjax.transformer.run_path` takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from thoughtjax.config import ModelConfig
from thoughtjax.transformer import kv_cache_shape

Caches = tuple[tuple[jax.Array, jax.Array], ...]


def empty_caches(cfg: ModelConfig | None, layers, batch: int, length: int, dtype=jnp.float32) -> Caches:
  """Zero (keys, values) caches of ``length`` slots, one pair per entry of ``layers``. A bridge (a negative
  layer) reads no keys: it gets a one-element placeholder per row, not a cache; so does every entry when
  ``cfg`` is None (a path of bridges only)."""
  placeholder = (batch, 1, 1, 1)
  shape = placeholder if cfg is None else kv_cache_shape(cfg, batch, length)
  return tuple((jnp.zeros(shape if i >= 0 else placeholder, dtype),) * 2 for i in layers)


def causal(batch: int, length: int) -> tuple[jax.Array, jax.Array]:
  """Whole sequences from slot 0, no padding: positions [B, T] = 0..T-1 and the causal mask [B, T, T]."""
  positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool))[None], (batch, length, length))
  return positions, mask


def prefill(pad: jax.Array, prompt_len: int, cache_len: int) -> tuple[jax.Array, jax.Array]:
  """Left-padded prompts [B, T] written at slots [0, T) of a cache of ``cache_len`` slots: positions [B, T]
  (0 from each row's first real token; padding at 0) and mask [B, T, S]."""
  t, s = jnp.arange(prompt_len), jnp.arange(cache_len)
  positions = jnp.maximum(t[None, :] - pad[:, None], 0)
  mask = ((s[None, None, :] >= pad[:, None, None]) & (s[None, None, :] <= t[None, :, None])) | (
    s[None, None, :] == t[None, :, None]
  )
  return positions, mask


def steps_at(pad: jax.Array, slots: jax.Array, cache_len: int) -> tuple[jax.Array, jax.Array]:
  """Queries at cache ``slots`` [B, T] of left-padded rows (``pad`` [B]) after the prompt: positions [B, T] and
  mask [B, T, S]. A decode step is T = 1; a speculative verify pass is the K + 1 slots it checks at once."""
  s = jnp.arange(cache_len)
  positions = slots - pad[:, None]
  mask = (s[None, None, :] >= pad[:, None, None]) & (s[None, None, :] <= slots[:, :, None])
  return positions, mask


def step_at(pad: jax.Array, slot: jax.Array, cache_len: int) -> tuple[jax.Array, jax.Array]:
  """One decode step at cache ``slot`` (a scalar shared by every row, or one per row [B]): positions [B, 1] and
  mask [B, 1, S]."""
  slots = jnp.broadcast_to(slot, pad.shape)[:, None]
  return steps_at(pad, slots, cache_len)


def ring_behind(cursor: jax.Array, ring_len: int) -> jax.Array:
  """How far behind the ``cursor`` each ring index's key was written [S]: 1 for the newest, S for the oldest
  (0 at the index the cursor writes next)."""
  return (cursor - jnp.arange(ring_len, dtype=jnp.int32)) % ring_len


def ring_step(cursor: jax.Array, start: jax.Array, ring_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decode step of every row of a ring at absolute time ``cursor`` (rows started at ``start`` [N]):
  positions [N, 1], mask [N, 1, S] and the ring index written (``cursor % S``). A free row (start past the
  cursor) sees the index it writes only: no NaN."""
  s = jnp.arange(ring_len, dtype=jnp.int32)
  w = cursor % ring_len
  positions = jnp.maximum(cursor - start, 0)[:, None]
  absolute = cursor - (cursor - s) % ring_len  # the absolute time held at each ring index
  mask = (absolute[None, :] >= start[:, None]) | (s == w)[None, :]
  return positions, mask[:, None, :], w

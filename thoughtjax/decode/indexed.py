"""The layer-indexed form of a generation program: one loop over stacked layer weights, driven by an index vector.

The unrolled form (:class:`~thoughtjax.decode.program.Program`) traces every block of a path into the program, so its
executable grows with the path and a path of another length compiles again. This form stacks the blocks a model
holds once (every weight gets a leading axis over the held layers, :func:`stack`) and runs a ``lax.fori_loop``
over the path's positions: position p reads the weights of layer ``index[p]`` and its own KV cache, ``count``
positions in all. The path is data, so every path over the same held blocks of at most ``max_layers`` positions
(the model's layer count, doubled until the path fits) runs one compiled program. A path composed over a model's
own weights runs on that model's stack when the stack holds every block it runs (:func:`covers`; the model's
``with_path``), so a path holding fewer of the blocks shares that executable too.

It computes what the unrolled form computes, block by block in the same order (``tests/decode/test_indexed.py``
checks tokens against it); paths with bridges have no indexed form. Which form is faster on this machine, and by
how much, is measured by ``thoughtjax bench layers`` (BENCHMARKS.md); ``thoughtjax.load`` defaults to this form for
native weights and to the unrolled one for float32 (``thoughtjax.model.DEFAULT_LAYOUT``). The slot engines' programs
have this form too (:class:`~thoughtjax.serving.slot_program.SlotProgram`, its caches [positions, N, K, S, E]), and
:func:`run_blocks` is the loop both run: a block hands back only its new keys and values, which go into the stack in
place after the loop. A slot program's decode step reads its ring by blocks: each row's queries see only the keys of
its own request, so the step gathers the (row, block) pairs its rows' masks allow instead of every row's whole ring
(16 users of mixed prompt lengths over a 512-slot ring: a decode step about twice as fast, BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from thoughtjax.decode.program import Program
from thoughtjax.transformer import PathParts, blocks_needed, key_blocks, kv_cache_shape, rope_tables

LAYOUTS = ("unrolled", "indexed")


class StackedParts(NamedTuple):
  """What an indexed program takes in place of a path's parts."""

  embed: nnx.State
  blocks: nnx.State  # every leaf [L, ...]: the held layers, in ascending layer order
  head: nnx.State
  index: jax.Array  # [max_layers] i32: row of ``blocks`` at each path position (0 past ``count``)
  count: jax.Array  # i32: positions in use


class Stack(NamedTuple):
  """Blocks stacked for an indexed program: ``blocks`` holds layer ``held[r]`` at row r."""

  held: tuple[int, ...]  # the stacked layers, ascending
  blocks: nnx.State  # every leaf [len(held), ...]


def stack(parts: PathParts) -> Stack:
  """The blocks ``parts`` holds, stacked along a new leading axis in ascending layer order (a copy)."""
  held = tuple(sorted(parts.blocks))
  if any(i < 0 for i in held):
    raise ValueError("a path with a bridge has no layer-indexed form; run it unrolled")
  return Stack(held, jax.tree.map(lambda *xs: jnp.stack(xs), *[parts.blocks[i] for i in held]))


def covers(stacked: Stack, source: PathParts, parts: PathParts) -> bool:
  """Whether ``stacked`` (the :func:`stack` of ``source``) serves ``parts`` too: every block ``parts`` holds is
  ``source``'s block of that layer, the same arrays (a path composed over the same loaded weights). Then the
  path runs on that stack, whose shape is the same for every such path, so they share one executable."""
  held = set(stacked.held)
  for i, block in parts.blocks.items():
    if i not in held:
      return False
    mine, theirs = jax.tree.leaves(block), jax.tree.leaves(source.blocks[i])
    if len(mine) != len(theirs) or any(x is not y for x, y in zip(mine, theirs, strict=True)):
      return False
  return True


def max_layers(path_len: int, num_layers: int) -> int:
  """Positions an indexed program holds: ``num_layers``, doubled until ``path_len`` fits."""
  n = num_layers
  while n < path_len:
    n *= 2
  return n


def stacked_parts(parts: PathParts, stacked: Stack, layers: Sequence[int], positions: int) -> StackedParts:
  """``layers`` as an index vector over ``stacked`` (holding every layer of ``layers``), padded to ``positions``;
  embedding and head from ``parts``."""
  row = {layer: r for r, layer in enumerate(stacked.held)}
  index = np.zeros(positions, np.int32)
  index[: len(layers)] = [row[i] for i in layers]
  return StackedParts(parts.embed, stacked.blocks, parts.head, jnp.asarray(index), jnp.asarray(len(layers), jnp.int32))


class IndexedProgram(Program):
  """A :class:`~thoughtjax.decode.program.Program` whose path is a loop over stacked weights (see the module docstring).

  Its key's ``layers`` are ``range(max_layers)`` (the positions it holds caches for) and its ``layout``
  ``"indexed"``; ``advance`` takes :class:`StackedParts` where the unrolled form takes the path's parts."""

  def _init_caches(self) -> tuple:
    k = self.key
    return empty_caches(self.cfg, len(k.layers), k.batch, k.cache_len)

  def _run(self, parts: StackedParts, tokens, positions, caches, write_at, mask, embeddings=None, *, last=False):
    embed, head = nnx.merge(self.defs.embed, parts.embed), nnx.merge(self.defs.head, parts.head)
    x = embed(tokens) if embeddings is None else embeddings
    cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
    x, caches = run_blocks(self.defs, parts, x, cos, sin, caches, write_at, mask)
    return head(x[:, -1:] if last else x, embed.table[...]), caches


def empty_caches(cfg, positions: int, batch: int, length: int) -> tuple:
  """Zero caches of an indexed program: one (keys, values) pair, each [positions, B, K, S, E]."""
  shape = (positions, *kv_cache_shape(cfg, batch, length))
  return ((jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)),)  # two arrays: each may be donated


# A slot program reads its caches in part where it can. A decode step of its ring reads them by blocks of
# S / KEY_BLOCKS slots: only the (row, block) pairs its rows' masks allow (rows share the ring, each attends over its
# own request's keys). A prefill chunk reads the slots before its end only (a prompt's key i sits at slot i). Each is
# compiled for these fractions of what it could read (pairs, slots) and for the whole caches, and a call takes the
# smallest that holds what it reads.
KEY_BLOCKS = 16
READ_FRACTIONS = (1 / 8, 1 / 4, 1 / 2)
READS = ("all", "blocks", "prefix")


def pair_budgets(rows: int, ring: int) -> tuple[int, ...]:
  """The pair budgets a ring decode step of ``rows`` rows is compiled for (empty: it reads whole caches)."""
  if ring % KEY_BLOCKS or ring < 4 * KEY_BLOCKS:
    return ()
  return tuple(sorted({max(1, int(rows * KEY_BLOCKS * f)) for f in READ_FRACTIONS}))


def prefix_windows(tokens: int, length: int) -> tuple[int, ...]:
  """The leading slots a prefill chunk of ``tokens`` over caches of ``length`` is compiled to read (and all)."""
  return tuple(sorted({int(length * f) for f in READ_FRACTIONS if tokens <= int(length * f) < length}))


def run_blocks(defs, parts: StackedParts, x, cos, sin, caches, write_at, mask, *, reads: str = "all"):
  """``x`` through the path's ``parts.count`` positions, in order: position p runs stacked layer ``parts.index[p]``
  on its own keys and values (``caches``: ((keys, values),), each [positions, B, K, S, E]). Returns (x, caches).

  The loop only reads the caches; every position's new keys and values go into them after it, in one write (an
  in-place update of the caches, not a copy of them). ``reads``: what of the caches a call reads. ``"all"``: all of
  them. ``"blocks"`` (one query per row): the (row, block) pairs its mask allows
  (:func:`~thoughtjax.transformer.key_blocks`), under the smallest of :func:`pair_budgets` that holds them.
  ``"prefix"`` (the mask allows no slot at or past ``write_at + T``): the first slots, the smallest of
  :func:`prefix_windows` that holds them."""
  if reads not in READS:
    raise ValueError(f"reads is one of {', '.join(READS)}; got {reads!r}")
  ((keys, values),) = caches
  P, B, K, S, E = keys.shape
  T = x.shape[1]
  at = jnp.clip(write_at, 0, S - T)  # where the new keys go (where a cache write would put them)
  # One query per row: the slots read from the caches, all those the mask allows but the one the new key replaces.
  seen = mask & (jnp.arange(S) != at)[None, None, :]

  def through(pairs: int | None = None, window: int = S):
    def run(x):
      plan = None if pairs is None else key_blocks(seen, KEY_BLOCKS, pairs)
      part = mask[..., :window]

      def body(p, carry):
        x, new_k, new_v = carry
        take = lambda a: jax.lax.dynamic_index_in_dim(a, parts.index[p], keepdims=False)  # noqa: E731
        block = nnx.merge(defs.block, jax.tree.map(take, parts.blocks))
        ck = jax.lax.dynamic_index_in_dim(keys, p, keepdims=False)[:, :, :window]
        cv = jax.lax.dynamic_index_in_dim(values, p, keepdims=False)[:, :, :window]
        x, k_new, v_new = block(x, cos, sin, ck, cv, at, part, new_only=True, blocks=plan)
        new_k = jax.lax.dynamic_update_index_in_dim(new_k, k_new.astype(new_k.dtype), p, 0)
        new_v = jax.lax.dynamic_update_index_in_dim(new_v, v_new.astype(new_v.dtype), p, 0)
        return x, new_k, new_v

      fresh = jnp.zeros((P, B, K, T, E), keys.dtype)
      return jax.lax.fori_loop(0, parts.count, body, (x, fresh, fresh))

    return run

  if reads == "blocks" and T == 1 and (budgets := pair_budgets(B, S)):
    needed, ways = blocks_needed(seen, KEY_BLOCKS), [through(pairs=n) for n in budgets]
  elif reads == "prefix" and (budgets := prefix_windows(T, S)):
    needed, ways = at + T, [through(window=w) for w in budgets]
  else:
    budgets, ways = (), []
  if budgets:  # the first budget that holds what the call reads, else the whole caches
    choice = sum((needed > n).astype(jnp.int32) for n in budgets)
    x, new_k, new_v = jax.lax.switch(choice, [*ways, through()], x)
  else:
    x, new_k, new_v = through()(x)
  # Positions past ``count`` write zeros into their own caches, which no position of this path reads.
  keys, values = (jax.lax.dynamic_update_slice_in_dim(c, new, at, 3) for c, new in ((keys, new_k), (values, new_v)))
  return x, ((keys, values),)

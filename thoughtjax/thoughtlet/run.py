"""Running one thoughtlet alone, outside any path, through the model's own module code.

Each function merges the graph definitions (:class:`~thoughtjax.transformer.GraphDefs`) with a
thoughtlet's state and calls the part; nothing here is jitted (callers own the jit boundary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
from flax import nnx

from thoughtjax.config import ModelConfig
from thoughtjax.decode.layout import causal, empty_caches
from thoughtjax.kernels.template_embed import template_embed
from thoughtjax.transformer import GraphDefs, rope_tables


def run_embed(defs: GraphDefs, state: nnx.State, tokens):  # [B, T] -> [B, T, D]
  return nnx.merge(defs.embed, state)(tokens)


def causal_setup(cfg: ModelConfig, batch: int, length: int, layers: int):
  """Fresh caches of ``length`` slots for ``layers`` blocks, write slot 0 and the causal mask [B, T, T]."""
  caches = list(empty_caches(cfg, range(layers), batch, length))
  return caches, jnp.zeros((), jnp.int32), causal(batch, length)[1]


def run_blocks(
  defs: GraphDefs,
  cfg: ModelConfig,
  states: Sequence[nnx.State],
  x,
  positions=None,
  caches=None,
  write_at=None,
  mask=None,
):
  """Blocks in order over residual x [B, T, D].

  Without caches this is a causal forward from scratch (fresh caches of T slots);
  returns the residual and the caches.
  """
  B, T = x.shape[:2]
  if positions is None:
    positions = causal(B, T)[0]
  if caches is None:
    caches, write_at, mask = causal_setup(cfg, B, T, len(states))
  cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
  new = []
  for state, (ck, cv) in zip(states, caches, strict=True):
    x, ck, cv = nnx.merge(defs.block, state)(x, cos, sin, ck, cv, write_at, mask)
    new.append((ck, cv))
  return x, new


def run_head(defs: GraphDefs, state: nnx.State, x, table=None):  # [B, T, D] -> [B, T, V]
  return nnx.merge(defs.head, state)(x, table)


def run_template(
  params: Mapping,
  table,
  user_ids,
  user_lengths,
  total_len: int,
  left_pad: bool = True,
  implementation: str | None = None,
):
  """[B, U] user ids -> [B, total_len, D]: template rows around the user rows (one pass)."""

  return template_embed(
    params["prefix_rows"],
    params["suffix_rows"],
    table,
    user_ids,
    user_lengths,
    total_len=total_len,
    left_pad=left_pad,
    implementation=implementation,
  )

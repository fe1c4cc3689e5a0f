"""Bridge thoughtlets: a small trained adapter (residual -> residual) that heals a cut path.

A bridge is a low-rank residual MLP applied position-wise::

    y = x + up(silu(down(norm(x))))       x, y [B, T, D]; down [D, R]; up [R, D]

``norm`` is an RMSNorm (float32, cast back) with its own weight. ``up`` starts at zero, so an
untrained bridge is exactly the identity and a path with it computes what the cut path computes.
Its params are a plain nested dict ``{"norm": {"weight": [D]}, "down": [D, R], "up": [R, D]}``
(``rank`` R is their shape; nothing else is configured), so one traced function serves every rank.

In a path a bridge sits where the cut is (``embed, blocks[0:10), bridge.10-30, head``); the program
runs it as a :class:`thoughtjax.transformer.BridgeLayer` between the blocks, with a block's call signature and
no KV cache of its own use; :func:`thoughtjax.transformer.apply_bridge` is its computation. This module holds
the thoughtlet side: fresh params, where a cut is, the bridged path and the published unit. Training
lives in :mod:`thoughtjax.synthesis.heal`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from thoughtjax.config import ModelConfig
from thoughtjax.path_syntax import parse_path
from thoughtjax.thoughtlet.errors import ThoughtletError
from thoughtjax.thoughtlet.types import Kind, Thoughtlet, signature_for

DEFAULT_RANK = 64


def init_params(cfg: ModelConfig, rank: int = DEFAULT_RANK, seed: int = 0) -> dict:
  """Fresh bridge params for a model with ``cfg``: unit norm, random ``down`` [D, R], zero ``up`` [R, D]."""
  if not isinstance(rank, int) or rank < 1:
    raise ThoughtletError(f"bridge rank must be a positive integer (e.g. 64, 128, 256), got {rank!r}")
  D = cfg.d_model
  down = jax.random.normal(jax.random.key(seed), (D, rank), jnp.float32) * (D**-0.5)
  return {"norm": {"weight": jnp.ones((D,), jnp.float32)}, "down": down, "up": jnp.zeros((rank, D), jnp.float32)}


def rank_of(params: Mapping) -> int:
  return int(params["down"].shape[1])


def is_bridge_slot(slot: int) -> bool:
  """Bridges live in a path's layer sequence as negative slots (blocks use slots >= 0)."""
  return slot < 0


def cut_point(path: str | Sequence, num_layers: int) -> tuple[int, tuple[int, int]]:
  """(index in the path's block sequence where the bridge goes, layers [a, b) it stands in for).

  The first gap in the layer sequence: an early exit ``blocks[0:10)`` -> (10, (10, L)); a skip
  ``blocks[0:8), blocks[10:30)`` -> (8, (8, 10)). A path that already runs every layer in order has no cut.
  """
  refs = parse_path(path) if isinstance(path, str) else list(path)
  layers: list[int] = []
  for ref in refs:
    if ref.span is not None:
      layers.extend(ref.layers(num_layers))
  for i, layer in enumerate(layers):
    if layer != i:
      if layer <= i:
        raise ThoughtletError(
          f"path {path!r} repeats layers at position {i} (layer {layer}); a bridge heals "
          f"skipped layers or an early exit, give a path whose blocks go up in order"
        )
      return i, (i, layer)
  if len(layers) >= num_layers:
    raise ThoughtletError(
      f"path {path!r} runs all {num_layers} layers; there is no cut to heal. Give an early "
      f"exit (embed, blocks[0:10), head) or a skip (embed, blocks[0:8), blocks[10:{num_layers}), head)"
    )
  return len(layers), (len(layers), num_layers)


def bridge_name(span: tuple[int, int]) -> str:
  """The registry name of the bridge standing in for layers [a, b): ``bridge.a-b``."""
  return f"bridge.{span[0]}-{span[1]}"


def bridged_path(path: str, name: str, num_layers: int) -> str:
  """``path`` with the bridge ``name`` inserted at its cut (see :func:`cut_point`)."""
  refs = parse_path(path)
  at, _ = cut_point(refs, num_layers)
  out, seen = [], 0
  for ref in refs:
    if ref.span is not None:
      a, b = ref.span
      if seen < at < seen + (b - a):  # the cut falls inside this range: split it
        out += [f"blocks[{a}:{a + at - seen})", name, f"blocks[{a + at - seen}:{b})"]
        seen += b - a
        continue
      if seen == at and name not in out:
        out.append(name)
      seen += b - a
    elif ref.name == "head" and name not in out:
      out.append(name)
    out.append(str(ref))
  return ", ".join(out)


def bridge_thoughtlet(
  cfg: ModelConfig,
  tokenizer_hash: str,
  params: Mapping,
  *,
  cut_path: str,
  span: tuple[int, int],
  report: Mapping | None = None,
) -> Thoughtlet:
  """A bridge as a :class:`Thoughtlet` (unprofiled): typed residual -> residual; its constraints record
  the cut path it heals and (``report``) how it was trained and its held-out quality before and after."""
  name = bridge_name(span)
  sig = signature_for(
    Kind.BRIDGE,
    cfg,
    tokenizer_hash,
    tags=("bridge", "heal"),
    description=f"heals layers [{span[0]}, {span[1]}) of {cut_path}",
  )
  extra = {"heals": list(span), "cut_path": cut_path, "rank": rank_of(params)}
  if report is not None:
    extra["training"] = dict(report)
  sig = dataclasses.replace(sig, constraints={**sig.constraints, **extra})
  return Thoughtlet(
    name,
    Kind.BRIDGE,
    sig,
    {"norm": {"weight": params["norm"]["weight"]}, "down": params["down"], "up": params["up"]},
    cfg,
  )

"""Orbax checkpoints of thoughtlet weights: save, and restore into dtype and sharding targets."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp


def _checkpointer():
  """A synchronous Orbax PyTree checkpointer (OCDBT). Uncompressed: weights barely compress,
  and zstd decoding made restores 2-3x slower than reading the bytes (BENCHMARKS.md)."""
  import orbax.checkpoint as ocp

  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _restore_checkpoint(ckptr, path: Path, target):
  """Restore straight into ``target``'s dtypes and shardings (``jax.ShapeDtypeStruct`` leaves)."""
  import orbax.checkpoint as ocp

  return ckptr.restore(path, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))


def _save_checkpoint(path: Path, params: Mapping) -> None:
  import orbax.checkpoint as ocp

  tree = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), dict(params))
  _checkpointer().save(path, args=ocp.args.PyTreeSave(tree))

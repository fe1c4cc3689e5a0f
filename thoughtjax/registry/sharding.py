"""How thoughtlet weights are laid out over a ("data", "model") mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec as P


def param_partition(kind: str, path: str, shape: Sequence[int], model_size: int):
  """PartitionSpec of one weight over a ("data", "model") mesh: Megatron-style tensor
  parallelism on the ``model`` axis (heads, FFN width, vocabulary), replicated over ``data``;
  a dimension that the ``model`` axis does not divide is replicated instead."""

  leaf = path.split("/")[-1]
  axis = None
  if kind == "embed" and leaf == "table":
    axis = 0  # [V, D]: vocabulary-parallel
  elif kind == "head" and leaf == "unembed":
    axis = 0
  elif kind == "blocks":
    axis = {"q": 1, "k": 1, "v": 1, "o": 0, "q_bias": 0, "k_bias": 0, "v_bias": 0, "gate": 1, "up": 1, "down": 0}.get(
      leaf
    )
  if axis is None or model_size <= 1 or shape[axis] % model_size:
    return P()
  spec = [None] * len(shape)
  spec[axis] = "model"
  return P(*spec)


def sharding_key(mesh) -> Any:
  if mesh is None:
    return None
  return (tuple(mesh.shape.items()), tuple(int(d.id) for d in mesh.devices.flat))

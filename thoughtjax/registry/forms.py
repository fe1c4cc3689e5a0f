"""Restore forms: what a restore of one thoughtlet version reads, what it returns, and what it costs resident.

A registry built from a quantized GGUF stores its matrices packed (:mod:`thoughtjax.thoughtlet.stored`).
``weights`` (per registry, or per :meth:`~thoughtjax.registry.store.Registry.restore`) says what a restore
returns, one of :data:`RESTORE_FORMS`: ``"f32"`` (default) dequantizes them at restore into the model's float32
layout, bit for bit the arrays a float32 registry held; ``"native"`` keeps them packed
(:class:`~thoughtjax.quantized.BlockQuant`, computed in float32 from the packed bytes); ``"stored"`` returns the
checkpoint's arrays as they are (what the versioned hash covers). Int8 variants come back as their stored
``{"int8", "scale"}`` arrays in every form (:func:`thoughtjax.quantized.from_stored`).

Everything here is a pure function of a manifest's ``params`` spec (and, for :func:`to_form`, the arrays restored
for it): :func:`restore_targets` gives the flat Orbax targets (path -> ``jax.ShapeDtypeStruct`` carrying dtype and
sharding; packed weights are read as stored and converted after the restore), :func:`to_form` turns the restored
stored arrays into form ``weights``, and :func:`resident_bytes` is what the result takes resident, known before
anything is read. Nothing here reads files or checks digests; :mod:`.store` does, before these run.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from thoughtjax import quantized
from thoughtjax.config import ModelConfig
from thoughtjax.registry.errors import RegistryError
from thoughtjax.registry.manifest import Manifest
from thoughtjax.registry.sharding import param_partition
from thoughtjax.thoughtlet.stored import block_from_stored, in_dims, model_layout, stored_kind
from thoughtjax.transformer import abstract_model

# What a restore returns (module docstring): f32 and native are the weight formats a path runs in.
RESTORE_FORMS = ("f32", "native", "stored")


def check_form(weights: str) -> str:
  """``weights`` if it is one of :data:`RESTORE_FORMS`, else a :class:`RegistryError` naming them."""
  if weights not in RESTORE_FORMS:
    raise RegistryError(
      f"weights={weights!r}: a registry restores weights as one of {', '.join(RESTORE_FORMS)} (f32: dequantized "
      f"float32; native: the GGUF's blocks kept packed; stored: the checkpoint's arrays). int8 is a variant a path "
      f"names (blocks[a:b)@int8, from `registry build --variants int8`), not a restore form"
    )
  return weights


def _packed_nodes(params: dict) -> dict[str, str]:
  """Parent path -> block type of every stored native weight in a manifest's ``params`` spec."""
  children: dict[str, dict] = {}
  for path in params:
    parent, _, leaf = path.rpartition("/")
    children.setdefault(parent, {})[leaf] = None
  out = {}
  for parent, keys in children.items():
    kind = stored_kind(keys)
    if kind in quantized.KINDS:
      out[parent] = kind
  return out


@functools.lru_cache(maxsize=8)
def _layout_shapes(cfg: ModelConfig) -> dict:
  """Model-layout shapes of the parameters of each kind's module (one block stands for all)."""

  abstract = abstract_model(cfg)

  def shapes(module):
    return jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(nnx.state(module)))

  return {"embed": shapes(abstract.embed), "head": shapes(abstract.head), "blocks": shapes(abstract.blocks[0])}


def _layout_shape(cfg: ModelConfig, kind: str, parent: str) -> tuple[int, ...]:
  node = _layout_shapes(cfg)[kind]
  for key in parent.split("/")[1:] if kind == "blocks" else parent.split("/"):
    node = node[key]
  return node


def _packed_bytes(params: dict, parent: str, kind: str, weights: str, dtype) -> int:
  """Bytes a stored native weight takes resident in form ``weights``."""
  rows, cols = params[f"{parent}/scale"]["shape"]
  n = rows * cols * quantized.BLOCK
  if weights == "f32":
    return n * np.dtype(dtype or np.float32).itemsize
  if weights == "native":  # one byte per value, float32 scale (and minimum) per block
    return n + rows * cols * 4 * (2 if kind == "Q4_1" else 1)
  return sum(
    int(np.prod(s["shape"])) * np.dtype(s["dtype"]).itemsize for p, s in params.items() if p.startswith(parent + "/")
  )


def restore_targets(m: Manifest, dtype, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """Flat Orbax restore targets of version ``m`` (param path -> shape, dtype and sharding): float arrays cast to
  ``dtype``, sharded over ``mesh`` (None: the first device); packed weights as stored, on the first local device."""
  flat = {}
  model_size = 1 if mesh is None else int(mesh.shape.get("model", 1))
  if mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    raise RegistryError(
      "the mesh has Explicit axes; thoughtjax's model leaves sharding to XLA's propagation, so build the "
      "mesh with Auto axes: jax.sharding.Mesh(devices, ('data', 'model')) or "
      "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)"
    )
  packed = _packed_nodes(m.params)
  for path, spec in m.params.items():
    dt = np.dtype(spec["dtype"])
    if path.rpartition("/")[0] in packed:  # read as stored (small), converted after the restore
      flat[path] = jax.ShapeDtypeStruct(tuple(spec["shape"]), dt, sharding=SingleDeviceSharding(jax.local_devices()[0]))
      continue
    if dtype is not None and np.issubdtype(dt, np.floating):
      dt = np.dtype(dtype)
    if mesh is None:
      sharding = SingleDeviceSharding(jax.devices()[0])
    else:
      sharding = NamedSharding(mesh, param_partition(m.kind.value, path, spec["shape"], model_size))
    flat[path] = jax.ShapeDtypeStruct(tuple(spec["shape"]), dt, sharding=sharding)
  return flat


def resident_bytes(m: Manifest, dtype, weights: str) -> int:
  """Bytes version ``m`` takes resident once restored in form ``weights`` (float arrays cast to ``dtype``)."""
  packed = _packed_nodes(m.params)
  plain = 0
  for path, spec in m.params.items():
    if path.rpartition("/")[0] in packed:
      continue
    dt = np.dtype(spec["dtype"])
    if dtype is not None and np.issubdtype(dt, np.floating):
      dt = np.dtype(dtype)
    plain += int(np.prod(spec["shape"])) * dt.itemsize
  return plain + sum(_packed_bytes(m.params, parent, kind, weights, dtype) for parent, kind in packed.items())


def to_form(m: Manifest, params: dict, dtype, mesh, weights: str) -> dict:
  """Restored stored arrays of version ``m`` in form ``weights``: native weights kept packed or dequantized
  (module docstring), placed on ``mesh`` like :func:`restore_targets`; ``params`` itself is left as it is."""

  packed = _packed_nodes(m.params)
  if weights == "stored" or not packed:
    return params
  model_size = 1 if mesh is None else int(mesh.shape.get("model", 1))
  out = jax.tree.map(lambda x: x, params)  # a new tree: the stored one stays as Orbax gave it
  for parent in packed:
    *up, leaf = parent.split("/")
    node = out
    for key in up:
      node = node[key]
    w = block_from_stored({k: np.asarray(v) for k, v in node[leaf].items()})
    shape = _layout_shape(m.config, m.kind.value, parent)
    spec = param_partition(m.kind.value, parent, shape, model_size) if mesh is not None else PartitionSpec()
    if weights == "f32":
      dense = model_layout(leaf, quantized.dequantize(w), shape).astype(np.dtype(dtype or np.float32))
      sharding = SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, spec)
      node[leaf] = jax.device_put(dense, sharding)
      continue
    # Native: rows are outputs, so a model-axis split of an output dim splits q's rows, one of an
    # input dim splits its columns (whole blocks only, else replicated).
    axis = next((i for i, a in enumerate(spec) if a == "model"), None)
    n_in = in_dims(leaf, w.shape, shape)
    axis = None if axis is None else (1 if n_in is not None and axis < n_in else 0)
    if axis == 1 and (w.shape[1] // quantized.BLOCK) % model_size:
      axis = None

    def put(a, axis=axis):
      if mesh is None:
        return jax.device_put(a, SingleDeviceSharding(jax.devices()[0]))
      parts = [None] * a.ndim
      if axis is not None:
        parts[axis] = "model"
      return jax.device_put(a, NamedSharding(mesh, PartitionSpec(*parts)))

    node[leaf] = w.map(put)
  return out

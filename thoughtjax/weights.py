"""Hugging Face-named tensors -> a :class:`~thoughtjax.transformer.Transformer`.

Both loaders (GGUF and safetensors) first produce a dict of numpy arrays under
Hugging Face names (``model.layers.3.self_attn.q_proj.weight``, PyTorch
``[out, in]`` layout); this module is the single place that maps them onto the
NNX parameter layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from thoughtjax import quantized
from thoughtjax.config import ModelConfig
from thoughtjax.errors import UserError
from thoughtjax.quantized import from_stored  # noqa: F401 - the inverse of to_stored, kept importable here
from thoughtjax.transformer import Transformer, abstract_model


class MissingTensorError(UserError, KeyError):
  """A checkpoint lacks a tensor the configuration requires."""

  def __str__(self) -> str:  # KeyError would print the message in quotes
    return str(self.args[0]) if self.args else ""


class TensorShapeError(UserError, ValueError):
  """A checkpoint tensor's shape does not match what its configuration implies."""


# Parameters used as an [I, O] matrix whose leading dims (the count given) are the inputs; a native
# weight keeps the checkpoint's [O, I] blocks instead (see thoughtjax.transformer._matrix).
_IN_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def _in_out(w, *shape):
  """[out, in] checkpoint tensor -> the model's [in..., out...] layout; packed blocks stay [O, I]."""
  return w if quantized.is_packed(w) else w.T.reshape(shape)


def native_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape [O, I] of a native weight standing for parameter ``name`` of shape ``shape``."""
  if name not in _IN_DIMS:  # embed table, unembed: already [V, D] = [O, I]
    return tuple(shape)
  n = _IN_DIMS[name]
  return (int(np.prod(shape[n:])), int(np.prod(shape[:n])))


def _as_rows(name: str, w) -> np.ndarray:
  """The [O, I] matrix of parameter ``name`` held in the model's [in..., out...] layout (float32)."""
  if quantized.is_packed(w):
    return quantized.dequantize(w)
  w = np.asarray(w, np.float32)
  if name not in _IN_DIMS:
    return w
  n = _IN_DIMS[name]
  return w.reshape(int(np.prod(w.shape[:n])), -1).T


def int8_block(params: Mapping) -> dict:
  """One block's params (nested dict, model layout) with every projection as per-row int8
  (:class:`thoughtjax.quantized.RowInt8`, [O, I]); norms and biases stay float32."""

  def walk(node):
    return {
      k: walk(v) if isinstance(v, Mapping) else (quantized.quantize_int8(_as_rows(k, v)) if k in _IN_DIMS else v)
      for k, v in node.items()
    }

  return walk(params)


def variant_block(params: Mapping, variant: str) -> dict:
  """One block's params in a weight variant (:data:`thoughtjax.path_syntax.VARIANTS`): ``int8``, every projection
  as per-row int8 (:func:`int8_block`); ``int8a8``, the same int8 weights computed with int8 activations
  (:class:`~thoughtjax.quantized.RowInt8A8`). Both store the same arrays (:func:`to_stored`)."""
  block = int8_block(params)
  return quantized.int8_activations(block) if variant == "int8a8" else block


def from_stored_variant(params: Mapping, variant: str) -> dict:
  """A variant thoughtlet's params as a registry restores them (``{"int8", "scale"}`` arrays) back in the
  variant's compute form; inverse of :func:`to_stored` of :func:`variant_block`."""
  block = quantized.from_stored(params)
  return quantized.int8_activations(block) if variant == "int8a8" else block


def to_stored(params: Mapping) -> dict:
  """Params with each :class:`~thoughtjax.quantized.RowInt8` as a plain ``{"int8": q [O, I], "scale": [O]}``
  mapping: the tree a registry checkpoints and hashes (arrays only). Inverse of :func:`from_stored`."""
  return {
    k: {"int8": v.q, "scale": v.scale}
    if isinstance(v, quantized.RowInt8)
    else (to_stored(v) if isinstance(v, Mapping) else v)
    for k, v in params.items()
  }


def int8_params(params: Mapping) -> dict:
  """A whole model's params (see :func:`params_from_hf`) with every matrix as per-row int8: the
  block projections, the embedding table (also the tied head) and an untied head's unembed."""
  out = {k: dict(v) for k, v in params.items()}
  out["embed"]["table"] = quantized.quantize_int8(_as_rows("table", params["embed"]["table"]))
  if "unembed" in params["head"]:
    out["head"]["unembed"] = quantized.quantize_int8(_as_rows("unembed", params["head"]["unembed"]))
  out["blocks"] = {i: int8_block(b) for i, b in params["blocks"].items()}
  return out


def _layer_params(cfg: ModelConfig, get, i: int) -> dict:
  D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  pre = f"model.layers.{i}."
  attn = {
    "q": _in_out(get(pre + "self_attn.q_proj.weight"), D, H, E),
    "k": _in_out(get(pre + "self_attn.k_proj.weight"), D, K, E),
    "v": _in_out(get(pre + "self_attn.v_proj.weight"), D, K, E),
    "o": _in_out(get(pre + "self_attn.o_proj.weight"), H, E, D),
  }
  if cfg.qkv_bias:
    attn["q_bias"] = get(pre + "self_attn.q_proj.bias").reshape(H, E)
    attn["k_bias"] = get(pre + "self_attn.k_proj.bias").reshape(K, E)
    attn["v_bias"] = get(pre + "self_attn.v_proj.bias").reshape(K, E)
  return {
    "attn_norm": {"weight": get(pre + "input_layernorm.weight")},
    "attn": attn,
    "mlp_norm": {"weight": get(pre + "post_attention_layernorm.weight")},
    "mlp": {
      "gate": _in_out(get(pre + "mlp.gate_proj.weight"), D, cfg.ffn_dim),
      "up": _in_out(get(pre + "mlp.up_proj.weight"), D, cfg.ffn_dim),
      "down": _in_out(get(pre + "mlp.down_proj.weight"), cfg.ffn_dim, D),
    },
  }


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
  """Nested dict of numpy arrays (or packed native blocks, kept as they are) in the model's parameter layout."""

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise MissingTensorError(
        f"tensor {name!r} is missing from the checkpoint; the config "
        f"({cfg.architecture.value}, {cfg.num_layers} layers, qkv_bias={cfg.qkv_bias}, "
        f"tie_embeddings={cfg.tie_embeddings}) requires it"
      )
    w = tensors[name]
    return w if quantized.is_packed(w) else np.asarray(w)

  params = {
    "embed": {"table": get("model.embed_tokens.weight")},
    "blocks": {i: _layer_params(cfg, get, i) for i in range(cfg.num_layers)},
    "head": {"norm": {"weight": get("model.norm.weight")}},
  }
  if not cfg.tie_embeddings:
    params["head"]["unembed"] = get("lm_head.weight")
  return params


def build_model(cfg: ModelConfig, params: dict, dtype=jnp.float32) -> Transformer:
  """Materialize a Transformer from nested numpy params, cast to ``dtype``; native (packed) weights
  stay packed on the device (they compute in float32 whatever ``dtype``)."""
  model = abstract_model(cfg, dtype)
  state = nnx.state(model, nnx.Param)
  flat = dict(nnx.to_flat_state(state))

  def lookup(path):
    node = params
    for key in path:
      node = node[key]
    return node

  for path, var in flat.items():
    arr = lookup(path)
    packed = quantized.is_packed(arr)
    want = native_shape(str(path[-1]), tuple(var.shape)) if packed else tuple(var.shape)
    if tuple(arr.shape) != want:
      raise TensorShapeError(
        f"parameter {'/'.join(map(str, path))}: expected shape {want} from the config, got "
        f"{tuple(arr.shape)} from the checkpoint; the checkpoint and its config do not belong together"
      )
    var.set_value(arr.map(_to_device) if packed else _to_device(arr, dtype))
  nnx.update(model, nnx.from_flat_state(flat))
  return model


def _to_device(arr, dtype=None) -> jax.Array:
  """``arr`` as a device array of ``dtype`` (default: its own). A read-only, 64-byte aligned numpy array
  already of that dtype (a tensor mapped from the weight cache) goes through ``jax.device_put``, which on
  the CPU adopts the buffer instead of copying it: the weights stay the file's pages, counted once in
  memory and never duplicated (538 MB for the default model in float32, 165 MB native)."""
  if isinstance(arr, np.ndarray) and (dtype is None or arr.dtype == np.dtype(dtype)):
    return jax.device_put(arr)
  return jnp.asarray(arr, dtype=dtype)


def model_params(model: Transformer) -> dict:
  """The model's parameters as a nested dict of arrays (inverse of build_model)."""
  out: dict = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = var[...]
  return out


def param_bytes(tree) -> int:
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def to_hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """Inverse of :func:`params_from_hf`: the model layout back to Hugging Face names."""
  D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  f = lambda x: np.asarray(x, np.float32)  # noqa: E731

  def mat(x, rows, cols):  # the [out, in] tensor of a weight held as [in, out] or as native [O, I] blocks
    return quantized.dequantize(x) if quantized.is_packed(x) else f(x).reshape(rows, cols).T.copy()

  out = {
    "model.embed_tokens.weight": _dense(params["embed"]["table"]),
    "model.norm.weight": f(params["head"]["norm"]["weight"]),
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = _dense(params["head"]["unembed"])
  for i in range(cfg.num_layers):
    b, pre = params["blocks"][i], f"model.layers.{i}."
    a, m = b["attn"], b["mlp"]
    out[pre + "input_layernorm.weight"] = f(b["attn_norm"]["weight"])
    out[pre + "post_attention_layernorm.weight"] = f(b["mlp_norm"]["weight"])
    out[pre + "self_attn.q_proj.weight"] = mat(a["q"], D, H * E)
    out[pre + "self_attn.k_proj.weight"] = mat(a["k"], D, K * E)
    out[pre + "self_attn.v_proj.weight"] = mat(a["v"], D, K * E)
    out[pre + "self_attn.o_proj.weight"] = mat(a["o"], H * E, D)
    if cfg.qkv_bias:
      out[pre + "self_attn.q_proj.bias"] = f(a["q_bias"]).reshape(H * E)
      out[pre + "self_attn.k_proj.bias"] = f(a["k_bias"]).reshape(K * E)
      out[pre + "self_attn.v_proj.bias"] = f(a["v_bias"]).reshape(K * E)
    out[pre + "mlp.gate_proj.weight"] = mat(m["gate"], D, cfg.ffn_dim)
    out[pre + "mlp.up_proj.weight"] = mat(m["up"], D, cfg.ffn_dim)
    out[pre + "mlp.down_proj.weight"] = mat(m["down"], cfg.ffn_dim, D)
  return out


def _dense(x) -> np.ndarray:
  """float32 numpy of an array or of native blocks (dequantized, the same values)."""
  return quantized.dequantize(x) if quantized.is_packed(x) else np.asarray(x, np.float32)

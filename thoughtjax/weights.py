"""Hugging Face-named tensors -> a :class:`~thoughtjax.model.Transformer`.

Both loaders (GGUF and safetensors) first produce a dict of numpy arrays under
Hugging Face names (``model.layers.3.self_attn.q_proj.weight``, PyTorch
``[out, in]`` layout); this module is the single place that maps them onto the
NNX parameter layout.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from thoughtjax.config import ModelConfig
from thoughtjax.errors import UserError
from thoughtjax.model import Transformer, abstract_model


class MissingTensorError(UserError, KeyError):
  """A checkpoint lacks a tensor the configuration requires."""

  def __str__(self) -> str:  # KeyError would print the message in quotes
    return str(self.args[0]) if self.args else ""


class TensorShapeError(UserError, ValueError):
  """A checkpoint tensor's shape does not match what its configuration implies."""


def _layer_params(cfg: ModelConfig, get, i: int) -> dict:
  D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  pre = f"model.layers.{i}."
  attn = {
      "q": get(pre + "self_attn.q_proj.weight").T.reshape(D, H, E),
      "k": get(pre + "self_attn.k_proj.weight").T.reshape(D, K, E),
      "v": get(pre + "self_attn.v_proj.weight").T.reshape(D, K, E),
      "o": get(pre + "self_attn.o_proj.weight").T.reshape(H, E, D),
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
          "gate": get(pre + "mlp.gate_proj.weight").T,
          "up": get(pre + "mlp.up_proj.weight").T,
          "down": get(pre + "mlp.down_proj.weight").T,
      },
  }


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
  """Nested dict of numpy arrays in the model's parameter layout."""

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise MissingTensorError(
          f"tensor {name!r} is missing from the checkpoint; the config "
          f"({cfg.architecture.value}, {cfg.num_layers} layers, qkv_bias={cfg.qkv_bias}, "
          f"tie_embeddings={cfg.tie_embeddings}) requires it"
      )
    return np.asarray(tensors[name])

  params = {
      "embed": {"table": get("model.embed_tokens.weight")},
      "blocks": {i: _layer_params(cfg, get, i) for i in range(cfg.num_layers)},
      "head": {"norm": {"weight": get("model.norm.weight")}},
  }
  if not cfg.tie_embeddings:
    params["head"]["unembed"] = get("lm_head.weight")
  return params


def build_model(cfg: ModelConfig, params: dict, dtype=jnp.float32) -> Transformer:
  """Materialize a Transformer from nested numpy params, cast to ``dtype``."""
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
    if tuple(arr.shape) != tuple(var.shape):
      raise TensorShapeError(
          f"parameter {'/'.join(map(str, path))}: expected shape {tuple(var.shape)} from the config, got "
          f"{tuple(arr.shape)} from the checkpoint; the checkpoint and its config do not belong together")
    var.set_value(jnp.asarray(arr, dtype=dtype))
  nnx.update(model, nnx.from_flat_state(flat))
  return model


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
  out = {"model.embed_tokens.weight": f(params["embed"]["table"]),
         "model.norm.weight": f(params["head"]["norm"]["weight"])}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = f(params["head"]["unembed"])
  for i in range(cfg.num_layers):
    b, pre = params["blocks"][i], f"model.layers.{i}."
    a, m = b["attn"], b["mlp"]
    out[pre + "input_layernorm.weight"] = f(b["attn_norm"]["weight"])
    out[pre + "post_attention_layernorm.weight"] = f(b["mlp_norm"]["weight"])
    out[pre + "self_attn.q_proj.weight"] = f(a["q"]).reshape(D, H * E).T.copy()
    out[pre + "self_attn.k_proj.weight"] = f(a["k"]).reshape(D, K * E).T.copy()
    out[pre + "self_attn.v_proj.weight"] = f(a["v"]).reshape(D, K * E).T.copy()
    out[pre + "self_attn.o_proj.weight"] = f(a["o"]).reshape(H * E, D).T.copy()
    if cfg.qkv_bias:
      out[pre + "self_attn.q_proj.bias"] = f(a["q_bias"]).reshape(H * E)
      out[pre + "self_attn.k_proj.bias"] = f(a["k_bias"]).reshape(K * E)
      out[pre + "self_attn.v_proj.bias"] = f(a["v_bias"]).reshape(K * E)
    out[pre + "mlp.gate_proj.weight"] = f(m["gate"]).T.copy()
    out[pre + "mlp.up_proj.weight"] = f(m["up"]).T.copy()
    out[pre + "mlp.down_proj.weight"] = f(m["down"]).T.copy()
  return out

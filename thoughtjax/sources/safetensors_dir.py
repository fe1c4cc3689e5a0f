"""Read a Hugging Face safetensors directory (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from thoughtjax.config import Architecture, ModelConfig
from thoughtjax.sources.errors import ModelNotFoundError, UnsupportedModelError

# RoPE variants the model computes exactly (thoughtjax.transformer.rope_tables: plain rotate-half RoPE).
SUPPORTED_ROPE_TYPES = ("default",)


def _rope_scaling(raw: dict, path: Path) -> dict:
  """The RoPE parameter dict of a config (``rope_scaling``, or transformers 5's ``rope_parameters``),
  refused by name unless it asks for plain RoPE."""
  for key in ("rope_scaling", "rope_parameters"):
    scaling = raw.get(key)
    if scaling is None:
      continue
    if not isinstance(scaling, dict):
      raise UnsupportedModelError(
        f"{path}: {key} = {scaling!r} is not a JSON object; expected null or {{\"rope_type\": \"default\"}}"
      )
    type_key = "rope_type" if "rope_type" in scaling else "type"
    rope_type = scaling.get(type_key, "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise UnsupportedModelError(
        f"{path}: {key}.{type_key} = {rope_type!r} ({key} = {json.dumps(scaling, sort_keys=True)}) is not "
        f"supported; supported RoPE scaling types: {', '.join(SUPPORTED_ROPE_TYPES)} (plain RoPE). Loading it "
        f"with plain RoPE would rotate positions wrongly, so the model is refused; use a checkpoint without "
        f"RoPE scaling."
      )
    return scaling
  return {}


def read_eos_ids(directory: Path) -> tuple[int, ...]:
  """Every end-of-sequence id: ``config.json``'s ``eos_token_id`` (an int or a list) first, then any
  further ones from ``generation_config.json``, de-duplicated, in order."""
  ids: list[int] = []
  for name in ("config.json", "generation_config.json"):
    path = directory / name
    if not path.exists():
      continue
    value = json.loads(path.read_text()).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UnsupportedModelError(
          f"{path}: eos_token_id holds {v!r}; expected a non-negative token id or a list of them"
        )
      if v not in ids:
        ids.append(v)
  return tuple(ids)


def read_hf_config(directory: Path) -> ModelConfig:
  path = directory / "config.json"
  if not path.exists():
    raise ModelNotFoundError(f"{directory} has no config.json; a Hugging Face model directory needs one")
  raw = json.loads(path.read_text())
  archs = raw.get("architectures") or [raw.get("model_type", "?")]
  arch = Architecture.parse(raw.get("model_type") or archs[0])
  scaling = _rope_scaling(raw, path)
  partial = raw.get("partial_rotary_factor", 1.0)
  if partial != 1.0:
    raise UnsupportedModelError(
      f"{path}: partial_rotary_factor = {partial!r} is not supported; only RoPE over the whole head "
      f"(1.0) is. Use a checkpoint that rotates every head dimension."
    )
  theta = raw.get("rope_theta")
  if theta is None:
    theta = scaling.get("rope_theta")
  D, H = int(raw["hidden_size"]), int(raw["num_attention_heads"])
  eos_ids = read_eos_ids(directory)
  return ModelConfig(
    architecture=arch,
    vocab_size=int(raw["vocab_size"]),
    d_model=D,
    num_layers=int(raw["num_hidden_layers"]),
    num_heads=H,
    num_kv_heads=int(raw.get("num_key_value_heads") or H),
    head_dim=int(raw.get("head_dim") or D // H),
    ffn_dim=int(raw["intermediate_size"]),
    rope_theta=float(theta or 10000.0),
    rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
    tie_embeddings=bool(raw.get("tie_word_embeddings", arch is not Architecture.MISTRAL)),
    qkv_bias=bool(raw.get("attention_bias", arch is Architecture.QWEN2)),
    max_context=int(raw.get("max_position_embeddings", 2048)),
    bos_id=raw.get("bos_token_id"),
    eos_id=eos_ids[0] if eos_ids else None,
  )


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
  """All tensors of a directory's ``*.safetensors`` files, as float32 numpy arrays."""
  from safetensors import safe_open  # deferred for start-up: only safetensors loads need it

  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise ModelNotFoundError(f"{directory} has no *.safetensors files; a Hugging Face model directory needs them")
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    # framework="numpy" cannot read bf16; go through flax's loader, which can.
    with safe_open(str(f), framework="flax") as sf:
      for name in sf.keys():
        tensors[name] = np.asarray(sf.get_tensor(name), dtype=np.float32)
  return tensors

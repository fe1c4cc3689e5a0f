"""Read a Hugging Face safetensors directory (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from thoughtjax.config import Architecture, ModelConfig, UnsupportedModelError


def read_hf_config(directory: Path) -> ModelConfig:
  path = directory / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{directory} has no config.json; a Hugging Face model directory needs one")
  raw = json.loads(path.read_text())
  archs = raw.get("architectures") or [raw.get("model_type", "?")]
  arch = Architecture.parse(raw.get("model_type") or archs[0])
  scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {})
  rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
  if rope_type not in ("default", None):
    raise UnsupportedModelError(f"rope scaling {rope_type!r} in {path} is not supported; only plain RoPE is")
  theta = raw.get("rope_theta")
  if theta is None and isinstance(scaling, dict):
    theta = scaling.get("rope_theta")
  D, H = int(raw["hidden_size"]), int(raw["num_attention_heads"])
  eos = raw.get("eos_token_id")
  if isinstance(eos, list):
    eos = eos[0]
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
      eos_id=eos,
  )


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
  """All tensors of a directory's ``*.safetensors`` files, as float32 numpy arrays."""
  from safetensors import safe_open

  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{directory} has no *.safetensors files")
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    # framework="numpy" cannot read bf16; go through flax's loader, which can.
    with safe_open(str(f), framework="flax") as sf:
      for name in sf.keys():
        tensors[name] = np.asarray(sf.get_tensor(name), dtype=np.float32)
  return tensors

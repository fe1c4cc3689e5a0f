"""Model configuration: one frozen dataclass, derived values as properties.

Dimension letters used across thoughtjax (einsums, annotations, names):
B batch, T time (new tokens), S cache length, D model width, H query heads,
K kv heads, G query heads per kv head (H // K), E head dim, F ffn width,
V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json

from thoughtjax.errors import UserError


class Architecture(enum.Enum):
  """Llama-family decoders that share one Flax model."""

  LLAMA = "llama"
  MISTRAL = "mistral"
  QWEN2 = "qwen2"

  @classmethod
  def parse(cls, name: str) -> Architecture:
    key = name.lower()
    aliases = {
      "llama": cls.LLAMA,
      "llamaforcausallm": cls.LLAMA,
      "mistral": cls.MISTRAL,
      "mistralforcausallm": cls.MISTRAL,
      "qwen2": cls.QWEN2,
      "qwen2forcausallm": cls.QWEN2,
    }
    if key not in aliases:
      raise UnsupportedModelError(
        f"architecture {name!r} is not supported; expected one of "
        f"llama, mistral, qwen2 (Llama-family decoders). Convert the model to one of "
        f"those or add the architecture to thoughtjax.config.Architecture."
      )
    return aliases[key]


class UnsupportedModelError(UserError, ValueError):
  """A model file uses an architecture, tensor type or RoPE variant thoughtjax cannot load."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a Llama-family decoder."""

  architecture: Architecture
  vocab_size: int  # V
  d_model: int  # D
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K
  head_dim: int  # E
  ffn_dim: int  # F
  rope_theta: float = 10000.0
  rms_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  max_context: int = 2048
  bos_id: int | None = None
  eos_id: int | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
        f"{self.num_kv_heads} for grouped-query attention."
      )

  @property
  def group_size(self) -> int:  # G
    return self.num_heads // self.num_kv_heads

  @property
  def param_count(self) -> int:
    D, F, E, H, K, V = (self.d_model, self.ffn_dim, self.head_dim, self.num_heads, self.num_kv_heads, self.vocab_size)
    attn = D * H * E + 2 * D * K * E + H * E * D
    if self.qkv_bias:
      attn += H * E + 2 * K * E
    block = attn + 3 * D * F + 2 * D
    head = D + (0 if self.tie_embeddings else V * D)
    return V * D + self.num_layers * block + head

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["architecture"] = self.architecture.value
    return d

  @classmethod
  def from_json(cls, d: dict) -> ModelConfig:
    d = dict(d)
    d["architecture"] = Architecture(d["architecture"])
    return cls(**d)

  @property
  def family_hash(self) -> str:
    """Short hash of what makes residual streams of two models interchangeable."""
    keys = ("architecture", "d_model", "vocab_size", "rope_theta", "rms_eps", "head_dim")
    blob = json.dumps({k: self.to_json()[k] for k in keys}, sort_keys=True)
    return hashlib.sha3_256(blob.encode()).hexdigest()[:12]

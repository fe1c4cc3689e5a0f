"""What a thoughtlet is: its kind, the typed links it connects, and the unit itself.

A :class:`TensorType` is what flows along one link of a path (role, shape letters, dtype and
a *family*: the model family hash for residuals, the tokenizer hash for token ids and
logits); a :class:`SemanticSignature` types a thoughtlet's input and output and carries its
constraints, tags and description; a :class:`Thoughtlet` holds a name, kind, signature,
weights and (once measured) its resource profile.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from thoughtjax.config import ModelConfig
from thoughtjax.thoughtlet.errors import ThoughtletError
from thoughtjax.thoughtlet.hashing import param_spec, versioned_hash
from thoughtjax.thoughtlet.resource_profile import ResourceProfile


class Kind(enum.Enum):
  EMBED = "embed"  # tokens[B,T] i32 -> residual[B,T,D] f32
  BLOCKS = "blocks"  # residual -> residual: decoder layers a..b-1 (half-open)
  HEAD = "head"  # residual[B,T,D] -> logits[B,T,V] f32 (final norm + LM head)
  TEMPLATE = "template"  # message[B,U] i32 -> residual[B,T,D] (a chat template's fixed rows)
  BRIDGE = "bridge"  # residual -> residual: a small trained adapter that heals a cut path
  ROUTER = "router"  # tokens[B,T] i32 -> hint_probs[B,C] f32: picks a hint; never a link of a path


@dataclasses.dataclass(frozen=True)
class TensorType:
  """What flows along a link of a path, e.g. ``residual[B,T,576] f32 family=1a2b``."""

  role: str  # tokens | message | residual | logits
  shape: tuple[str | int, ...]
  dtype: str  # i32 | f32
  family: str | None = None

  def __str__(self) -> str:
    dims = ",".join(str(d) for d in self.shape)
    return f"{self.role}[{dims}] {self.dtype}" + (f" family={self.family}" if self.family else "")

  def mismatch(self, received: TensorType) -> str | None:
    """Why ``received`` cannot feed an input of this type (None if it can)."""
    if received.role != self.role:
      return f"role {received.role!r} is not {self.role!r}"
    if received.dtype != self.dtype:
      return f"dtype {received.dtype} is not {self.dtype}"
    if len(received.shape) != len(self.shape):
      return f"rank {len(received.shape)} is not {len(self.shape)}"
    for i, (want, got) in enumerate(zip(self.shape, received.shape, strict=True)):
      if isinstance(want, int) and isinstance(got, int) and want != got:
        return f"dimension {i} is {got}, not {want}"
    if self.family and received.family and self.family != received.family:
      return f"family {received.family} is not {self.family} (different model or tokenizer)"
    return None

  def to_json(self) -> dict:
    return {"role": self.role, "shape": list(self.shape), "dtype": self.dtype, "family": self.family}

  @classmethod
  def from_json(cls, d: Mapping) -> TensorType:
    return cls(d["role"], tuple(d["shape"]), d["dtype"], d.get("family"))


@dataclasses.dataclass(frozen=True)
class SemanticSignature:
  input: TensorType
  output: TensorType
  constraints: Mapping[str, Any]  # max_context, rope, vocab_size, tokenizer_hash, requires, ...
  tags: tuple[str, ...] = ()
  description: str = ""

  def to_json(self) -> dict:
    return {
      "input": self.input.to_json(),
      "output": self.output.to_json(),
      "constraints": dict(self.constraints),
      "tags": list(self.tags),
      "description": self.description,
    }

  @classmethod
  def from_json(cls, d: Mapping) -> SemanticSignature:
    return cls(
      TensorType.from_json(d["input"]),
      TensorType.from_json(d["output"]),
      dict(d["constraints"]),
      tuple(d.get("tags", ())),
      d.get("description", ""),
    )


def residual_type(cfg: ModelConfig) -> TensorType:
  return TensorType("residual", ("B", "T", cfg.d_model), "f32", cfg.family_hash)


def _links(kind: Kind, cfg: ModelConfig, tokenizer_hash: str) -> tuple[TensorType, TensorType]:
  """(input, output) types of a thoughtlet of ``kind``."""
  resid = residual_type(cfg)
  return {
    Kind.EMBED: (TensorType("tokens", ("B", "T"), "i32", tokenizer_hash), resid),
    Kind.BLOCKS: (resid, resid),
    Kind.HEAD: (resid, TensorType("logits", ("B", "T", cfg.vocab_size), "f32", tokenizer_hash)),
    Kind.TEMPLATE: (TensorType("message", ("B", "U"), "i32", tokenizer_hash), resid),
    Kind.BRIDGE: (resid, resid),
    Kind.ROUTER: (
      TensorType("tokens", ("B", "T"), "i32", tokenizer_hash),
      TensorType("hint_probs", ("B", "C"), "f32", tokenizer_hash),
    ),
  }[kind]


def _constraints(kind: Kind, cfg: ModelConfig, tokenizer_hash: str, layers, context: int) -> dict:
  vocab = {"vocab_size": cfg.vocab_size, "tokenizer_hash": tokenizer_hash}
  if kind is Kind.EMBED:
    return {"max_context": context, **vocab}
  if kind is Kind.BLOCKS:
    rope = {"theta": cfg.rope_theta, "head_dim": cfg.head_dim}
    return {
      "max_context": context,
      "rope": rope,
      "layers": list(layers),
      "num_heads": cfg.num_heads,
      "num_kv_heads": cfg.num_kv_heads,
    }
  if kind is Kind.HEAD:  # a tied head reads the embed thoughtlet's table
    return {
      "max_context": context,
      "tied": cfg.tie_embeddings,
      **vocab,
      **({"requires": ["embed"]} if cfg.tie_embeddings else {}),
    }
  if kind is Kind.BRIDGE:  # position-wise: no rope, no cache; what it heals is in its tags/constraints
    return {"max_context": context}
  return {"max_context": context, "requires": ["embed"], **vocab}  # template, router


def signature_for(
  kind: Kind,
  cfg: ModelConfig,
  tokenizer_hash: str,
  *,
  layers: tuple[int, int] | None = None,
  max_context: int | None = None,
  tags: tuple[str, ...] = (),
  description: str = "",
) -> SemanticSignature:
  """The semantic signature of a thoughtlet of ``kind`` cut from a model with ``cfg``."""
  if kind is Kind.BLOCKS and layers is None:
    raise ThoughtletError("a blocks thoughtlet's signature needs its layer range; pass layers=(a, b)")
  context = min(cfg.max_context, max_context or cfg.max_context)
  inp, out = _links(kind, cfg, tokenizer_hash)
  return SemanticSignature(inp, out, _constraints(kind, cfg, tokenizer_hash, layers, context), tuple(tags), description)


@dataclasses.dataclass(frozen=True)
class Thoughtlet:
  """A unit of a model: name, kind, signature, weights and (once measured) its profile.

  ``params`` is a nested dict of arrays: for embed and head the pure dict of the NNX module
  state; for blocks ``{"<layer>": block state}``; for a template ``{"prefix_ids",
  "suffix_ids", "prefix_rows", "suffix_rows"}``.
  """

  name: str
  kind: Kind
  signature: SemanticSignature
  params: Mapping[str, Any]
  config: ModelConfig
  layers: tuple[int, int] | None = None
  profile: ResourceProfile | None = None

  @property
  def param_bytes(self) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(self.params)))

  def identity(self) -> dict:
    """What the versioned hash covers besides the weights."""
    return {
      "name": self.name,
      "kind": self.kind.value,
      "layers": None if self.layers is None else list(self.layers),
      "semantic_signature": self.signature.to_json(),
      "model_config": self.config.to_json(),
    }

  def versioned_hash(self) -> str:
    return versioned_hash(self.identity(), self.params)

  def with_params(self, params: Mapping[str, Any]) -> Thoughtlet:
    """A new version with other weights (same shapes), e.g. after fine-tuning; unprofiled."""
    spec_old, spec_new = param_spec(self.params), param_spec(params)
    if spec_old != spec_new:
      raise ThoughtletError(
        f"{self.name}: new weights must keep the parameter tree; expected "
        f"{spec_old}, got {spec_new}. Give arrays of the same paths, shapes and dtypes"
      )
    return dataclasses.replace(self, params=params, profile=None)

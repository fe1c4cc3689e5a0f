"""The manifest of one thoughtlet version: what was published, with the digest of every file."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from thoughtjax.config import ModelConfig
from thoughtjax.registry.errors import RegistryError
from thoughtjax.registry.layout import MANIFEST_FORMAT, _now
from thoughtjax.thoughtlet import Kind, ResourceProfile, SemanticSignature, Thoughtlet, param_spec


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A thoughtlet version as published (weights not loaded)."""

  name: str
  kind: Kind
  version: str
  versioned_hash: str
  layers: tuple[int, int] | None
  signature: SemanticSignature
  profile: ResourceProfile | None
  config: ModelConfig
  params: Mapping[str, Mapping]  # path -> {shape, dtype}
  files: Mapping[str, Mapping]  # relative path -> {sha256, bytes}
  parent: str | None
  signed_by: str | None
  raw: Mapping[str, Any]

  @property
  def ref(self) -> str:
    return f"{self.name}@{self.version}"

  @property
  def param_bytes(self) -> int:
    return sum(int(np.prod(s["shape"])) * np.dtype(s["dtype"]).itemsize for s in self.params.values())

  def identity(self) -> dict:
    return {
      "name": self.name,
      "kind": self.kind.value,
      "layers": None if self.layers is None else list(self.layers),
      "semantic_signature": self.signature.to_json(),
      "model_config": self.config.to_json(),
    }

  @classmethod
  def from_json(cls, d: Mapping) -> Manifest:
    if d.get("format") != MANIFEST_FORMAT:
      raise RegistryError(f"manifest format {d.get('format')!r} is not {MANIFEST_FORMAT!r}")
    prof = d.get("resource_profile")
    return cls(
      d["name"],
      Kind(d["kind"]),
      d["version"],
      d["versioned_hash"],
      None if d.get("layers") is None else tuple(d["layers"]),
      SemanticSignature.from_json(d["semantic_signature"]),
      None if prof is None else ResourceProfile.from_json(prof),
      ModelConfig.from_json(d["model"]["config"]),
      d["params"],
      d["files"],
      d.get("parent"),
      d.get("signed_by"),
      d,
    )


def _manifest_json(
  t: Thoughtlet,
  version: str,
  vhash: str,
  files: Mapping,
  parent: str | None,
  signed_by: str | None,
  tokenizer_hash: str,
) -> dict:
  return {
    "format": MANIFEST_FORMAT,
    "name": t.name,
    "kind": t.kind.value,
    "version": version,
    "versioned_hash": vhash,
    "layers": None if t.layers is None else list(t.layers),
    "semantic_signature": t.signature.to_json(),
    "resource_profile": None if t.profile is None else t.profile.to_json(),
    "model": {"config": t.config.to_json(), "family": t.config.family_hash, "tokenizer_hash": tokenizer_hash},
    "params": param_spec(t.params),
    "files": dict(files),
    "parent": parent,
    "signed_by": signed_by,
    "created": _now(),
  }

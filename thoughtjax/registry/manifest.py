"""The manifest of one thoughtlet version: what was published, with the digest of every file."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from thoughtjax.config import ModelConfig
from thoughtjax.registry.errors import RegistryError
from thoughtjax.registry.layout import MANIFEST_FORMAT, utc_now
from thoughtjax.thoughtlet import Kind, ResourceProfile, SemanticSignature, Thoughtlet, param_spec

# A manifest's file list names checkpoint files only: relative, normalised, below ``checkpoint/``.
CHECKPOINT_DIR = "checkpoint"
_PART_RE = re.compile(r"[A-Za-z0-9_.@=+\-]{1,255}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
MAX_FILES = 1 << 16
MAX_FILE_BYTES = 1 << 40


def check_file_key(rel) -> str:
  """``rel`` if it is a manifest file key: a normalised relative POSIX path ``checkpoint/...`` whose parts are
  plain names (letters, digits, ``_.@=+-``; never ``.``, ``..``, empty, absolute, a backslash or a NUL); else
  :class:`RegistryError` naming it. What is checked here is what a restore may create in its scratch copy."""
  shown = repr(rel)[:120]
  if not isinstance(rel, str) or len(rel) > 4096:
    raise RegistryError(f"manifest file key {shown} is not a path string of at most 4096 characters")
  parts = rel.split("/")
  if (
    len(parts) < 2
    or parts[0] != CHECKPOINT_DIR
    or any(p in (".", "..") or not _PART_RE.fullmatch(p) for p in parts[1:])
  ):
    raise RegistryError(
      f"manifest file key {shown} is not a normalised relative path below {CHECKPOINT_DIR}/ (plain names of "
      f"letters, digits and _.@=+- joined by '/'; no '..', no absolute path); the manifest was not written by "
      f"thoughtjax. Republish the thoughtlet"
    )
  return rel


def check_files(files) -> dict[str, dict]:
  """The manifest's ``files`` (key -> {sha256, bytes}) checked whole: every key (:func:`check_file_key`),
  a 64-hex digest and a byte count each, at most :data:`MAX_FILES` entries; :class:`RegistryError` otherwise.
  Called before anything is written, so a bad entry late in the list cannot follow a write of an early one."""
  if not isinstance(files, Mapping) or not files or len(files) > MAX_FILES:
    raise RegistryError(
      f"manifest 'files' must map 1 to {MAX_FILES} checkpoint files to their digests, got "
      f"{type(files).__name__}{f' of {len(files)}' if isinstance(files, Mapping) else ''}"
    )
  out = {}
  for rel, spec in files.items():
    check_file_key(rel)
    if not isinstance(spec, Mapping):
      raise RegistryError(f"manifest file {rel!r}: expected {{sha256, bytes}}, got {type(spec).__name__}")
    digest, size = spec.get("sha256"), spec.get("bytes")
    if not (isinstance(digest, str) and _SHA256_RE.fullmatch(digest)):
      raise RegistryError(f"manifest file {rel!r}: sha256 {repr(digest)[:80]} is not 64 lowercase hex digits")
    if not (isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_FILE_BYTES):
      raise RegistryError(f"manifest file {rel!r}: bytes {repr(size)[:80]} is not a size from 0 to {MAX_FILE_BYTES}")
    out[rel] = {"sha256": digest, "bytes": size}
  return out


def _check_params(params) -> dict:
  if not isinstance(params, Mapping) or len(params) > MAX_FILES:
    raise RegistryError(f"manifest 'params' must map parameter paths to {{shape, dtype}}, got {type(params).__name__}")
  for path, spec in params.items():
    ok = (
      isinstance(path, str)
      and isinstance(spec, Mapping)
      and isinstance(spec.get("shape"), list)
      and len(spec["shape"]) <= 8
      and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in spec["shape"])
      and isinstance(spec.get("dtype"), str)
    )
    if ok:
      try:
        ok = np.dtype(spec["dtype"]).kind in "biufV"  # V: ml_dtypes' narrow floats
      except (TypeError, ValueError, SyntaxError):
        ok = False
    if not ok:
      raise RegistryError(
        f"manifest parameter {repr(path)[:80]}: {repr(spec)[:120]} is not {{shape: [dims], dtype: numeric}}"
      )
  return dict(params)


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
    """Parse a manifest; :class:`RegistryError` (or ``KeyError``/``TypeError``/``ValueError``, which a reader
    reports as an integrity failure) on anything that is not one."""
    if not isinstance(d, Mapping) or d.get("format") != MANIFEST_FORMAT:
      got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
      raise RegistryError(f"manifest format {repr(got)[:80]} is not {MANIFEST_FORMAT!r}")
    for key in ("name", "version", "versioned_hash"):
      if not isinstance(d.get(key), str):
        raise RegistryError(f"manifest {key!r} is {repr(d.get(key))[:80]}, not a string")
    for key in ("parent", "signed_by"):
      if d.get(key) is not None and not isinstance(d[key], str):
        raise RegistryError(f"manifest {key!r} is {repr(d[key])[:80]}, not a string or null")
    layers = d.get("layers")
    if layers is not None and not (
      isinstance(layers, list)
      and len(layers) == 2
      and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 20 for x in layers)
    ):
      raise RegistryError(f"manifest 'layers' is {repr(layers)[:80]}, not [start, end] or null")
    prof = d.get("resource_profile")
    return cls(
      d["name"],
      Kind(d["kind"]),
      d["version"],
      d["versioned_hash"],
      None if layers is None else tuple(layers),
      SemanticSignature.from_json(d["semantic_signature"]),
      None if prof is None else ResourceProfile.from_json(prof),
      ModelConfig.from_json(d["model"]["config"]),
      _check_params(d["params"]),
      check_files(d["files"]),
      d.get("parent"),
      d.get("signed_by"),
      d,
    )


def manifest_json(
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
    "created": utc_now(),
  }

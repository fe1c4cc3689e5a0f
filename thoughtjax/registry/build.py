"""Building a registry: cut a model along a semantic mapping, profile, publish.

A model named by path or name is loaded with ``weights="native"``: a quantized GGUF's matrices stay
its packed blocks and are stored so (:mod:`thoughtjax.thoughtlet.stored`: the registry is as large as
the GGUF, and hashes and signatures cover the packed bytes); readers dequantize them at restore or keep
them packed (:class:`~thoughtjax.registry.store.Registry` ``weights=``). A loaded model is stored in the
form it holds.

``variants=("int8",)`` also publishes a weight variant of every block thoughtlet: ``blocks[a:b)@int8``
holds the same layers with every projection as per-row int8 (:class:`thoughtjax.quantized.RowInt8`,
stored as ``{"int8": q, "scale": s}`` arrays), the variant in its signature (``constraints["weights"]``
and a tag), so it is hashed, signed and profiled like any thoughtlet, and paths can name it.
``"int8a8"`` publishes ``blocks[a:b)@int8a8``: the same stored int8 arrays under a signature of its own, restored
as :class:`thoughtjax.quantized.RowInt8A8` (the activations quantized per row too, so a few-row step or a prompt
runs an integer GEMM; lossier).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from thoughtjax.loading import LoadedModel
from thoughtjax.loading import load as load_model
from thoughtjax.mapping import Mapping as SemanticMapping
from thoughtjax.mapping import load_mapping
from thoughtjax.path_syntax import VARIANTS
from thoughtjax.registry.codec import codec_digest
from thoughtjax.registry.errors import RegistryError
from thoughtjax.registry.layout import check_format, index_format, is_older_format, writer_lock
from thoughtjax.registry.lease import LEASE_DIR
from thoughtjax.registry.publish import publish_version
from thoughtjax.registry.store import Registry
from thoughtjax.registry.trust import TrustPolicy
from thoughtjax.thoughtlet import (
  Kind,
  ProfileSettings,
  Thoughtlet,
  ThoughtletError,
  cut,
  measure_profile,
  signature_for,
)
from thoughtjax.thoughtlet.stored import to_stored
from thoughtjax.transformer import Transformer
from thoughtjax.weights import variant_block

# What a registry directory holds (thoughtjax.registry.layout), removed when an older format is replaced.
_REGISTRY_ENTRIES = ("index.json", "thoughtlets", "codec", "keys", "calibration", ".staging", LEASE_DIR)


def _remove_registry(root: Path) -> None:
  """Remove an older-format registry's own entries (index first: from then on it is no registry)."""

  (root / "index.json").unlink(missing_ok=True)
  for entry in _REGISTRY_ENTRIES[1:]:
    shutil.rmtree(root / entry, ignore_errors=True)


def cut_thoughtlets(model, codec, mapping: SemanticMapping) -> list[Thoughtlet]:
  """One unprofiled thoughtlet per mapping entry, weights taken from ``model``."""
  cfg = model.cfg
  mapping.check_model(cfg.num_layers)
  tok = codec_digest(codec)
  out = []
  for e in mapping.entries:
    kind = Kind(e.kind)
    sig = signature_for(
      kind,
      cfg,
      tok,
      layers=e.layers,
      max_context=e.constraint_dict.get("max_context"),
      tags=e.tags,
      description=e.description,
    )
    params = cut(model, kind, layers=e.layers, codec=codec, system=e.system)
    if kind is Kind.TEMPLATE:
      sig = dataclasses.replace(
        sig,
        constraints={
          **sig.constraints,
          "system": e.system,
          "prefix_len": int(params["prefix_ids"].shape[0]),
          "suffix_len": int(params["suffix_ids"].shape[0]),
        },
      )
    out.append(Thoughtlet(e.name, kind, sig, params, cfg, e.layers))
  return out


_VARIANT_WORDS = {"int8": "per-row int8 weights", "int8a8": "per-row int8 weights and int8 activations"}


def variant_of(t: Thoughtlet, variant: str) -> Thoughtlet:
  """The ``variant`` of a blocks thoughtlet, named ``<name>@<variant>``; its params hold
  :class:`~thoughtjax.quantized.RowInt8` weights (:func:`thoughtjax.weights.to_stored` before publishing)."""

  if variant not in VARIANTS:
    raise ThoughtletError(f"weight variant {variant!r} is not known; expected one of {', '.join(VARIANTS)}")
  if t.kind is not Kind.BLOCKS:
    raise ThoughtletError(f"{t.name}: weight variants are built for block thoughtlets, not {t.kind.value}")
  sig = t.signature
  sig = dataclasses.replace(
    sig,
    constraints={**sig.constraints, "weights": variant},
    tags=(*sig.tags, variant),
    description=f"{sig.description} [{variant}: {_VARIANT_WORDS[variant]}, lossy]".strip(),
  )
  params = {k: variant_block(v, variant) for k, v in t.params.items()}
  return dataclasses.replace(t, name=f"{t.name}@{variant}", signature=sig, params=params, profile=None)


def build(
  out: str | os.PathLike,
  mapping: str | os.PathLike | SemanticMapping,
  model,
  *,
  codec=None,
  sign_key=None,
  settings: ProfileSettings | None = ProfileSettings(),
  progress: Callable[[str, str, int, int], None] | None = None,
  source: str | None = None,
  source_hash: str | None = None,
  trust: TrustPolicy | None = None,
  variants: Sequence[str] = (),
  weights: str = "native",
  replace_old_format: bool = False,
) -> Registry:
  """Cut ``model`` along ``mapping``, profile every thoughtlet and publish them to ``out``.

  ``model`` is a known model name or path (loaded with :func:`thoughtjax.loading.load`), a
  :class:`~thoughtjax.loading.LoadedModel`, or a :class:`~thoughtjax.transformer.Transformer` with
  ``codec`` given. Building into an existing registry of the same model publishes the changed
  thoughtlets as new versions (one atomic index switch); unchanged ones keep their version, and the
  existing index is verified first under ``trust`` (see :mod:`.publish`). ``variants`` (e.g. ``("int8",)``)
  adds that weight variant of every block thoughtlet (:func:`variant_of`). ``weights`` is the form a model
  given by name or path is loaded in (``"native"``: a quantized GGUF's blocks, stored packed; ``"f32"``).

  A registry of an older format at ``out`` cannot be built upon (:class:`RegistryFormatError`);
  ``replace_old_format=True`` removes it first and builds a new one there.
  """

  report = progress or (lambda stage, name, i, n: None)
  if weights not in ("native", "f32"):
    raise RegistryError(
      f"build(weights={weights!r}): a registry stores native (a quantized GGUF's blocks, packed) or f32 weights; "
      f"int8 versions are variants (variants=('int8',), CLI --variants int8)"
    )
  if is_older_format(out):
    if not replace_old_format:
      check_format(index_format(out), Path(out))  # raises, naming the way out
    with writer_lock(Path(out)):  # two processes replacing one cache: the second finds it replaced
      if is_older_format(out):
        report("replace", str(out), 0, 1)
        _remove_registry(Path(out))
        report("replace", str(out), 1, 1)
  if isinstance(model, (str, os.PathLike)):
    report("load", str(model), 0, 1)
    name = str(model)
    model = load_model(model, weights=weights)
    report("load", name, 1, 1)
  if isinstance(model, LoadedModel):
    codec = codec or model.codec
    source, source_hash = source or model.source, source_hash or model.source_hash
    model = model.model
  if not isinstance(model, Transformer) or codec is None:
    raise TypeError("build needs a model name/path, a LoadedModel, or a Transformer together with codec=")
  cfg = model.cfg
  if not isinstance(mapping, SemanticMapping):
    mapping = load_mapping(mapping, cfg.num_layers)
  units = cut_thoughtlets(model, codec, mapping)
  units += [variant_of(t, v) for v in dict.fromkeys(variants) for t in units if t.kind is Kind.BLOCKS]
  n = len(units)
  if settings is not None:
    table = model.embed.table[...]
    profiled = []
    for i, t in enumerate(units):
      report("profile", t.name, i, n)
      profiled.append(dataclasses.replace(t, profile=measure_profile(t, settings, table)))
    units = profiled
  units = [dataclasses.replace(t, params=to_stored(t.params)) for t in units]  # packed weights as plain arrays
  counter = {"stage:checkpoint": 0, "verify": 0, "commit:version": 0}

  def on_step(event, name):
    if event in counter:
      counter[event] += 1
      report(
        {"stage:checkpoint": "write", "verify": "verify", "commit:version": "commit"}[event], name, counter[event], n
      )

  model_info = {
    "config": cfg.to_json(),
    "family": cfg.family_hash,
    "source": source or "in-memory model",
    "source_hash": source_hash,
  }
  publish_version(
    Path(out),
    units,
    sign_key=sign_key,
    on_step=on_step,
    model=model_info,
    codec=codec,
    order=[t.name for t in units],
    mapping_text=mapping.text,
    trust=trust,
  )
  report("done", "", n, n)
  return Registry(out, trust)

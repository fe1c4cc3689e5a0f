"""Path strings: ``"embed, blocks[0:12), head"`` -> a parsed chain of thoughtlet refs.

Grammar (whitespace-insensitive)::

    path    := ref ("," ref)*
    ref     := name ["@" variant] ["@" version]
    name    := "embed" | "head" | "template" | "blocks[" a ":" b ")" | identifier
    variant := "int8" | "int8a8"

``blocks[a:b)`` is always half-open. A *variant* names a lossy weight form of the same thoughtlet
(``int8``: per-row int8 weights; ``int8a8``: the same int8 weights computed with each row of activations
quantized to int8 too, lossier; see :mod:`thoughtjax.quantized`); it is one of :data:`VARIANTS`, a closed set of
words, so ``@int8`` is never read as a version. A version is any other text without commas or ``@``
(in a registry a prefix of the hex versioned hash, e.g. ``3fa2c01b9e4d`` (at least 12 hex digits); hex never spells a variant); no
version means the registry's current one. ``blocks[0:10)@int8`` runs layers 0..9 from their int8
variant, ``blocks[0:10)@int8@3fa2c01b9e4d`` pins a version of it, and a path may mix variants:
``embed, blocks[0:10)@int8, blocks[10:30), head``. In a registry the variant is a thoughtlet of its
own, named with its suffix (``blocks[0:10)@int8``, see :attr:`Ref.unit`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

from thoughtjax.errors import UserError

_BLOCKS = re.compile(r"^blocks\[\s*(\d+)\s*:\s*(\d+)\s*([)\]])$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
VARIANTS: tuple[str, ...] = ("int8", "int8a8")  # weight variants a ref may name (a thoughtlet of its own in a registry)


class PathSyntaxError(UserError, ValueError):
  """A path string could not be parsed."""


def split_variant(unit: str) -> tuple[str, str | None]:
  """``"blocks[0:10)@int8"`` -> (``"blocks[0:10)"``, ``"int8"``); a name without a variant suffix -> (name, None)."""
  base, at, variant = unit.rpartition("@")
  return (base, variant) if at and variant in VARIANTS else (unit, None)


@dataclasses.dataclass(frozen=True)
class Ref:
  name: str
  version: str | None = None
  variant: str | None = None

  @property
  def span(self) -> tuple[int, int] | None:
    """(a, b) of ``blocks[a:b)`` (a registry unit name's variant suffix ignored), else None."""
    m = _BLOCKS.match(split_variant(self.name)[0])
    return (int(m.group(1)), int(m.group(2))) if m else None

  @property
  def unit(self) -> str:
    """The thoughtlet name this ref reads in a registry: the name, with ``@variant`` when it has one."""
    return self.name if self.variant is None else f"{self.name}@{self.variant}"

  def __str__(self) -> str:
    return self.unit if self.version is None else f"{self.unit}@{self.version}"

  def layers(self, num_layers: int) -> tuple[int, ...]:
    """The layers ``blocks[a:b)`` runs on a model of ``num_layers`` layers (checked)."""
    span = self.span
    if span is None:
      raise PathSyntaxError(f"{self} is not a block range blocks[a:b)")
    a, b = span
    if b > num_layers:
      raise PathSyntaxError(f"{self}: layer range ends at {b} but the model has {num_layers} layers")
    return tuple(range(a, b))


def parse_path(text: str) -> list[Ref]:
  """Parse a path string; errors name the offending item and its position."""
  if not text or not text.strip():
    raise PathSyntaxError('empty path; expected e.g. "embed, blocks[0:12), head"')
  refs = []
  for i, item in enumerate(text.split(",")):
    item = item.strip()
    name, *suffixes = [part.strip() for part in item.split("@")]
    variant = suffixes.pop(0) if suffixes and suffixes[0] in VARIANTS else None
    if len(suffixes) > 1:
      raise PathSyntaxError(
        f"item {i} {item!r}: expected name[@variant][@version] with variant one of {', '.join(VARIANTS)} "
        f"(e.g. blocks[0:10)@int8 or blocks[0:10)@int8@3fa2c01b9e4d); {suffixes[0]!r} is not a variant, so only one "
        f"version may follow"
      )
    version = (suffixes[0] if suffixes else "") or None
    m = _BLOCKS.match(name)
    if m:
      a, b = int(m.group(1)), int(m.group(2))
      if m.group(3) == "]":
        raise PathSyntaxError(f"item {i} {item!r}: block ranges are half-open, write blocks[{a}:{b})")
      if a >= b:
        raise PathSyntaxError(f"item {i} {item!r}: empty or reversed range; need a < b")
      name = f"blocks[{a}:{b})"
    elif not _IDENT.match(name):
      raise PathSyntaxError(
        f"item {i} {item!r} is not a thoughtlet ref; expected embed, head, template, "
        f"blocks[a:b) or a registered name, optionally with @version"
      )
    refs.append(Ref(name, version, variant))
  return refs


def layers_of_path(text: str, num_layers: int) -> tuple[int, ...]:
  """The layer sequence of an ``embed, blocks[..), ..., head`` path over one model (syntax and layer
  ranges only; ``model.with_path(text)`` resolves and type-checks any path, templates included)."""
  refs = parse_path(text)
  if refs[0].name != "embed":
    raise PathSyntaxError(f"a path starts with embed (tokens -> residual); got {refs[0]}")
  if refs[-1].name != "head":
    raise PathSyntaxError(f"a path ends with head (residual -> logits); got {refs[-1]}")
  layers: list[int] = []
  for ref in refs[1:-1]:
    if ref.variant is not None:
      raise PathSyntaxError(
        f"{ref}: a weight variant is a thoughtlet of its own; compose the path with "
        f"thoughtjax.compose.compose(path, model_or_registry) (or load the model with weights={ref.variant!r})"
      )
    span = ref.span
    if span is None:
      raise PathSyntaxError(
        f"{ref} is not a block range; composing other thoughtlets (bridges, templates) "
        f"goes through the registry's compose()"
      )
    layers.extend(ref.layers(num_layers))
  return tuple(layers)


def format_path(layers: Sequence[int], *, template: bool = False) -> str:
  """The path string of a layer sequence: runs of consecutive layers become one ``blocks[a:b)``."""
  items, start, prev = ["template" if template else "embed"], None, None
  for i in layers:
    if start is not None and i != prev + 1:
      items.append(f"blocks[{start}:{prev + 1})")
      start = None
    start = i if start is None else start
    prev = i
  if start is not None:
    items.append(f"blocks[{start}:{prev + 1})")
  return ", ".join([*items, "head"])


def hash_refs(refs: Sequence[str]) -> str:
  """Identity of a path: a hash of its resolved refs (``name@version`` or bare names), in order."""
  return hashlib.sha3_256("\n".join(refs).encode()).hexdigest()[:16]

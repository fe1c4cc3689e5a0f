"""Path strings: ``"embed, blocks[0:12), head"`` -> a parsed chain of thoughtlet refs.

Grammar (whitespace-insensitive)::

    path  := ref ("," ref)*
    ref   := name ["@" version]
    name  := "embed" | "head" | "template" | "blocks[" a ":" b ")" | identifier

``blocks[a:b)`` is always half-open. A version is free text without commas
(for example a hash prefix or ``v2``); no version means the registry's current one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

from thoughtjax.errors import UserError

_BLOCKS = re.compile(r"^blocks\[\s*(\d+)\s*:\s*(\d+)\s*([)\]])$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class PathSyntaxError(UserError, ValueError):
  """A path string could not be parsed."""


@dataclasses.dataclass(frozen=True)
class Ref:
  name: str
  version: str | None = None

  @property
  def span(self) -> tuple[int, int] | None:
    m = _BLOCKS.match(self.name)
    return (int(m.group(1)), int(m.group(2))) if m else None

  def __str__(self) -> str:
    return self.name if self.version is None else f"{self.name}@{self.version}"

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
    name, _, version = item.partition("@")
    name, version = name.strip(), version.strip() or None
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
    refs.append(Ref(name, version))
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

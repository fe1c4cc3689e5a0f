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
import re

_BLOCKS = re.compile(r"^blocks\[\s*(\d+)\s*:\s*(\d+)\s*([)\]])$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class PathSyntaxError(ValueError):
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
          f"blocks[a:b) or a registered name, optionally with @version")
    refs.append(Ref(name, version))
  return refs


def layers_of_path(text: str, num_layers: int) -> tuple[int, ...]:
  """The layer sequence of an ``embed, blocks[..), ..., head`` path over one model."""
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
          f"goes through the registry's compose()")
    a, b = span
    if b > num_layers:
      raise PathSyntaxError(f"{ref}: layer range ends at {b} but the model has {num_layers} layers")
    layers.extend(range(a, b))
  return tuple(layers)

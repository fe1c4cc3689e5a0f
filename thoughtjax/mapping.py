"""``semantic_mapping.yaml``: how a model is cut into thoughtlets (schema and validation).

Format (documented for users in ``registry/README.md``)::

    format: 1
    model: smollm2-135m-instruct      # informative
    num_layers: 30                    # optional; checked against the model at build
    thoughtlets:
      - kind: embed                   # embed | blocks | head | template
        tags: [lexical]
        description: token ids -> residual stream
      - kind: blocks
        layers: [0, 2]                # half-open [a, b)
        tags: [syntax]
        description: ...
        constraints: {max_context: 2048}
      - kind: head
      - kind: template
        name: chat                    # default: the kind (blocks: "blocks[a:b)")
        system: null                  # system message rendered into the template

Rules: exactly one ``embed`` and one ``head``; ``blocks`` spans are half-open, in
range, and tile ``[0, num_layers)`` with no overlap and no gap; names are unique.
Every error names the entry (index and name) and its line in the file.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from thoughtjax import yamlnodes
from thoughtjax.errors import UserError

KINDS = ("embed", "blocks", "head", "template")
_TOP_KEYS = {"format", "model", "num_layers", "thoughtlets"}
_ENTRY_KEYS = {"kind", "name", "layers", "tags", "description", "constraints", "system"}
_CONSTRAINT_KEYS = {"max_context"}


class MappingError(UserError, ValueError):
  """A semantic mapping is invalid; names the file, line and entry."""

  def __init__(self, message: str, *, source: str, line: int | None, entry: int | None = None, name: str | None = None):
    where = f"{source}:{line}" if line is not None else source
    who = "" if entry is None else f"entry {entry}" + (f" ({name})" if name else "") + ": "
    super().__init__(f"{where}: {who}{message}")
    self.source, self.line, self.entry, self.name = source, line, entry, name


@dataclasses.dataclass(frozen=True)
class MappingEntry:
  index: int
  name: str
  kind: str
  layers: tuple[int, int] | None  # blocks only, half-open
  tags: tuple[str, ...] = ()
  description: str = ""
  constraints: tuple[tuple[str, Any], ...] = ()
  system: str | None = None  # template only
  line: int = 0  # of the entry
  layers_line: int = 0  # of its layers field (blocks)

  @property
  def constraint_dict(self) -> dict:
    return dict(self.constraints)


@dataclasses.dataclass(frozen=True)
class Mapping:
  entries: tuple[MappingEntry, ...]
  num_layers: int | None
  model: str | None
  source: str
  text: str

  def by_name(self) -> dict[str, MappingEntry]:
    return {e.name: e for e in self.entries}

  def check_model(self, num_layers: int) -> None:
    """Range and coverage of the block spans against a model with ``num_layers`` layers."""
    _check_spans(self, num_layers)


_line, _field_nodes = yamlnodes.line, yamlnodes.field_nodes


def load_mapping(source: str | os.PathLike, num_layers: int | None = None, *, text: str | None = None) -> Mapping:
  """Parse and validate a mapping file (or ``text``, with ``source`` as its display name)."""
  name = str(source)
  if text is None:
    text = Path(source).read_text()
  data, top = yamlnodes.load_document(text, name, MappingError, top_keys=_TOP_KEYS, expected="a 'thoughtlets' list")
  declared = data.get("num_layers")
  if declared is not None and (not isinstance(declared, int) or declared <= 0):
    raise MappingError(
      f"num_layers must be a positive integer, got {declared!r}", source=name, line=_line(top["num_layers"][1])
    )
  if num_layers is not None and declared is not None and declared != num_layers:
    raise MappingError(
      f"num_layers: the mapping declares {declared} layers but the model has "
      f"{num_layers}; use a mapping written for this model",
      source=name,
      line=_line(top["num_layers"][1]),
    )
  items = data.get("thoughtlets")
  if "thoughtlets" not in top or not isinstance(items, list) or not items:
    raise MappingError(
      "'thoughtlets' must be a non-empty list of entries",
      source=name,
      line=_line(top["thoughtlets"][1]) if "thoughtlets" in top else 1,
    )
  seq = top["thoughtlets"][1]
  entries = [_entry(i, raw, node, name) for i, (raw, node) in enumerate(zip(items, seq.value))]

  seen: dict[str, MappingEntry] = {}
  for e in entries:
    if e.name in seen:
      first = seen[e.name]
      raise MappingError(
        f"name {e.name!r} is already used by entry {first.index} (line {first.line}); names must be unique",
        source=name,
        line=e.line,
        entry=e.index,
        name=e.name,
      )
    seen[e.name] = e
  for kind in ("embed", "head"):
    found = [e for e in entries if e.kind == kind]
    if len(found) != 1:
      line = found[1].line if len(found) > 1 else _line(seq)
      raise MappingError(
        f"need exactly one {kind!r} entry, found {len(found)}",
        source=name,
        line=line,
        entry=found[1].index if len(found) > 1 else None,
      )
  mapping = Mapping(tuple(entries), declared, data.get("model"), name, text)
  layers = num_layers if num_layers is not None else declared
  _check_spans(mapping, layers)
  return mapping


def _entry(i: int, raw: Any, node: yaml.Node, source: str) -> MappingEntry:
  line = _line(node)
  if not isinstance(raw, dict) or not isinstance(node, yaml.MappingNode):
    raise MappingError(f"expected a mapping with at least 'kind', got {raw!r}", source=source, line=line, entry=i)
  fields = _field_nodes(node)
  given_name = raw.get("name")

  def fail(msg: str, key: str | None = None):
    at = _line(fields[key][1]) if key in fields else line
    raise MappingError(msg, source=source, line=at, entry=i, name=given_name or _guess_name(raw))

  unknown = sorted(set(raw) - _ENTRY_KEYS)
  if unknown:
    at = _line(fields[unknown[0]][0])
    raise MappingError(
      f"unknown key {unknown[0]!r}; allowed: {sorted(_ENTRY_KEYS)}",
      source=source,
      line=at,
      entry=i,
      name=given_name or _guess_name(raw),
    )
  kind = raw.get("kind")
  if kind not in KINDS:
    fail(
      f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}"
      + (
        " (bridges are trained adapters, published with Registry.publish, not cut from a model)"
        if kind == "bridge"
        else ""
      ),
      "kind",
    )
  layers = raw.get("layers")
  if kind == "blocks":
    if (
      not isinstance(layers, list)
      or len(layers) != 2
      or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    ):
      fail(f"blocks need 'layers: [a, b]' (two integers, half-open [a, b)), got {layers!r}", "layers")
    a, b = layers
    if a < 0 or b <= a:
      fail(f"layers [{a}, {b}) is empty, reversed or negative; need 0 <= a < b", "layers")
    layers = (a, b)
  elif layers is not None:
    fail(f"only blocks entries have 'layers'; a {kind} entry must not", "layers")
  tags = raw.get("tags", [])
  if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
    fail(f"tags must be a list of strings, got {tags!r}", "tags")
  desc = raw.get("description", "")
  if not isinstance(desc, str):
    fail(f"description must be a string, got {desc!r}", "description")
  constraints = raw.get("constraints", {}) or {}
  if not isinstance(constraints, dict):
    fail(f"constraints must be a mapping, got {constraints!r}", "constraints")
  bad = sorted(set(constraints) - _CONSTRAINT_KEYS)
  if bad:
    fail(f"unknown constraint {bad[0]!r}; allowed: {sorted(_CONSTRAINT_KEYS)}", "constraints")
  mc = constraints.get("max_context")
  if mc is not None and (not isinstance(mc, int) or mc <= 0):
    fail(f"constraints.max_context must be a positive integer, got {mc!r}", "constraints")
  system = raw.get("system")
  if system is not None and (kind != "template" or not isinstance(system, str)):
    fail("'system' is a string and only template entries take it", "system")
  name = given_name if given_name is not None else (f"blocks[{layers[0]}:{layers[1]})" if kind == "blocks" else kind)
  if not isinstance(name, str) or not name:
    fail(f"name must be a non-empty string, got {name!r}", "name")
  if kind == "blocks" and name != f"blocks[{layers[0]}:{layers[1]})":
    fail(
      f"a blocks entry is named by its span; expected 'blocks[{layers[0]}:{layers[1]})' or no name, got {name!r}",
      "name",
    )
  if kind != "blocks" and name.startswith("blocks["):
    fail(f"name {name!r} is reserved for blocks entries", "name")
  layers_line = _line(fields["layers"][1]) if "layers" in fields else line
  return MappingEntry(
    i, name, kind, layers, tuple(tags), desc, tuple(sorted(constraints.items())), system, line, layers_line
  )


def _guess_name(raw: dict) -> str | None:
  if raw.get("kind") == "blocks" and isinstance(raw.get("layers"), list) and len(raw["layers"]) == 2:
    return f"blocks[{raw['layers'][0]}:{raw['layers'][1]})"
  return raw.get("kind") if isinstance(raw.get("kind"), str) else None


def _check_spans(mapping: Mapping, num_layers: int | None) -> None:
  spans = sorted((e for e in mapping.entries if e.kind == "blocks"), key=lambda e: e.layers)
  src = mapping.source
  for prev, cur in zip(spans, spans[1:]):
    if cur.layers[0] < prev.layers[1]:
      raise MappingError(
        f"layers [{cur.layers[0]}, {cur.layers[1]}) overlap entry {prev.index} ({prev.name}, line "
        f"{prev.line}) on layers [{cur.layers[0]}, {min(prev.layers[1], cur.layers[1])}); spans "
        f"must be disjoint",
        source=src,
        line=cur.layers_line,
        entry=cur.index,
        name=cur.name,
      )
  if num_layers is None:
    return
  for e in spans:
    if e.layers[1] > num_layers:
      raise MappingError(
        f"layers [{e.layers[0]}, {e.layers[1]}) end past the model's last layer; "
        f"the model has {num_layers} layers, so spans must end at <= {num_layers}",
        source=src,
        line=e.layers_line,
        entry=e.index,
        name=e.name,
      )
  covered = 0
  for i, e in enumerate(spans):
    if e.layers[0] > covered:
      before = spans[i - 1] if i else None
      ctx = f" between entry {before.index} ({before.name}, line {before.line}) and" if before else " before"
      raise MappingError(
        f"gap: layers [{covered}, {e.layers[0]}) are in no entry;{ctx} this one. "
        f"Spans must tile [0, {num_layers}) so every path can reach every layer",
        source=src,
        line=e.layers_line,
        entry=e.index,
        name=e.name,
      )
    covered = e.layers[1]
  if covered < num_layers:
    last = spans[-1] if spans else None
    raise MappingError(
      f"gap: layers [{covered}, {num_layers}) are in no entry; spans must tile [0, {num_layers})",
      source=src,
      line=last.layers_line if last else None,
      entry=last.index if last else None,
      name=last.name if last else None,
    )

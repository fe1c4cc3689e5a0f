"""YAML files whose errors name the file and the line: the registry's data files (the semantic
mapping, the synthesis dictionary) are parsed with their node marks kept, so a validation error can
point at the entry that caused it."""

from __future__ import annotations

from collections.abc import Callable, Collection

import yaml


def line(node: yaml.Node) -> int:
  """1-based line where ``node`` starts."""
  return node.start_mark.line + 1


def field_nodes(node: yaml.MappingNode) -> dict[str, tuple[yaml.Node, yaml.Node]]:
  """key -> (key node, value node) of a mapping node's scalar keys."""
  return {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def load_document(
  text: str, source: str, error: Callable[..., Exception], *, top_keys: Collection[str], expected: str
) -> tuple[dict, dict[str, tuple[yaml.Node, yaml.Node]]]:
  """Parse ``text`` (shown as ``source``) and check its top level: a mapping with only ``top_keys``
  and ``format: 1`` if present. Returns the data and its top-level field nodes; any failure raises
  ``error(message, source=..., line=...)``."""
  loader = yaml.SafeLoader(text)
  try:
    root = loader.get_single_node()
    data = loader.construct_document(root) if root is not None else None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    raise error(
      f"not valid YAML: {getattr(e, 'problem', e)}", source=source, line=None if mark is None else mark.line + 1
    ) from None
  finally:
    loader.dispose()
  if not isinstance(data, dict) or not isinstance(root, yaml.MappingNode):
    raise error(f"expected a mapping with {expected} at the top level", source=source, line=1)
  top = field_nodes(root)
  unknown = sorted(set(data) - set(top_keys))
  if unknown:
    raise error(
      f"unknown top-level key {unknown[0]!r}; allowed: {sorted(top_keys)}", source=source, line=line(top[unknown[0]][0])
    )
  if data.get("format", 1) != 1:
    raise error(f"format {data['format']!r} is not supported; expected 1", source=source, line=line(top["format"][1]))
  return data, top

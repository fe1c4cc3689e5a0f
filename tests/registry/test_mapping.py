"""semantic_mapping.yaml: the shipped mapping is valid; each kind of bad mapping is rejected
with the entry and the line named."""

from __future__ import annotations

import re

import pytest

from tests.registry.helpers import REPO, mapping_text
from thoughtjax.mapping import MappingError, load_mapping

GOOD = mapping_text([(0, 2), (2, 4)], 4)


def test_default_mapping_tiles_the_default_model():
  m = load_mapping(REPO / "registry" / "semantic_mapping.yaml", num_layers=30)
  spans = [e.layers for e in m.entries if e.kind == "blocks"]
  assert spans[0][0] == 0 and spans[-1][1] == 30
  assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
  assert all(2 <= b - a <= 3 for a, b in spans)
  bounds = {a for a, _ in spans}
  assert {10, 12, 20} <= bounds  # early exit at 12, blocks[10:20) as whole thoughtlets
  assert [e.kind for e in m.entries].count("template") == 1
  assert m.by_name()["embed"].line == 10


def _line_of(text: str, needle: str, occurrence: int = 1) -> int:
  lines = [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]
  return lines[occurrence - 1]


# (case, yaml edit, layers of the model, pieces the message must contain, line locator)
CASES = {
  "overlap": (
    GOOD.replace("layers: [2, 4]", "layers: [1, 4]"),
    4,
    ["entry 3 (blocks[1:4))", "overlap entry 2 (blocks[0:2)", "layers [1, 2)"],
    "layers: [1, 4]",
  ),
  "gap": (
    GOOD.replace("layers: [2, 4]", "layers: [3, 4]"),
    4,
    ["entry 3 (blocks[3:4))", "gap: layers [2, 3)"],
    "layers: [3, 4]",
  ),
  "gap_at_end": (GOOD.replace("layers: [2, 4]", "layers: [2, 3]"), 4, ["gap: layers [3, 4)"], "layers: [2, 3]"),
  "out_of_range": (
    GOOD.replace("layers: [2, 4]", "layers: [2, 9]").replace("num_layers: 4\n", ""),
    4,
    ["entry 3 (blocks[2:9))", "the model has 4 layers"],
    "layers: [2, 9]",
  ),
  "unknown_kind": (
    GOOD.replace("  - kind: head", "  - kind: bridge"),
    4,
    ["entry 4 (bridge)", "unknown kind 'bridge'", "embed, blocks, head, template"],
    "kind: bridge",
  ),
  "reversed": (
    GOOD.replace("layers: [2, 4]", "layers: [4, 2]"),
    4,
    ["entry 3 (blocks[4:2))", "need 0 <= a < b"],
    "layers: [4, 2]",
  ),
  "layers_on_head": (
    GOOD.replace("  - kind: head", "  - kind: head\n    layers: [0, 1]"),
    4,
    ["entry 4 (head)", "only blocks entries have 'layers'"],
    "layers: [0, 1]",
  ),
  "unknown_key": (
    GOOD.replace("    description: tokens -> residual", "    descripton: typo"),
    4,
    ["entry 0 (embed)", "unknown key 'descripton'"],
    "descripton",
  ),
  "duplicate": (
    GOOD.replace("  - kind: head", "  - kind: embed\n  - kind: head"),
    4,
    ["entry 4 (embed)", "already used by entry 0"],
    ("kind: embed", 2),
  ),
  "wrong_layer_count": (GOOD, 6, ["declares 4 layers but the model has 6"], "num_layers: 4"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_mapping_names_entry_and_line(case):
  text, layers, pieces, locator = CASES[case]
  needle, occ = locator if isinstance(locator, tuple) else (locator, 1)
  with pytest.raises(MappingError) as info:
    load_mapping("bad.yaml", layers, text=text)
  msg = str(info.value)
  line = _line_of(text, needle, occ)
  assert msg.startswith(f"bad.yaml:{line}: "), msg
  assert info.value.line == line
  for piece in pieces:
    assert piece in msg, msg


def test_invalid_yaml_reports_the_line():
  with pytest.raises(MappingError, match=r"^bad.yaml:\d+: not valid YAML"):
    load_mapping("bad.yaml", text="thoughtlets:\n  - kind: embed\n    description: a: b\n")


def test_missing_head_is_rejected():
  text = GOOD.replace("  - kind: head\n    description: residual -> logits\n", "")
  with pytest.raises(MappingError, match=re.escape("need exactly one 'head' entry, found 0")):
    load_mapping("bad.yaml", 4, text=text)

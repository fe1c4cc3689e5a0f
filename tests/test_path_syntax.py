"""Path strings: parsing, half-open ranges, errors that name the item."""

from __future__ import annotations

import pytest

from thoughtjax.path_syntax import PathSyntaxError, Ref, layers_of_path, parse_path


def test_parse_refs_with_versions():
  refs = parse_path(" embed@v1 , blocks[0:8),blocks[10 : 30)@abc123, head ")
  assert refs == [Ref("embed", "v1"), Ref("blocks[0:8)"), Ref("blocks[10:30)", "abc123"), Ref("head")]
  assert refs[2].span == (10, 30) and refs[0].span is None
  assert str(refs[2]) == "blocks[10:30)@abc123"


@pytest.mark.parametrize(
  "text,layers",
  [
    ("embed, blocks[0:12), head", tuple(range(12))),
    ("embed, blocks[0:8), blocks[10:30), head", tuple(range(8)) + tuple(range(10, 30))),
    ("embed, blocks[0:20), blocks[10:30), head", tuple(range(20)) + tuple(range(10, 30))),
    ("embed, head", ()),
  ],
)
def test_layers_of_path(text, layers):
  assert layers_of_path(text, 30) == layers


@pytest.mark.parametrize(
  "text,match",
  [
    ("", "empty path"),
    ("embed, blocks[0:12], head", "half-open"),
    ("embed, blocks[5:5), head", "reversed"),
    ("embed, blocks[0:31), head", "30 layers"),
    ("blocks[0:2), head", "starts with embed"),
    ("embed, blocks[0:2)", "ends with head"),
    ("embed, 12 layers, head", "item 1"),
  ],
)
def test_bad_paths_are_named(text, match):
  with pytest.raises(PathSyntaxError, match=match):
    layers_of_path(text, 30)

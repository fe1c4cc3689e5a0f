"""The one slicer: thoughtlet weights taken from a model by kind or by name."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from thoughtjax.thoughtlet import Kind, ThoughtletError, block_states, cut, defs_for, template_parts, unit_of


def test_template_parts_wrap_one_message(tiny):
  _, _, codec = tiny
  prefix, suffix = template_parts(codec, None)
  message = codec.tokenizer.encode("hello there", add_special_tokens=False).ids
  rendered = codec.encode(codec.render_chat([{"role": "user", "content": "hello there"}]))
  assert prefix + message + suffix == rendered


@pytest.mark.parametrize(
  "name,kind,layers",
  [
    ("embed", Kind.EMBED, None),
    ("head", Kind.HEAD, None),
    ("template", Kind.TEMPLATE, None),
    ("blocks[2:5)", Kind.BLOCKS, (2, 5)),
  ],
)
def test_cut_by_name_equals_cut_by_kind(tiny, name, kind, layers):
  _, model, codec = tiny
  assert unit_of(name) == (kind, layers)
  by_name = cut(model, name, codec=codec)
  by_kind = cut(model, kind, layers=layers, codec=codec)
  assert sorted(by_name) == sorted(by_kind)
  for (a, x), (b, y) in zip(sorted(_leaves(by_name)), sorted(_leaves(by_kind)), strict=True):
    assert a == b and np.array_equal(np.asarray(x), np.asarray(y))


def _leaves(tree, prefix=""):
  for k, v in tree.items():
    yield from _leaves(v, f"{prefix}{k}/") if isinstance(v, dict) else [(f"{prefix}{k}", v)]


def test_cut_takes_the_models_arrays_and_they_run_as_its_parts(tiny):
  cfg, model, codec = tiny
  blocks = cut(model, "blocks[1:3)")
  assert sorted(blocks) == ["1", "2"]
  assert blocks["2"]["mlp"]["up"] is nnx.to_pure_dict(nnx.state(model.blocks[2]))["mlp"]["up"]  # not copied
  template = cut(model, "template", codec=codec)
  prefix, _ = template_parts(codec, None)
  np.testing.assert_array_equal(template["prefix_rows"], np.asarray(model.embed.table[...])[prefix])
  states = block_states(model, blocks)
  assert sorted(states) == [1, 2]
  part = nnx.merge(defs_for(cfg).block, states[1])  # the cut state fits the model's own Block
  assert part.mlp.up[...] is model.blocks[1].mlp.up[...]


@pytest.mark.parametrize(
  "name,match",
  [("blocks[3:3)", "need blocks"), ("bridge", "not a thoughtlet of a model"), ("blocks[4:9)", r"layers 0\.\.5")],
)
def test_cut_refuses_what_the_model_does_not_hold(tiny, name, match):
  _, model, _ = tiny
  with pytest.raises(ThoughtletError, match=match):
    cut(model, name)


def test_a_template_needs_the_codec(tiny):
  _, model, _ = tiny
  with pytest.raises(ThoughtletError, match="pass codec="):
    cut(model, Kind.TEMPLATE)

"""Semantic signatures type the links of a path; a new version keeps the parameter tree."""

from __future__ import annotations

import pytest

from thoughtjax.errors import UserError
from thoughtjax.registry import codec_digest
from thoughtjax.thoughtlet import Kind, SemanticSignature, TensorType, Thoughtlet, ThoughtletError, cut, signature_for


def test_signatures_type_the_links(tiny):
  cfg, _, codec = tiny
  tok = codec_digest(codec)
  embed = signature_for(Kind.EMBED, cfg, tok)
  head = signature_for(Kind.HEAD, cfg, tok)
  assert str(embed.input) == f"tokens[B,T] i32 family={tok}"
  assert str(embed.output) == f"residual[B,T,{cfg.d_model}] f32 family={cfg.family_hash}"
  assert str(head.output) == f"logits[B,T,{cfg.vocab_size}] f32 family={tok}"
  assert head.input.mismatch(embed.output) is None
  assert "role 'logits' is not 'residual'" in head.input.mismatch(head.output)
  other = TensorType("residual", ("B", "T", cfg.d_model), "f32", "0000")
  assert "family 0000" in head.input.mismatch(other)
  wide = TensorType("residual", ("B", "T", cfg.d_model + 1), "f32", cfg.family_hash)
  assert "dimension 2" in head.input.mismatch(wide)
  assert head.constraints["requires"] == ["embed"]  # tied head reads the embed table
  template = signature_for(Kind.TEMPLATE, cfg, tok)
  assert str(template.input) == f"message[B,U] i32 family={tok}" and template.output == embed.output


@pytest.mark.parametrize("kind", list(Kind))
def test_signature_round_trips_through_json(tiny, kind):
  cfg, _, _ = tiny
  layers = (1, 3) if kind is Kind.BLOCKS else None
  sig = signature_for(kind, cfg, "tok", layers=layers, max_context=64, tags=("a", "b"), description="one line")
  assert SemanticSignature.from_json(sig.to_json()) == sig
  assert sig.constraints["max_context"] == 64
  assert signature_for(kind, cfg, "tok", layers=layers, max_context=10**6).constraints["max_context"] == cfg.max_context


def test_a_blocks_signature_needs_its_layers(tiny):
  cfg, _, _ = tiny
  with pytest.raises(ThoughtletError, match=r"pass layers=\(a, b\)"):
    signature_for(Kind.BLOCKS, cfg, "tok")


def test_new_weights_must_keep_the_parameter_tree(tiny):
  cfg, model, _ = tiny
  t = Thoughtlet(
    "blocks[0:2)",
    Kind.BLOCKS,
    signature_for(Kind.BLOCKS, cfg, "tok", layers=(0, 2)),
    cut(model, "blocks[0:2)"),
    cfg,
    (0, 2),
  )
  with pytest.raises(ThoughtletError, match="must keep the parameter tree") as err:
    t.with_params({"0": t.params["0"]})
  assert isinstance(err.value, UserError) and "'1/attn" in str(err.value)  # names what is missing
  assert t.with_params(dict(t.params)).profile is None

"""compose(): type-checked chains, one program, numerics vs the monolithic model, residency,
shared buffers for repeated spans, versions and templates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import greedy_reference
from thoughtjax.assembly import PathTypeError, full_path
from thoughtjax.compose import compose
from thoughtjax.decode import program as program_lib
from thoughtjax.loading import LoadedModel
from thoughtjax.model import Model
from thoughtjax.path_syntax import PathSyntaxError
from thoughtjax.registry import Registry

IDS = [7, 70, 71, 72, 32, 73, 74, 75, 76, 77, 78, 79, 80]


def _monolithic(cfg, model, codec, layers=None):
  return Model(LoadedModel(cfg, model, codec, "tiny", "seed"), layers)


def test_full_path_matches_the_monolithic_model(tiny, built):
  cfg, model, codec = tiny
  reg = Registry.open(built)
  m = compose(full_path(reg), reg)
  assert type(m) is Model and m.layers == tuple(range(6))  # one Model class, carrying its path
  assert m.path == full_path(reg) and len(m.links) == len(m.path.split(", "))
  ref = _monolithic(cfg, model, codec)
  np.testing.assert_allclose(m.logits(IDS), ref.logits(IDS), atol=1e-5, rtol=0)
  got = m.generate(IDS, max_tokens=6).token_ids
  before = program_lib.PROGRAMS.stats()
  again = m.generate(IDS[:5], max_tokens=3)  # same buckets: the same compiled program
  after = program_lib.PROGRAMS.stats()
  assert (after.misses, after.hits) == (before.misses, before.hits + 1)
  assert again.trace.compile_s == 0.0  # nothing traced or compiled for the second call
  assert again.trace.program.layers == tuple(range(6))
  assert got == greedy_reference(ref, IDS, 6, stop_at_eos=True)
  assert [t for d in m.stream(IDS, max_tokens=4) for t in d.token_ids] == got[:4]
  assert m.score(IDS).nll == pytest.approx(ref.score(IDS).nll, abs=1e-5)


def test_path_identity_is_a_hash_of_resolved_refs(built):
  reg = Registry.open(built)
  a = compose("embed, blocks[0:3), head", reg)
  assert a.refs == [f"{n}@{reg.current[n]}" for n in ("embed", "blocks[0:2)", "blocks[2:3)", "head")]
  assert a.path_hash == compose("embed, blocks[0:2), blocks[2:3), head", reg).path_hash
  assert a.path_hash != compose("embed, blocks[0:6), head", reg).path_hash


@pytest.mark.parametrize(
  "path, link, expected, received",
  [
    ("embed, head, blocks[0:2)", 2, "residual[B,T,32]", "logits[B,T,264]"),
    ("blocks[0:2), head", 0, "residual[B,T,32]", "tokens[B,T] i32"),
    ("embed, blocks[0:2), template, head", 2, "message[B,U] i32", "residual[B,T,32]"),
    ("embed, embed, head", 1, "tokens[B,T] i32", "residual[B,T,32]"),
    ("embed, blocks[0:2)", 2, "logits[B,T,V] f32", "residual[B,T,32]"),
  ],
)
def test_type_errors_name_the_first_broken_link(built, path, link, expected, received):
  reg = Registry.open(built)
  with pytest.raises(PathTypeError) as info:
    compose(path, reg)
  e = info.value
  assert e.link == link
  assert str(e.expected).startswith(expected) and str(e.received).startswith(received)
  assert expected in str(e) and received in str(e)
  assert f"link {link} (" in str(e) or (link == len(path.split(",")) and "must end in logits" in str(e))
  assert reg.stats().restores == 0  # checked before any weight is read


def test_versions_pin_one_thoughtlet(built):
  reg = Registry.open(built)
  v = reg.current["blocks[0:2)"]
  m = compose(f"embed, blocks[0:2)@{v[:12]}, blocks[2:6), head", reg)
  assert m.refs[1] == f"blocks[0:2)@{v}" and m.layers == tuple(range(6))
  with pytest.raises(PathSyntaxError, match="a version pins one thoughtlet"):
    compose(f"embed, blocks[0:3)@{v[:12]}, head", reg)


def test_early_exit_keeps_at_most_45_percent_resident(deep):
  cfg, model, codec, root = deep
  reg = Registry.open(root)
  m = compose("embed, blocks[0:12), head", reg)
  full = sum(x.nbytes for x in jax.tree.leaves(nnx_params(model)))
  assert m.layers == tuple(range(12))
  # Exactly the path's thoughtlets are resident: embed, 12 layers, head.
  manifests = [
    reg.manifest(n)
    for n in ("embed", "head", *[f"blocks[{a}:{b})" for a, b in [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]])
  ]
  assert reg.stats().resident_bytes == m.resident_bytes == sum(x.param_bytes for x in manifests)
  assert m.resident_bytes <= 0.45 * full
  ref = _monolithic(cfg, model, codec, tuple(range(12)))
  np.testing.assert_allclose(m.logits(IDS), ref.logits(IDS), atol=1e-5, rtol=0)


def nnx_params(model):
  from flax import nnx

  return nnx.state(model, nnx.Param)


def test_repeated_span_shares_buffers(deep):
  cfg, model, codec, root = deep
  reg = Registry.open(root)
  m = compose("embed, blocks[0:10), blocks[10:20), blocks[10:20), blocks[20:30), head", reg)
  layers = list(range(10)) + list(range(10, 20)) * 2 + list(range(20, 30))
  assert m.layers == tuple(layers)
  # Each layer's weights are held once; both passes over 10..19 read the same buffers.
  assert sorted(m.parts.blocks) == list(range(30))
  full = compose(full_path(reg), reg)
  assert m.resident_bytes == full.resident_bytes
  for i in range(10, 20):
    a = jax.tree.leaves(m.parts.blocks[i])
    b = jax.tree.leaves(full.parts.blocks[i])
    assert all(x is y for x, y in zip(a, b, strict=True))  # the resident set hands out the same arrays
  # The compiled program takes the 30 distinct blocks as arguments, not 40.
  tokens = jnp.zeros((1, 16), jnp.int32)
  args = program_lib.score_logits.lower(m.defs, m.layers, m.parts, tokens).compile().memory_analysis()
  assert args.argument_size_in_bytes == m.resident_bytes + tokens.nbytes
  ref = _monolithic(cfg, model, codec, tuple(layers))
  np.testing.assert_allclose(m.logits(IDS), ref.logits(IDS), atol=1e-5, rtol=0)


def test_template_path_wraps_the_prompt(tiny, built):
  cfg, model, codec = tiny
  reg = Registry.open(built)
  m = compose("template, blocks[0:6), head", reg)
  message = "hi there"
  ids = m.prompt_ids(message)
  assert ids == codec.encode(codec.render_chat([{"role": "user", "content": message}]))
  # The embed table comes along (the decode loop embeds new tokens; the head is tied).
  assert any(r.startswith("embed@") for r in reg.stats().resident)
  ref = _monolithic(cfg, model, codec)
  np.testing.assert_allclose(m.logits(ids), ref.logits(ids), atol=1e-5, rtol=0)


def test_compose_from_a_loaded_model(tiny):
  cfg, model, codec = tiny
  ref = _monolithic(cfg, model, codec)
  m = compose("embed, blocks[0:2), blocks[1:4), head", ref)
  assert m.layers == (0, 1, 1, 2, 3)
  np.testing.assert_allclose(m.logits(IDS), ref.with_path((0, 1, 1, 2, 3)).logits(IDS), atol=1e-6, rtol=0)
  with pytest.raises(PathSyntaxError, match="versions exist only in a registry"):
    compose("embed@v1, head", ref)


def test_two_versions_of_one_layer_in_one_path(registry_copy, tiny, keypair):
  cfg, model, codec = tiny
  reg = Registry.open(registry_copy)
  old = reg.current["blocks[0:2)"]
  base = reg.thoughtlet("blocks[0:2)")
  new = reg.publish(
    [base.with_params(jax.tree.map(lambda x: x * 1.5, dict(base.params)))], sign_key=keypair[0], settings=None
  )
  m = compose(f"embed, blocks[0:2)@{old}, blocks[0:2)@{new['blocks[0:2)']}, blocks[2:6), head", reg)
  assert len(m.parts.blocks) == 8 and m.layers[:4] == (0, 1, 6, 7)  # distinct slots, distinct weights
  assert not np.allclose(
    m.logits(IDS), compose(f"embed, blocks[0:2)@{old}, blocks[0:2)@{old}, blocks[2:6), head", reg).logits(IDS)
  )


def test_composed_template_survives_with_chunk_and_with_path(tiny, built):
  cfg, model, codec = tiny
  reg = Registry.open(built)
  m = compose("template, blocks[0:6), head", reg)
  message = "hi there"
  wrapped = codec.encode(codec.render_chat([{"role": "user", "content": message}]))
  ref = _monolithic(cfg, model, codec)
  want = greedy_reference(ref, wrapped, 4)
  variants = {
    "composed": m,
    "with_chunk": m.with_chunk(3),
    "with_path(layers)": m.with_path((0, 1, 2, 3, 4, 5)),
    "with_path(str)": m.with_path("template, blocks[0:6), head"),
  }
  for label, v in variants.items():
    assert v.template is not None, label
    assert v.prompt_ids(message) == wrapped, label
    out = v.generate(message, max_tokens=4, ignore_eos=True)
    assert out.prompt_ids == wrapped and out.token_ids == want, label
    assert out.trace.program.template == (len(m.template.prefix_ids), len(m.template.suffix_ids)), label
  assert variants["with_chunk"].chunk == 3 and variants["with_chunk"].refs == m.refs
  # A shorter path over held layers keeps the template too.
  short = m.with_path((0, 1, 2))
  assert short.template is m.template and short.path == "template, blocks[0:3), head"
  assert short.prompt_ids(message) == wrapped


def test_with_path_string_on_a_loaded_model_composes(tiny):
  cfg, model, codec = tiny
  ref = _monolithic(cfg, model, codec)
  m = ref.with_path("embed, blocks[0:2), blocks[1:4), head")
  assert type(m) is Model and m.layers == (0, 1, 1, 2, 3) and m.source is ref
  assert m.refs == ["embed", "blocks[0:2)", "blocks[1:4)", "head"]
  np.testing.assert_allclose(m.logits(IDS), ref.with_path((0, 1, 1, 2, 3)).logits(IDS), atol=1e-6, rtol=0)
  # Composing again from the composed model goes back to the same source weights.
  assert m.with_path("embed, blocks[0:6), head").source is ref

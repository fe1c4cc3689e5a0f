"""Isolate and replay: every thoughtlet kind, captured inside the whole model, run alone, gives the same output.

The capture taps the model's own parts (embed, every block, head) while its forward runs a causal
pass; each thoughtlet then runs by itself, outside the model, on the captured input and must
reproduce the captured output. Published versions are replayed with the weights restored from a
registry, named units with the weights cut from a loaded Model.
"""

from __future__ import annotations

import numpy as np
import pytest

import thoughtjax
from thoughtjax.loading import LoadedModel
from thoughtjax.thoughtlet import Kind, ReplayReport, ThoughtletError, capture, replay
from thoughtjax.transformer import Block, abstract_model

MESSAGE = "replay me"


@pytest.fixture(scope="module")
def loaded(tiny):
  cfg, model, codec = tiny
  return thoughtjax.Model(LoadedModel(cfg, model, codec, "tiny-seed7", ""))


# A router is no part of the model's forward pass (nothing to capture); its round trip is in test_router_store.
# A bridge is no part of the whole model either: it replays inside a composed bridged path (test_bridge).
@pytest.mark.parametrize("kind", [k for k in Kind if k not in (Kind.ROUTER, Kind.BRIDGE)], ids=lambda k: k.value)
def test_every_published_kind_replays_alone(kind, tiny, built, loaded):
  from thoughtjax.registry import Registry

  reg = Registry.open(built)
  names = [n for n in reg.names if reg.manifest(n).kind is kind]
  assert names
  for name in names:
    report = replay(loaded, reg.thoughtlet(name), MESSAGE, chat=True)
    assert isinstance(report, ReplayReport) and (report.name, report.kind) == (name, kind)
    assert report.replayed.shape == report.captured.shape
    np.testing.assert_allclose(report.replayed, report.captured, atol=1e-5, rtol=0, err_msg=name)
    assert report.ok() and report.max_abs_diff <= 1e-5


def test_what_each_kind_receives_and_produces(tiny, loaded):
  cfg, _, codec = tiny
  tokens = codec.encode(codec.render_chat([{"role": "user", "content": MESSAGE}]))
  user = codec.tokenizer.encode(MESSAGE, add_special_tokens=False).ids
  cap = capture(loaded, tokens)
  T, D, V = len(tokens), cfg.d_model, cfg.vocab_size
  embed = replay(loaded, "embed", tokens)
  np.testing.assert_array_equal(embed.input, [tokens])
  blocks = replay(loaded, "blocks[2:5)", tokens)
  np.testing.assert_array_equal(blocks.input, cap.blocks[2][0])  # what layer 2 received
  np.testing.assert_array_equal(blocks.captured, cap.blocks[4][1])  # what layer 4 produced
  head = replay(loaded, "head", tokens)
  assert head.captured.shape == (1, T, V) and np.array_equal(head.captured, cap.logits)
  template = replay(loaded, "template", MESSAGE)
  np.testing.assert_array_equal(template.input, [user])  # the message alone
  np.testing.assert_array_equal(template.captured, cap.embed[1])  # the whole chat prompt's rows
  assert blocks.captured.shape == template.replayed.shape == (1, T, D)
  for r in (embed, blocks, head, template):
    assert r.ok(), str(r)


def test_capture_follows_the_residual_and_leaves_the_model_alone(tiny):
  cfg, model, _ = tiny
  call = Block.__call__
  tokens = np.arange(3, 14, dtype=np.int32)
  cap = capture(model, tokens)
  assert Block.__call__ is call  # nothing patched, so other threads see the plain model
  assert len(cap.blocks) == cfg.num_layers
  chain = [cap.embed] + list(cap.blocks) + [cap.head]
  for (_, out), (nxt, _) in zip(chain, chain[1:], strict=False):
    np.testing.assert_array_equal(out, nxt)
  again = capture(model, tokens[None])
  np.testing.assert_array_equal(again.logits, cap.logits)


def test_replay_catches_a_changed_weight(tiny, loaded):
  from thoughtjax.registry import codec_digest
  from thoughtjax.thoughtlet import Thoughtlet, cut, signature_for

  cfg, model, codec = tiny
  params = cut(model, "blocks[1:3)")
  bent = {**params, "2": {**params["2"], "mlp": {**params["2"]["mlp"], "down": params["2"]["mlp"]["down"] * 1.01}}}
  t = Thoughtlet(
    "blocks[1:3)", Kind.BLOCKS, signature_for(Kind.BLOCKS, cfg, codec_digest(codec), layers=(1, 3)), bent, cfg, (1, 3)
  )
  report = replay(loaded, t, "hello there")
  assert report.max_abs_diff > 1e-4 and not report.ok()
  assert "replay blocks[1:3)" in str(report)


def test_replay_refuses_what_it_cannot_replay(tiny, loaded):
  from tests.registry.helpers import tiny_config
  from thoughtjax.thoughtlet import Thoughtlet, cut, signature_for

  cfg, model, _ = tiny
  wide = tiny_config(d_model=48)
  t = Thoughtlet("embed", Kind.EMBED, signature_for(Kind.EMBED, wide, "tok"), cut(model, "embed"), wide)
  with pytest.raises(ThoughtletError, match="family"):
    replay(loaded, t, "hello")
  with pytest.raises(ThoughtletError, match="expected a str"):
    replay(loaded, "template", [5, 6, 7])
  with pytest.raises(ThoughtletError, match="no tokens"):
    replay(loaded, "embed", [])
  with pytest.raises(ThoughtletError, match="not a thoughtlet of a model"):
    replay(loaded, "bridge", "hello")
  with pytest.raises(ThoughtletError, match="pass codec="):
    replay(model, "embed", "hello")  # a bare Transformer has no codec
  with pytest.raises(ThoughtletError, match="holds no whole-model weights"):
    replay(abstract_model(cfg), "embed", [1, 2, 3])


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["embed", "blocks[3:5)", "head", "template"])
def test_replay_inside_the_default_model(default_model, unit):
  report = replay(default_model, unit, "The capital of France is", chat=unit != "template")
  assert report.captured.shape[-1] == (
    default_model.config.vocab_size if unit == "head" else default_model.config.d_model
  )
  assert report.ok(atol=1e-4), str(report)

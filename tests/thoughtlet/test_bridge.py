"""Bridge thoughtlets: identity when untrained, typed like any link, published like any thoughtlet, and
replayed alone from what the composed bridged path fed it."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.registry.helpers import FAST
from thoughtjax import transformer
from thoughtjax.assembly import PathTypeError
from thoughtjax.compose import compose
from thoughtjax.decode import program as program_lib
from thoughtjax.registry import Registry, SignatureDowngradeError
from thoughtjax.thoughtlet import Kind, ThoughtletError
from thoughtjax.thoughtlet import bridge as bridge_lib

PROMPT = [5, 17, 99, 3, 42, 8, 120, 64, 7]


@pytest.fixture
def reg_copy(built, tmp_path):
  dst = tmp_path / "registry"
  shutil.copytree(built, dst)
  return Registry.open(dst)


def _trained_like(cfg, rank=8, seed=1):
  """Params of a bridge that is not the identity (up drawn at random, as after training)."""
  p = bridge_lib.init_params(cfg, rank, seed)
  p["up"] = 0.3 * jax.random.normal(jax.random.key(seed + 1), p["up"].shape)
  p["norm"]["weight"] = p["norm"]["weight"] * 1.5
  return jax.tree.map(np.asarray, p)


def publish_version(reg, params, span=(3, 6), cut_path="embed, blocks[0:3), head", settings=None):
  t = bridge_lib.bridge_thoughtlet(reg.config, reg.tokenizer_hash, params, cut_path=cut_path, span=span)
  return t, reg.publish([t], settings=settings)[t.name]


def test_untrained_bridge_is_the_identity(tiny):
  cfg = tiny[0]
  p = bridge_lib.init_params(cfg, rank=16, seed=3)
  x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model)) * 3.0
  np.testing.assert_array_equal(np.asarray(transformer.apply_bridge(p, x)), np.asarray(x))
  assert p["down"].shape == (cfg.d_model, 16) and p["up"].shape == (16, cfg.d_model)


def test_bridged_path_with_an_untrained_bridge_equals_the_cut_path(reg_copy):
  params = jax.tree.map(np.asarray, bridge_lib.init_params(reg_copy.config, 8, 0))
  publish_version(reg_copy, params)
  cut = compose("embed, blocks[0:3), head", reg_copy, compile_cache=False)
  bridged = compose("embed, blocks[0:3), bridge.3-6, head", reg_copy, compile_cache=False)
  assert bridged.layers == (0, 1, 2, -1)
  np.testing.assert_allclose(bridged.logits(PROMPT), cut.logits(PROMPT), rtol=0, atol=1e-6)
  assert bridged.generate(PROMPT, max_tokens=6).token_ids == cut.generate(PROMPT, max_tokens=6).token_ids


def test_a_bridged_path_taken_from_an_indexed_model_runs_unrolled(reg_copy):
  """A path with a bridge has no layer-indexed form: from an indexed model it keeps the unrolled layout (a model
  made indexed on purpose with a bridge is refused) and gives the cut path's tokens."""
  params = jax.tree.map(np.asarray, bridge_lib.init_params(reg_copy.config, 8, 0))
  publish_version(reg_copy, params)
  fast = compose("embed, blocks[0:3), head", reg_copy, compile_cache=False).with_layout("indexed")
  bridged = fast.with_path("embed, blocks[0:3), bridge.3-6, head")
  assert bridged.layout == "unrolled" and bridged.layers == (0, 1, 2, -1)
  assert bridged.generate(PROMPT, max_tokens=6).token_ids == fast.generate(PROMPT, max_tokens=6).token_ids
  with pytest.raises(ValueError, match="no layer-indexed form"):
    bridged.with_layout("indexed")


def test_a_trained_bridge_changes_the_path_and_runs_as_one_program(reg_copy):
  publish_version(reg_copy, _trained_like(reg_copy.config))
  cut = compose("embed, blocks[0:3), head", reg_copy, compile_cache=False)
  bridged = compose("embed, blocks[0:3), bridge.3-6, head", reg_copy, compile_cache=False)
  assert np.abs(bridged.logits(PROMPT) - cut.logits(PROMPT)).max() > 1e-3
  # Scoring and generation agree: the greedy first token is the argmax of the scored last position.
  first = bridged.generate(PROMPT, max_tokens=4).token_ids[0]
  assert first == int(np.argmax(bridged.logits(PROMPT)[-1]))
  # A skip bridge sits between two block ranges.
  publish_version(
    reg_copy, _trained_like(reg_copy.config, seed=5), span=(3, 5), cut_path="embed, blocks[0:3), blocks[5:6), head"
  )
  skip = compose("embed, blocks[0:3), bridge.3-5, blocks[5:6), head", reg_copy, compile_cache=False)
  assert skip.layers == (0, 1, 2, -1, 5) and len(skip.generate(PROMPT, max_tokens=3).token_ids) == 3


def test_bridge_links_are_type_checked(reg_copy):
  publish_version(reg_copy, _trained_like(reg_copy.config))
  with pytest.raises(PathTypeError) as e:
    compose("bridge.3-6, embed, blocks[0:3), head", reg_copy, compile_cache=False)
  assert e.value.link == 0 and "residual" in str(e.value)
  with pytest.raises(PathTypeError) as e:
    compose("embed, blocks[0:3), head, bridge.3-6", reg_copy, compile_cache=False)
  assert e.value.link == 3 and "logits" in str(e.value) and "residual" in str(e.value)
  # Straight after embed is type-correct (residual -> residual) and runs.
  assert (
    len(compose("embed, bridge.3-6, head", reg_copy, compile_cache=False).generate(PROMPT, max_tokens=2).token_ids) == 2
  )


def test_replay_bridge_inside_the_composed_path(reg_copy, monkeypatch):
  """Capture the bridge's input and output inside the bridged path's own forward, run it alone, compare."""
  params = _trained_like(reg_copy.config)
  publish_version(reg_copy, params)
  model = compose("embed, blocks[0:3), bridge.3-6, head", reg_copy, compile_cache=False)
  records = []

  class Recording(transformer.BridgeLayer):
    def __call__(self, x, *rest):
      out = super().__call__(x, *rest)
      records.append((np.asarray(x), np.asarray(out[0])))
      return out

  monkeypatch.setattr(transformer, "BridgeLayer", Recording)
  tokens = jnp.asarray([PROMPT])
  logits = program_lib.sequence_logits(model.defs, model.layers, model.parts, tokens)  # not jitted
  monkeypatch.undo()
  assert len(records) == 1
  x, y = records[0]
  restored = reg_copy.restore("bridge.3-6")
  alone = np.asarray(transformer.apply_bridge(restored, jnp.asarray(x)))
  np.testing.assert_allclose(alone, y, rtol=0, atol=1e-6)
  # What was captured is what the compiled program computes.
  np.testing.assert_allclose(np.asarray(logits[0]), model.logits(PROMPT), rtol=1e-5, atol=1e-5)


def test_published_bridge_is_versioned_hashed_signed_and_profiled(tmp_path, monkeypatch):
  from tests.registry.helpers import TINY_SPANS, mapping_text, tiny_codec, tiny_config
  from thoughtjax.registry import build
  from thoughtjax.signing import keygen
  from thoughtjax.transformer import init_random

  monkeypatch.setenv("THOUGHTJAX_TRUST_STATE", str(tmp_path / "trust-state.json"))  # not the user's
  key, _ = keygen(tmp_path / "keys" / "registry")
  reg_dir = tmp_path / "signed"
  (tmp_path / "m.yaml").write_text(mapping_text(TINY_SPANS, 6))
  cfg = tiny_config()
  reg = build(
    reg_dir,
    tmp_path / "m.yaml",
    init_random(cfg, seed=7, scale=0.08),
    codec=tiny_codec(),
    sign_key=key,
    settings=None,
    source="tiny-seed7",
  )
  t = bridge_lib.bridge_thoughtlet(
    reg.config,
    reg.tokenizer_hash,
    _trained_like(cfg),
    cut_path="embed, blocks[0:3), head",
    span=(3, 6),
    report={"after": {"mean_kl": 0.1}},
  )
  # The registry's trust rules hold for bridges: a signed registry refuses an unsigned publish, counted.
  with pytest.raises(SignatureDowngradeError):
    reg.publish([t], settings=None)
  stats = reg.stats()
  assert stats.downgrade_refusals == 1 and any(f["kind"] == "downgrade" for f in stats.failures)
  assert "bridge.3-6" not in reg.names
  version = reg.publish([t], sign_key=key, settings=FAST)[t.name]
  reg = Registry.open(reg_dir)
  m = reg.manifest("bridge.3-6")
  assert m.kind is Kind.BRIDGE and m.version == version == m.versioned_hash[:16] == t.versioned_hash()[:16]
  assert m.signed_by is not None and m.profile is not None and m.profile.param_bytes == t.param_bytes
  assert m.profile.flops_per_token > 0
  assert m.signature.constraints["training"]["after"]["mean_kl"] == 0.1
  assert m.signature.constraints["heals"] == [3, 6] and m.signature.constraints["rank"] == 8
  assert str(m.signature.input) == str(m.signature.output)
  report = reg.verify()
  assert any(r["ref"].startswith("bridge.3-6@") for r in report.thoughtlets)


def test_cut_point_and_bridged_path():
  assert bridge_lib.cut_point("embed, blocks[0:10), head", 30) == (10, (10, 30))
  assert bridge_lib.cut_point("embed, blocks[0:8), blocks[10:30), head", 30) == (8, (8, 10))
  assert (
    bridge_lib.bridged_path("embed, blocks[0:10), head", "bridge.10-30", 30)
    == "embed, blocks[0:10), bridge.10-30, head"
  )
  assert (
    bridge_lib.bridged_path("embed, blocks[0:8), blocks[10:30), head", "bridge.8-10", 30)
    == "embed, blocks[0:8), bridge.8-10, blocks[10:30), head"
  )
  with pytest.raises(ThoughtletError, match="no cut to heal"):
    bridge_lib.cut_point("embed, blocks[0:30), head", 30)
  with pytest.raises(ThoughtletError, match="repeats layers"):
    bridge_lib.cut_point("embed, blocks[0:20), blocks[10:30), head", 30)
  with pytest.raises(ThoughtletError, match="positive integer"):
    bridge_lib.init_params(None, rank=0)


def test_a_bridged_path_in_a_slot_engine_runs_unrolled_and_gives_its_alone_tokens(reg_copy):
  """A path with a bridge has no layer-indexed form: its slot engine runs unrolled (asking for indexed is refused by
  name), a pool of indexed engines makes it an unrolled one, and a request in it gives the path's alone tokens."""
  from thoughtjax.sampling import SamplingParams
  from thoughtjax.serving import SlotEngine, SlotRequestError, generate_in_slots
  from thoughtjax.serving.pool import EnginePool

  publish_version(reg_copy, _trained_like(reg_copy.config))
  bridged = compose("embed, blocks[0:3), bridge.3-6, head", reg_copy, compile_cache=False)
  with pytest.raises(SlotRequestError, match="no layer-indexed form"):
    SlotEngine(bridged, slots=2, cache_len=32, layout="indexed")
  pool = EnginePool(2, cache_len=32, layout="indexed")
  try:
    driver = pool.lease(bridged, 16)
    assert driver.engine.layout == "unrolled" and driver.engine.program.key.layout == "unrolled"
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    (run,) = generate_in_slots(driver.engine, [(PROMPT, params)])
    assert run.token_ids == bridged.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids
    pool.give_back(driver)
  finally:
    pool.close()

"""Healing a cut path on a tiny seeded model: training lowers held-out KL, is deterministic for a seed,
and `registry heal` publishes a bridge whose bridged path composes and runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.tiny import tiny_engine
from thoughtjax.synthesis.heal import HealError, HealSettings, heal

CUT = "embed, blocks[0:2), head"  # the 3-layer tiny model without its last layer
SMALL = HealSettings(rank=8, steps=40, learning_rate=1e-2, batch=4, window=32, seed=0, generated=8, generated_tokens=48)
DOCS = ["The quick brown fox jumps over the lazy dog. " * 3, "Pack my box with five dozen liquor jugs. " * 3]


@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", seed=4)


@pytest.fixture(scope="module")
def healed(model):
  return heal(model, CUT, SMALL, documents=DOCS)


def test_training_reduces_heldout_kl(healed):
  params, report = healed
  assert report.before.tokens == report.after.tokens > 0
  assert report.before.mean_kl > 0 and report.before.top1_agreement < 1.0  # the cut loses something
  assert report.after.mean_kl < 0.8 * report.before.mean_kl
  assert report.after.top1_agreement >= report.before.top1_agreement
  assert report.name == "bridge.2-3" and report.heals == (2, 3)
  assert report.bridged_path == "embed, blocks[0:2), bridge.2-3, head"
  assert report.param_bytes == sum(
    np.asarray(x).nbytes for x in (params["down"], params["up"], params["norm"]["weight"])
  )
  assert len(report.losses) == SMALL.steps and np.isfinite(report.losses).all()
  json.dumps(report.to_json())  # stored with the bridge: must serialize


def test_same_seed_same_bridge_other_seed_other_bridge(model, healed):
  params, report = healed
  again, report2 = heal(model, CUT, SMALL, documents=DOCS)
  for a, b in zip((params["down"], params["up"]), (again["down"], again["up"]), strict=True):
    np.testing.assert_array_equal(a, b)
  assert report2.after == report.after and report2.losses == report.losses
  other, _ = heal(model, CUT, HealSettings(**{**SMALL.__dict__, "seed": 1, "steps": 2}), documents=DOCS)
  assert not np.array_equal(other["down"], params["down"])


def test_progress_is_reported_every_step(model):
  seen = []
  heal(
    model,
    CUT,
    HealSettings(**{**SMALL.__dict__, "steps": 3}),
    documents=DOCS,
    progress=lambda step, steps, loss: seen.append((step, steps, loss)),
  )
  assert [s[:2] for s in seen] == [(1, 3), (2, 3), (3, 3)] and all(np.isfinite(s[2]) for s in seen)


def test_bad_requests_are_named(model):
  with pytest.raises(HealError, match="rank must be >= 1"):
    HealSettings(rank=0)
  from thoughtjax.thoughtlet import ThoughtletError

  with pytest.raises(ThoughtletError, match="no cut to heal"):
    heal(model, "embed, blocks[0:3), head", SMALL)


def test_cli_registry_heal_publishes_a_composable_bridge(tmp_path, monkeypatch, capsys):
  from tests.registry.helpers import TINY_SPANS, mapping_text, tiny_codec, tiny_config
  from thoughtjax import cli
  from thoughtjax.compose import compose
  from thoughtjax.registry import Registry, build
  from thoughtjax.transformer import init_random

  monkeypatch.setenv("THOUGHTJAX_TRUST_STATE", str(tmp_path / "trust-state.json"))
  (tmp_path / "m.yaml").write_text(mapping_text(TINY_SPANS, 6))
  build(
    tmp_path / "reg",
    tmp_path / "m.yaml",
    init_random(tiny_config(), seed=7, scale=0.08),
    codec=tiny_codec(),
    settings=None,
    source="tiny-seed7",
  )
  rc = cli.main(
    [
      "registry",
      "heal",
      str(tmp_path / "reg"),
      "--path",
      "embed, blocks[0:2), blocks[3:6), head",
      "--steps",
      "4",
      "--rank",
      "4",
      "--window",
      "16",
      "--generated",
      "4",
      "--no-corpora",
      "--reps",
      "1",
      "--context",
      "16",
    ]
  )
  out = capsys.readouterr().out
  assert rc == 0
  assert "before" in out and "after" in out and "agreement" in out and "KL" in out and "ΔNLL" in out
  reg = Registry.open(tmp_path / "reg")
  m = reg.manifest("bridge.2-3")
  training = m.signature.constraints["training"]
  assert set(training["before"]) >= {"top1_agreement", "mean_kl", "delta_nll"} and training["steps"] == 4
  assert m.profile is not None and m.signature.constraints["cut_path"] == "embed, blocks[0:2), blocks[3:6), head"
  bridged = compose(training["bridged_path"], reg, compile_cache=False)
  assert bridged.layers == (0, 1, -1, 3, 4, 5)
  assert len(bridged.generate([5, 6, 7], max_tokens=3).token_ids) == 3

"""Candidate proposals: influence, greedy removal, kinds and de-duplication, hashes as compose reports them.

The tiny model's block 2 has zeroed output projections, so it returns its input: its influence is 0,
skipping it is lossless, and greedy removal must take it first. The corpus is sampled from the full
path itself, so every other removal costs a positive expected ΔNLL (its KL from the full path).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tests.registry.helpers import DEEP_SPANS
from tests.synthesis.tiny_synthesis import make_model
from thoughtjax.compose import compose
from thoughtjax.decode import program
from thoughtjax.path_syntax import layers_of_path
from thoughtjax.synthesis.calibration import Calibration, PathQuality
from thoughtjax.synthesis.candidate import CandidateKind
from thoughtjax.synthesis.candidates import (
  CandidateError,
  CandidateSettings,
  block_influence,
  default_exits,
  default_repeats,
  greedy_removal,
  pin,
  propose,
  unit_spans,
)
from thoughtjax.synthesis.latency_params import LatencyParams, LinearCost
from thoughtjax.synthesis.quality import measure, measure_candidates, windows
from thoughtjax.thoughtlet import capture
from thoughtjax.transformer import GraphDefs

IDENTITY = 2
WINDOW = 48
SETTINGS = CandidateSettings(
  exits=[3, 5], single_skips=2, greedy_removals=3, greedy_windows=4, repeats=[(2, 4)], window=WINDOW
)


@pytest.fixture(scope="module")
def ident():
  return make_model(identity=IDENTITY)


@pytest.fixture(scope="module")
def docs(ident):
  """4 documents of 48 tokens, each next token drawn from the full path's own distribution."""
  rng = np.random.default_rng(20240611)
  defs, layers = GraphDefs.from_model(ident.module), tuple(range(ident.config.num_layers))
  ids = np.zeros((4, WINDOW), np.int32)
  ids[:, 0] = ident.config.bos_id
  for t in range(1, WINDOW):  # right padding never reaches earlier positions (causal): one shape serves all
    z = np.asarray(program.score_logits(defs, layers, ident.parts, jnp.asarray(ids))[:, t - 1], np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids[:, t] = [rng.choice(p.shape[1], p=row) for row in p]
  return ids.tolist()


@pytest.fixture(scope="module")
def proposals(ident, docs):
  return propose(ident, docs, SETTINGS, manual=["embed, blocks[0:3), head", "embed, blocks[0:1), blocks[4:6), head"])


# ------------------------------------------------------------------------------ measurements
def test_influence_is_zero_for_an_identity_block_and_matches_the_captured_residuals(ident, docs):
  influence = block_influence(ident, docs, window=WINDOW)
  assert list(influence) == unit_spans(6)
  assert abs(influence[(IDENTITY, IDENTITY + 1)]) < 1e-6
  assert min(v for u, v in influence.items() if u != (IDENTITY, IDENTITY + 1)) > 1e-3
  # Independent route: each block's input and output captured inside the model's own forward.
  sums, n = np.zeros(6), 0
  for ids in windows(None, docs, WINDOW):
    cap = capture(ident, ids)
    for layer, (x, y) in enumerate(cap.blocks):
      x, y = x[0].astype(np.float64), y[0].astype(np.float64)
      sums[layer] += np.sum(1 - np.sum(x * y, -1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1)))
    n += len(ids)
  np.testing.assert_allclose(list(influence.values()), sums / n, atol=1e-5)


def test_influence_of_coarser_units_spans_their_layers(ident, docs):
  coarse = block_influence(ident, docs, spans=[(0, 2), (2, 3), (3, 6)], window=WINDOW)
  assert list(coarse) == [(0, 2), (2, 3), (3, 6)] and abs(coarse[(2, 3)]) < 1e-6 and coarse[(3, 6)] > 1e-3


def test_greedy_removal_takes_the_identity_block_first(ident, docs):
  order = greedy_removal(ident, docs, 3, window=WINDOW)
  assert order[0][0] == (IDENTITY, IDENTITY + 1) and abs(order[0][1]) < 1e-7
  # Each step's ΔNLL is that path's ΔNLL as the quality route measures it, and the least of its options.
  removed = []
  for unit, dnll in order:
    removed.append(unit)
    kept = [i for i in range(6) if (i, i + 1) not in removed]
    assert measure(ident, [kept], docs, window=WINDOW)[0].delta_nll == pytest.approx(dnll, abs=1e-6)
  kept = [i for i in range(6) if i != IDENTITY]
  options = measure(ident, [[i for i in kept if i != j] for j in kept], docs, window=WINDOW)
  assert order[1][1] == pytest.approx(min(q.delta_nll for q in options), abs=1e-6)
  assert min(q.delta_nll for q in options) > 0  # the sampled corpus makes every real removal cost
  assert len(greedy_removal(ident, docs, 99, window=WINDOW, max_windows=1)) == 5  # at most units - 1


# ------------------------------------------------------------------------------ proposals
def test_proposals_kinds_order_and_dedup(proposals):
  kinds = [p.kind for p in proposals]
  assert proposals[0].kind is CandidateKind.FULL and proposals[0].layers == tuple(range(6))
  assert kinds.count(CandidateKind.FULL) == 1
  seqs = [p.layers for p in proposals]
  assert len(set(seqs)) == len(seqs)  # equal layer sequences kept once
  by_layers = {p.layers: p for p in proposals}
  assert by_layers[(0, 1, 2)].kind is CandidateKind.EXIT  # the manual duplicate of an exit is not added again
  assert by_layers[(0, 1, 2, 3, 4)].kind is CandidateKind.EXIT
  assert by_layers[(0, 1, 3, 4, 5)].kind is CandidateKind.SKIP and "influence" in by_layers[(0, 1, 3, 4, 5)].why
  assert by_layers[(0, 1, 2, 3, 2, 3, 4, 5)].kind is CandidateKind.REPEAT
  assert by_layers[(0, 4, 5)].kind is CandidateKind.MANUAL
  assert sum(k is CandidateKind.SKIP for k in kinds) >= 3  # 2 single skips + greedy prefixes not already there
  for p in proposals:
    assert layers_of_path(p.path, 6) == p.layers
  assert [p.path for p in proposals[:3]] == [
    "embed, blocks[0:6), head",
    "embed, blocks[0:3), head",
    "embed, blocks[0:5), head",
  ]


def test_the_full_path_is_always_proposed(ident, docs):
  only = propose(ident, docs, CandidateSettings(exits=[], single_skips=0, greedy_removals=0, repeats=[]))
  assert [(p.kind, p.layers) for p in only] == [(CandidateKind.FULL, tuple(range(6)))]
  manual_full = propose(
    ident,
    docs,
    CandidateSettings(exits=[], single_skips=0, greedy_removals=0, repeats=[]),
    manual=["embed, blocks[0:4), blocks[4:6), head"],
  )
  assert len(manual_full) == 1 and manual_full[0].kind is CandidateKind.FULL


def test_defaults_follow_the_depth_and_unit_boundaries():
  assert default_exits(unit_spans(30), 30) == list(range(15, 30, 2))  # 15, 17, ..., 29
  assert default_repeats(unit_spans(30), 30) == [(10, 20)]
  shipped = DEEP_SPANS  # the shipped mapping's block boundaries
  assert default_exits(unit_spans(30, shipped), 30) == [15, 18, 20, 22, 24, 26, 28]
  assert default_repeats(unit_spans(30, shipped), 30) == [(10, 20)]


def test_default_settings_on_the_tiny_model(ident, docs):
  got = propose(ident, docs, CandidateSettings(single_skips=0, greedy_removals=0))
  assert [(p.kind.value, p.path) for p in got] == [
    ("full", "embed, blocks[0:6), head"),
    ("exit", "embed, blocks[0:3), head"),
    ("exit", "embed, blocks[0:5), head"),
    ("repeat", "embed, blocks[0:4), blocks[2:6), head"),
  ]


def test_hashes_are_those_compose_reports(ident, proposals):
  for p in proposals:
    assert p.path_hash == ident.with_path(p.path).path_hash


@pytest.fixture(scope="module")
def built(ident, tmp_path_factory):
  """A registry of the identity model cut in spans (0, 2), (2, 3), (3, 5), (5, 6); unsigned, unprofiled. Read-only."""
  from tests.registry.helpers import TINY_SPANS, mapping_text
  from thoughtjax.registry import build

  root = tmp_path_factory.mktemp("candidates-registry")
  (root / "mapping.yaml").write_text(mapping_text(TINY_SPANS, 6))
  build(root / "reg", root / "mapping.yaml", ident.module, codec=ident.codec, settings=None, source="tiny")
  return root / "reg"


def test_measured_candidates_build_a_calibration(ident, docs, proposals, built):
  from thoughtjax.registry import Registry

  reg = Registry.open(built)
  # Per-layer proposals that cut inside a registry thoughtlet are refused, with the reason.
  pinned, refused = pin(proposals, reg)
  assert refused and all("boundaries" in why for _, why in refused)
  assert {p.path for p, _ in refused}.isdisjoint(c.path for c in pinned)
  # Proposals on the registry's own units all compose.
  aligned = propose(ident, docs, dataclasses.replace(SETTINGS, repeats=[(2, 5)]), spans=reg.block_spans())
  pinned, refused = pin(aligned, reg)
  assert refused == [] and len(pinned) == len(aligned)
  for p, c in zip(aligned, pinned):
    composed = compose(c.path, reg)
    assert c.path_hash == composed.path_hash and list(c.refs) == list(dict.fromkeys(composed.refs))
    assert c.kind is p.kind and all(u.version == reg.current[u.name] for u in c.units)
    assert sum(u.layers for u in c.units) == len(p.layers)
  quality = measure_candidates(ident, pinned, {"general_purpose": (docs[:2], docs[2:])}, window=WINDOW)
  keys = {u.cost_key for c in pinned for u in c.units}
  params = LatencyParams(
    prefill={k: LinearCost(1.0, 0.01) for k in keys},
    decode={k: LinearCost(0.5) for k in keys},
    restore=LinearCost(1.0),
    compile={16: LinearCost(10.0)},
  )
  cal = Calibration(reg.generation, "cpu:test", pinned, quality, params, reg.current)
  again = Calibration.from_json(cal.to_json())
  assert again.hint_quality(cal.full.path_hash, "general_purpose").calibration.top1_agreement == 1.0
  exit3 = next(c for c in pinned if c.kind is CandidateKind.EXIT)
  got = again.hint_quality(exit3.path_hash, "general_purpose").heldout
  assert isinstance(got, PathQuality) and got == measure(ident, [exit3.path], docs[2:], window=WINDOW)[0]


def test_a_tampered_thoughtlet_is_an_error_never_a_quiet_refusal(ident, docs, built, tmp_path):
  from thoughtjax.registry import IntegrityError, Registry

  shutil.copytree(built, tmp_path / "reg")
  reg = Registry.open(tmp_path / "reg")
  version = reg.current["blocks[2:3)"]
  path = reg.version_dir("blocks[2:3)", version) / "manifest.json"
  raw = json.loads(path.read_text())
  raw["layers"] = [2, 4]  # claims to run one more layer than it was published with
  path.write_text(json.dumps(raw))
  aligned = propose(
    ident, docs, CandidateSettings(exits=[2, 3], single_skips=0, greedy_removals=0, repeats=[]), spans=reg.block_spans()
  )
  with pytest.raises(IntegrityError) as info:
    pin(aligned, reg)
  assert (info.value.thoughtlet, info.value.version) == ("blocks[2:3)", version)
  assert reg.stats().integrity_failures == 1 and reg.stats().failures[0]["thoughtlet"] == f"blocks[2:3)@{version}"
  # A path that avoids the tampered thoughtlet still pins.
  assert [c.path for c in pin([aligned[1]], reg)[0]] == ["embed, blocks[0:2), head"]


# ------------------------------------------------------------------------------ refusals
def test_refusals_name_the_setting_and_the_fix(ident, docs):
  with pytest.raises(CandidateError, match=r"the span \(3, 6\) follows layer 2"):
    unit_spans(6, [(0, 2), (3, 6)])
  with pytest.raises(CandidateError, match="end at layer 4"):
    unit_spans(6, [(0, 2), (2, 4)])
  quiet = {"single_skips": 0, "greedy_removals": 0, "repeats": []}
  with pytest.raises(CandidateError, match=r"exit depth: expected a unit boundary in \[0, 2, 6\], got 3"):
    propose(ident, docs, CandidateSettings(exits=[3], **quiet), spans=[(0, 2), (2, 6)])
  with pytest.raises(CandidateError, match="exit depth: expected 1..5"):
    propose(ident, docs, CandidateSettings(exits=[6], **quiet))
  with pytest.raises(CandidateError, match=r"repeat: expected a span \(a, b\)"):
    propose(ident, docs, CandidateSettings(exits=[], single_skips=0, greedy_removals=0, repeats=[(1, 2, 3)]))
  with pytest.raises(CandidateError, match=r"repeat \(4, 2\): expected 0 <= a < b <= 6"):
    propose(ident, docs, CandidateSettings(exits=[], single_skips=0, greedy_removals=0, repeats=[(4, 2)]))
  with pytest.raises(CandidateError, match="manual path .*bridge"):
    propose(ident, docs, CandidateSettings(exits=[], **quiet), manual=["embed, blocks[0:2), bridge, head"])
  with pytest.raises(CandidateError, match="single_skips: expected an integer >= 0, got -1"):
    CandidateSettings(single_skips=-1)
  with pytest.raises(CandidateError, match="2 or more tokens"):
    block_influence(ident, [[5]])


def test_proposing_reports_progress_per_measurement(ident, docs):
  seen = []
  propose(
    ident,
    docs,
    CandidateSettings(exits=[], single_skips=1, greedy_removals=2, greedy_windows=2, repeats=[], window=WINDOW),
    progress=lambda *a: seen.append(a),
  )
  n = len(windows(None, docs, WINDOW))
  assert seen == [(i, n, "influence") for i in range(1, n + 1)] + [(1, 2, "greedy removal"), (2, 2, "greedy removal")]

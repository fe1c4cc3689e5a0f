"""The hint router stored in a registry as a signed ``router`` thoughtlet: round trip, tampering, paths,
a router of another model, routing a request without hints, and ``registry train-router``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.synthesis.conftest import WORDS, router_model, synthetic
from tests.synthesis.tiny_synthesis import HINTS, registry_copy, tiny_setup
from thoughtjax.assembly import PathTypeError
from thoughtjax.compose import compose
from thoughtjax.registry import IntegrityError, Registry
from thoughtjax.synthesis.calibration_store import read_calibration
from thoughtjax.synthesis.router import train_router
from thoughtjax.synthesis.router_store import (
  ROUTER_NAME,
  RouterMismatchError,
  clear_cache,
  load_router,
  publish_router,
  route_hint,
  train_registry_router,
)
from thoughtjax.thoughtlet import Kind

# The router tests' synthetic labeled set (conftest), its three word lists relabeled with two dictionary hints
# (the tiny registry is calibrated on HINTS); "gamma" prompts are dropped.
RELABEL = dict(zip(WORDS, HINTS))
TRAIN = [(p, RELABEL[h]) for p, h in synthetic(20, seed=1) if h in RELABEL]
HELDOUT = [(p, RELABEL[h]) for p, h in synthetic(6, seed=2) if h in RELABEL]
STEPS = 120


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
  """A private copy of the tiny calibrated registry with a router trained and published into it."""
  root = registry_copy(tmp_path_factory.mktemp("router-store") / "registry")
  with Registry.open(root) as reg:
    before = reg.sequence
    router, report, version = train_registry_router(
      reg, TRAIN, HELDOUT, sign_key=tiny_setup().key, steps=STEPS, labels=HINTS
    )
    assert reg.sequence == before + 1
  return root, router, report, version


def test_round_trip_reopened_registry_predicts_identically(stored):
  root, router, report, version = stored
  assert report.accuracy >= 0.9  # chance is 1/2
  with Registry.open(root) as reg:
    m = reg.manifest(ROUTER_NAME)
    assert m.kind is Kind.ROUTER and m.version == version and m.signed_by is not None
    assert str(m.signature.input).startswith("tokens[B,T] i32") and m.signature.output.role == "hint_probs"
    meta = m.signature.constraints["router"]
    assert meta["labels"] == list(HINTS) and meta["codec_digest"] == reg.tokenizer_hash
    assert m.profile is not None and m.profile.param_bytes == m.param_bytes  # the classifier alone, measured
    again = load_router(reg)
    prompts = [p for p, _ in HELDOUT]
    np.testing.assert_array_equal(again.probabilities(prompts), router.probabilities(prompts))
    assert [again.predict(p)[0] for p in prompts] == [router.predict(p)[0] for p in prompts]
    # Verified like any thoughtlet: digests, signature, versioned hash from the restored weights.
    checked = {t["ref"]: t for t in reg.verify().thoughtlets}
    assert checked[f"{ROUTER_NAME}@{version}"]["versioned_hash"] == "ok"
    # Its profile is re-measured like any thoughtlet's (the classifier alone): FLOPs and bytes agree.
    from thoughtjax.registry import Tolerance

    assert reg.verify_hardware(Tolerance(latency=None, peak_memory=None), names=[ROUTER_NAME]) == []
    # The calibration pinned to unchanged versions moved to the new sequence, signed: synthesis still opens.
    cal = read_calibration(reg)
    assert cal.sequence == reg.sequence and ROUTER_NAME not in cal.current


def test_a_retrained_router_becomes_current_and_the_calibration_follows(stored, tmp_path):
  import shutil

  root = tmp_path / "registry"
  shutil.copytree(stored[0], root)
  with Registry.open(root) as reg:
    first = reg.resolve(ROUTER_NAME)
    read_calibration(reg)  # carried once already (the fixture's publish)
    _, _, version = train_registry_router(
      reg, TRAIN, HELDOUT, sign_key=tiny_setup().key, steps=STEPS // 2, labels=HINTS, seed=1
    )
    assert version != first and reg.versions(ROUTER_NAME) == [first, version]
    cal = read_calibration(reg)
    assert cal.sequence == reg.sequence and ROUTER_NAME not in cal.current
    assert load_router(reg).meta["training"]["seed"] == 1


def test_tampered_router_checkpoint_is_refused_named_and_counted(stored, tmp_path):
  root = tmp_path / "registry"
  import shutil

  shutil.copytree(stored[0], root)
  with Registry.open(root) as reg:
    version = reg.resolve(ROUTER_NAME)
    files = sorted(
      p
      for p in (reg.version_dir(ROUTER_NAME, version) / "checkpoint").rglob("*")
      if p.is_file() and p.stat().st_size > 0
    )
    target = max(files, key=lambda p: p.stat().st_size)  # the array data
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    before = reg.stats().integrity_failures
    with pytest.raises(IntegrityError) as e:
      load_router(reg)
    assert e.value.thoughtlet == ROUTER_NAME and version in str(e.value)
    stats = reg.stats()
    assert stats.integrity_failures == before + 1
    assert stats.failures[-1]["thoughtlet"] == f"{ROUTER_NAME}@{version}"
    # Synthesis without hints does not route with it: the default hint, and the note says why.
    clear_cache()
    hint, note = route_hint(reg, "cab bead faced", "general_purpose")
    assert hint == "general_purpose" and "the stored router was refused (integrity check failed" in note
    assert reg.stats().integrity_failures == before + 2


@pytest.mark.parametrize("path, link", [("embed, router, head", 1), ("router, embed, blocks[0:6), head", 0)])
def test_router_kind_is_refused_in_a_path(stored, path, link):
  with Registry.open(stored[0]) as reg:
    with pytest.raises(PathTypeError, match="router thoughtlet") as e:
      compose(path, reg)
    assert e.value.link == link and "not a link of a path" in str(e.value)


def test_a_router_of_another_model_is_refused_on_publish(stored):
  other, _ = train_router(router_model(seed=3), TRAIN, HELDOUT, steps=10, labels=HINTS)
  with Registry.open(stored[0]) as reg:
    seq = reg.sequence
    with pytest.raises(RouterMismatchError, match="train-router"):
      publish_router(reg, other, sign_key=tiny_setup().key)
    assert reg.sequence == seq  # nothing published


def test_a_request_without_hints_uses_the_stored_router(stored):
  from thoughtjax.synthesis.synthesize import Synthesizer

  root, router, _, _ = stored
  clear_cache()
  with Registry.open(root) as reg:
    syn = Synthesizer.open(reg)
    prompt = HELDOUT[0][0]
    plan = syn.plan(prompt, max_latency_ms=float("inf"), max_tokens=4)
    want = router.predict(prompt)[0]
    assert plan.hints == (want,) and any(f"the router picked {want}" in n for n in plan.notes)
  with Registry.open(tiny_setup().registry) as plain:  # no router stored: the default hint, said so
    hint, note = route_hint(plain, prompt, "general_purpose")
    assert hint == "general_purpose" and "no router in this registry" in note


def test_cli_train_router_prints_the_report_and_publishes(tmp_path, capsys):
  from thoughtjax.cli import main

  root = registry_copy(tmp_path / "registry")
  prompts = tmp_path / "prompts"
  prompts.mkdir()
  for split, rows in (("train", TRAIN), ("heldout", HELDOUT)):
    (prompts / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p, "hint": h}) + "\n" for p, h in rows))
  code = main(
    [
      "registry",
      "train-router",
      str(root),
      "--sign-key",
      str(tiny_setup().key),
      "--prompts",
      str(prompts),
      "--steps",
      str(STEPS),
      "--hint",
      HINTS[0],
      "--hint",
      HINTS[1],
      "--json",
    ]
  )
  out, err = capsys.readouterr()
  assert code == 0
  d = json.loads(out)
  assert d["ref"].startswith(f"{ROUTER_NAME}@") and d["accuracy"] >= 0.9 and d["labels"] == list(HINTS)
  assert np.asarray(d["confusion"]).shape == (2, 2) and d["predict_ms"] > 0
  assert "router training" in err  # progress shown
  code = main(["registry", "list", str(root)])
  out, _ = capsys.readouterr()
  assert code == 0 and "router" in out  # listed with the rest (the table folds narrow columns)
  code = main(["registry", "show", str(root), ROUTER_NAME])
  out, _ = capsys.readouterr()
  assert code == 0 and json.loads(out)["kind"] == "router"
  code = main(
    [
      "registry",
      "train-router",
      str(Path(root)),
      "--prompts",
      str(prompts),
      "--steps",
      "5",
      "--hint",
      HINTS[0],
      "--hint",
      HINTS[1],
    ]
  )
  _, err = capsys.readouterr()
  assert code != 0 and "SignatureDowngradeError" in err  # a signed registry stays signed

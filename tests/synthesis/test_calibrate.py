"""registry calibrate: candidates, quality per hint, latency from the real program, stored signed.

Attacks on the stored calibration (an edited byte, a removed signature, a re-signature by an untrusted
key, an unsigned write into a signed registry) must each be a loud, named refusal, counted in the
registry's stats.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.synthesis.tiny_synthesis import FULL, HINTS, IDENTITY_SKIP, registry_copy, tiny_setup
from thoughtjax.registry import IntegrityError, Registry, SignatureDowngradeError, SignatureError
from thoughtjax.synthesis.calibrate import load, recalibrate_latency
from thoughtjax.synthesis.calibrate_latency import machine_fingerprint
from thoughtjax.synthesis.calibrate_settings import CalibrateError, LatencySettings
from thoughtjax.synthesis.calibration_store import (
  MissingCalibrationError,
  calibration_path,
  read_calibration,
  write_calibration,
)
from thoughtjax.synthesis.candidate import CandidateKind
from thoughtjax.synthesis.latency import LatencyModel
from thoughtjax.synthesis.latency_load import EngineLoad, Load
from thoughtjax.synthesis.latency_params import ROWS_DEFAULT


@pytest.fixture(scope="module")
def setup():
  return tiny_setup()


@pytest.fixture(scope="module")
def cal(setup):
  with Registry.open(setup.registry) as reg:
    return load(reg)


def test_candidates_are_pinned_to_current_versions_and_include_the_lossless_skip(setup, cal):
  with Registry.open(setup.registry) as reg:
    current = reg.current
    assert cal.sequence == reg.sequence and dict(cal.current) == current
  paths = {c.path: c for c in cal.candidates}
  assert cal.full.path == FULL and cal.full.kind is CandidateKind.FULL
  assert {"embed, blocks[0:2), head", "embed, blocks[0:3), head", "embed, blocks[0:5), head", IDENTITY_SKIP} <= set(
    paths
  )
  for c in cal.candidates:
    assert all(current[u.name] == u.version for u in c.units)
  skip = paths[IDENTITY_SKIP]
  for hint in HINTS:
    q = cal.hint_quality(skip.path_hash, hint)
    assert q.calibration.top1_agreement == 1.0 and q.calibration.mean_kl == pytest.approx(0.0, abs=1e-9)
    assert q.heldout.top1_agreement == 1.0 and q.calibration.tokens > 0 and q.heldout.tokens > 0
    exit2 = cal.hint_quality(paths["embed, blocks[0:2), head"].path_hash, hint)
    assert exit2.calibration.top1_agreement < 1.0 and exit2.calibration.mean_kl > 0


def test_latency_is_measured_here_and_predicts_every_candidate(cal, setup):
  assert cal.fingerprint == machine_fingerprint()
  lat = cal.latency
  blocks = [k for k in lat.decode if k.startswith("blocks:")]
  assert blocks and {"embed", "head"} <= set(lat.prefill) and set(lat.prefill) == set(lat.decode)
  assert set(lat.compile) == {16}  # the one prompt bucket measured
  model = LatencyModel(lat)
  by_layers = {}
  for c in cal.candidates:
    p = model.predict(c, 10, 8)
    assert math.isfinite(p.total) and p.total > 0 and min(p.stage(s) for s in ("restore", "compile", "prefill")) >= 0
    by_layers.setdefault(sum(u.layers for u in c.units), []).append(p.prefill + p.decode)
  depths = sorted(by_layers)
  assert max(by_layers[depths[0]]) <= min(by_layers[depths[-1]])  # more layers never predicted faster
  assert setup.report.latency_runs and all(r["tokens_out"] in (4, 9) for r in setup.report.latency_runs)
  assert set(setup.report.seconds) == {"load", "candidates", "quality", "latency"}


def test_stored_calibration_reads_back_identical(setup, cal):
  with Registry.open(setup.registry) as reg:
    again = read_calibration(reg)
  assert again.digest() == cal.digest()
  assert calibration_path(setup.registry, cal.sequence).with_suffix(".sig").is_file()


def test_an_edited_calibration_is_refused_loudly_and_counted(setup, tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    path = calibration_path(root, reg.sequence)
    doc = json.loads(path.read_bytes())
    # The attack: make a lossy path look lossless on a hint.
    quality = doc["calibration"]["quality"]
    h = next(h for h, q in quality.items() if q["fast_draft"]["calibration"]["top1_agreement"] < 1.0)
    doc["calibration"]["quality"][h]["fast_draft"]["calibration"]["top1_agreement"] = 1.0
    path.write_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    before = reg.stats().signature_failures
    with pytest.raises(SignatureError, match="does not verify"):
      read_calibration(reg)
    stats = reg.stats()
    assert stats.signature_failures == before + 1
    assert stats.failures[-1]["kind"] == "signature" and stats.failures[-1]["thoughtlet"] == "calibration"


def test_a_removed_signature_is_a_downgrade(setup, tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    calibration_path(root, reg.sequence).with_suffix(".sig").unlink()
    before = reg.stats().downgrade_refusals
    with pytest.raises(SignatureDowngradeError, match="the signature was removed"):
      read_calibration(reg)
    assert reg.stats().downgrade_refusals == before + 1 and reg.stats().failures[-1]["kind"] == "downgrade"


def test_a_resigned_calibration_by_an_untrusted_key_is_refused(setup, tmp_path):
  from thoughtjax.signing import keygen

  root = registry_copy(tmp_path / "reg")
  other, _ = keygen(tmp_path / "keys" / "mallory")
  with Registry.open(root) as reg:
    cal = read_calibration(reg)
    write_calibration(reg, cal, sign_key=other)  # a writer with a key the registry never listed
    with pytest.raises(SignatureError, match="not among the trusted"):
      read_calibration(reg)
    assert [f["kind"] for f in reg.stats().failures if f["thoughtlet"] == "calibration"] == ["signature"]


def test_an_unsigned_calibration_cannot_be_written_into_a_signed_registry(setup, tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    cal = read_calibration(reg)
    with pytest.raises(SignatureDowngradeError, match="--sign-key"):
      write_calibration(reg, cal)
    assert read_calibration(reg).digest() == cal.digest()  # nothing was replaced


def test_a_corrupted_document_is_an_integrity_error(setup, tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    path = calibration_path(root, reg.sequence)
    path.with_suffix(".sig").unlink()
    path.write_bytes(path.read_bytes()[:-40])
  from thoughtjax.registry import TrustPolicy

  with Registry.open(root, trust=TrustPolicy(allow_unsigned=True)) as reg:
    with pytest.raises(IntegrityError, match="calibration"):
      read_calibration(reg)
    assert reg.stats().integrity_failures == 1


def test_missing_calibration_names_the_fix(setup):
  with Registry.open(setup.registry) as reg:
    with pytest.raises(MissingCalibrationError, match="registry calibrate"):
      read_calibration(reg, reg.sequence + 5)


def test_latency_only_keeps_candidates_and_quality(setup, cal, tmp_path):
  root = registry_copy(tmp_path / "reg")
  with Registry.open(root) as reg:
    again = recalibrate_latency(
      reg, cal, LatencySettings(prompt_tokens=(4, 12), max_tokens=(4, 9), reps=1, plan_reps=5)
    )
    assert [c.path_hash for c in again.candidates] == [c.path_hash for c in cal.candidates]
    assert {h: {k: q.to_json() for k, q in v.items()} for h, v in again.quality.items()} == {
      h: {k: q.to_json() for k, q in v.items()} for h, v in cal.quality.items()
    }
    assert again.fingerprint == machine_fingerprint()
    write_calibration(reg, again, sign_key=setup.key)
    assert read_calibration(reg).digest() == again.digest()


def test_settings_refuse_what_cannot_be_fitted():
  with pytest.raises(CalibrateError, match="at least two"):
    LatencySettings(prompt_tokens=(8,))
  for bad in (1, -2, True, 2.5):
    with pytest.raises(CalibrateError, match="rows_width"):
      LatencySettings(rows_width=bad)


def test_how_the_full_path_batches_is_measured_and_prices_a_busy_engine(setup, cal):
  """The full path decoded alone and as 8 rows of one batch: the fit passes through one row at 1 and the measured
  ratio at 8, the report holds both step times, and a prediction joining a busy engine of the path uses it."""
  (row,) = setup.report.rows
  assert row["path_hash"] == cal.full.path_hash and row["width"] == 8
  assert row["ms_per_step_1"] > 0 and row["ms_per_step_8"] > 0
  fit = cal.latency.rows[cal.full.path_hash]
  # Speculative plans decode alone; no variants here; the full path's fit also prices the paths not measured.
  assert set(cal.latency.rows) == {cal.full.path_hash, ROWS_DEFAULT} and cal.latency.rows[ROWS_DEFAULT] == fit
  assert fit(1) == pytest.approx(1.0) and fit(8) == pytest.approx(min(max(row["ratio"], 1.0), 8.0))
  model = LatencyModel(cal.latency)
  load = Load((EngineLoad(cal.full.path_hash, 3, 64),), slots=8)
  got = model.predict(cal.full, 12, 9, load=load)
  assert got.load_factor == pytest.approx(fit(4)) and got.cache_len == 64  # the engine has not stepped: the fit


@pytest.mark.slow
def test_the_shipped_default_table_pins_to_the_default_registry_and_reproduces():
  """registry/default_calibration.json (made by `registry calibrate` on the default registry) names exactly
  the versions a build of the default model gives, and re-measuring two of its paths on one hint gives its
  numbers."""
  from thoughtjax.synthesis.calibrate import _token_docs, full_model
  from thoughtjax.synthesis.calibrate_settings import CalibrateSettings
  from thoughtjax.synthesis.default_registry import ensure_default, shipped_calibration, shipped_table_path
  from thoughtjax.synthesis.dictionary import load_dictionary
  from thoughtjax.synthesis.quality import measure_candidates

  assert shipped_table_path().is_file()
  with ensure_default() as reg:
    shipped = shipped_calibration(reg)
    assert shipped is not None, "the shipped table does not pin to the default registry's current versions"
    hint, s = "general_purpose", CalibrateSettings()
    d = load_dictionary()[hint]
    model = full_model(reg)
    corpora = {
      hint: (
        _token_docs(model.codec, d.documents("calibration"), s.window, s.max_windows),
        _token_docs(model.codec, d.documents("heldout"), s.window, s.max_windows),
      )
    }
    some = [c for c in shipped.candidates if c.kind is not CandidateKind.FULL][:2]
    again = measure_candidates(model, some, corpora, window=s.window)
    for c in some:
      want, got = shipped.quality[c.path_hash][hint], again[c.path_hash][hint]
      assert got.calibration.tokens == want.calibration.tokens
      assert got.calibration.top1_agreement == pytest.approx(want.calibration.top1_agreement, abs=1e-6)
      assert got.heldout.mean_kl == pytest.approx(want.heldout.mean_kl, rel=1e-3, abs=1e-5)

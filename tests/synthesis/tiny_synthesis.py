"""A signed tiny registry with a stored calibration, built once per test process and shared read-only.

The model is the synthesis tests' 6-layer seeded model (:func:`make_model`) with block 2 turned into an identity
(zeroed output projections), cut in spans (0, 2), (2, 3), (3, 5), (5, 6). Skipping ``blocks[2:3)`` is therefore
exactly lossless: it ties the full path on quality and is faster, so the planner must choose it. The
shipped dictionary is used, calibrated on two hints with short windows so the whole build takes seconds
of measurement (plus the program compiles).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

import thoughtjax
from tests.registry.helpers import TINY_SPANS, mapping_text, tiny_codec, tiny_config
from thoughtjax.loading import LoadedModel
from thoughtjax.synthesis.calibrate_settings import CalibrateReport, CalibrateSettings, LatencySettings
from thoughtjax.synthesis.candidates import CandidateSettings
from thoughtjax.transformer import init_random

HINTS = ("general_purpose", "fast_draft")
IDENTITY_SKIP = "embed, blocks[0:2), blocks[3:6), head"
FULL = "embed, blocks[0:6), head"
SETTINGS = CalibrateSettings(
  candidates=CandidateSettings(exits=[2, 3, 5], single_skips=1, greedy_removals=0, repeats=[]),
  window=32,
  max_windows=2,
  hints=HINTS,
  # Both prompt lengths and both decode lengths in one shape bucket: one program per timed path.
  latency=LatencySettings(prompt_tokens=(4, 12), max_tokens=(4, 9), reps=1, plan_reps=10),
)


@functools.cache
def _seeded(seed: int):
  cfg = tiny_config()
  return cfg, init_random(cfg, seed=seed, scale=0.08)


def make_model(seed: int = 7, identity: int | None = None) -> thoughtjax.Model:
  """A 6-layer random model; ``identity``: that block's output projections are zero (it returns its input)."""
  cfg, module = _seeded(seed)
  if identity is not None:
    module = nnx.clone(module)  # the seeded model stays as it is for other tests
    blk = module.blocks[identity]
    blk.attn.o.set_value(jnp.zeros_like(blk.attn.o.get_value()))
    blk.mlp.down.set_value(jnp.zeros_like(blk.mlp.down.get_value()))
  return thoughtjax.Model(LoadedModel(cfg, module, tiny_codec(), f"tiny-seed{seed}", ""))


@dataclasses.dataclass(frozen=True)
class TinySetup:
  root: Path  # scratch folder of this process
  registry: Path  # signed registry with calibration/<sequence>.json + .sig (read-only: copy it to change it)
  key: Path  # its private signing key
  public_key: Path
  report: CalibrateReport


@functools.cache
def tiny_setup() -> TinySetup:
  from thoughtjax.registry import Registry, build
  from thoughtjax.signing import keygen
  from thoughtjax.synthesis.calibrate import calibrate, store

  root = Path(tempfile.mkdtemp(prefix="thoughtjax-synthesis-"))
  atexit.register(shutil.rmtree, root, True)
  # Rollback state of this process's registries, not the user's.
  os.environ.setdefault("THOUGHTJAX_TRUST_STATE", str(root / "trust-state.json"))
  # Learned latency corrections stay in process (tests that need the file name one of their own): neither
  # the user's file nor what one test learned reaches another test's plans.
  os.environ.setdefault("THOUGHTJAX_LATENCY_CORRECTIONS", "off")
  key, pub = keygen(root / "keys" / "registry")
  (root / "mapping.yaml").write_text(mapping_text(TINY_SPANS, 6))
  model = make_model(identity=2)
  build(
    root / "registry",
    root / "mapping.yaml",
    model.module,
    codec=model.codec,
    sign_key=key,
    settings=None,
    source="tiny-identity2",
  )
  report = CalibrateReport()
  with Registry.open(root / "registry") as reg:
    store(reg, calibrate(reg, settings=SETTINGS, report=report), sign_key=key)
  return TinySetup(root, root / "registry", key, pub, report)


def registry_copy(dst: Path) -> Path:
  """A private copy of the tiny calibrated registry (to damage or update)."""
  shutil.copytree(tiny_setup().registry, dst)
  return dst

"""Fixtures of the registry tests: a tiny seeded model, a signing key, built registries.

Numerics run on tiny random models (``init_random``); the real default model appears only
in tests marked ``slow``. Registries are built once per session and copied (``registry_copy``)
when a test damages or updates one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.registry.helpers import DEEP_SPANS, FAST, TINY_SPANS, mapping_text, tiny_codec, tiny_config
from thoughtjax.transformer import init_random


@pytest.fixture(scope="session")
def tiny():
  """(config, model, codec) of a 6-layer random model."""
  cfg = tiny_config()
  return cfg, init_random(cfg, seed=7, scale=0.08), tiny_codec()


@pytest.fixture(scope="session")
def tiny_mapping(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("mapping") / "semantic_mapping.yaml"
  path.write_text(mapping_text(TINY_SPANS, 6))
  return path


@pytest.fixture(scope="session")
def keypair(tmp_path_factory) -> tuple[Path, Path]:
  from thoughtjax.signing import keygen

  return keygen(tmp_path_factory.mktemp("keys") / "registry")


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny, tiny_mapping, keypair) -> Path:
  """A signed, profiled registry of the tiny model. Read-only: copy it to change it."""
  from thoughtjax.registry import build

  cfg, model, codec = tiny
  out = tmp_path_factory.mktemp("built") / "registry"
  build(out, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=FAST, source="tiny-seed7")
  return out


@pytest.fixture
def registry_copy(built, tmp_path) -> Path:
  dst = tmp_path / "registry"
  shutil.copytree(built, dst)
  return dst


@pytest.fixture(scope="session")
def deep(tmp_path_factory):
  """(config, model, codec, registry dir) of a 30-layer tiny model cut like the default one
  (unsigned, unprofiled: these tests are about residency and composition)."""
  from thoughtjax.registry import build

  cfg = tiny_config(30)
  model = init_random(cfg, seed=3, scale=0.08)
  codec = tiny_codec()
  root = tmp_path_factory.mktemp("deep")
  (root / "mapping.yaml").write_text(mapping_text(DEEP_SPANS, 30, template=False))
  build(root / "registry", root / "mapping.yaml", model, codec=codec, settings=None, source="tiny30-seed3")
  return cfg, model, codec, root / "registry"


@pytest.fixture(scope="session", autouse=True)
def trust_state(tmp_path_factory):
  """One rollback-state file for the session (subprocesses inherit it), not the user's."""
  path = tmp_path_factory.mktemp("trust") / "trust-state.json"
  old = os.environ.get("THOUGHTJAX_TRUST_STATE")
  os.environ["THOUGHTJAX_TRUST_STATE"] = str(path)
  yield path
  if old is None:
    os.environ.pop("THOUGHTJAX_TRUST_STATE", None)
  else:
    os.environ["THOUGHTJAX_TRUST_STATE"] = old

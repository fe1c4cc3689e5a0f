"""Fixtures of the thoughtlet tests: the tiny seeded model and a registry built from it.

The same seeds and mapping as the registry tests (``tests/registry/helpers.py``), built here
once per session so these tests do not depend on another folder's fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.registry.helpers import TINY_SPANS, mapping_text, tiny_codec, tiny_config
from thoughtjax.transformer import init_random


@pytest.fixture(scope="session")
def tiny():
  """(config, model, codec) of a 6-layer random model."""
  cfg = tiny_config()
  return cfg, init_random(cfg, seed=7, scale=0.08), tiny_codec()


@pytest.fixture(scope="session")
def built(tmp_path_factory, tiny) -> Path:
  """A registry of the tiny model (embed, template, 4 block spans, head), unsigned and unprofiled
  (replay is about the weights). Read-only."""
  from thoughtjax.registry import build

  cfg, model, codec = tiny
  root = tmp_path_factory.mktemp("thoughtlet-registry")
  (root / "mapping.yaml").write_text(mapping_text(TINY_SPANS, cfg.num_layers))
  build(root / "registry", root / "mapping.yaml", model, codec=codec, settings=None, source="tiny-seed7")
  return root / "registry"

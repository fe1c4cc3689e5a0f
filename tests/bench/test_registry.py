"""``thoughtjax bench registry`` on a tiny 30-layer registry cut like the default model.

Behaviour only: every restore row is there and the chained-jit comparator decodes the same tokens
as the one-program path; never how fast.
"""

import pytest

from tests.registry.helpers import DEEP_SPANS, mapping_text, tiny_codec, tiny_config
from thoughtjax.bench import registry as bench
from thoughtjax.compose import compose
from thoughtjax.registry import Registry, build
from thoughtjax.transformer import init_random


@pytest.fixture(scope="module")
def deep_registry(tmp_path_factory):
  root = tmp_path_factory.mktemp("bench-registry")
  (root / "mapping.yaml").write_text(mapping_text(DEEP_SPANS, 30, template=False))
  model = init_random(tiny_config(30), seed=3, scale=0.08)
  build(root / "registry", root / "mapping.yaml", model, codec=tiny_codec(), settings=None, source="tiny30-seed3")
  return root / "registry"


def test_chained_jits_decode_what_the_one_program_decodes(deep_registry):
  """The comparator the decode rows time: one jit per thoughtlet, chained from Python (a repeated span too)."""
  from thoughtjax.sampling import SamplingParams

  model = compose(
    "embed, blocks[0:2), blocks[2:4), blocks[0:2), head", Registry.open(deep_registry), compile_cache=False
  )
  ids = model.codec.encode("hello there")
  tokens, times = bench._chained(model, ids, 4)
  assert tokens == model.generate_batch([ids], [SamplingParams(max_tokens=4, ignore_eos=True)])[0].token_ids
  assert times["start"] <= times["first_token"] <= times["end"]


def test_restore_rows_cover_every_thoughtlet_and_path(deep_registry):
  per_thoughtlet, per_path = bench.bench_restores(deep_registry, repeats=1)
  reg = Registry.open(deep_registry)
  assert [r["thoughtlet"] for r in per_thoughtlet] == list(reg.names)
  assert all(r["bytes"] == reg.manifest(r["thoughtlet"]).param_bytes for r in per_thoughtlet)
  assert all({"restore_s", "orbax_only_s", "mapped_s"} <= set(r) for r in per_thoughtlet)
  assert all({"restore_s", "restore_checkpoint_s", "compose_s", "compose_checkpoint_s"} <= set(r) for r in per_path)
  assert [r["path"] for r in per_path] == list(bench.PATHS)
  for r in per_path:
    assert r["resident_bytes"] == compose(r["refs"], Registry.open(deep_registry), compile_cache=False).resident_bytes

"""Integration on the real default model (SmolLM2-135M-Instruct, 30 layers): a registry built
from the shipped mapping composes the monolithic model exactly, and residency follows the path.

Residency of the early exit ``embed, blocks[0:12), head``: the embedding table (49152 x 576,
28.3M parameters, 21% of the model) is needed at both ends of every path (the head is tied), so
12 of 30 layers hold (28.3M + 12 x 3.54M) / 134.5M = 52.6% of the weight bytes; 45% is below
what any float32 early exit at layer 12 of this model can hold. The test asserts the exact
accounting (nothing but the path's thoughtlets is resident, measured in a fresh process); the
<= 45% bound for 12 of 30 layers is asserted on a tiny model with a small vocabulary
(``test_compose.test_early_exit_keeps_at_most_45_percent_resident``).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.registry.helpers import REPO, run_python
from thoughtjax.assembly import full_path
from thoughtjax.compose import compose
from thoughtjax.registry import Registry, build

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris, and the capital of Germany is"


@pytest.fixture(scope="session")
def real_registry(default_model, tmp_path_factory):
  out = tmp_path_factory.mktemp("real") / "registry"
  build(out, REPO / "registry" / "semantic_mapping.yaml", default_model.loaded, settings=None)
  return out


def test_full_path_matches_the_monolithic_model(default_model, real_registry):
  reg = Registry.open(real_registry)
  m = compose(full_path(reg), reg)
  assert len(m.refs) == 16 and m.layers == tuple(range(30))
  ids = default_model.codec.encode(PROMPT)
  np.testing.assert_allclose(m.logits(ids), default_model.logits(ids), atol=1e-5, rtol=0)


def test_template_wraps_like_the_chat_template(default_model, real_registry):
  reg = Registry.open(real_registry)
  m = compose("template, blocks[0:30), head", reg)
  question = "What is the capital of France?"
  assert m.prompt_ids(question) == default_model.prompt_ids(question, chat=True)


RESIDENT_PROBE = """
import json, sys, jax
from thoughtjax.compose import compose
from thoughtjax.registry import Registry
reg = Registry.open(sys.argv[1])
m = compose("embed, blocks[0:12), head", reg)
print(json.dumps({"live": sum(x.nbytes for x in jax.live_arrays()), "resident": m.resident_bytes,
                  "restored": sorted(r.split("@")[0] for r in reg.stats().resident)}))
"""


def test_early_exit_holds_only_its_thoughtlets(default_model, real_registry):
  full = sum(x.nbytes for x in jax.tree.leaves(default_model.parts))
  reg = Registry.open(real_registry)
  names = ["embed", "head"] + [f"blocks[{a}:{b})" for a, b in [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]]
  path_bytes = sum(reg.manifest(n).param_bytes for n in names)
  r = run_python(RESIDENT_PROBE.replace("sys.argv[1]", repr(str(real_registry))))
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["restored"] == sorted(names)
  # In a fresh process, every live device buffer is the path's weights: nothing else loaded.
  assert got["resident"] == path_bytes and got["live"] <= path_bytes + 1024
  cfg = default_model.config
  table = cfg.vocab_size * cfg.d_model * 4
  block = (full - table - cfg.d_model * 4) // 30
  assert path_bytes == table + 12 * block + cfg.d_model * 4
  assert path_bytes / full == pytest.approx(0.5263, abs=1e-3)  # see the module docstring


def test_repeated_span_shares_buffers(default_model, real_registry):
  reg = Registry.open(real_registry)
  m = compose("embed, blocks[0:10), blocks[10:20), blocks[10:20), blocks[20:30), head", reg)
  assert len(m.layers) == 40 and sorted(m.parts.blocks) == list(range(30))
  full = sum(x.nbytes for x in jax.tree.leaves(default_model.parts))
  assert m.resident_bytes == full == reg.stats().resident_bytes


@pytest.fixture(scope="session")
def native_registry(default_model, tmp_path_factory):
  """The default model built by name, as `thoughtjax registry build` does: its Q4_1 / Q8_0 blocks stored packed."""
  out = tmp_path_factory.mktemp("real-native") / "registry"
  build(out, REPO / "registry" / "semantic_mapping.yaml", "smollm2-135m-instruct", settings=None)
  return out


def test_native_registry_is_the_gguf_size_and_gives_the_float32_logits(default_model, native_registry):
  import gguf

  from thoughtjax import quantized
  from thoughtjax.fetch import fetch

  reg = Registry.open(native_registry)
  assert "0/mlp/up/Q4_1" in reg.manifest("blocks[0:2)").params and "table/Q8_0" in reg.manifest("embed").params
  stored = sum(m.param_bytes for m in reg.manifests() if m.name != "template")
  assert stored == sum(int(t.n_bytes) for t in gguf.GGUFReader(str(fetch(progress=False))).tensors)
  ids = default_model.codec.encode(PROMPT)
  # Restored for weights="f32" (the default): exactly the float32 load's logits.
  assert np.array_equal(compose(full_path(reg), reg).logits(ids), default_model.logits(ids))
  native = Registry.open(native_registry, weights="native")
  m = compose(full_path(native), native)
  assert any(quantized.is_packed(x) for x in jax.tree.leaves(m.parts.embed, is_leaf=quantized.is_packed))
  # The native form dequantizes inside each dot, so it sums in another order than the float32 load: ~1e-4 on
  # logits of magnitude ~20 (1.1e-4 measured on an AMD EPYC 2-core machine, below 1e-4 on others).
  assert np.max(np.abs(m.logits(ids) - default_model.logits(ids))) <= 2e-4
  greedy = dict(max_tokens=8, ignore_eos=True)
  assert m.generate(ids, **greedy).token_ids == default_model.generate(ids, **greedy).token_ids

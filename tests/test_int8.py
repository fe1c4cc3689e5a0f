"""int8 weights (thoughtjax.formats.RowInt8): per-output-row symmetric int8, quantized from float32 at load.

Lossy by design, so the contract is a bound, not equality: every weight within half a step of its
row's scale; the matmul equal to x @ dequantized(W).T; the compiled decode-shaped matmul reads the
int8 bytes; a model loaded with ``weights="int8"`` holds every matrix as int8 and stays close to f32.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thoughtjax
from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax import formats
from thoughtjax.model import init_random

IDS = [5, 77, 130, 9, 201, 64, 33]


def _weights(rng, rows=48, cols=96):
  w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
  w[0] = 0.0  # an all-zero row: scale 0, q 0
  w[2] *= 400  # a row far larger than the others keeps its own scale
  return w


def test_quantize_int8_is_within_half_a_step_per_row(rng):
  w = _weights(rng)
  p = formats.quantize_int8(w)
  assert p.q.dtype == np.int8 and p.q.shape == w.shape and p.scale.shape == (w.shape[0],)
  assert np.abs(p.q.astype(np.int32)).max() <= 127 and np.all(p.q[0] == 0) and p.scale[0] == 0
  err = np.abs(formats.dequantize(p) - w)
  assert np.all(err <= p.scale[:, None] / 2 * (1 + 1e-6) + 1e-12)
  # The largest |w| of each nonzero row maps to +-127 exactly.
  assert np.all(np.abs(p.q[1:]).max(axis=1) == 127)
  assert np.array_equal(np.asarray(jnp.asarray(formats.to_device(p))), formats.dequantize(p))


def test_quantize_int8_of_native_blocks_quantizes_their_float32_values(rng):
  import gguf

  w = _weights(rng, 32, 64)
  raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
  blocks = formats.from_gguf_blocks(raw, "Q8_0")
  a, b = formats.quantize_int8(blocks), formats.quantize_int8(formats.dequantize(blocks))
  assert np.array_equal(a.q, b.q) and np.array_equal(a.scale, b.scale)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_matmul_and_rows_match_the_dequantized_matrix(rng, rows):
  w = formats.to_device(formats.quantize_int8(_weights(rng)))
  dense = formats.dequantize(w)
  x = rng.standard_normal((1, rows, 96)).astype(np.float32)
  got = np.asarray(jax.jit(formats.matmul)(jnp.asarray(x), w))
  np.testing.assert_allclose(got, x @ dense.T, rtol=1e-5, atol=1e-4)
  ids = np.array([[3, 0], [47, 2]])
  assert np.array_equal(np.asarray(formats.take_rows(w, ids)), dense[ids])
  assert np.array_equal(np.asarray(w[jnp.asarray(ids)]), dense[ids]) and w[...] is w


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts XLA:CPU's fusion of the decode dot")
def test_int8_decode_matmul_reads_the_int8_bytes(rng):
  """x [1, 1, I] @ convert(q).T * scale: the dot's fusion reads s8 [O, I]; no float32 copy of W."""
  rows, cols = 1536, 576
  p = formats.to_device(formats.quantize_int8(rng.standard_normal((rows, cols)).astype(np.float32)))
  hlo = jax.jit(formats.matmul).lower(jnp.zeros((1, 1, cols)), p).compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  entry = entry[: entry.index("\n}")]
  assert f"f32[{rows},{cols}]" not in entry and f"f32[{cols},{rows}]" not in entry, entry
  bodies = [m.group(0) for m in re.finditer(r"\n%?[\w.]+ \(.*?\n}", hlo, re.S) if " dot(" in m.group(0)]
  assert any(f"s8[{rows},{cols}]" in b and "convert(" in b for b in bodies), hlo


def test_unknown_weight_format_names_the_choices():
  with pytest.raises(formats.WeightFormatError, match=r"weights='int4'.*f32, native, int8"):
    formats.check_format("int4")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  return tmp_path / "cache"


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
def test_tiny_model_loaded_as_int8_holds_int8_and_stays_close(tmp_path, cache_dir, name):
  cfg = TINY_CONFIGS[name]
  path = write_gguf(tmp_path / f"{name}.gguf", cfg, init_random(cfg, 1, scale=0.08))
  f32 = thoughtjax.load(path, weights="f32", compile_cache=False)
  q8 = thoughtjax.load(path, weights="int8", compile_cache=False)
  block = q8.module.blocks[0]
  for w in (block.attn.q, block.attn.o, block.mlp.gate, block.mlp.down, q8.module.embed.table):
    assert isinstance(w.get_value(), formats.RowInt8)
  assert not formats.is_packed(block.attn_norm.weight.get_value())
  a, b = f32.logits(IDS), q8.logits(IDS)
  assert 0 < np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(a)), (np.max(np.abs(a - b)), np.max(np.abs(a)))
  assert np.mean(np.argmax(a, -1) == np.argmax(b, -1)) >= 0.8
  got = q8.generate(IDS, max_tokens=12, ignore_eos=True).token_ids
  assert len(got) == 12


def test_a_loaded_model_composes_a_mixed_variant_path(tmp_path, cache_dir):
  """From a loaded model (no registry) ``blocks[a:b)@int8`` quantizes those layers at compose time."""
  from thoughtjax.compose import compose
  from thoughtjax.paths import PathSyntaxError, layers_of_path

  cfg = TINY_CONFIGS["llama_gqa"]
  model = thoughtjax.load(write_gguf(tmp_path / "t.gguf", cfg, init_random(cfg, 1, scale=0.08)), compile_cache=False)
  n = cfg.num_layers
  full = compose(f"embed, blocks[0:{n}), head", model)
  mixed = compose(f"embed, blocks[0:1)@int8, blocks[1:{n}), head", model)
  both = compose(f"embed, blocks[0:1)@int8, blocks[0:{n}), head", model)  # layer 0 in both forms: two slots
  assert len(set(both.layers)) == n + 1 and mixed.path_hash != full.path_hash
  a, b = full.logits(IDS), mixed.logits(IDS)
  assert 0 < np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(a))
  assert len(mixed.generate(IDS, max_tokens=4, ignore_eos=True).token_ids) == 4
  with pytest.raises(PathSyntaxError, match=r"blocks\[0:1\)@int8: a weight variant.*compose"):
    layers_of_path("embed, blocks[0:1)@int8, head", n)
  with pytest.raises(PathSyntaxError, match=r"head@int8: weight variants exist for block ranges only"):
    compose("embed, blocks[0:1), head@int8", model)


@pytest.mark.slow
def test_default_model_int8_quality_against_f32():
  """The default model with every matrix per-row int8: measured against float32 on held-out text."""
  from thoughtjax.bench.decode import heldout_documents, weights_quality

  f32, q8 = thoughtjax.load(weights="f32"), thoughtjax.load(weights="int8")
  q = weights_quality(f32, q8, heldout_documents(), max_windows=3)
  assert q.tokens > 200 and q.top1_agreement >= 0.9 and 0 < q.mean_kl < 0.02 and abs(q.delta_nll) < 0.05, q
  text = q8.generate("The capital of France is", max_tokens=8).text
  assert "Paris" in text, text

"""int8 weights (thoughtjax.quantized.RowInt8): per-output-row symmetric int8, quantized from float32 at load.

Lossy by design, so the contract is a bound, not equality: every weight within half a step of its
row's scale; the matmul equal to x @ dequantized(W).T; the compiled decode-shaped matmul reads the
int8 bytes; a model loaded with ``weights="int8"`` holds every matrix as int8 and stays close to f32.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thoughtjax
from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax import quantized
from thoughtjax.transformer import init_random

IDS = [5, 77, 130, 9, 201, 64, 33]


def _weights(rng, rows=48, cols=96):
  w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
  w[0] = 0.0  # an all-zero row: scale 0, q 0
  w[2] *= 400  # a row far larger than the others keeps its own scale
  return w


def test_quantize_int8_is_within_half_a_step_per_row(rng):
  w = _weights(rng)
  p = quantized.quantize_int8(w)
  assert p.q.dtype == np.int8 and p.q.shape == w.shape and p.scale.shape == (w.shape[0],)
  assert np.abs(p.q.astype(np.int32)).max() <= 127 and np.all(p.q[0] == 0) and p.scale[0] == 0
  err = np.abs(quantized.dequantize(p) - w)
  assert np.all(err <= p.scale[:, None] / 2 * (1 + 1e-6) + 1e-12)
  # The largest |w| of each nonzero row maps to +-127 exactly.
  assert np.all(np.abs(p.q[1:]).max(axis=1) == 127)
  assert np.array_equal(np.asarray(jnp.asarray(quantized.to_device(p))), quantized.dequantize(p))


def test_quantize_int8_of_native_blocks_quantizes_their_float32_values(rng):
  import gguf

  w = _weights(rng, 32, 64)
  raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
  blocks = quantized.from_gguf_blocks(raw, "Q8_0")
  a, b = quantized.quantize_int8(blocks), quantized.quantize_int8(quantized.dequantize(blocks))
  assert np.array_equal(a.q, b.q) and np.array_equal(a.scale, b.scale)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_matmul_and_rows_match_the_dequantized_matrix(rng, rows):
  w = quantized.to_device(quantized.quantize_int8(_weights(rng)))
  dense = quantized.dequantize(w)
  x = rng.standard_normal((1, rows, 96)).astype(np.float32)
  got = np.asarray(jax.jit(quantized.matmul)(jnp.asarray(x), w))
  np.testing.assert_allclose(got, x @ dense.T, rtol=1e-5, atol=1e-4)
  ids = np.array([[3, 0], [47, 2]])
  assert np.array_equal(np.asarray(quantized.take_rows(w, ids)), dense[ids])
  assert np.array_equal(np.asarray(w[jnp.asarray(ids)]), dense[ids]) and w[...] is w


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts XLA:CPU's fusion of the decode dot")
def test_int8_decode_matmul_reads_the_int8_bytes(rng):
  """x [1, 1, I] @ convert(q).T * scale: the dot's fusion reads s8 [O, I]; no float32 copy of W."""
  rows, cols = 1536, 576
  p = quantized.to_device(quantized.quantize_int8(rng.standard_normal((rows, cols)).astype(np.float32)))
  hlo = jax.jit(quantized.matmul).lower(jnp.zeros((1, 1, cols)), p).compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  entry = entry[: entry.index("\n}")]
  assert f"f32[{rows},{cols}]" not in entry and f"f32[{cols},{rows}]" not in entry, entry
  bodies = [m.group(0) for m in re.finditer(r"\n%?[\w.]+ \(.*?\n}", hlo, re.S) if " dot(" in m.group(0)]
  assert any(f"s8[{rows},{cols}]" in b and "convert(" in b for b in bodies), hlo


def test_unknown_weight_format_names_the_choices():
  with pytest.raises(quantized.WeightFormatError, match=r"weights='int4'.*f32, native, int8"):
    quantized.check_format("int4")


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
    assert isinstance(w.get_value(), quantized.RowInt8)
  assert not quantized.is_packed(block.attn_norm.weight.get_value())
  a, b = f32.logits(IDS), q8.logits(IDS)
  assert 0 < np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(a)), (np.max(np.abs(a - b)), np.max(np.abs(a)))
  assert np.mean(np.argmax(a, -1) == np.argmax(b, -1)) >= 0.8
  got = q8.generate(IDS, max_tokens=12, ignore_eos=True).token_ids
  assert len(got) == 12


def test_a_loaded_model_composes_a_mixed_variant_path(tmp_path, cache_dir):
  """From a loaded model (no registry) ``blocks[a:b)@int8`` quantizes those layers at compose time."""
  from thoughtjax.compose import compose
  from thoughtjax.path_syntax import PathSyntaxError, layers_of_path

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


# ---- int8a8: the same int8 weights, activations quantized per row (quantized.RowInt8A8) -------------------


def _x(rng, rows: int, cols: int = 96) -> np.ndarray:
  x = rng.standard_normal((rows, cols)).astype(np.float32)
  if rows > 1:
    x[1] = 0.0  # an all-zero row: scale 0, output 0
  if rows > 2:
    x[2] *= 1000  # a row far larger than the others keeps its own scale
  return x


def test_quantize_rows_is_within_half_a_step_per_row(rng):
  x = _x(rng, 8)
  xq, scale = jax.jit(quantized.quantize_rows)(jnp.asarray(x))
  xq, scale = np.asarray(xq), np.asarray(scale)
  assert xq.dtype == np.int8 and xq.shape == x.shape and scale.shape == (8,) and scale[1] == 0
  assert np.all(xq[1] == 0) and np.all(np.abs(np.delete(xq, 1, axis=0).astype(np.int32)).max(axis=1) == 127)
  assert np.all(np.abs(scale[:, None] * xq - x) <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12)


def _int8a8_reference(x: np.ndarray, w: quantized.RowInt8) -> np.ndarray:
  """The int8a8 product in numpy: per-row int8 x, an exact integer dot, then both scales."""
  scale = np.max(np.abs(x), axis=1) / np.float32(127)
  xq = np.clip(np.rint(x / np.where(scale > 0, scale, 1)[:, None]), -127, 127).astype(np.int64)
  acc = (xq @ np.asarray(w.q).astype(np.int64).T).astype(np.float32)
  return acc * scale[:, None] * np.asarray(w.scale)[None, :]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8a8_matmul_is_the_integer_product(rng, rows):
  """Every row count gives the integer dot's result; a row's result does not depend on its batch; the
  error against the float32 product stays within the worst case of rounding both operands."""
  dense = _weights(rng)
  w = quantized.to_device(quantized.int8_activations(quantized.quantize_int8(dense)))
  assert isinstance(w, quantized.RowInt8A8) and w.kind == "int8a8" and quantized.is_packed(w)
  x = _x(rng, 8)[:rows]
  mm = jax.jit(quantized.matmul)
  got = np.asarray(mm(jnp.asarray(x[None]), w))[0]
  np.testing.assert_allclose(got, _int8a8_reference(x, w), rtol=1e-6, atol=0)
  one_by_one = np.stack([np.asarray(mm(jnp.asarray(x[None, i : i + 1]), w))[0, 0] for i in range(rows)])
  assert np.array_equal(got, one_by_one)  # exact integer sums at M = 1 (float32) and M > 1 (int32)
  # |x w - xq wq| <= sum_i |x_i| dw + |w_i| dx + dx dw, each operand off by at most half its step.
  dx, dw = np.max(np.abs(x), axis=1)[:, None] / 254, np.asarray(w.scale)[None, :] / 2
  bound = np.abs(x) @ np.ones_like(dense.T) * dw + dx * (np.ones_like(x) @ np.abs(dense).T) + x.shape[1] * dx * dw
  err = np.abs(got - x @ dense.T)
  assert np.all(err <= bound * (1 + 1e-4) + 1e-6) and err.max() > 0, (err / np.maximum(bound, 1e-30)).max()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts XLA:CPU's code for the int8a8 dot")
@pytest.mark.parametrize("rows", [1, 8])
def test_int8a8_matmul_reads_the_int8_bytes_without_a_wide_copy(rng, rows):
  """M = 1: the fused decode dot over q's s8 bytes, x quantized once (outside that fusion); M > 1: an
  s8 x s8 -> s32 dot (XLA:CPU's integer GEMM) over the same bytes. Never an f32 or s32 copy of W."""
  rows_w, cols = 1536, 576
  w = quantized.to_device(
    quantized.int8_activations(quantized.quantize_int8(rng.standard_normal((rows_w, cols)).astype(np.float32)))
  )
  hlo = jax.jit(quantized.matmul).lower(jnp.zeros((1, rows, cols)), w).compile().as_text()
  assert not re.search(rf"(f32|s32)\[({rows_w},{cols}|{cols},{rows_w})\]", hlo[hlo.index("ENTRY") :]), hlo
  bodies = [m.group(0) for m in re.finditer(r"\n%?[\w.]+ \(.*?\n}", hlo, re.S) if " dot(" in m.group(0)]
  (dot,) = [b for b in bodies if f"s8[{rows_w},{cols}]" in b]
  if rows == 1:
    assert "convert(" in dot and "round-nearest" not in dot and "clamp(" not in dot, dot
    assert " conditional(" in hlo  # what keeps the quantization out of the dot's fusion
  else:
    assert re.search(rf"s32\[{rows},{rows_w}\]\S* dot\(", dot) and f"s8[{rows},{cols}]" in dot, dot


def test_int8a8_survives_the_stored_form_and_jit(rng):
  """Stored (registry/cache) as the int8 form's arrays; int8_activations makes it int8a8 again."""
  from thoughtjax.weights import to_stored

  params = {"attn": {"q": quantized.int8_activations(quantized.quantize_int8(_weights(rng))), "bias": np.ones(3)}}
  stored = to_stored(params)
  assert set(stored["attn"]["q"]) == {"int8", "scale"}
  back = quantized.int8_activations(quantized.from_stored(stored))
  assert type(back["attn"]["q"]) is quantized.RowInt8A8 and np.array_equal(back["attn"]["q"].q, params["attn"]["q"].q)
  through = jax.jit(lambda t: t)(quantized.to_device(back["attn"]["q"]))
  assert type(through) is quantized.RowInt8A8 and type(through.map(lambda a: a[:4])) is quantized.RowInt8A8


def test_int8_and_int8a8_trees_differ_for_jit_caches(rng):
  """The two forms share their arrays (int8a8 is int8's weights), so only the tree structure tells a jit cache
  which program to run: it must compare unequal, or one form may run the other's program."""
  w = quantized.quantize_int8(_weights(rng))
  a8 = quantized.int8_activations(w)
  assert a8.q is w.q and a8.scale is w.scale
  assert jax.tree.structure(w) != jax.tree.structure(a8)
  twice = jax.jit(lambda t: t.scale * (2.0 if isinstance(t, quantized.RowInt8A8) else 1.0))
  for _ in range(3):  # interleaved calls on the same buffers
    np.testing.assert_array_equal(twice(w), np.asarray(w.scale))
    np.testing.assert_array_equal(twice(a8), 2 * np.asarray(w.scale))


def test_tiny_model_with_int8_activations_stays_close(tmp_path, cache_dir):
  """int8a8 against f32 on a tiny model, beside int8 (the same weights): the activation rounding is a
  second error of the same size as the weights' (half a step of 1/127 of a row's largest value)."""
  from thoughtjax.sampling import SamplingParams

  cfg = TINY_CONFIGS["llama_gqa"]
  path = write_gguf(tmp_path / "t.gguf", cfg, init_random(cfg, 1, scale=0.08))
  f32 = thoughtjax.load(path, weights="f32", compile_cache=False)
  q8 = thoughtjax.load(path, weights="int8", compile_cache=False)
  a8 = q8.with_path(q8.layers, parts=quantized.int8_activations(q8.parts))
  assert {type(w) for w in jax.tree.leaves(a8.parts, is_leaf=quantized.is_packed) if quantized.is_packed(w)} == {
    quantized.RowInt8A8
  }
  ref, got, weight_only = f32.logits(IDS), a8.logits(IDS), q8.logits(IDS)
  err, err8 = np.max(np.abs(got - ref)), np.max(np.abs(weight_only - ref))
  assert 0 < err <= 0.05 * np.max(np.abs(ref)) and err <= 3 * err8, (err, err8, np.max(np.abs(ref)))
  assert np.mean(np.argmax(ref, -1) == np.argmax(got, -1)) >= 0.8
  # Batch 1 decodes what the same rows decode inside a batch (exact integer sums either way).
  params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
  one = a8.generate_batch([IDS], params[:1])[0].token_ids
  assert a8.generate_batch([IDS, IDS[:4]], params)[0].token_ids == one and len(one) == 8


def test_load_and_generate_take_int8a8(tmp_path, cache_dir, capsys):
  """``weights="int8a8"`` loads the int8 weights with int8 activations (the logits of the derived form built
  by hand); ``generate --weights int8a8`` runs it; with --registry it is refused with the fix."""
  from thoughtjax.cli import main

  cfg = TINY_CONFIGS["llama_gqa"]
  path = write_gguf(tmp_path / "t.gguf", cfg, init_random(cfg, 1, scale=0.08))
  a8 = thoughtjax.load(path, weights="int8a8", compile_cache=False)
  assert isinstance(a8.module.blocks[0].mlp.gate.get_value(), quantized.RowInt8A8)
  q8 = thoughtjax.load(path, weights="int8", compile_cache=False)
  by_hand = q8.with_path(q8.layers, parts=quantized.int8_activations(q8.parts))
  np.testing.assert_array_equal(a8.logits(IDS), by_hand.logits(IDS))
  argv = ["generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "4", "--json"]
  assert main([*argv, "--weights", "int8a8"]) == 0
  assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1
  assert main(["generate", "--registry", str(tmp_path), "--prompt", "x", "--weights", "int8a8"]) == 2
  assert "--weights int8a8 applies to --model" in capsys.readouterr().err
  with pytest.raises(quantized.WeightFormatError, match="int4"):
    thoughtjax.load(path, weights="int4", compile_cache=False)


@pytest.mark.slow
def test_default_model_int8a8_quality_against_f32():
  """int8a8 (activations quantized per row too) on the default model, against float32 on held-out text.
  Measured over the 2412 held-out tokens: top-1 0.853, KL 0.049, ΔNLL +0.053 (int8: 0.951, 0.0047,
  +0.0055); the bounds leave room over 3 windows and catch a broken quantization (top-1 near 0)."""
  from thoughtjax.bench.decode import heldout_documents, load_forms, weights_quality

  models = load_forms(None, ["f32", "int8a8"])
  q = weights_quality(models["f32"], models["int8a8"], heldout_documents(), max_windows=3)
  assert q.tokens > 200 and q.top1_agreement >= 0.75 and 0 < q.mean_kl < 0.15 and abs(q.delta_nll) < 0.2, q
  text = models["int8a8"].generate("The capital of France is", max_tokens=8).text
  assert "Paris" in text, text

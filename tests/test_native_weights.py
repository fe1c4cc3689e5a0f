"""Native weights (thoughtjax.quantized): a GGUF's Q8_0 / Q4_0 / Q4_1 blocks held packed, computed in float32.

The contract checked here: the packed form dequantizes bit for bit to what ``gguf`` dequantizes; a
model loaded with ``weights="native"`` gives the f32 model's logits (to float32 summation order) and its
greedy tokens; the compiled decode-shaped matmul reads the packed bytes (no float32 copy of W); the
native cache entry is checked like the f32 one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import thoughtjax
from tests.tiny import TINY_CONFIGS, VOCAB, write_gguf
from thoughtjax import loading, quantized
from thoughtjax.config import Architecture, ModelConfig
from thoughtjax.errors import UserError
from thoughtjax.sources.errors import WeightCacheError
from thoughtjax.transformer import init_random

KINDS = ("Q8_0", "Q4_0", "Q4_1")
# Every matrix dimension a multiple of the 32-value block (llama_gqa, qwen2_bias qualify as they are).
UNTIED = ModelConfig(
  Architecture.MISTRAL,
  VOCAB,
  64,
  2,
  4,
  2,
  16,
  96,
  rope_theta=1e5,
  rms_eps=1e-5,
  tie_embeddings=False,
  max_context=256,
  bos_id=1,
  eos_id=2,
)
CONFIGS = {"llama_gqa": TINY_CONFIGS["llama_gqa"], "qwen2_bias": TINY_CONFIGS["qwen2_bias"], "untied": UNTIED}
IDS = [5, 77, 130, 9, 201, 64, 33]


def _weights(rng, rows=48, cols=96):
  w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
  w[0, :32] = 0.0  # an all-zero block (scale 0)
  w[1, 32:64] = 3.0  # a constant block (Q4_1: scale 0, min 3)
  w[2] *= 400  # values far from the others
  return w


def _packed(w: np.ndarray, kind: str) -> tuple[quantized.BlockQuant, np.ndarray]:
  qt = gguf.GGMLQuantizationType[kind]
  raw = gguf.quants.quantize(w, qt)
  return quantized.from_gguf_blocks(raw, kind), gguf.quants.dequantize(raw, qt)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_bitwise_gguf(rng, kind):
  p, ref = _packed(_weights(rng), kind)
  assert p.shape == ref.shape and p.kind == kind
  assert p.q.dtype == (np.uint8 if kind == "Q4_1" else np.int8)
  assert (p.min is None) == (kind != "Q4_1")
  assert np.array_equal(quantized.dequantize(p).view(np.uint32), ref.view(np.uint32))
  in_xla = np.asarray(jax.jit(quantized.dequantize_jnp)(quantized.to_device(p)))
  assert np.array_equal(in_xla.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead", [(1, 1), (3, 1), (2, 5)], ids=["decode_b1", "decode_b3", "prefill"])
def test_matmul_and_rows_match_the_float32_weights(rng, kind, lead):
  p, ref = _packed(_weights(rng), kind)
  x = rng.standard_normal((*lead, ref.shape[1])).astype(np.float32)
  got = np.asarray(jax.jit(quantized.matmul)(jnp.asarray(x), quantized.to_device(p)))
  want = x @ ref.T  # numpy's float32 product: jnp's default precision is TF32 on a GPU
  assert got.shape == (*lead, ref.shape[0])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  ids = np.array([[0, 2, 47], [1, 1, 5]])
  assert np.array_equal(np.asarray(quantized.take_rows(quantized.to_device(p), ids)), ref[ids])
  assert quantized.to_device(p)[...] is not None and np.array_equal(np.asarray(jnp.asarray(p)), ref)


def test_unsupported_block_type_and_bad_sizes_are_refused(rng):
  raw = gguf.quants.quantize(_weights(rng), gguf.GGMLQuantizationType.Q5_0)
  with pytest.raises(quantized.WeightFormatError, match=r"Q5_0.*no native form.*Q8_0, Q4_0, Q4_1.*weights='f32'"):
    quantized.from_gguf_blocks(raw, "Q5_0")
  raw = gguf.quants.quantize(_weights(rng), gguf.GGMLQuantizationType.Q8_0)
  with pytest.raises(quantized.WeightFormatError, match=r"do not hold a \[48, 64\] matrix"):
    quantized.from_gguf_blocks(raw, "Q8_0", (48, 64))
  with pytest.raises(quantized.WeightFormatError, match=r"weights='int4'.*f32, native") as err:
    loading.load_params(Path("unused.gguf"), weights="int4")
  assert isinstance(err.value, UserError)


def _entry_lines(hlo: str) -> list[str]:
  entry = hlo[hlo.index("ENTRY") :]
  return entry[: entry.index("\n}")].splitlines()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts XLA:CPU's fusion of the decode dot")
@pytest.mark.parametrize("kind,rows,cols", [("Q4_1", 1536, 576), ("Q8_0", 4096, 576)], ids=["mlp_q4_1", "head_q8_0"])
def test_decode_matmul_reads_the_packed_bytes(rng, kind, rows, cols):
  """x [1, 1, I] @ W.T: the dot's fusion takes q's bytes as a parameter; no float32 [O, I] buffer."""
  p, _ = _packed(_weights(rng, rows, cols), kind)
  hlo = jax.jit(quantized.matmul).lower(jnp.zeros((1, 1, cols)), quantized.to_device(p)).compile().as_text()
  entry = _entry_lines(hlo)
  narrow = "u8" if kind == "Q4_1" else "s8"
  assert not [ln for ln in entry if f"f32[{rows},{cols}]" in ln or f"f32[{cols},{rows}]" in ln], "\n".join(entry)
  fusions = [ln for ln in entry if " fusion(" in ln]
  dot_fusions = [
    name
    for name in re.findall(r"calls=(%[\w.]+)", "\n".join(fusions))
    if re.search(re.escape(name) + r" .*?\n}", hlo, re.S)
    and " dot(" in re.search(re.escape(name) + r" .*?\n}", hlo, re.S).group(0)
  ]
  assert dot_fusions, "the dot was not fused with the dequantization:\n" + "\n".join(entry)
  body = re.search(re.escape(dot_fusions[0]) + r" .*?\n}", hlo, re.S).group(0)
  assert f"{narrow}[{rows},{cols}]" in body and "convert(" in body


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("THOUGHTJAX_VERIFY_CACHE", raising=False)
  return tmp_path / "cache"


def _pair(tmp_path, name: str, kind: str):
  cfg = CONFIGS[name]
  model = init_random(cfg, 1, scale=0.08)
  path = write_gguf(tmp_path / f"{name}-{kind}.gguf", cfg, model, kind)
  return thoughtjax.load(path, weights="f32", compile_cache=False), thoughtjax.load(
    path, weights="native", compile_cache=False
  )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_quantized_gguf_native_equals_f32(tmp_path, cache_dir, name, kind):
  f32, native = _pair(tmp_path, name, kind)
  leaves = jax.tree.leaves(native.module.blocks[0].mlp.gate.get_value())
  assert {str(a.dtype) for a in leaves} >= {"float32", "uint8" if kind == "Q4_1" else "int8"}
  assert quantized.is_packed(native.module.embed.table.get_value())
  assert not quantized.is_packed(f32.module.embed.table.get_value())
  a, b = f32.logits(IDS), native.logits(IDS)
  assert np.max(np.abs(a - b)) <= 1e-5, np.max(np.abs(a - b))
  got = native.generate(IDS, max_tokens=32, ignore_eos=True).token_ids
  assert got == f32.generate(IDS, max_tokens=32, ignore_eos=True).token_ids and len(got) == 32
  # A batch (M > 1 rows per matmul) decodes the same tokens as one row at a time.
  from thoughtjax.sampling import SamplingParams

  params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
  rows = native.generate_batch([IDS, IDS[:4]], params)
  assert [r.token_ids for r in rows] == [r.token_ids for r in f32.generate_batch([IDS, IDS[:4]], params)]


def test_native_cache_entry_is_packed_mapped_and_checked(tmp_path, cache_dir):
  cfg = CONFIGS["llama_gqa"]
  path = write_gguf(tmp_path / "t.gguf", cfg, init_random(cfg, 1, scale=0.08), "Q4_1")
  _, first, _, _ = loading.load_params(path, weights="native")
  (entry,) = (cache_dir / "weights").glob(f"*-native-v{loading._NATIVE_FORMAT}")
  meta = loading._read_meta(entry)
  assert meta["weights"] == "native" and meta["packed"]["blocks/0/mlp/gate"] == "Q4_1"
  assert meta["packed"]["embed/table"] == "Q4_1"
  f32_bytes = 4 * sum(int(np.prod(quantized.dequantize(v).shape)) for v in _packed_leaves(first))
  native_bytes = sum(v.nbytes for v in _packed_leaves(first))
  assert native_bytes < 0.33 * f32_bytes  # one byte per value + 8 bytes per 32 values, vs 4 bytes
  before = loading.CACHE_STATS["sampled"]
  _, again, _, _ = loading.load_params(path, weights="native")
  assert loading.CACHE_STATS["sampled"] == before + 1
  w = again["blocks"][1]["attn"]["o"]
  assert isinstance(w.q, np.memmap) or isinstance(getattr(w.q, "base", None), np.memmap)
  assert np.array_equal(quantized.dequantize(w), quantized.dequantize(first["blocks"][1]["attn"]["o"]))
  # The f32 entry of the same GGUF lives beside it; loading one never deletes the other.
  loading.load_params(path, weights="f32")
  assert entry.is_dir() and len(list((cache_dir / "weights").glob("*-v*"))) == 2
  assert loading.verify_weight_cache(cache_dir / "weights") == {
    str(p): "ok" for p in (cache_dir / "weights").glob("*-v*")
  }


def _packed_leaves(params):
  return [v for v in jax.tree.leaves(params, is_leaf=quantized.is_packed) if quantized.is_packed(v)]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_native_entry_is_refused_loudly(tmp_path, cache_dir, damage):
  cfg = CONFIGS["llama_gqa"]
  path = write_gguf(tmp_path / "t.gguf", cfg, init_random(cfg, 1, scale=0.08), "Q8_0")
  loading.load_params(path, weights="native")
  (entry,) = (cache_dir / "weights").glob(f"*-native-v{loading._NATIVE_FORMAT}")
  weights = entry / "weights.safetensors"
  st = weights.stat()
  with open(weights, "r+b") as f:
    if damage == "truncate":
      f.truncate(st.st_size - 100)
    else:  # mtime kept so only the sampled hash can see it (a tiny file is sampled whole)
      f.seek(st.st_size // 2)
      b = f.read(1)
      f.seek(st.st_size // 2)
      f.write(bytes([b[0] ^ 0xFF]))
  os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
  before = loading.CACHE_STATS["refused"]
  with pytest.raises(WeightCacheError, match=r"weights.safetensors failed its check.*rm -r") as err:
    loading.load_params(path, weights="native")
  assert loading.CACHE_STATS["refused"] == before + 1
  assert ("truncated" if damage == "truncate" else "sampled blocks") in str(err.value)


def test_decode_loop_does_not_hoist_a_float32_weight(rng):
  """Inside a loop W is invariant: XLA must not dequantize it once outside and carry float32 W."""
  p = quantized.to_device(_packed(_weights(rng, 1536, 576), "Q4_1")[0])

  def steps(x, w):
    return jax.lax.fori_loop(0, 4, lambda i, x: x + quantized.matmul(x, w)[..., :576], x)

  hlo = jax.jit(steps).lower(jnp.zeros((1, 1, 576)), p).compile().as_text()
  # Buffers live in the unfused computations (entry, while body and condition); a float32 W there,
  # as an instruction's result, would be a materialized copy.
  unfused = [c for c in re.split(r"\n(?=\S)", hlo) if not c.startswith("%fused")]
  big = re.compile(r"= f32\[(1536,576|576,1536|1536,18,32)\]")
  assert not [ln for c in unfused for ln in c.splitlines() if big.search(ln)]
  assert any(" while(" in c for c in unfused)


def test_cli_weights_flag(tmp_path, cache_dir):
  """``generate`` and ``score`` take ``--weights``; native and f32 print the same tokens and scores."""
  import json
  import subprocess
  import sys

  cfg = CONFIGS["llama_gqa"]
  path = write_gguf(tmp_path / "t.gguf", cfg, init_random(cfg, 1, scale=0.08), "Q4_1")

  def cli(*args):
    r = subprocess.run(
      [sys.executable, "-m", "thoughtjax.cli", *args, "--model", str(path), "--json"],
      capture_output=True,
      text=True,
      env={**os.environ, "THOUGHTJAX_CACHE": str(cache_dir)},
      timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)

  gen = {w: cli("generate", "--prompt", "hello", "--max-tokens", "6", "--weights", w) for w in ("native", "f32")}
  assert gen["native"]["token_ids"] == gen["f32"]["token_ids"] and len(gen["f32"]["token_ids"]) > 0
  score = {w: cli("score", "--token-ids", "5,6,7,8", "--top-k", "3", "--weights", w) for w in ("native", "f32")}
  assert score["native"]["top_ids"] == score["f32"]["top_ids"]
  np.testing.assert_allclose(score["native"]["top_logits"], score["f32"]["top_logits"], atol=1e-5)
  assert abs(score["native"]["nll"] - score["f32"]["nll"]) <= 1e-5
  assert len(list((cache_dir / "weights").glob("*-native-v*"))) == 1
  bad = subprocess.run(
    [sys.executable, "-m", "thoughtjax.cli", "score", "--token-ids", "5,6", "--weights", "int4"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert bad.returncode != 0 and "--weights" in bad.stderr and "native" in bad.stderr


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts XLA:CPU's fusion of the decode dot")
@pytest.mark.parametrize("form", ["Q4_1", "Q8_0", "int8", "int8a8"])
def test_decode_dot_takes_its_operand_computed_once(rng, form):
  """x's producer (here an RMSNorm-like scaling) stays out of the one-row dot's fusion: fused, XLA:CPU
  recomputed it for every output row (the head: 49152 times per step). XLA splits that fusion into
  parallel tasks itself (outer_dimension_partitions), which is why splitting W's rows by hand did not pay."""
  rows, cols = 1536, 576
  w = _weights(rng, rows, cols)
  if form.startswith("int8"):
    p = quantized.quantize_int8(w)
    p = quantized.int8_activations(p) if form == "int8a8" else p
  else:
    p = _packed(w, form)[0]
  p = quantized.to_device(p)

  def step(x, g, w):
    return quantized.matmul(x * jax.lax.rsqrt(jnp.mean(x * x)) * g[None, None], w)

  x, g = rng.standard_normal((2, 1, 1, cols)).astype(np.float32)
  hlo = jax.jit(step).lower(jnp.asarray(x), jnp.asarray(g[0, 0]), p).compile().as_text()
  entry = _entry_lines(hlo)
  (dot_line,) = [ln for ln in entry if " fusion(" in ln and "dot" in ln.split("=")[0]]
  name = re.search(r"calls=(%[\w.]+)", dot_line).group(1)
  body = re.search(re.escape(name) + r" .*?\n}", hlo, re.S).group(0)
  narrow = "u8" if form == "Q4_1" else "s8"
  assert f"{narrow}[{rows},{cols}]" in body and " dot(" in body
  operand = re.compile(rf"= f32\[(1,)*{cols}\]\S* (multiply|rsqrt|round-nearest-even|clamp)\(")
  assert not operand.search(body), body  # x arrives as a buffer: no scaling or rounding of it inside
  if (os.cpu_count() or 1) >= 2:
    assert '"outer_dimension_partitions":["' in dot_line, dot_line

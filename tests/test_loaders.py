"""GGUF and safetensors loaders: the same weights through every format, clear errors."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import thoughtjax
from thoughtjax.config import UnsupportedModelError
from thoughtjax.loading import load_tensors
from thoughtjax.sources.gguf_file import permute_rows, unpermute_rows
from thoughtjax.weights import model_params
from tests.tiny import tiny_model, write_gguf, write_safetensors_dir


def _leaves(model):
  return jax.tree.leaves(model_params(model))


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64 // 8, 24)  # 8 heads of dim 8
  assert np.array_equal(unpermute_rows(permute_rows(w, 8), 8), w)
  assert not np.array_equal(permute_rows(w, 8), w)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "mistral_untied"])
def test_safetensors_dir_roundtrip(tmp_path, name):
  cfg, model = tiny_model(name)
  write_safetensors_dir(tmp_path / name, cfg, model)
  loaded = thoughtjax.load(str(tmp_path / name), compile_cache=False)
  assert loaded.config == cfg
  for a, b in zip(_leaves(model), _leaves(loaded.module)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert loaded.codec.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("qtype,tol", [("F32", 0.0), ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 0.02),
                                       ("Q4_1", 0.1), ("Q4_0", 0.15)])
def test_gguf_types_dequantize_to_the_same_model(tmp_path, monkeypatch, qtype, tol):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, model, qtype)
  got_cfg, tensors, codec, _ = load_tensors(path)
  assert got_cfg.num_heads == cfg.num_heads and got_cfg.tie_embeddings
  loaded = thoughtjax.load(str(path), compile_cache=False)
  for a, b in zip(_leaves(model), _leaves(loaded.module)):
    a, b = np.asarray(a), np.asarray(b)
    scale = np.max(np.abs(a)) + 1e-12
    assert np.max(np.abs(a - b)) <= tol * scale
  # Un-permuted Q/K: with exact weights the logits match the source model bit for bit.
  if qtype == "F32":
    src = thoughtjax.Model(thoughtjax.loading.LoadedModel(cfg, model, codec, "src", ""))
    ids = [5, 9, 100, 200, 7]
    np.testing.assert_allclose(loaded.logits(ids), src.logits(ids), atol=1e-6)
  # Second load comes from the dequantized cache, identical.
  again = thoughtjax.load(str(path), compile_cache=False)
  for a, b in zip(_leaves(loaded.module), _leaves(again.module)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unsupported_architecture_is_named(tmp_path):
  cfg, model = tiny_model("llama_gqa")
  d = write_safetensors_dir(tmp_path / "m", cfg, model)
  raw = json.loads((d / "config.json").read_text())
  raw["model_type"] = "gpt_neox"
  (d / "config.json").write_text(json.dumps(raw))
  with pytest.raises(UnsupportedModelError, match="gpt_neox"):
    thoughtjax.load(str(d), compile_cache=False)


def test_unsupported_quantization_is_named(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = write_gguf(tmp_path / "q5.gguf", cfg, model, "Q5_0")
  with pytest.raises(UnsupportedModelError, match="Q5_0"):
    load_tensors(path)


def test_missing_path_is_a_clear_error():
  with pytest.raises(FileNotFoundError, match="neither a known name"):
    thoughtjax.load("/nonexistent/model.gguf", compile_cache=False)


def test_weight_cache_replaces_entries_of_older_formats(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  from thoughtjax import fetch as fetch_lib

  cfg, model = tiny_model("llama_gqa")
  path = write_gguf(tmp_path / "tiny.gguf", cfg, model, "F32")
  stale = tmp_path / "cache" / "weights" / f"{fetch_lib.sha256_file(path)[:24]}-v0"
  stale.mkdir(parents=True)
  (stale / "weights.safetensors").write_bytes(b"old format")
  thoughtjax.load(str(path), compile_cache=False)
  entries = sorted(p.name for p in (tmp_path / "cache" / "weights").iterdir() if p.is_dir())
  assert entries == [f"{stale.name[:-3]}-v{thoughtjax.loading._CACHE_FORMAT}"]

"""GGUF and safetensors loaders: the same weights through every format, clear errors."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import thoughtjax
from tests.tiny import tiny_model, write_gguf, write_safetensors_dir
from thoughtjax.config import UnsupportedModelError
from thoughtjax.errors import UserError
from thoughtjax.loading import load_tensors
from thoughtjax.sources.errors import TruncatedModelError
from thoughtjax.sources.gguf_file import permute_rows, unpermute_rows
from thoughtjax.weights import model_params


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


@pytest.mark.parametrize(
  "qtype,tol", [("F32", 0.0), ("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 0.02), ("Q4_1", 0.1), ("Q4_0", 0.15)]
)
def test_gguf_types_dequantize_to_the_same_model(tmp_path, monkeypatch, qtype, tol):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, model, qtype)
  got_cfg, _, codec, _ = load_tensors(path)
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


def _write_gguf_with(path, cfg, model, kv=(), tensors=(), qtype="F32"):
  """tests.tiny.write_gguf plus extra metadata ``(key, value, GGUFValueType)`` and extra tensors."""
  import gguf

  original = gguf.GGUFWriter.write_header_to_file

  def with_extras(self, *args, **kwargs):
    for key, value, vtype in kv:
      self.add_key_value(key, value, vtype)
    for name, array in tensors:
      self.add_tensor(name, array)
    return original(self, *args, **kwargs)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(gguf.GGUFWriter, "write_header_to_file", with_extras)
    return write_gguf(path, cfg, model, qtype)


@pytest.mark.parametrize("kind", ["linear", "yarn", "longrope"])
def test_gguf_rope_scaling_type_is_refused_by_name(tmp_path, monkeypatch, kind):
  import gguf

  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = _write_gguf_with(
    tmp_path / "scaled.gguf",
    cfg,
    model,
    kv=[
      ("llama.rope.scaling.type", kind, gguf.GGUFValueType.STRING),
      ("llama.rope.scaling.factor", 8.0, gguf.GGUFValueType.FLOAT32),
    ],
  )
  with pytest.raises(UnsupportedModelError) as err:
    thoughtjax.load(str(path), compile_cache=False)
  message = str(err.value)
  assert f"llama.rope.scaling.type = {kind!r}" in message and "supported RoPE scaling types: none" in message
  assert str(path) in message
  assert isinstance(err.value, UserError)
  assert not (tmp_path / "cache" / "weights").exists() or not any((tmp_path / "cache" / "weights").glob("*-v*"))


def test_gguf_llama3_rope_freqs_tensor_is_refused_by_name(tmp_path, monkeypatch):
  # llama.cpp writes Llama 3.x "llama3" scaling as a rope_freqs.weight tensor, with no type key.
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  factors = np.linspace(1.0, 8.0, cfg.head_dim // 2, dtype=np.float32)
  path = _write_gguf_with(tmp_path / "llama3.gguf", cfg, model, tensors=[("rope_freqs.weight", factors)])
  with pytest.raises(
    UnsupportedModelError,
    match=r"rope_freqs\.weight .*'llama3' scaling.*supported RoPE scaling "
    r"types: none",
  ):
    load_tensors(path)


def test_gguf_plain_rope_scaling_keys_still_load(tmp_path, monkeypatch):
  import gguf

  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = _write_gguf_with(
    tmp_path / "plain.gguf",
    cfg,
    model,
    kv=[
      ("llama.rope.scaling.type", "none", gguf.GGUFValueType.STRING),
      ("llama.rope.dimension_count", cfg.head_dim, gguf.GGUFValueType.UINT32),
    ],
  )
  assert load_tensors(path)[0].rope_theta == cfg.rope_theta


def test_gguf_partial_rope_is_refused_by_name(tmp_path, monkeypatch):
  import gguf

  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = _write_gguf_with(
    tmp_path / "partial.gguf",
    cfg,
    model,
    kv=[("llama.rope.dimension_count", cfg.head_dim // 2, gguf.GGUFValueType.UINT32)],
  )
  with pytest.raises(
    UnsupportedModelError,
    match=rf"llama\.rope\.dimension_count = {cfg.head_dim // 2} but the "
    rf"head dimension is {cfg.head_dim}",
  ):
    load_tensors(path)


@pytest.mark.parametrize(
  "key,scaling",
  [
    (
      "rope_scaling",
      {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
      },
    ),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
  ],
)
def test_safetensors_rope_scaling_is_refused_by_name(tmp_path, key, scaling):
  cfg, model = tiny_model("llama_gqa")
  d = write_safetensors_dir(tmp_path / "m", cfg, model)
  raw = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(raw | {key: scaling}))
  kind = scaling.get("rope_type", scaling.get("type"))
  type_key = "rope_type" if "rope_type" in scaling else "type"
  with pytest.raises(UnsupportedModelError) as err:
    thoughtjax.load(str(d), compile_cache=False)
  message = str(err.value)
  assert f"{key}.{type_key} = {kind!r}" in message and "supported RoPE scaling types: default" in message
  assert str(d / "config.json") in message


def test_safetensors_default_rope_parameters_load(tmp_path):
  cfg, model = tiny_model("llama_gqa")
  d = write_safetensors_dir(tmp_path / "m", cfg, model)
  raw = json.loads((d / "config.json").read_text())
  raw.pop("rope_theta")
  (d / "config.json").write_text(
    json.dumps(raw | {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
  )
  assert thoughtjax.load(str(d), compile_cache=False).config == cfg


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
@pytest.mark.parametrize("keep", ["all_but_3", "half", "inside_header"])
def test_truncated_gguf_says_truncated(tmp_path, monkeypatch, qtype, keep):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = write_gguf(tmp_path / "cut.gguf", cfg, model, qtype)
  data = path.read_bytes()
  cut = {"all_but_3": len(data) - 3, "half": len(data) // 2, "inside_header": 200}[keep]
  path.write_bytes(data[:cut])
  with pytest.raises(TruncatedModelError) as err:
    thoughtjax.load(str(path), compile_cache=False)
  message = str(err.value)
  assert str(path) in message and "truncated" in message and "thoughtjax fetch --force" in message
  if keep != "inside_header":
    assert f"expected {len(data)} bytes" in message and f"got {cut} bytes" in message
  assert isinstance(err.value, UserError)


def test_loader_errors_are_user_errors():
  from thoughtjax.fetch import FetchError
  from thoughtjax.sources.errors import ModelNotFoundError, WeightCacheError
  from thoughtjax.weights import MissingTensorError, TensorShapeError

  for cls in (
    UnsupportedModelError,
    FetchError,
    MissingTensorError,
    TensorShapeError,
    ModelNotFoundError,
    TruncatedModelError,
    WeightCacheError,
  ):
    assert issubclass(cls, UserError), cls
  assert str(MissingTensorError("tensor 'x' is missing")) == "tensor 'x' is missing"  # no KeyError quotes


def test_safetensors_keeps_every_eos_id_and_generation_stops_on_each(tmp_path):
  cfg, model = tiny_model("llama_gqa")
  d = write_safetensors_dir(tmp_path / "m", cfg, model)
  raw = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(raw | {"eos_token_id": [2, 7]}))
  (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
  loaded = thoughtjax.load(str(d), compile_cache=False)
  assert loaded.codec.eos_ids == (2, 7, 11) and loaded.codec.eos_id == 2 and loaded.config.eos_id == 2
  prompt = [5, 9, 100]
  for eos in (7, 11):  # a bias makes the second (third) EOS id the greedy choice: generation ends on it
    out = loaded.generate(prompt, max_tokens=6, logit_bias={eos: 100.0})
    assert out.token_ids == [eos] and out.finish_reason == "stop"
  # Without the extra ids the same biased run goes on to max_tokens: the stop above came from eos_ids.
  (d / "config.json").write_text(json.dumps(raw | {"eos_token_id": 2}))
  (d / "generation_config.json").unlink()
  single = thoughtjax.load(str(d), compile_cache=False)
  assert single.codec.eos_ids == (2,)
  out = single.generate(prompt, max_tokens=3, logit_bias={7: 100.0})
  assert out.token_ids == [7, 7, 7] and out.finish_reason == "length"


def test_bad_eos_token_id_is_named(tmp_path):
  cfg, model = tiny_model("llama_gqa")
  d = write_safetensors_dir(tmp_path / "m", cfg, model)
  raw = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(raw | {"eos_token_id": [2, "</s>"]}))
  with pytest.raises(UnsupportedModelError, match=r"config\.json: eos_token_id holds '</s>'"):
    thoughtjax.load(str(d), compile_cache=False)


def test_codec_eos_ids_keep_single_id_callers_working():
  from tests.tiny import tiny_tokenizer
  from thoughtjax.sampling import SamplingParams, stop_ids_for
  from thoughtjax.tokenizer import TextCodec

  single = TextCodec(tiny_tokenizer(), None, 1, 2)
  assert single.eos_id == 2 and single.eos_ids == (2,)
  several = TextCodec(tiny_tokenizer(), None, 1, 2, eos_ids=(2, 7, 2, 9))
  assert several.eos_id == 2 and several.eos_ids == (2, 7, 9)
  assert TextCodec(tiny_tokenizer(), None, 1, None, eos_ids=[7, 9]).eos_id == 7
  assert TextCodec(tiny_tokenizer(), None, 1, None).eos_ids == ()
  p = SamplingParams(stop_token_ids=(9, 4))
  assert stop_ids_for(p, 2) == [9, 4, 2]
  assert stop_ids_for(p, several.eos_ids) == [9, 4, 2, 7]
  assert stop_ids_for(p, None) == [9, 4]
  assert stop_ids_for(SamplingParams(ignore_eos=True), several.eos_ids) == []


def test_gguf_end_of_turn_ids_join_eos_ids(tmp_path, monkeypatch):
  import gguf

  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  path = _write_gguf_with(
    tmp_path / "eot.gguf", cfg, model, kv=[("tokenizer.ggml.eot_token_id", 7, gguf.GGUFValueType.UINT32)]
  )
  assert load_tensors(path)[2].eos_ids == (2, 7)
  assert load_tensors(path)[2].eos_ids == (2, 7)  # the second load comes from the weight cache

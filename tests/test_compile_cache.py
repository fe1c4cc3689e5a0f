"""The persistent compilation cache: a second process running the same program compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tiny import tiny_model, write_safetensors_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  cfg, model = tiny_model("llama_gqa", seed=2)
  return write_safetensors_dir(tmp_path_factory.mktemp("tiny") / "model", cfg, model)


_CACHE_PROBE = """
import sys, jax
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
import thoughtjax
m = thoughtjax.load(sys.argv[1])
m.generate([5, 6, 7], max_tokens=4)
print("HITS", len(hits))
"""


def test_second_process_hits_the_persistent_compile_cache(tiny_dir, tmp_path):
  env = {**os.environ, "THOUGHTJAX_CACHE": str(tmp_path)}
  runs = [
    subprocess.run(
      [sys.executable, "-c", _CACHE_PROBE, str(tiny_dir)], capture_output=True, text=True, env=env, timeout=600
    )
    for _ in range(2)
  ]
  for r in runs:
    assert r.returncode == 0, r.stderr
  first, second = (int(r.stdout.split("HITS")[1]) for r in runs)
  assert first == 0 and second >= 1
  assert any((tmp_path / "xla").iterdir())


_EXPORT_PROBE = """
import sys, json
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
import thoughtjax
from thoughtjax import exported
m = thoughtjax.load(sys.argv[1])
c = m.generate([5, 6, 7], max_tokens=6, ignore_eos=True)
print(json.dumps({"stats": dict(exported.EXPORT_STATS), "hits": len(hits), "tokens": c.token_ids}))
"""


def test_second_process_loads_the_exported_program_and_its_compiled_executable(tiny_dir, tmp_path):
  env = {**os.environ, "THOUGHTJAX_CACHE": str(tmp_path)}
  out = []
  for _ in range(2):
    r = subprocess.run(
      [sys.executable, "-c", _EXPORT_PROBE, str(tiny_dir)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr
    out.append(json.loads(r.stdout.strip().splitlines()[-1]))
  first, second = out
  assert first["stats"] == {"exported": 1}
  assert second["stats"] == {"loaded": 1} and second["hits"] >= 1
  assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 6
  assert len(list((tmp_path / "exported").glob("*.jaxexp"))) == 1

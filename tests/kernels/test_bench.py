"""``thoughtjax bench kernels`` runs end to end on tiny shapes and writes its JSON.

Behaviour only: which rows exist and that outputs agree; never how fast.
"""

import json

import jax

from thoughtjax.kernels import bench


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
  assert all(r["agrees_with_reference"] for r in timed)
  assert all(r["gbps"] > 0 and r["bytes"] > 0 for r in timed)
  if jax.default_backend() != "gpu":
    interpreted = [r for r in rows if r["implementation"] == "pallas (interpret)"]
    assert interpreted and all(r["shape"].startswith("B=1 ") for r in interpreted)
    assert any("interpreted" in note for note in report["notes"])
    assert all(r["note"].startswith("skipped") for r in rows if r["implementation"] == "cuda")
  assert "sample_stop" in capsys.readouterr().out


def test_peak_table_matches_device_names():
  assert bench.table_peak_gbps("NVIDIA H200") == 4800.0
  assert bench.table_peak_gbps("NVIDIA GH200 480GB") == 4000.0
  assert bench.table_peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
  assert bench.table_peak_gbps("NVIDIA H100 PCIe") == 2000.0
  assert bench.table_peak_gbps("cpu") is None

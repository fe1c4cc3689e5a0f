"""``thoughtjax bench decode --startup --quick`` per weight form on a tiny quantized GGUF: a fresh ``generate``
process per form, cold then warm on the caches the cold one filled, each with its peak RSS in the table and the
JSON (the figures are not asserted: tests never judge timings or the host's memory)."""

from __future__ import annotations

import json

from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax import loading
from thoughtjax.cli import main
from thoughtjax.transformer import init_random


def test_bench_decode_startup_quick_reports_each_weight_form(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg = TINY_CONFIGS["llama_gqa"]
  gguf = write_gguf(tmp_path / "tiny.gguf", cfg, init_random(cfg, 3, scale=0.08), "Q4_1")
  out = tmp_path / "startup.json"
  argv = ["bench", "decode", "--startup", "--quick", "--weights", "native,f32", "--model", str(gguf)]
  code = main([*argv, "--json", str(out)])
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["quick"] and list(d["forms"]) == ["native", "f32"]
  for form in d["forms"].values():
    assert len(form["cold_runs_s"]) == len(form["warm_runs_s"]) == len(form["peak_rss_runs_mb"]) == 1
    assert form["process_peak_rss_mb"] > 0 and form["process_peak_rss_cold_mb"] > 0
  assert d["process_peak_rss_mb"] == d["forms"]["native"]["process_peak_rss_mb"]  # the first form's, as before
  assert "peak RSS of a warm process" in printed and "native" in printed and "f32" in printed
  # Quick runs use temporary caches only: the user's compile cache stays empty, while each form's weight
  # cache entry was written once by its cold process.
  assert not (tmp_path / "cache" / "xla").exists() or not any((tmp_path / "cache" / "xla").iterdir())
  entries = {p.name.split("-", 1)[1] for p in (tmp_path / "cache" / "weights").glob("*-v*")}
  assert entries == {f"native-v{loading._NATIVE_FORMAT}", f"v{loading._CACHE_FORMAT}"}

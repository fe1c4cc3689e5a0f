"""``thoughtjax bench decode --startup`` on a tiny model: fresh processes, cold and warm, one table and its JSON
(numbers are not asserted: tests never judge timings)."""

from __future__ import annotations

import json

from tests.tiny import tiny_model, write_safetensors_dir
from thoughtjax.cli import main


def test_bench_decode_startup_runs_fresh_processes(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa", seed=4)
  tiny = write_safetensors_dir(tmp_path / "tiny", cfg, model)
  out = tmp_path / "startup.json"
  code = main(["bench", "decode", "--startup", "--repeats", "1", "--model", str(tiny), "--json", str(out)])
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["process_first_token_cold_s"] > 0 and d["process_first_token_warm_s"] > 0
  assert len(d["cold_runs_s"]) == len(d["warm_runs_s"]) == 1 and d["process_peak_rss_mb"] > 0
  assert "empty compile cache" in printed and "warm caches" in printed
  # The warm runs used the user's compile cache; the cold ones their own, removed afterwards.
  assert any((tmp_path / "cache" / "xla").iterdir())

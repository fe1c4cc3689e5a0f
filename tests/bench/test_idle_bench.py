"""``thoughtjax bench idle`` on the tiny calibrated registry: a real ``thoughtjax serve`` subprocess with a short
idle time releases its path and answers again; the JSON holds the named fields (numbers are not judged: tests
never assert on timings)."""

from __future__ import annotations

import json

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.cli import main


def test_bench_idle_measures_a_release_and_the_way_back(tmp_path, capsys):
  out = tmp_path / "idle.json"
  args = ["bench", "idle", "--registry", str(tiny_setup().registry), "--idle", "0.2", "--warm", "1", "--cycles", "1"]
  assert main([*args, "--max-tokens", "4", "--timeout", "300", "--json", str(out)]) == 0
  printed, _ = capsys.readouterr()
  d = json.loads(out.read_text())
  assert d["idle_release_s"] == 0.2 and d["hints"] == ["general_purpose"]
  assert d["cold"]["tokens"] >= 1 and d["warm"][0]["tokens"] >= 1
  (cycle,) = d["cycles"]
  assert cycle["resident_paths"] == 0  # scaled to zero
  assert cycle["after_idle"]["tokens"] >= 1 and cycle["rss_released_mib"] > 0
  s = d["summary"]
  for key in ("rss_baseline_mib", "rss_warm_mib", "rss_released_mib_max", "warm_ttft_ms", "after_idle_ttft_ms_max"):
    assert s[key] > 0
  assert isinstance(s["rss_target_met"], bool) and isinstance(s["ttft_target_met"], bool)
  assert "scale to zero and back" in printed

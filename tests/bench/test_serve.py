"""``thoughtjax bench serve --quick`` on the tiny calibrated registry: every section runs, on loopback, and the JSON
holds the named fields (numbers are not asserted: tests never judge timings)."""

from __future__ import annotations

import json

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.cli import main


def test_bench_serve_quick_writes_every_section(tmp_path, capsys):
  out = tmp_path / "serve.json"
  args = ["bench", "serve", "--registry", str(tiny_setup().registry), "--quick", "--slots", "4"]
  code = main([*args, "--concurrency", "1,4,8", "--soak", "1", "--json", str(out)])
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["quick"] is True and d["path"].startswith("embed, blocks[0:2)") and d["max_tokens"] == 8 and d["slots"] == 4

  levels = d["levels"]
  assert [r["streams"] for r in levels] == [1, 4, 8]
  for r in levels:
    assert r["errors"] == 0 and r["requests"] == r["streams"]  # one round per client
    assert r["tokens"] == r["requests"] * 8  # EOS suppressed: every stream decodes max_tokens
    assert r["tok_s"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert r["prefilled"] == r["requests"] and 1 <= r["prefill_calls"] <= r["requests"] and r["decode_chunks"] >= 1
  s = d["static_batch8"]
  assert s["batch"] == 8 and s["tokens"] == 64 and s["tok_s"] > 0
  assert d["ratio_8_streams_to_static_batch8"] > 0 and d["ttft_p50_8_over_1"] > 0

  c = d["cancellation"]
  assert c["cancelled"] == c["recorded"] == 2 and c["chunks_between_max"] <= 1 and c["cancel_to_free_ms_max"] >= 0

  soak = d["soak"]
  assert soak["errors"] == 0 and soak["requests"] >= 16 and soak["rss_end_mib"] > 0
  sched = d["scheduler"]
  assert sched["scheduler"] == "continuous" and sched["engines"] == 1 and sched["slots_in_use"] == 0
  for title in ("gRPC streams on loopback", "static batch 8", "cancellation", "soak: 16 streams"):
    assert title in printed

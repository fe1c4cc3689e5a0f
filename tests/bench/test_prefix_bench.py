"""``thoughtjax bench prefix`` on a tiny chat model: the measured pass misses once, then reuses the system prompt,
every output equals the engine's without the cache, the table and the JSON report come out (no timing asserted)."""

from __future__ import annotations

import json

from tests.tiny import tiny_engine
from thoughtjax.bench import prefix


def test_the_measured_pass_reuses_the_system_prompt_and_outputs_are_equal():
  model = tiny_engine("llama_gqa", seed=7, chat=True, chunk=4)
  res = prefix.run(model, requests=3, system_tokens=40, max_tokens=4, block_tokens=16, cache_len=256)
  assert res["identical_outputs"] == 3 and res["hits"] == 2 and res["tokens_reused"] >= 2 * 32
  assert res["compiled_requests"] == {"without": 0, "with": 0}
  assert len(res["ttft_s"]["with"]) == 3 and res["ratio_with_over_without"] > 0


def test_the_command_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
  model = tiny_engine("llama_gqa", seed=7, chat=True, chunk=4)
  monkeypatch.setattr("thoughtjax.load", lambda *a, **k: model)
  out = tmp_path / "prefix.json"
  argv = ["--requests", "2", "--system-tokens", "20", "--max-tokens", "2", "--cache-len", "256", "--json", str(out)]
  assert prefix.main(argv) == 0
  text = capsys.readouterr().out
  assert "median TTFT ms" in text and "ratio with/without" in text and "identical outputs 2/2" in text
  report = json.loads(out.read_text())
  assert report["requests"] == 2 and set(report["median_ttft_s"]) == {"without", "with"}

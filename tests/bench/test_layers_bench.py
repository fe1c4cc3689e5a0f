"""``thoughtjax bench layers`` on a tiny GGUF: both layouts compile in processes of their own into empty caches,
every figure is measured for both (the plain programs and a slot engine), the tables and the JSON report come out
(no timing asserted)."""

from __future__ import annotations

import json

from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax.bench import layers
from thoughtjax.transformer import init_random


def test_both_layouts_are_measured_and_reported(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg = TINY_CONFIGS["llama_gqa"]
  gguf = write_gguf(tmp_path / "tiny.gguf", cfg, init_random(cfg, 1, scale=0.08))
  out = tmp_path / "layers.json"
  argv = ["--model", str(gguf), "--new-tokens", "4", "--prompt-tokens", "20", "--repeats", "1"]
  assert layers.main([*argv, "--startup-runs", "1", "--slots", "2", "--ring", "64", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "decode b1" in text and "indexed / unrolled" in text and "slot engine, indexed / unrolled: warm" in text
  report = json.loads(out.read_text())
  for name in layers.LAYOUTS:
    assert all(s > 0 for s in report["compile_s"][name].values()) and report["executable_cache_bytes"][name] > 0
    assert all(len(v) == 1 and v[0] > 0 for v in report["rates"][name].values())
    assert len(report["startup_first_token_s"][name]) == 1 and report["startup_first_token_s"][name][0] > 0
    # The start-up process found its programs in the cache the compile process filled, and loaded them.
    (load,) = report["startup_executable_load_s"][name]
    assert 0 < load <= report["startup_first_token_s"][name][0]
  assert report["prompt_tokens"] == 20
  assert (report["slots"], report["ring"]) == (2, 64)
  for name, engine in report["slot_engine"].items():  # each child ran an engine in the layout it was given
    assert engine["layout"] == name and engine["warm_s"] > 0 and len(engine["step_ms"]) == 1
    assert 0 < engine["rss_before_mib"] <= engine["peak_rss_mib"] and engine["step_ms"][0] > 0
    assert len(engine["prefill_chunk_ms"]) == 1 and engine["prefill_chunk_ms"][0] > 0
    assert 0 < engine["prefill_chunk_tokens"] <= 64

"""``thoughtjax bench speculative --quick`` on a tiny model: every section runs, the greedy tokens are identical
to plain decoding, and the JSON holds the named fields (numbers are not asserted: tests never judge timings)."""

from __future__ import annotations

import json
import math

from tests.tiny import tiny_model, write_safetensors_dir
from thoughtjax.cli import main


def test_bench_speculative_quick_writes_every_section(tmp_path, capsys):
  cfg, model = tiny_model("llama_gqa", seed=2)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  out = tmp_path / "speculative.json"
  code = main(["bench", "speculative", "--model", str(directory), "--quick", "--heal-steps", "2", "--json", str(out)])
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["quick"] is True and d["depths"] == [2] and d["draft_tokens"] == [2] and d["batch"] == 2
  assert d["identical"] is True
  assert d["plain"]["tok_s_b1"] > 0 and d["plain"]["tok_s_bn"] > 0 and d["plain"]["ms_per_step"] > 0
  drafts = {(r["draft"], r["k"]): r for r in d["drafts"]}
  assert set(drafts) == {("exit 2", 2), ("exit 2 + bridge", 2), ("int8 blocks[0:3)", 2), ("ngram:3", 2)}
  for r in d["drafts"]:
    assert r["identical"] is True and 0 <= r["acceptance"] <= 1
    assert 1 <= r["tokens_per_pass"] <= r["k"] + 1 and r["tok_s_b1"] > 0 and r["tok_s_bn"] > 0
    assert math.isclose(r["speedup_b1"], r["tok_s_b1"] / d["plain"]["tok_s_b1"])
    # Only an n-gram draft takes plain steps (iterations without a match); its ms per pass is estimated.
    assert r["plain_steps"] >= 0 and (
      r["draft"].startswith("ngram") or (r["plain_steps"] == 0 and r["ms_per_pass"] > 0)
    )
    weights = "none" if r["draft"].startswith("ngram") else "int8" if "int8" in r["draft"] else "f32"
    assert r["bridge"] == ("bridge" in r["draft"]) and r["weights"] == weights
  assert "healed here: 2 steps" in drafts[("exit 2 + bridge", 2)]["origin"]
  assert d["reuse"]["identical"] is True and d["reuse"]["tok_s_recompute"] > 0 and d["reuse"]["tok_s_reuse"] > 0
  for title in ("plain decode", "self-speculative decoding", "saved residual", "identical to plain decoding: yes"):
    assert title in printed


def test_bench_speculative_refuses_depths_outside_the_model(tmp_path, capsys):
  cfg, model = tiny_model("llama_gqa", seed=2)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  assert main(["bench", "speculative", "--model", str(directory), "--quick", "--depths", "1,7"]) == 2
  err = capsys.readouterr().err
  assert "--depths [7]" in err and "0..2" in err


def test_bench_speculative_ngram_alone_on_repeating_text(tmp_path, capsys):
  cfg, model = tiny_model("llama_gqa", seed=2)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  out = tmp_path / "speculative.json"
  argv = ["bench", "speculative", "--model", str(directory), "--quick", "--no-exits", "--no-int8", "--ngram", "1,2:2"]
  assert main([*argv, "--text", "repeating", "--json", str(out)]) == 0
  d = json.loads(out.read_text())
  assert d["text"] == "repeating" and d["identical"] is True and d["reuse"] is None
  assert [(r["draft"], r["weights"]) for r in d["drafts"]] == [("ngram:1", "none"), ("ngram:2:2", "none")]
  assert "saved residual" not in capsys.readouterr()[0]

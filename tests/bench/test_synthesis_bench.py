"""``thoughtjax bench synthesis --quick`` on the tiny calibrated registry: every section runs and the JSON
holds the named fields (numbers are not asserted: tests never judge timings)."""

from __future__ import annotations

import json
import math

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.cli import main


def test_bench_synthesis_quick_writes_every_section(tmp_path, capsys):
  out = tmp_path / "synthesis.json"
  code = main(
    [
      "bench",
      "synthesis",
      "--registry",
      str(tiny_setup().registry),
      "--quick",
      "--requests",
      "4",
      "--calibrate",
      "--json",
      str(out),
    ]
  )
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["quick"] is True and d["hints"] == ["fast_draft", "general_purpose"]

  o = d["overhead"]
  assert o["calls"] == 200 and 0 < o["p50_ms"] <= o["p99_ms"]

  p = d["prediction"]
  assert p["requests"] == len(p["rows"]) == 4
  assert {"median_rel_error", "p90_rel_error", "fits", "fits_within_budget"} <= set(p)
  for row in p["rows"]:
    assert 10 <= row["prompt_tokens"] <= 40 and 8 <= row["max_tokens"] <= 12
    assert row["tokens_out"] == row["max_tokens"] and row["actual_ms"] > 0  # EOS ignored: every token decoded
    assert row["rel_error"] == abs(row["predicted_ms"] - row["actual_ms"]) / row["actual_ms"]
  assert p["fits"] == sum(not r["degraded"] for r in p["rows"])

  rows = d["per_hint"]
  assert {(r["hint"], r["budget"]) for r in rows} == {(h, b) for h in d["hints"] for b in ("full", "generous", "tight")}
  for r in rows:
    assert r["tok_s"] > 0 and (r["budget"] == "full") == (r["predicted_ms"] is None)
    if r["budget"] == "full":
      assert r["path"] == "embed, blocks[0:6), head" and r["top1_heldout"] == 1.0

  r = d["router"]
  assert r["source"] == "trained here (none stored)" and r["n_heldout"] > 0
  assert 0 <= r["accuracy"] <= 1 and len(r["confusion"]) == len(r["labels"]) == len(r["precision"])
  assert sum(map(sum, r["confusion"])) == r["n_heldout"] and r["predict_ms_p50"] > 0

  r = d["load"]
  assert r["streams"] == 2 and r["budget_ms"] > 0 and r["tokens"] == 8
  assert [(x["when"], x["hint"]) for x in r["plans"]] == [(w, h) for w in ("idle", "load") for h in d["hints"]]
  for x in r["plans"]:
    assert x["wall_ms"] > 0 and x["predicted_ms"] > 0 and x["reason"]
  assert [x["path"] for x in r["forced"]] == ["embed, blocks[0:6), head"] * 2  # no weight variant in this registry
  assert all(x["wall_ms"] > 0 and x["idle_wall_ms"] > 0 for x in r["forced"]) and 0 <= r["moved_by_load"] <= 2

  r = d["streams"]
  assert (r["streams"], r["hint"], r["tokens"], r["weights"]) == (2, "fast_draft", 8, "f32") and r["budget_ms"] > 0
  for mode, rounds in r["rounds"].items():
    assert len(rounds) == 1 and r["tok_s"][mode] == rounds[0]["tok_s"] > 0
    assert rounds[0]["tokens"] == 2 * 8 and sum(rounds[0]["plans"].values()) == 2  # EOS ignored: every token
  assert set(r["rounds"]) == {"synthesized", "full"}  # no weight variant in this registry
  assert r["rounds"]["full"][0]["plans"] == {"explicit: embed, blocks[0:6), head": 2}
  assert r["ratio"] == {"synthesized": r["tok_s"]["synthesized"] / r["tok_s"]["full"]}

  c = d["calibrate"]
  assert c["wall_s"] > 0 and c["candidates"] >= 2 and not math.isnan(c["wall_s"])
  for title in (
    "GetOptimalPath overhead",
    "prediction over 4 warm requests",
    "per hint",
    "router",
    "calibrate",
    "idle and under load",
    "each path forced under the same load",
    "concurrent fast_draft streams through the server",
  ):
    assert title in printed, title

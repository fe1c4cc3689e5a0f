"""``thoughtjax bench startup`` on the tiny calibrated registry: every command row in-process and through the server
the benchmark starts, each answer checked to come from where its row says (numbers are not asserted: tests never
judge timings)."""

from __future__ import annotations

import json

import pytest

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax import local_server
from thoughtjax.cli import main


def test_bench_startup_times_each_command_both_ways_and_leaves_no_server(tmp_path, capsys, monkeypatch):
  monkeypatch.delenv(local_server.NO_SERVER_ENV, raising=False)  # the benchmark's own commands use its server
  out = tmp_path / "startup.json"
  registry = str(tiny_setup().registry)
  assert (
    main(["bench", "startup", "--registry", registry, "--repeats", "1", "--max-tokens", "2", "--json", str(out)]) == 0
  )
  printed = capsys.readouterr().out
  d = json.loads(out.read_text())
  names = [r["name"] for r in d["rows"]]
  assert names == [
    "import thoughtjax",
    "thoughtjax --help",
    "generate (in-process)",
    "synthesize (in-process)",
    "generate (server)",
    "synthesize (server)",
  ]
  for r in d["rows"]:
    assert len(r["runs"]) == 1 and r["median_s"] > 0 and r["peak_rss_mib"] > 0 and r["name"] in printed
  assert set(d["targets_met"]) == {
    "generate (in-process)",
    "generate (server)",
    "synthesize (in-process)",
    "generate peak RSS <= 0.6 GB",
  }
  assert d["server"] and d["server"] not in {a.target for a in local_server.announcements()}  # stopped, withdrawn


def test_bench_startup_refuses_nonsense():
  with pytest.raises(SystemExit):
    main(["bench", "startup", "--repeats", "0"])

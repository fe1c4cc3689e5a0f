"""``thoughtjax bench soak`` on the tiny registry, briefly: every group of clients is answered and counted, the
half-open sockets are accounted for, and the summary says whether the users noticed."""

from __future__ import annotations

import json

import pytest

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.cli import main


@pytest.mark.slow
def test_bench_soak_answers_every_client_and_reports_each_group(tmp_path, capsys):
  out = tmp_path / "soak.json"
  args = ["bench", "soak", "--registry", str(tiny_setup().registry), "--seconds", "4", "--streams", "2"]
  args += ["--sockets", "300", "--hostile", "12", "--slots", "4", "--max-tokens", "8", "--timeout", "300"]
  assert main([*args, "--json", str(out)]) == 0
  printed, _ = capsys.readouterr()
  d = json.loads(out.read_text())
  s = d["summary"]
  assert s["user_streams_ok"] >= 2 and s["user_streams_failed"] == 0, d["users"]
  assert sum(d["attackers"].values()) >= 12 and s["internal_or_unknown"] == 0, d["attackers"]
  assert set(d["attackers"]) <= {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, d["attackers"]
  assert d["health"].get("SERVING", 0) >= 1 and s["health_serving_share"] == 1.0, d["health"]
  # Each held socket is accounted for: answered 503 past the HTTP connection cap, closed, or still open.
  assert 0 < d["sockets_opened"] <= 300
  assert d["sockets_opened"] == d["sockets_refused_503"] + d["sockets_closed"] + d["sockets_open_at_end"]
  assert s["user_stream_s_alone"] > 0 and s["user_stream_s_max"] >= s["user_stream_s_p50"] > 0
  assert d["clients_stuck"] == 0 and d["after_finish_reason"]
  assert d["rss_mib"]["before"] > 0 and len(d["rss_series"]) >= 4
  half = next(r for t, r in d["rss_series"] if t >= d["seconds"] / 2)
  assert s["rss_growth_second_half_mib"] == d["rss_series"][-1][1] - half
  assert "soak:" in printed and "INTERNAL or UNKNOWN answers" in printed

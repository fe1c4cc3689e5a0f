"""``thoughtjax bench serve --peer llama-server`` end to end on the tiny calibrated registry, with a stub
llama-server (tests/bench/stub_llama_server.py): thoughtjax serve runs as its own process with its default
config, both servers get the same requests through the same streaming client, and the table, the JSON and the
plot hold every field. A missing peer binary, one that dies at start, and options that belong to the other mode
are named one-line errors. Timings are never judged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.synthesis.tiny_synthesis import tiny_setup
from thoughtjax.bench import serve_peer
from thoughtjax.bench.serve_peer import MIX, Outcome, PromptSet, summarize
from thoughtjax.cli import main

CELL_FIELDS = {
  "max_tokens",
  "users",
  "requests",
  "ok",
  "completion_tokens",
  "tokens_per_request",
  "wall_s",
  "tok_s",
  "ttft_p50_ms",
  "ttft_p95_ms",
  "e2e_p50_ms",
  "e2e_p95_ms",
  "ttft_le_1s_share",
  "errors",
  "error_kinds",
  "mix",
  "prompt_tokens_mean",
  "peak_rss_mib",
  "outcomes",
}


def peer_args(stub, gguf: Path, *extra: str) -> list[str]:
  reg = str(tiny_setup().registry)
  head = ["bench", "serve", "--peer", "llama-server", "--llama-server", str(stub), "--registry", reg]
  return head + ["--gguf", str(gguf), "--quick", *extra]


def test_both_servers_get_the_same_requests_and_every_field_is_reported(tmp_path, stub_llama_server, capsys):
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"GGUF")
  out, png = tmp_path / "peer.json", tmp_path / "peer.png"
  argv = peer_args(stub_llama_server, gguf, "--levels", "1,2", "--max-tokens", "3,5", "--json", str(out))
  assert main(argv + ["--plot", str(png)]) == 0
  printed = capsys.readouterr().out
  assert "OpenAI-compatible streaming, closed-loop users" in printed and "thoughtjax / llama-server" in printed
  d = json.loads(out.read_text())
  assert d["levels"] == [1, 2] and d["max_tokens"] == [3, 5] and d["requests_per_user"] == 1 and d["seconds"] == 0
  assert d["eos_ids_biased"] == [2] and d["mix"] == {"short": 0.3, "medium": 0.5, "long": 0.2}
  for name in ("thoughtjax", "llama-server"):
    s = d["servers"][name]
    assert (
      s["warmup_errors"] == 0
      and s["warmup_error_kinds"] == {}
      and s["warmup_requests"] == 3 * 2 + 2 * 2
      and s["peak_rss_hwm_mib"] > 0
    )
    assert [(c["max_tokens"], c["users"]) for c in s["cells"]] == [(3, 1), (3, 2), (5, 1), (5, 2)]
    for c in s["cells"]:
      assert set(c) == CELL_FIELDS
      assert c["errors"] == 0 and c["requests"] == c["ok"] == c["users"]  # seconds 0: one request per user
      assert c["completion_tokens"] == c["requests"] * c["max_tokens"]  # end of sequence suppressed on both
      assert c["tok_s"] > 0 and c["ttft_p50_ms"] <= c["ttft_p95_ms"] <= c["e2e_p95_ms"]
      assert 0 <= c["ttft_le_1s_share"] <= 1 and c["peak_rss_mib"] > 0
      assert all(o["chunks"] >= 1 and o["error"] is None for o in c["outcomes"])
  assert d["servers"]["thoughtjax"]["config"].startswith("default")
  assert d["servers"]["thoughtjax"]["argv"][-6:] == ["--port", "0", "--http-port", "0", "--registry", d["registry"]]
  assert [(r["max_tokens"], r["users"]) for r in d["ratios"]] == [(3, 1), (3, 2), (5, 1), (5, 2)]
  assert all(r["tok_s"] > 0 and r["ttft_p95"] > 0 for r in d["ratios"])
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  peer = d["servers"]["llama-server"]
  started = json.loads(Path(f"{gguf}.argv.json").read_text())
  assert started == peer["argv"][1:] and started[started.index("-m") + 1] == str(gguf)
  assert started[started.index("--parallel") + 1] == "2" and peer["parallel"] == 2
  assert int(started[started.index("-c") + 1]) == 2 * peer["context_per_slot"] and "--jinja" in started
  sent = [json.loads(x) for x in Path(f"{gguf}.requests").read_text().splitlines()]
  for body in sent:
    assert body["temperature"] == 0.0 and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["logit_bias"] == {"2": -100.0} and body["max_tokens"] in (3, 5)
  asked = [b["messages"][0]["content"] for b in sent]
  prompts = PromptSet(quick=True)
  measured = [prompts.prompt(cell, k)[1] for cell, users in enumerate([1, 2, 1, 2]) for k in range(users)]
  assert sorted(asked[-6:]) == sorted(measured)  # the levels' prompts, after the warm-up's
  assert len(set(asked)) == len(asked)  # each request its own prompt


def test_a_missing_peer_binary_is_a_one_line_error_before_anything_starts(tmp_path, capsys):
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"GGUF")
  assert main(peer_args(tmp_path / "nowhere" / "llama-server", gguf)) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and "LlamaServerError" in err and "not found" in err and "--llama-server" in err


def test_a_peer_that_dies_at_start_is_a_one_line_error_quoting_it(tmp_path, capsys):
  stub = tmp_path / "llama-server"
  stub.write_text(
    f"#!{sys.executable}\nimport sys\nprint('loading')\nprint('error: failed to load model')\nsys.exit(1)\n"
  )
  stub.chmod(0o755)
  gguf = tmp_path / "model.gguf"
  gguf.write_bytes(b"GGUF")
  out = tmp_path / "peer.json"
  assert main(peer_args(stub, gguf, "--levels", "1", "--json", str(out))) == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert err.startswith("thoughtjax bench serve: error: LlamaServerError:") or "LlamaServerError" in err
  assert "exited with 1 while starting" in err and "loading | error: failed to load model" in err
  assert not out.exists()


def test_a_thoughtjax_serve_that_dies_at_start_is_a_named_error_quoting_it(tmp_path):
  with pytest.raises(serve_peer.PeerBenchError, match="thoughtjax serve exited with 2 while starting") as e:
    with serve_peer.ThoughtjaxServe(str(tmp_path / "no-registry")):
      pass
  assert "no-registry" in str(e.value) and "\n" not in str(e.value)


def test_a_thoughtjax_serve_whose_warm_up_failed_is_a_named_error_at_once_not_a_wait_for_the_deadline():
  import os
  import sys

  server = serve_peer.ThoughtjaxServe(None)
  server.argv = [
    sys.executable,
    "-c",
    "import time; print('openai http on http://127.0.0.1:9/v1'); print('ERROR:thoughtjax.server:warming failed, "
    "health stays NOT_SERVING: ValueError: bad warm', flush=True); time.sleep(600)",
  ]
  with pytest.raises(serve_peer.PeerBenchError, match="will not become ready.*ValueError: bad warm"):
    with server:
      pass
  with pytest.raises(ProcessLookupError):  # stopped and reaped, not left running
    os.kill(server.pid, 0)


def test_a_missing_gguf_and_a_registry_without_one_are_named_errors(tmp_path, stub_llama_server, capsys):
  assert main(peer_args(stub_llama_server, tmp_path / "absent.gguf")) == 2
  assert "PeerBenchError: --gguf" in capsys.readouterr().err
  argv = peer_args(stub_llama_server, tmp_path / "x.gguf")
  i = argv.index("--gguf")
  assert main(argv[:i] + argv[i + 2 :]) == 2
  assert "--registry needs --gguf FILE" in capsys.readouterr().err


def test_a_server_config_reaches_thoughtjax_serve_and_a_missing_one_is_refused_before_anything_starts(
  tmp_path, stub_llama_server, capsys
):
  assert serve_peer.ThoughtjaxServe(None, tmp_path / "c.yaml").argv[-2:] == ["--config", str(tmp_path / "c.yaml")]
  assert "--config" not in serve_peer.ThoughtjaxServe(None).argv
  out = tmp_path / "out.json"
  argv = peer_args(stub_llama_server, tmp_path / "x.gguf", "--server-config", str(tmp_path / "absent.yaml"))
  assert main([*argv, "--json", str(out)]) == 2
  assert "PeerBenchError: --server-config" in capsys.readouterr().err
  assert not out.exists()


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--seconds", "5"], "--seconds: only with --peer llama-server"),
    (["--llama-server", "x"], "--llama-server: only with --peer llama-server"),
    (["--server-config", "x.yaml"], "--server-config: only with --peer llama-server"),
    (["--max-tokens", "32,128"], "--max-tokens: one number without --peer"),
    (["--peer", "llama-server", "--slots", "4"], "--slots: not with --peer"),
    (["--peer", "llama-server", "--soak", "3"], "--soak: not with --peer"),
    (["--peer", "llama-server", "--requests-per-user", "0"], "--requests-per-user: expected at least 1"),
    (["--levels", "1,0"], "expected a comma list of positive integers"),
  ],
)
def test_options_of_the_other_mode_are_refused_by_name(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    main(["bench", "serve", *argv])
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_prompt_mix_is_seeded_30_50_20_and_every_prompt_is_unique():
  prompts = PromptSet()
  drawn = [prompts.prompt(3, k) for k in range(3000)]
  assert drawn[:50] == [PromptSet().prompt(3, k) for k in range(50)]  # the same on every server
  shares = {kind: sum(d[0] == kind for d in drawn) / len(drawn) for kind, _ in MIX}
  assert shares == pytest.approx(dict(MIX), abs=0.03)
  assert len({d[1] for d in drawn}) == len(drawn) and all(
    d[1].startswith(f"Request 3-{k}: ") for k, d in enumerate(drawn)
  )
  words = {kind: np.mean([len(t.split()) for k, t in drawn if k == kind]) for kind, _ in MIX}
  assert words["short"] < words["medium"] < words["long"] <= len(prompts.longest().split())
  assert prompts.prompt(4, 0) != prompts.prompt(3, 0)  # levels do not repeat each other's prompts


def test_summary_counts_a_failed_request_as_an_error_and_not_within_one_second():
  rows = [
    Outcome("short", 0.0, ttft_s=0.2, e2e_s=1.0, prompt_tokens=20, completion_tokens=8),
    Outcome("long", 0.0, ttft_s=2.0, e2e_s=3.0, prompt_tokens=300, completion_tokens=8),
    Outcome("medium", 0.1, e2e_s=0.1, error="HTTP_429"),
  ]
  s = summarize(rows, wall=4.0)
  assert s["requests"] == 3 and s["ok"] == 2 and s["errors"] == 1 and s["error_kinds"] == {"HTTP_429": 1}
  assert s["completion_tokens"] == 16 and s["tok_s"] == 4.0 and s["ttft_le_1s_share"] == pytest.approx(1 / 3)
  assert s["mix"] == {"short": 1, "medium": 1, "long": 1} and s["prompt_tokens_mean"]["long"] == 300

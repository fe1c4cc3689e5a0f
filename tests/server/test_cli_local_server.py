"""``thoughtjax generate`` and ``synthesize`` through a running local ``thoughtjax serve`` (thoughtjax/local_server.py,
thoughtjax/cli/remote.py): found by its announcement, the same answer as in-process, in-process again when asked
(``--no-server``), when a flag needs it, when the server refuses, and once the server is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.server.conftest import wait_serving
from thoughtjax import local_server
from thoughtjax.assembly import full_path
from thoughtjax.cli import main


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_announcements_name_live_reachable_servers_only(tmp_path, monkeypatch):
  monkeypatch.delenv(local_server.TOKEN_ENV, raising=False)
  reg = tmp_path / "reg"
  reg.mkdir()
  mine = local_server.announce("127.0.0.1:5", reg, "embed, head", token=False, tls=False)
  assert oct(mine.stat().st_mode & 0o777) == "0o600"
  found = local_server.find(reg)
  assert found is not None and (found.pid, found.target, found.full_path) == (os.getpid(), "127.0.0.1:5", "embed, head")
  assert local_server.find(tmp_path / "another") is None  # a server of another registry is not this one's

  def forge(name: str, **fields) -> os.PathLike:
    d = {**found.to_json(), **fields}
    file = mine.with_name(f"{name}.json")
    file.write_text(json.dumps(d))
    return file

  local_server.withdraw(mine)
  gone = forge("gone", pid=_dead_pid())  # killed: it could not remove its own
  reused = forge("reused", started="1")  # a live process id, not the process that announced
  assert local_server.find(reg) is None and not gone.exists() and not reused.exists()

  tls, token = forge("tls", tls=True), forge("token", token=True)
  assert local_server.find(reg) is None  # TLS: no CA here; a token: none at hand
  monkeypatch.setenv(local_server.TOKEN_ENV, "x" * 16)
  assert local_server.find(reg).token
  forge("garbled").write_text("{not json")
  assert local_server.find(reg).token  # an unreadable announcement is skipped
  for f in (tls, token):
    local_server.withdraw(f)
  assert local_server.dial_address("0.0.0.0", 7) == "127.0.0.1:7" and local_server.dial_address("::", 7) == "[::1]:7"


@pytest.fixture
def served(tiny_registry, monkeypatch):
  monkeypatch.delenv(local_server.NO_SERVER_ENV, raising=False)
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "thoughtjax.cli",
      "serve",
      "--registry",
      str(tiny_registry.root),
      "--port",
      "0",
      "--no-http",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    line = proc.stdout.readline()
    assert line.startswith("serving on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
    target = line.split()[-1]
    assert wait_serving(target), "the server never reported SERVING"
    deadline = time.monotonic() + 60  # announced just after SERVING
    while not [a for a in local_server.announcements() if a.pid == proc.pid] and time.monotonic() < deadline:
      time.sleep(0.05)
    yield proc, target
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(60)
    proc.stdout.close()
    proc.stderr.close()


def _json(argv, capsys) -> tuple[dict, str]:
  assert main(argv) == 0
  out = capsys.readouterr()
  return json.loads(out.out), out.err


def test_generate_and_synthesize_use_the_running_server_and_answer_as_in_process(served, tiny_registry, capsys):
  proc, target = served
  (mine,) = [a for a in local_server.announcements() if a.pid == proc.pid]
  assert mine.target == target and mine.full_path == full_path(tiny_registry) and not mine.token

  gen = ["generate", "--registry", str(tiny_registry.root), "--prompt", "The quick brown fox", "--max-tokens", "6"]
  remote, _ = _json([*gen, "--json"], capsys)
  local, _ = _json([*gen, "--json", "--no-server"], capsys)
  assert remote["server"] == target and "server" not in local
  for k in ("prompt_ids", "token_ids", "text", "finish_reason"):
    assert remote[k] == local[k], k
  assert len(remote["token_ids"]) == 6
  assert "server" not in _json([*gen, "--json", "--kernels", "xla"], capsys)[0]  # a flag the server does not take
  # Sampling: the server's random stream is its engine's, so the seed's in-process text comes from in-process.
  assert "server" not in _json([*gen, "--json", "--temperature", "0.8", "--seed", "3"], capsys)[0]

  assert main(gen) == 0  # streamed text through the server too
  assert capsys.readouterr().out.strip() == local["text"].strip()

  syn = ["synthesize", "--registry", str(tiny_registry.root), "--prompt", "Once upon a time", "--max-latency-ms", "inf"]
  got, _ = _json([*syn, "--max-tokens", "4", "--json"], capsys)
  assert got["server"] == target and got["path"] and got["path_hash"] and got["tokens_out"] == len(got["token_ids"])
  assert got["finish_reason"] and set(got["actual_ms"]) >= {"total", "prefill", "decode"}
  # A refusal before the plan runs in-process, which gives the in-process answer or error.
  assert main([*syn, "--hint", "poetry_in_klingon"]) == 2
  err = capsys.readouterr().err
  assert "refused (INVALID_ARGUMENT); running in-process" in err and "poetry_in_klingon" in err

  proc.send_signal(signal.SIGTERM)
  assert proc.wait(120) == 0
  assert not [a for a in local_server.announcements() if a.pid == proc.pid]  # withdrawn on the way out
  assert "server" not in _json([*gen, "--json"], capsys)[0]


def test_a_server_that_does_not_answer_leaves_the_command_in_process(tiny_registry, monkeypatch, capsys):
  monkeypatch.delenv(local_server.NO_SERVER_ENV, raising=False)
  # This process, alive, announced on a port where nobody listens (a server that hangs up, or is draining).
  file = local_server.announce("127.0.0.1:1", tiny_registry.root, full_path(tiny_registry), token=False, tls=False)
  try:
    gen = ["generate", "--registry", str(tiny_registry.root), "--prompt", "Hello", "--max-tokens", "3", "--json"]
    out, err = _json(gen, capsys)
    assert "server" not in out and len(out["token_ids"]) == 3
    assert "the local server at 127.0.0.1:1 refused (UNAVAILABLE); running in-process" in err
  finally:
    local_server.withdraw(file)

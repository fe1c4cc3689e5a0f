"""``thoughtjax serve`` as a process over the tiny registry: ``thoughtjax client`` streams from it, and SIGTERM
drains it: a stream in flight finishes, then the process exits 0. ``--metrics-port`` serves its Prometheus
endpoint, ``--http-port`` the OpenAI-compatible one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import openai
import pytest

from tests.server.conftest import wait_serving
from thoughtjax.cli import main
from thoughtjax.client import Client


@pytest.fixture
def serve_process(tiny_registry):
  proc = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "from thoughtjax.cli import main; raise SystemExit(main())",
      "serve",
      "--registry",
      str(tiny_registry.root),
      "--port",
      "0",
      "--metrics-port",
      "0",
      "--http-port",
      "0",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=dict(os.environ),
  )
  try:
    line = proc.stdout.readline()  # blocks until the port is bound (or the process died)
    assert line.startswith("serving on 127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
    metrics = proc.stdout.readline()
    assert metrics.startswith("metrics on http://127.0.0.1:"), metrics
    openai_line = proc.stdout.readline()
    assert openai_line.startswith("openai http on http://127.0.0.1:") and openai_line.endswith("/v1\n"), openai_line
    target = line.split()[-1]
    assert wait_serving(target), "the server never reported SERVING"
    yield proc, target, metrics.split()[-1], openai_line.split()[-1]
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(60)
    proc.stdout.close()
    proc.stderr.close()


def test_client_streams_from_serve_and_sigterm_drains(serve_process, capsys):
  proc, target, metrics_url, openai_url = serve_process
  assert (
    main(
      [
        "client",
        "--target",
        target,
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "5",
        "--json",
        "--timeout",
        "120",
      ]
    )
    == 0
  )
  out = json.loads(capsys.readouterr().out)
  assert out["plan"]["path"] and out["final"]["usage"]["tokensOut"] >= 1
  assert out["trailer"]["tokens-out"] == str(out["final"]["usage"]["tokensOut"])
  with openai.OpenAI(base_url=openai_url, api_key="unused", max_retries=0) as oa:  # the same engines over HTTP
    model = oa.models.list().data[0].id
    got = oa.completions.create(model=model, prompt="The quick brown fox", max_tokens=5, temperature=0)
  assert (
    got.choices[0].text == out["final"]["text"] and got.usage.completion_tokens == out["final"]["usage"]["tokensOut"]
  )
  with urllib.request.urlopen(metrics_url, timeout=30) as r:  # the process's Prometheus endpoint
    text = r.read().decode()
  assert 'thoughtjax_requests_total{code="OK",method="Synthesize"} 1.0' in text
  assert 'thoughtjax_requests_total{code="OK",method="/v1/completions"} 1.0' in text
  assert main(["client", "--target", target, "--prompt", "x", "--hint", "poetry_in_klingon", "--timeout", "60"]) == 2
  assert "INVALID_ARGUMENT" in capsys.readouterr().err

  with Client(target, timeout=120) as c:
    assert c.health() == "SERVING"
    stream = c.synthesize("The quick brown fox", max_tokens=40, logit_bias={0: 50.0})
    assert next(stream).WhichOneof("kind") == "plan"
    proc.send_signal(signal.SIGTERM)
    rest = list(stream)
  assert rest[-1].final.finish_reason == "length" and rest[-1].final.usage.tokens_out == 40
  assert proc.wait(120) == 0


def test_the_server_predicts_in_its_slot_engines_context():
  """A continuous-batching server predicts with what its slot engines learned (the context its requests teach),
  never with a one-shot program's corrections; the simple scheduler runs each request as a plain program."""
  import types

  from thoughtjax.cli.serve import serving_context
  from thoughtjax.server.config import ServerConfig

  registry = types.SimpleNamespace(weights="native")
  ctx = serving_context(ServerConfig(max_concurrent=6), registry, "xla")
  assert (ctx.engine, ctx.weights, ctx.batch, ctx.kernels) == ("slots", "native", 6, "xla")
  assert serving_context(ServerConfig(scheduler="simple"), registry, "xla") is None


def test_serve_weights_opens_the_registry_in_that_form(tiny_registry, monkeypatch):
  """``serve --weights native`` restores the registry's blocks packed (the synthesizer it loads reads that form);
  a variant is not a restore form and is refused before anything starts."""
  import thoughtjax.server.app as app_mod

  got = {}

  async def fake_serve(_, config, *, load, **kw):
    got["synthesizer"] = load()

  monkeypatch.setattr(app_mod, "serve", fake_serve)
  assert main(["serve", "--registry", str(tiny_registry.root), "--weights", "native", "--port", "0"]) == 0
  assert got["synthesizer"].registry.weights == "native"
  with pytest.raises(SystemExit) as refused:
    main(["serve", "--registry", str(tiny_registry.root), "--weights", "int8a8"])
  assert refused.value.code == 2


def test_serve_takes_its_weight_form_from_the_config_file_or_its_variable(tiny_registry, monkeypatch, tmp_path, capsys):
  """``weights`` in the config file (or THOUGHTJAX_WEIGHTS over it, ``--weights`` over both) is the form the
  registry's restores take; a form that is not one is refused by the name of where it came from."""
  import thoughtjax.server.app as app_mod

  got = []

  async def fake_serve(_, config, *, load, **kw):
    got.append((config.weights, load().registry.weights))

  monkeypatch.setattr(app_mod, "serve", fake_serve)
  monkeypatch.delenv("THOUGHTJAX_WEIGHTS", raising=False)
  config = tmp_path / "native.yaml"
  config.write_text("weights: native\n")
  base = ["serve", "--registry", str(tiny_registry.root), "--port", "0"]
  assert main([*base, "--config", str(config)]) == 0
  monkeypatch.setenv("THOUGHTJAX_WEIGHTS", "f32")
  assert main([*base, "--config", str(config)]) == 0
  assert main([*base, "--config", str(config), "--weights", "native"]) == 0
  assert got == [("native", "native"), ("f32", "f32"), ("native", "native")]
  capsys.readouterr()
  monkeypatch.setenv("THOUGHTJAX_WEIGHTS", "int4")
  assert main(base) == 2
  assert "THOUGHTJAX_WEIGHTS: expected one of f32, native, got 'int4'" in capsys.readouterr().err
  monkeypatch.delenv("THOUGHTJAX_WEIGHTS")
  config.write_text("weights: int4\n")
  assert main([*base, "--config", str(config)]) == 2
  assert "weights: expected one of ['f32', 'native'], got 'int4'" in capsys.readouterr().err
  assert len(got) == 3

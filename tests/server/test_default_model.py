"""The server over the default model's registry (built and calibrated on first use), started as a user starts it:
the OpenAI client, curl and the gRPC client get answers from one process."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_serve_model_gguf_with_no_config_answers_the_openai_client_curl_and_grpc(tmp_path):
  """``thoughtjax serve --model <the default GGUF>``, no config file, as a llama-server user starts it: the official
  ``openai`` client and ``curl`` (with and without a Content-Type) get answers, fields the server does not use
  included; /health, /tokenize and /metrics answer on the same port; a gRPC chat request streams with its trace in
  the trailer."""
  import json
  import shutil
  import signal
  import subprocess
  import sys

  import openai

  from tests.server.conftest import wait_serving
  from thoughtjax import fetch as fetch_lib
  from thoughtjax.client import Client

  gguf = fetch_lib.fetch(fetch_lib.DEFAULT_MODEL, progress=False)
  argv = ["serve", "--model", str(gguf), "--port", "0", "--http-port", "0", "--parallel", "2"]
  log = open(tmp_path / "server.log", "w")
  proc = subprocess.Popen(
    [sys.executable, "-c", "from thoughtjax.cli import main; raise SystemExit(main())", *argv],
    stdout=subprocess.PIPE,
    stderr=log,
    text=True,
  )
  try:
    serving, http_line = proc.stdout.readline(), proc.stdout.readline()
    assert serving.startswith("serving on 127.0.0.1:"), (serving, (tmp_path / "server.log").read_text()[-2000:])
    assert http_line.startswith("openai http on http://127.0.0.1:") and http_line.endswith("/v1\n"), http_line
    base = http_line.split()[-1]
    assert wait_serving(serving.split()[-1], timeout=1200), (
      "the server never reported SERVING"
    )  # a Watch stream, not a poll
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600) as oa:
      (model,) = [m.id for m in oa.models.list().data]
      assert model == "SmolLM2-135M-Instruct.Q4_1"  # named after the file
      chat = oa.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1, "cache_prompt": True},
      )
      assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens >= 1
      assert chat.model_extra["thoughtjax"]["ignored_fields"] == ["cache_prompt", "min_p", "repetition_penalty"]
      chunks = list(oa.completions.create(model=model, prompt="The capital of France is", max_tokens=6, stream=True))
      assert "".join(c.choices[0].text for c in chunks if c.choices)

    curl = shutil.which("curl")
    if curl is None:
      pytest.skip("curl is not installed")
    root = base.removesuffix("/v1")
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "cache_prompt": True})

    def run_curl(*args: str) -> dict:
      out = subprocess.run([curl, "-sS", "--max-time", "600", *args], capture_output=True, text=True, check=True)
      return json.loads(out.stdout)

    for headers in ([], ["-H", "Content-Type: application/json"]):  # curl -d alone sends a form's type
      got = run_curl(f"{root}/v1/completions", *headers, "-d", body)
      assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] >= 1, got
    assert run_curl(f"{root}/health") == {"status": "ok"}
    tokens = run_curl(f"{root}/tokenize", "-d", json.dumps({"content": "Hello world"}))["tokens"]
    assert run_curl(f"{root}/detokenize", "-d", json.dumps({"tokens": tokens})) == {"content": "Hello world"}
    metrics = subprocess.run([curl, "-sS", f"{root}/metrics"], capture_output=True, text=True, check=True).stdout
    assert 'thoughtjax_requests_total{code="OK",method="/v1/completions"}' in metrics

    with Client(serving.split()[-1], timeout=600) as c:
      text = "".join(
        c.stream(
          messages=[{"role": "user", "content": "What is the capital of France?"}],
          hints=["general_purpose"],
          max_tokens=12,
        )
      )
      final = c.last_final
    assert text.strip() and final.text == text and final.usage.tokens_out >= 1
    assert final.trace.refs and final.trace.actual_ms["total"] > 0
    assert c.last_trailer.trace == final.trace and c.last_trailer.usage == final.usage

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(60)
    proc.stdout.close()
    log.close()

"""The server over the default model's registry (built and calibrated on first use): a chat request streams."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_serves_a_chat_request_on_the_default_model():
  from tests.server.conftest import config, wait_ready
  from thoughtjax.client import Client
  from thoughtjax.server.app import BackgroundServer
  from thoughtjax.synthesis.default_registry import open_default

  with BackgroundServer(open_default(), config(), timeout=600) as srv:
    wait_ready(srv)
    with Client(f"127.0.0.1:{srv.port}", timeout=600) as c:
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

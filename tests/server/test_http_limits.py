"""The HTTP front holds a bounded number of connections, each for a bounded time without a request: a flood of
idle sockets gets 503 past ``http_max_connections``, a silent or half-written request head is closed after
``http_idle_timeout_s``, a body that never finishes gets 408 after ``http_body_timeout_s``; gRPC and the
connections within the cap keep being answered."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time

import pytest

from tests.server.conftest import config, wait_ready
from thoughtjax.client import Client
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import ConfigError, from_mapping

HEAD = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _health(port: int) -> int:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    return r.status
  finally:
    conn.close()


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
  """Whether the server closed ``sock`` within ``seconds``, and what it sent before."""
  sock.settimeout(seconds)
  got = b""
  try:
    while chunk := sock.recv(65536):
      got += chunk
  except TimeoutError:
    return False, got
  except ConnectionResetError:
    pass
  return True, got


def test_connections_past_the_cap_get_503_unread_and_the_rest_are_served(synthesizer):
  cap = 6
  with BackgroundServer(synthesizer, config(http_port=0, http_max_connections=cap)) as srv:
    wait_ready(srv)
    port = srv.app.http_port
    with contextlib.ExitStack() as stack:
      idle = [stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(cap)]
      time.sleep(0.2)  # accepted by the loop
      with socket.create_connection(("127.0.0.1", port)) as extra:
        closed, got = _closed_within(extra, 10)
      assert closed and got.startswith(b"HTTP/1.1 503 ")
      body = json.loads(got.split(b"\r\n\r\n", 1)[1])
      assert body["error"]["code"] == "too_many_connections" and "http_max_connections" in body["error"]["message"]
      with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:  # gRPC is not held up by the HTTP flood
        assert c.health() == "SERVING"
      # A connection within the cap is still served.
      idle[0].sendall(f"{HEAD}\r\n".encode())
      assert idle[0].recv(65536).startswith(b"HTTP/1.1 200 ")
    deadline = time.monotonic() + 10
    while srv.app.http.runner.server.connections and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _health(port) == 200  # closed ones free their places


def test_silent_and_half_written_heads_are_closed_and_slow_bodies_get_408(synthesizer):
  cfg = config(http_port=0, http_idle_timeout_s=0.5, http_body_timeout_s=0.5)
  with BackgroundServer(synthesizer, cfg) as srv:
    wait_ready(srv)
    port = srv.app.http_port
    with (
      socket.create_connection(("127.0.0.1", port)) as silent,
      socket.create_connection(("127.0.0.1", port)) as half,
      socket.create_connection(("127.0.0.1", port)) as slow_body,
    ):
      half.sendall(HEAD.encode())  # the head never ends
      head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      slow_body.sendall(f"{head}Content-Length: 200\r\n\r\n{{\"prompt\": ".encode())  # 200 promised, 11 sent
      for sock in (silent, half):
        closed, got = _closed_within(sock, 10)
        assert closed and got == b""
      closed, got = _closed_within(slow_body, 10)
      assert closed and got.startswith(b"HTTP/1.1 408 ")
      assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert _health(port) == 200  # a prompt client is served as before


@pytest.mark.parametrize(
  "data, match",
  [
    ({"http_max_connections": 0}, "http_max_connections"),
    ({"http_idle_timeout_s": 0}, "http_idle_timeout_s"),
    ({"http_body_timeout_s": float("inf")}, "http_body_timeout_s"),
  ],
)
def test_the_limits_refuse_nonsense(data, match):
  with pytest.raises(ConfigError, match=match):
    from_mapping(data)

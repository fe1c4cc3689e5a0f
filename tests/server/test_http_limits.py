"""The HTTP front holds a bounded number of connections, each for a bounded time without a request: a flood of
idle sockets gets 503 past ``http_max_connections``, a silent or half-written request head is closed after
``http_idle_timeout_s``, a body that never finishes gets 408 after ``http_body_timeout_s``; gRPC and the
connections within the cap keep being answered."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import time
import types

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


def test_a_burst_accepted_at_once_is_held_to_the_cap(synthesizer):
  """The sockets the loop accepts together (it was busy while they queued) each count from their accept, not from
  their handler's start: at most ``cap`` are held, the rest get 503."""
  cap, burst = 6, 40
  with BackgroundServer(synthesizer, config(http_port=0, http_max_connections=cap)) as srv:
    wait_ready(srv)
    port = srv.app.http_port
    with contextlib.ExitStack() as stack:
      srv.loop.call_soon_threadsafe(time.sleep, 1.0)  # the loop is busy while the burst queues in the backlog
      time.sleep(0.1)
      socks = [stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(burst)]
      time.sleep(2.0)  # the loop is back and has answered (well within the idle timeout)
      answers = [_closed_within(s, 0.05) for s in socks]  # everything sent has arrived by now
      held = sum(not closed for closed, _ in answers)
      refused = sum(closed and got.startswith(b"HTTP/1.1 503 ") for closed, got in answers)
      assert held == cap and refused == burst - cap, answers
      assert len(srv.app.http.runner.server.connections) == cap


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


class _Chatty:
  """A synthesizer whose runs go alone and stream each delta's text 20 000 times over: a few tokens fill any
  socket buffer."""

  def __init__(self, synthesizer):
    self._syn = synthesizer

  def __getattr__(self, name):
    return getattr(self._syn, name)

  def synthesize(self, *a, **kw):
    return _LoudRun(self._syn.synthesize(*a, **kw))


class _LoudRun:
  def __init__(self, run):
    self.__dict__["_run"] = run

  def __getattr__(self, name):
    return getattr(self._run, name)

  request = types.SimpleNamespace(slot=lambda: None)  # runs alone, delta by delta

  def __iter__(self):
    return self

  def __next__(self):
    d = next(self._run)
    return dataclasses.replace(d, text=d.text * 20_000) if d.text else d


def test_a_streaming_client_that_stops_reading_is_reset_and_its_turn_freed(synthesizer):
  """Attack: a client asks for a stream and never reads it (a tiny receive buffer, nothing read). Once the socket's
  buffers are full the server's next write waits; after ``http_write_timeout_s`` the connection is reset and the
  request's turn comes back, so the next client is served (it used to hold the turn as long as the client did)."""
  cfg = config(http_port=0, http_write_timeout_s=0.5, max_concurrent=1, max_queue=0)
  with BackgroundServer(_Chatty(synthesizer), cfg) as srv:
    wait_ready(srv)
    port, sched = srv.app.http_port, srv.app.service.scheduler
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 64, "stream": True}).encode()
    head = (
      f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket() as stalled:
      stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
      stalled.connect(("127.0.0.1", port))
      stalled.sendall(head + body)
      deadline = time.monotonic() + 60
      while sched.free_turns == sched.max_concurrent and time.monotonic() < deadline:
        time.sleep(0.02)  # until it holds the one turn
      assert sched.free_turns == 0
      # Its turn comes back within the write timeout (and the time the buffers take to fill), unread.
      assert srv.call(lambda: sched.wait_idle(60)) and sched.free_turns == sched.max_concurrent
      closed, _ = _closed_within(stalled, 10)  # reset: what it had not read is gone with the connection
      assert closed
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
      conn.request(
        "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}), {"Content-Type": "application/json"}
      )
      r = conn.getresponse()
      assert r.status == 200 and json.loads(r.read())["choices"][0]["text"]
    finally:
      conn.close()


@pytest.mark.parametrize(
  "data, match",
  [
    ({"http_max_connections": 0}, "http_max_connections"),
    ({"http_idle_timeout_s": 0}, "http_idle_timeout_s"),
    ({"http_body_timeout_s": float("inf")}, "http_body_timeout_s"),
    ({"http_write_timeout_s": -1}, "http_write_timeout_s"),
  ],
)
def test_the_limits_refuse_nonsense(data, match):
  with pytest.raises(ConfigError, match=match):
    from_mapping(data)

"""Who may connect to the OpenAI-compatible HTTP endpoint: the listening socket's connection cap
(:class:`ConnectionGate`, ``http_max_connections``) and the Host names answered without a client token
(:func:`allowed_hosts`, :func:`host_name`; the check itself is ``server/http.py``'s middleware).

A connection past the cap gets a 503 in OpenAI's error body and is closed without reading anything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

from aiohttp import web

from thoughtjax.server.openai_request import error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(bind: str, listed: Iterable[str]) -> frozenset[str]:
  """The Host names a server bound to ``bind`` answers without a client token: the loopback names, the bind
  address and the ``listed`` ones (``http_allowed_hosts``); never a wildcard address or an empty name."""
  return frozenset({*LOOPBACK_HOSTS, bind.strip("[]").lower(), *listed}) - {"0.0.0.0", "::", ""}


def host_name(header: str) -> str:
  """The name of a Host header, without its port, lower case (``[::1]:8080`` -> ``::1``)."""
  h = header.strip().lower()
  if h.startswith("["):
    return h[1 : h.find("]")] if "]" in h else h
  return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class ConnectionGate:
  """The listening socket's protocol factory: aiohttp's request handler while fewer than ``cap`` HTTP connections
  are open, else a protocol that answers 503 and closes without reading anything (a flood of idle or half-open
  sockets cannot grow past the cap; each open one is closed by aiohttp's idle timeout)."""

  def __init__(self, server: web.Server, cap: int, service):
    self.server, self.cap, self.service = server, cap, service
    # Handlers handed out whose connection has not started yet. The loop accepts every socket waiting in the
    # backlog at once and calls this for each before any handler's connection_made (which puts it in
    # ``server.connections``) runs, so counting only those would let a whole burst in.
    self._opening = 0

  def __call__(self) -> asyncio.BaseProtocol:
    if len(self.server.connections) + self._opening < self.cap:
      self._opening += 1
      # Runs just before the transport's own call_soon(connection_made) for this socket (the transport is made
      # right after this returns): the handler stops counting here and counts in server.connections from there.
      asyncio.get_running_loop().call_soon(self._opened)
      return self.server()
    self.service.answered("HTTP", "HTTP_503")
    return _Refused(self.cap)

  def _opened(self) -> None:
    self._opening -= 1


class _Refused(asyncio.Protocol):
  """The answer past the cap: a 503 and a close, the socket never read."""

  def __init__(self, cap: int):
    self.cap = cap

  def connection_made(self, transport: asyncio.BaseTransport) -> None:
    message = f"the server holds its most HTTP connections ({self.cap}, http_max_connections); retry shortly"
    body = json.dumps(error_body(503, message, None, "too_many_connections")).encode()
    head = (
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
      f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    transport.write(head.encode() + body)  # type: ignore[attr-defined]
    transport.close()

"""Keepalive: a client that pings every 100 ms (gRPC sends at most one a second) keeps its connection to the
server, idle or in a call, for long enough that a default gRPC server would have sent GOAWAY too_many_pings
(the seeds' gateway crash). The control test shows that default server dropping the same client, so the
check is sensitive: a GOAWAY moves the channel out of READY (awaited as an event, with a generous bound)."""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc

PINGING = [
  ("grpc.keepalive_time_ms", 100),
  ("grpc.keepalive_timeout_ms", 5000),
  ("grpc.keepalive_permit_without_calls", 1),
  ("grpc.http2.max_pings_without_data", 0),
]
# A default server strikes an idle ping more often than every 5 minutes and sends GOAWAY after 2 strikes;
# at one ping a second that is about 3 s. The time below lets 4 or more pings happen (not a wait for an event).
PING_WINDOW_S = 4.5


def _states_while_pinging(port: int, call, *, until_dropped: float | None = None) -> list[str]:
  """The channel's connectivity states from its first call, through PING_WINDOW_S of pings (or, with
  ``until_dropped``, until it leaves READY, at most that many seconds), to a second call."""
  states: list[str] = []
  dropped = threading.Event()

  def watch(state):
    states.append(state.name)
    if state.name != "READY" and "READY" in states:
      dropped.set()

  with grpc.insecure_channel(f"127.0.0.1:{port}", options=PINGING) as ch:
    ch.subscribe(watch, try_to_connect=True)
    call(ch)
    if until_dropped is None:
      threading.Event().wait(PING_WINDOW_S)
    else:
      dropped.wait(until_dropped)
    call(ch)
    ch.unsubscribe(watch)
  return states


def _health_check(ch) -> None:
  r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
  assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_a_pinging_client_keeps_its_connection(served):
  def plan(ch):
    _health_check(ch)
    rpc.SynthesizerStub(ch).GetOptimalPath(pb.SynthesizeRequest(prompt="The quick brown fox"), timeout=60)

  states = _states_while_pinging(served.port, plan)
  assert states[states.index("READY") :] == ["READY"], states  # never left READY: no GOAWAY


def test_control_a_default_grpc_server_drops_the_same_client():
  loop = asyncio.new_event_loop()
  started, port, stop = threading.Event(), [], []

  async def main():
    srv = grpc.aio.server()  # default keepalive policy
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    port.append(srv.add_insecure_port("127.0.0.1:0"))
    await srv.start()
    stop.append(asyncio.Event())
    started.set()
    await stop[0].wait()
    await srv.stop(0)

  t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
  t.start()
  try:
    assert started.wait(30)
    states = _states_while_pinging(port[0], _health_check, until_dropped=60)
  finally:
    loop.call_soon_threadsafe(stop[0].set)
    t.join(30)
    loop.close()
  # Dropped (GOAWAY): the channel left READY; the second health check passed over a new connection.
  assert set(states[states.index("READY") :]) - {"READY"}, states

"""A tiny calibrated synthesizer (tests/synthesis/tiny_synthesis.py) served on 127.0.0.1, port 0, and the helpers
the server tests share (a test file imports them from here, never from another test file)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import AdminConfig, ServerConfig


@pytest.fixture(scope="session")
def tiny_registry():
  from tests.synthesis.tiny_synthesis import tiny_setup
  from thoughtjax.registry import Registry

  with Registry.open(tiny_setup().registry) as reg:
    yield reg


@pytest.fixture(scope="session")
def synthesizer(tiny_registry):
  from thoughtjax.synthesis.synthesize import Synthesizer

  # learn=False: a request's plan does not depend on what other tests, run before on this worker, taught it.
  return Synthesizer.open(tiny_registry, learn=False)


def config(**changes) -> ServerConfig:
  """A loopback test server's settings; admin calls open and reloads unthrottled unless ``admin`` is given
  (tests/server/test_hostile.py attacks the admin gate itself)."""
  return ServerConfig(port=0, grace_s=20.0, admin=AdminConfig(open=True, reload_interval_s=0)).replace(**changes)


def wait_ready(srv: BackgroundServer) -> None:
  """Until the warm-up finished (an awaited task, not a poll)."""
  assert srv.call(srv.app.wait_ready), srv.app.warm_error


def wait_serving(target: str, timeout: float = 300) -> bool:
  """Until grpc.health.v1 reports SERVING (the server listens before its registry is loaded): a Watch stream,
  which sends each status change, not a poll."""
  with grpc.insecure_channel(target) as ch:
    for r in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=timeout):
      if r.status == health_pb2.HealthCheckResponse.SERVING:
        return True
  return False


def stub_of(srv: BackgroundServer, **kw) -> tuple[grpc.Channel, rpc.SynthesizerStub]:
  """A plaintext channel to ``srv`` (``kw``: ``grpc.insecure_channel``'s) and a Synthesizer stub on it."""
  ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}", **kw)
  return ch, rpc.SynthesizerStub(ch)


def code_of(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
  """The status and details of the call ``fn(*args, **kwargs)`` (a stream is read to its end); OK and "" when
  it succeeds."""
  try:
    r = fn(*args, **kwargs)
    if not isinstance(r, pb.Plan):
      list(r)
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def served(synthesizer):
  """A ready server over the tiny registry (shared by a module's tests)."""
  with BackgroundServer(synthesizer, config(max_concurrent=2, max_queue=2)) as srv:
    wait_ready(srv)
    yield srv

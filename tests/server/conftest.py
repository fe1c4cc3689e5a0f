"""A tiny calibrated synthesizer (tests/synthesis/tiny_synthesis.py) served on 127.0.0.1, port 0."""

from __future__ import annotations

import pytest

from server.app import BackgroundServer
from server.config import AdminConfig, ServerConfig


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


@pytest.fixture(scope="module")
def served(synthesizer):
  """A ready server over the tiny registry (shared by a module's tests)."""
  with BackgroundServer(synthesizer, config(max_concurrent=2, max_queue=2)) as srv:
    wait_ready(srv)
    yield srv

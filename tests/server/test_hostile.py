"""A client that attacks the server (issue 16, items 10-14): each test sends the hostile request, asserts the named
status and message, that nothing was done on its behalf (no manifest read, no weight restored), and that the
server still serves a normal request afterwards."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import config, wait_ready
from thoughtjax.client import Client, ClientError
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.server.app import BackgroundServer, serve
from thoughtjax.server.config import AdminConfig, ConfigError, from_mapping
from thoughtjax.server.messages import public_message

C = grpc.StatusCode
PROMPT = "The quick brown fox"
TOKEN = "s3cret-admin-token-0123456789"


def call(fn, req, **kw):
  """(status, details) of a unary or streaming call; a stream is read to its end."""
  try:
    out = fn(req, timeout=120, **kw)
    if not hasattr(out, "path"):  # a stream
      list(out)
    return C.OK, ""
  except grpc.RpcError as e:
    return e.code(), e.details()


def still_serves(port: int) -> None:
  with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = list(rpc.SynthesizerStub(ch).Synthesize(pb.SynthesizeRequest(prompt=PROMPT, max_tokens=3), timeout=120))
    assert out[-1].final.usage.tokens_out >= 1


@pytest.fixture
def stub(served):
  with grpc.insecure_channel(f"127.0.0.1:{served.port}", options=[("grpc.max_send_message_length", -1)]) as ch:
    yield rpc.SynthesizerStub(ch)


@pytest.fixture
def counted(served, monkeypatch):
  """Counts of the served registry's manifest reads and weight restores during the test."""
  reg = served.app.service.registry
  counts = {"manifest": 0, "restore_many": 0}
  for name in counts:
    real = getattr(reg, name)

    def counting(*a, _real=real, _name=name, **kw):
      counts[_name] += 1
      return _real(*a, **kw)

    monkeypatch.setattr(reg, name, counting)
  return counts


def no_bug_statuses(served) -> None:
  statuses = served.app.service.statuses
  assert "UNKNOWN" not in statuses and "INTERNAL" not in statuses, statuses


# ---------------------------------------------------------------------------------- 10: explicit paths
def test_a_path_of_250000_pieces_is_refused_before_any_manifest_is_read(served, stub, counted):
  limit = 2 * served.app.service.serving.num_layers
  huge = "embed, " + "blocks[0:2), " * 250_000 + "head"
  for fn in (stub.GetOptimalPath, stub.Synthesize):
    code, details = call(fn, pb.SynthesizeRequest(prompt=PROMPT, path=huge, max_tokens=2))
    assert code == C.INVALID_ARGUMENT and "250002 pieces" in details, details
    assert f"limit is {limit} (max_path_layers" in details
  long_span = "embed, blocks[0:100000000), head"  # three pieces, a hundred million layers
  code, details = call(stub.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, path=long_span))
  assert code == C.INVALID_ARGUMENT and "runs 100000000 layers" in details, details
  assert counted == {"manifest": 0, "restore_many": 0}
  still_serves(served.port)
  no_bug_statuses(served)


def test_get_optimal_path_type_checks_an_explicit_path_without_restoring_weights(served, stub, counted):
  path = "embed, blocks[0:2), blocks[2:3), blocks[2:3), blocks[3:6), head"  # 7 layers, never composed here
  plan = stub.GetOptimalPath(pb.SynthesizeRequest(prompt=PROMPT, path=path, max_tokens=2), timeout=120)
  assert plan.kind == "explicit" and plan.path == path and len(plan.refs) == 7  # blocks[3:6) is two units
  code, details = call(stub.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, path="head, embed"))
  assert code == C.INVALID_ARGUMENT and "link 0" in details, details
  assert counted["restore_many"] == 0 and counted["manifest"] > 0  # manifests read, no weights
  # Synthesize runs the same path (through the scheduler's admission) and names the same identity.
  first = next(iter(stub.Synthesize(pb.SynthesizeRequest(prompt=PROMPT, path=path, max_tokens=2), timeout=120)))
  assert first.plan.path_hash == plan.path_hash and list(first.plan.refs) == list(plan.refs)
  still_serves(served.port)


# ---------------------------------------------------------------------------------- 11: stop strings
def test_too_many_or_too_long_stop_strings_are_refused_and_the_limits_are_served(served, stub):
  cfg = served.app.service.config
  many = [f"x{i}" for i in range(cfg.max_stop_strings + 1)]
  code, details = call(stub.Synthesize, pb.SynthesizeRequest(prompt=PROMPT, stop_strings=many))
  assert code == C.INVALID_ARGUMENT and f"at most {cfg.max_stop_strings} (max_stop_strings)" in details
  code, details = call(stub.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, stop_strings=["a" * 100_000]))
  assert code == C.INVALID_ARGUMENT and f"at most {cfg.max_stop_chars} per stop string" in details
  # Exactly at the limits: served, to the end.
  stops = [chr(0x4E00 + i) * cfg.max_stop_chars for i in range(cfg.max_stop_strings)]
  out = list(stub.Synthesize(pb.SynthesizeRequest(prompt=PROMPT, stop_strings=stops, max_tokens=6), timeout=120))
  assert out[-1].final.usage.tokens_out >= 1
  still_serves(served.port)
  no_bug_statuses(served)


def test_stop_limits_are_configurable_and_checked():
  c = from_mapping({"max_stop_strings": 2, "max_stop_chars": 8, "max_path_layers": 30})
  assert (c.max_stop_strings, c.max_stop_chars, c.max_path_layers) == (2, 8, 30)
  for bad in ({"max_stop_strings": 0}, {"max_stop_chars": "long"}, {"max_path_layers": -1}):
    with pytest.raises(ConfigError, match=next(iter(bad))):
      from_mapping(bad)


# ---------------------------------------------------------------------------------- 12: values past their types
@pytest.mark.parametrize(
  "fields, match",
  [
    ({"top_k": 2**31}, "top_k must be an integer in [0, 2147483647]"),
    ({"top_k": 2**32 - 1}, "top_k must be an integer"),
    ({"top_k": 100_000}, "top_k must be at most the vocabulary size"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"top_p": math.nan}, "top_p must be in (0, 1]"),
    ({"seed": 2**64 - 1}, "seed must be an integer"),
    ({"logit_bias": {3: math.inf}}, "logit_bias[3] must be a number in [-100, 100]"),
    ({"logit_bias": {3: 1e30}}, "logit_bias[3] must be a number in [-100, 100] (OpenAI's range)"),
    ({"logit_bias": {3: -100.5}}, "logit_bias[3] must be a number in [-100, 100]"),
    ({"logit_bias": {-5: 1.0}}, "logit_bias token must be an integer"),
    ({"logit_bias": {2**31 - 1: 1.0}}, "outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be an integer"),
    ({"max_latency_ms": math.inf}, "max_latency_ms: expected a finite number"),
    ({"max_tokens": 2**32 - 1}, "max_tokens: expected 1.."),
  ],
)
def test_a_value_past_its_type_or_the_model_is_invalid_argument_before_any_work(served, stub, fields, match):
  for fn in (stub.GetOptimalPath, stub.Synthesize):
    code, details = call(fn, pb.SynthesizeRequest(**{"prompt": PROMPT, "max_tokens": 4, **fields}))
    assert code == C.INVALID_ARGUMENT and match in details, (fields, code, details)
  no_bug_statuses(served)


def test_the_library_refuses_the_same_values_as_the_server():
  from thoughtjax.decode.request import ContextError, check_request
  from thoughtjax.sampling import SamplingError, SamplingParams

  with pytest.raises(SamplingError, match="top_k must be an integer"):
    SamplingParams(top_k=2**31)
  with pytest.raises(SamplingError, match="temperature must be a finite"):
    SamplingParams(temperature=math.nan)
  with pytest.raises(SamplingError, match="at most the vocabulary size 64"):
    SamplingParams(top_k=65).check_model(64)
  with pytest.raises(ContextError, match="exceeds the model's context of 16"):
    check_request([[1] * 7], [SamplingParams(max_tokens=10)], vocab_size=64, max_context=16)
  check_request([[1] * 7], [SamplingParams(top_k=64, max_tokens=9)], vocab_size=64, max_context=16)
  with pytest.raises(SamplingError, match="empty stop string"):
    SamplingParams(stop_strings=("",))
  with pytest.raises(SamplingError, match=r"logit_bias\[7\] must be a number in \[-100, 100\]"):
    SamplingParams(logit_bias={7: 101.0})
  SamplingParams(logit_bias={7: -100.0, 8: 100.0})  # the ends of the range are allowed


# ---------------------------------------------------------------------------------- 13: admin calls, error text
def admin_server(synthesizer, **admin):
  return BackgroundServer(synthesizer, config(admin=AdminConfig(**admin)))


def test_admin_calls_need_the_token_and_reloads_are_rate_limited(synthesizer):
  with admin_server(synthesizer, token=TOKEN, reload_interval_s=3600) as srv:
    wait_ready(srv)
    target = f"127.0.0.1:{srv.port}"
    for method in ("registry_stats", "reload_registry"):
      for token, code in ((None, C.UNAUTHENTICATED), ("wrong-token-of-some-length", C.PERMISSION_DENIED)):
        with Client(target, timeout=60, token=token) as c, pytest.raises(ClientError) as e:
          getattr(c, method)()
        assert e.value.code == code and "admin" in e.value.details, (method, e.value)
        assert TOKEN not in e.value.details
    with Client(target, timeout=120, token=TOKEN) as c:
      assert c.registry_stats().registry_sequence >= 1
      assert c.reload_registry().switched is False  # the same sequence: nothing to do
      with pytest.raises(ClientError) as e:
        c.reload_registry()  # at once again: refused before any file is read
      assert e.value.code == C.RESOURCE_EXHAUSTED and "admin.reload_interval_s" in e.value.details
      assert srv.app.service.reloader.counts["unchanged"] == 1
      assert c.list_thoughtlets().thoughtlets  # not an admin call
    still_serves(srv.port)


def test_admin_calls_are_refused_when_no_admin_client_is_configured(synthesizer):
  with admin_server(synthesizer) as srv:
    wait_ready(srv)
    with Client(f"127.0.0.1:{srv.port}", timeout=60, token=TOKEN) as c:
      for method in ("registry_stats", "reload_registry"):
        with pytest.raises(ClientError) as e:
          getattr(c, method)()
        assert e.value.code == C.PERMISSION_DENIED and "admin.token" in e.value.details
    still_serves(srv.port)


def test_admin_settings_are_checked(tmp_path):
  (tmp_path / "token").write_text(TOKEN + "\n")
  c = from_mapping({"admin": {"token_file": "token", "identities": ["operator"]}}, base=tmp_path)
  assert c.admin.bearer() == TOKEN and c.admin.identities == ("operator",)
  for bad, match in (
    ({"token": "short"}, "at least 16"),
    ({"token": TOKEN, "token_file": "x"}, "not both"),
    ({"identities": "operator"}, "identities: expected a list"),
    ({"reload_interval_s": -1}, "reload_interval_s"),
    ({"opne": True}, "unknown keys"),
  ):
    with pytest.raises(ConfigError, match=match):
      from_mapping({"admin": bad}, base=tmp_path)


class _Broken:
  """The served synthesizer, except that planning hits a bug whose message names a secret path."""

  def __init__(self, syn, secret: str):
    self._syn, self.secret = syn, secret

  def __getattr__(self, name):
    return getattr(self._syn, name)

  def plan(self, *a, **kw):
    raise RuntimeError(f"cannot open {self.secret}/weights.bin")


def test_a_bug_is_internal_with_a_request_id_and_the_detail_only_in_the_log(synthesizer, tmp_path, caplog):
  secret = str(tmp_path / "private")
  with BackgroundServer(_Broken(synthesizer, secret), config()) as srv:
    wait_ready(srv)
    with caplog.at_level(logging.INFO, logger="thoughtjax.server"):
      with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        code, details = call(
          rpc.SynthesizerStub(ch).GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, request_id="r-42")
        )
    assert code == C.INTERNAL and "request id r-42" in details, details
    assert secret not in details and "RuntimeError" not in details and "Traceback" not in details
    logged = [r for r in caplog.records if "r-42" in r.getMessage()]
    assert logged and logged[0].exc_info is not None and secret in str(logged[0].exc_info[1])
    still_serves(srv.port)


def test_client_messages_carry_no_filesystem_paths():
  text = "registry /home/u/.cache/thoughtjax/reg sequence 3: file ~/keys/a.pem; see https://x.org/a/b, blocks[0:2)"
  out = public_message(text)
  assert "/home" not in out and "~/keys" not in out and out.count("<path>") == 2
  assert "https://x.org/a/b" in out and "blocks[0:2)" in out
  assert len(public_message("x" * 10_000)) == 2000


# ---------------------------------------------------------------------------------- 14: readiness
def test_the_server_listens_at_once_and_serves_when_the_registry_is_loaded(synthesizer):
  gate, asked = threading.Event(), threading.Event()

  def load():
    asked.set()
    assert gate.wait(120), "the test never opened the gate"
    return synthesizer

  with BackgroundServer(None, config(), load=load) as srv:
    assert asked.wait(60)  # the port is bound and the load has begun, held by the test
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
      health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
      assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
      s = rpc.SynthesizerStub(ch)
      for fn, req in (
        (s.Synthesize, pb.SynthesizeRequest(prompt=PROMPT)),
        (s.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT)),
        (s.ListThoughtlets, pb.ListThoughtletsRequest()),
        (s.RegistryStats, pb.RegistryStatsRequest()),
        (s.ReloadRegistry, pb.ReloadRegistryRequest()),
      ):
        code, details = call(fn, req)
        assert code == C.UNAVAILABLE and "loading its registry" in details, (fn, code, details)
      gate.set()
      wait_ready(srv)
    still_serves(srv.port)


def test_a_registry_that_fails_to_load_stops_serve_with_its_error():
  class Broken(ConfigError):
    pass

  def load():
    raise Broken("the registry cannot be built")

  ports = []
  with pytest.raises(Broken, match="cannot be built"):
    asyncio.run(serve(None, config(), load=load, on_port=ports.append))
  assert ports  # it listened before loading


def test_half_open_grpc_sockets_are_capped_and_timed_out_and_clients_are_served_after(synthesizer):
  """Raw TCP sockets that never speak HTTP/2 against the gRPC port: past ``grpc_max_connections`` one is closed at
  once; the held ones get GOAWAY after ``grpc_handshake_timeout_s``; then a client is served."""
  import socket
  import time

  cap = 3
  with BackgroundServer(synthesizer, config(grpc_max_connections=cap, grpc_handshake_timeout_s=1.0)) as srv:
    wait_ready(srv)
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(cap)]
    try:
      time.sleep(0.3)
      with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as extra:
        assert extra.recv(4096) == b""  # closed before any byte of the server's HTTP/2 preface
      t0 = time.monotonic()
      for s in held:
        got = b""
        while chunk := s.recv(65536):  # the server's settings, then GOAWAY, then the close
          got += chunk
        assert b"handshake timeout" in got
      assert time.monotonic() - t0 < 8
    finally:
      for s in held:
        s.close()
    with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
      assert c.health() == "SERVING"
      assert c.generate(PROMPT, ["general_purpose"], max_tokens=2).finish_reason


def test_grpc_connection_limits_are_checked():
  for bad in ({"grpc_max_connections": 0}, {"grpc_handshake_timeout_s": 0}, {"grpc_handshake_timeout_s": math.inf}):
    with pytest.raises(ConfigError, match=next(iter(bad))):
      from_mapping(bad)


# ---------------------------------------------------------------------------------- request checks: time-bounded


@pytest.fixture
def held_checks(monkeypatch):
  """Request checks of requests whose id starts with "slow" block until ``release`` is set (a constraint whose
  compile runs long); ``started`` lists the ids whose checks ran."""
  from thoughtjax.server import servicer as servicer_mod

  release, started, real = threading.Event(), [], servicer_mod.validate

  def validate(m, *a, **kw):
    started.append(m.request_id)
    if m.request_id.startswith("slow"):
      release.wait(60)
    return real(m, *a, **kw)

  monkeypatch.setattr(servicer_mod, "validate", validate)
  yield release, started
  release.set()


def _checking(srv) -> int:
  """Request checks the server counts in flight now (read on its event loop, where the count changes)."""

  async def read():
    return srv.app.service._validating

  return srv.call(read)


def _until(what, seconds: float = 30.0) -> None:
  """Poll ``what()`` until true (state another thread changes), failing after ``seconds``."""
  import time

  end = time.monotonic() + seconds
  while not what():
    assert time.monotonic() < end, "condition not reached"
    time.sleep(0.02)


def test_checks_past_validation_timeout_are_refused_and_count_until_they_end(synthesizer, held_checks):
  """Two checks that do not end: each client gets RESOURCE_EXHAUSTED naming validation_timeout_s; the checks still
  hold their place in the bound (max_concurrent + max_queue = 2) while they run, so a third request is refused at
  once; once they end, requests are served."""
  release, started = held_checks
  with BackgroundServer(synthesizer, config(validation_timeout_s=0.5, max_concurrent=1, max_queue=1)) as srv:
    wait_ready(srv)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
      stub = rpc.SynthesizerStub(ch)
      for i in range(2):
        code, details = call(stub.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, request_id=f"slow{i}"))
        assert code == C.RESOURCE_EXHAUSTED and "validation_timeout_s (0.5 s)" in details, details
      code, details = call(stub.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, request_id="third"))
      assert code == C.RESOURCE_EXHAUSTED and "2 requests are being checked" in details, details
      assert "third" not in started
      release.set()
      _until(lambda: _checking(srv) == 0)
    still_serves(srv.port)
    no_bug_statuses(srv)


def test_a_check_queued_behind_busy_workers_is_dropped_when_its_client_leaves(synthesizer, held_checks):
  """Both check workers busy; a request queued behind them whose client gives up (its deadline) is never checked:
  its prompt is not tokenized, its constraint not compiled."""
  release, started = held_checks
  with BackgroundServer(synthesizer, config(validation_timeout_s=60)) as srv:
    wait_ready(srv)
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
      stub = rpc.SynthesizerStub(ch)
      slow = [
        threading.Thread(
          target=call, args=(stub.GetOptimalPath, pb.SynthesizeRequest(prompt=PROMPT, request_id=f"slow{i}"))
        )
        for i in range(2)
      ]
      for t in slow:
        t.start()
      _until(lambda: {"slow0", "slow1"} <= set(started))
      with pytest.raises(grpc.RpcError) as e:
        stub.GetOptimalPath(pb.SynthesizeRequest(prompt=PROMPT, regex="[a-z]+", request_id="left"), timeout=0.3)
      assert e.value.code() == C.DEADLINE_EXCEEDED
      _until(lambda: _checking(srv) == 2)  # the server saw it leave: its queued check was dropped, not run later
      release.set()
      for t in slow:
        t.join(60)
      _until(lambda: _checking(srv) == 0)
      assert "left" not in started
    still_serves(srv.port)

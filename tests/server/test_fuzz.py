"""Property-based fuzzing over loopback: over 10,000 random and malformed requests, each answered with a
precise status (never UNKNOWN or INTERNAL), and the server stays healthy and idle afterwards.

Requests go in batches of 25 concurrent calls: GetOptimalPath with random fields (planning only), Synthesize
with fields that fail validation (no model work), and random bytes that may or may not parse."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.proto.thoughtjax.v1 import synthesis_pb2 as pb
from server.proto.thoughtjax.v1 import synthesis_pb2_grpc as rpc

C = grpc.StatusCode
BATCH, EXAMPLES = 25, 404
PLAN_OK = {C.OK, C.INVALID_ARGUMENT, C.OUT_OF_RANGE, C.FAILED_PRECONDITION}
REFUSED = PLAN_OK - {C.OK}
HINTS = [
  "general_purpose",
  "fast_draft",
  "Fast-Draft",
  "genral_purpose",
  "",
  " ",
  "code_generation",
  "klingon",
  "legal_analysis",
  "x" * 300,
]
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
text = st.text(max_size=40)


@st.composite
def requests(draw) -> pb.SynthesizeRequest:
  """A valid request (prompt or chat, hints, budget, sampling), then zero to three random corruptions."""
  m = pb.SynthesizeRequest(
    prompt=draw(st.sampled_from(["The quick brown fox", "a", "Once upon a time"])),
    hints=draw(st.lists(st.sampled_from(HINTS[:3]), max_size=2)),
    max_tokens=draw(st.integers(1, 64)),
    max_latency_ms=draw(st.floats(1e-3, 1e7)),
  )
  for _ in range(draw(st.integers(0, 3))):
    corrupt = draw(st.sampled_from(CORRUPTIONS))
    corrupt(m, draw)
  return m


def _set(name, strat):
  return lambda m, draw: setattr(m, name, draw(strat))


def _messages(m, draw):
  m.ClearField("prompt")
  for _ in range(draw(st.integers(0, 3))):
    m.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "robot", ""])), content=draw(text))


CORRUPTIONS = [
  _set("prompt", text),
  _messages,
  _set("max_latency_ms", st.floats(allow_nan=True, allow_infinity=True)),
  _set("max_tokens", st.integers(0, 2**32 - 1)),
  _set("temperature", floats),
  _set("top_k", st.integers(0, 2**32 - 1)),
  _set("top_p", floats),
  _set("seed", st.integers(0, 2**64 - 1)),
  _set("registry_sequence", st.integers(0, 3)),
  _set("request_id", text),
  _set(
    "path",
    st.one_of(
      text,
      st.sampled_from(
        ["embed, blocks[0:2), head", "embed, blocks[0:9), head", "head, embed", "embed, blocks[2:1), head"]
      ),
    ),
  ),
  lambda m, draw: m.hints.extend(draw(st.lists(st.one_of(st.sampled_from(HINTS), text), max_size=4))),
  lambda m, draw: m.logit_bias.update(draw(st.dictionaries(st.integers(-(2**31), 2**31 - 1), floats, max_size=3))),
  lambda m, draw: m.stop_strings.extend(draw(st.lists(text, max_size=2))),
  lambda m, draw: m.stop_token_ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=2))),
]


def invalid(m: pb.SynthesizeRequest) -> pb.SynthesizeRequest:
  """``m`` made to fail validation, so a Synthesize call never reaches the model."""
  m = pb.SynthesizeRequest.FromString(m.SerializeToString())
  m.max_tokens = 0
  return m


def test_ten_thousand_random_and_malformed_requests_each_get_a_status(served):
  statuses: dict = {}
  sent = [0]
  ch = grpc.insecure_channel(f"127.0.0.1:{served.port}")
  stub = rpc.SynthesizerStub(ch)
  raw = ch.unary_unary("/thoughtjax.v1.Synthesizer/GetOptimalPath")

  @settings(
    max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
  )
  @given(
    st.lists(
      st.tuples(st.sampled_from(["plan", "synthesize", "bytes"]), requests(), st.binary(max_size=64)),
      min_size=BATCH,
      max_size=BATCH,
    )
  )
  def batch(items):
    calls = []
    for kind, m, junk in items:
      if kind == "plan":
        calls.append((PLAN_OK, m, stub.GetOptimalPath.future(m, timeout=60)))
      elif kind == "synthesize":
        calls.append((REFUSED, m, stub.Synthesize(invalid(m), timeout=60)))
      else:
        calls.append((PLAN_OK, junk, raw.future(junk, timeout=60)))
    for allowed, m, call in calls:
      try:
        call.result() if hasattr(call, "result") else list(call)
        code = C.OK
      except grpc.RpcError as e:
        code = e.code()
        assert e.details(), m  # every refusal says what to fix
      assert code in allowed, (code, m)
      statuses[code.name] = statuses.get(code.name, 0) + 1
      sent[0] += 1

  with ch:
    batch()
    assert sent[0] >= 10_000, sent[0]
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    final = list(stub.Synthesize(pb.SynthesizeRequest(prompt="The quick brown fox", max_tokens=4), timeout=120))[-1]
    assert final.final.usage.tokens_out >= 1
  assert statuses.get("INVALID_ARGUMENT", 0) > 0 and statuses.get("OK", 0) > 0
  assert served.call(lambda: served.app.service.scheduler.wait_idle(60))
  assert "UNKNOWN" not in served.app.service.statuses

"""Property-based fuzzing over loopback: 2,000 random and malformed requests (10,100 with ``THOUGHTJAX_FUZZ=full``,
tests/fuzzing.py), each answered with a precise status (never UNKNOWN or INTERNAL), and the server stays healthy
and idle afterwards.

Requests go in batches of 25 concurrent calls: GetOptimalPath with random fields (planning only), Synthesize
with fields that fail validation (no model work), and random bytes that may or may not parse.

Then valid-shaped Synthesize requests with random sampling values (edges of their types included), stop sets,
explicit paths and hint lists reach the model (96, or 240 in full, a few tokens each): each stream ends OK or with
a documented status, never UNKNOWN or INTERNAL, and the server serves afterwards."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import fuzzing
from tests.server.conftest import config, wait_ready
from tests.synthesis.tiny_synthesis import FULL, IDENTITY_SKIP
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.server.app import BackgroundServer

C = grpc.StatusCode
BATCH, EXAMPLES = 25, fuzzing.count(80, 404)
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


def _malformed(port: int, examples: int, **given_settings) -> dict:
  """Send ``examples`` batches of random and malformed calls; every answer a documented status (asserted per call).
  Returns the count of each status."""
  statuses: dict = {}
  sent = [0]
  ch = grpc.insecure_channel(f"127.0.0.1:{port}")
  stub = rpc.SynthesizerStub(ch)
  raw = ch.unary_unary("/thoughtjax.v1.Synthesizer/GetOptimalPath")

  @settings(
    max_examples=examples,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    **given_settings,
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
    assert sent[0] == BATCH * examples, sent[0]
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    final = list(stub.Synthesize(pb.SynthesizeRequest(prompt="The quick brown fox", max_tokens=4), timeout=120))[-1]
    assert final.final.usage.tokens_out >= 1
  return statuses


def test_thousands_of_random_and_malformed_requests_each_get_a_status(synthesizer):
  # A queue that holds a whole batch: every call is checked, none shed as a full server's would be
  # (tests/server/test_hostile.py floods a small one).
  with BackgroundServer(synthesizer, config(max_concurrent=2, max_queue=BATCH)) as srv:
    wait_ready(srv)
    statuses = _malformed(srv.port, EXAMPLES)
    assert statuses.get("INVALID_ARGUMENT", 0) > 0 and statuses.get("OK", 0) > 0
    assert srv.call(lambda: srv.app.service.scheduler.wait_idle(60))
    assert "UNKNOWN" not in srv.app.service.statuses


def test_the_tier_count_finds_a_planted_crash(synthesizer, monkeypatch):
  """The count the test tiers run still finds a fault of the kind this fuzz is for: here a validation that crashes
  (UNKNOWN) on a chat message with a role it does not know, instead of refusing it by name."""
  from thoughtjax.server import servicer

  real = servicer.validate

  def planted(m, *args, **kwargs):
    if any(msg.role not in ("system", "user", "assistant") for msg in m.messages):
      raise KeyError(m.messages[0].role)
    return real(m, *args, **kwargs)

  monkeypatch.setattr(servicer, "validate", planted)
  with BackgroundServer(synthesizer, config()) as srv:  # a server of its own: this one counts UNKNOWN statuses
    wait_ready(srv)
    with pytest.raises(AssertionError, match=r"StatusCode\.(UNKNOWN|INTERNAL)"):
      _malformed(srv.port, EXAMPLES, phases=[Phase.explicit, Phase.generate])  # found, not shrunk


# ---------------------------------------------------------------------------------- requests that reach the model
RUN_BATCH, RUN_EXAMPLES = 8, fuzzing.count(12, 30)
# What a valid-shaped request may be answered besides OK (server/servicer.py's module docstring lists each).
RUN_ALLOWED = {
  C.OK,
  C.INVALID_ARGUMENT,
  C.OUT_OF_RANGE,
  C.FAILED_PRECONDITION,
  C.RESOURCE_EXHAUSTED,
  C.DEADLINE_EXCEEDED,
}
VOCAB = 264  # the tiny model's vocabulary (tests/synthesis/tiny_synthesis.py)
PATHS = [
  IDENTITY_SKIP,
  FULL,
  "embed, blocks[0:2), head",
  "embed, blocks[0:2), blocks[0:2), blocks[2:3), head",  # a repeated span
]
BAD_PATHS = [
  "embed, " + "blocks[0:2), " * 7 + "head",  # past twice the model's layers
  "embed, blocks[0:3), head",  # ends inside a thoughtlet
  "head, embed",
  "embed, blocks[0:2)@int8, head",  # no such variant in the registry
  "embed, blocks[0:100000), head",
]
token_ids = st.integers(0, VOCAB - 1)
stop_sets = st.lists(
  st.one_of(
    st.sampled_from([" ", "e", "the", "\n", ".", "fox", "é", "\ufffd", "x" * 256]), st.text(min_size=1, max_size=6)
  ),
  max_size=5,
)
# Each sets a field to a value past its type, the model or the config (refused with INVALID_ARGUMENT).
HOSTILE = {
  "temperature": st.sampled_from([-1.0, float("inf"), float("nan")]),
  "top_p": st.sampled_from([0.0, 1.5, float("nan"), float("-inf")]),
  "top_k": st.sampled_from([VOCAB + 1, 2**31 - 1, 2**31, 2**32 - 1]),
  "seed": st.sampled_from([2**32, 2**64 - 1]),
  "max_latency_ms": st.sampled_from([0.0, -1.0, float("inf"), float("nan")]),
  "path": st.sampled_from(BAD_PATHS),
}


@st.composite
def runnable(draw) -> pb.SynthesizeRequest:
  """A well-formed request meant to run (a short prompt, a few tokens, random sampling values, stop sets, an
  explicit path or hints), then none, one or two fields set past their type, the model or the config."""
  m = pb.SynthesizeRequest(
    prompt=draw(st.sampled_from(["The quick brown fox", "a", "Once upon a time there was"])),
    max_tokens=draw(st.integers(1, 6)),
    hints=draw(st.lists(st.sampled_from(HINTS[:3]), max_size=3)),
    stop_strings=draw(stop_sets),
  )
  for name, strat in (
    ("temperature", st.floats(0, 3, width=32) | st.sampled_from([1e-30, 1e30, 3.4e38])),
    ("top_p", st.floats(2**-10, 1, width=32)),
    ("top_k", st.integers(0, VOCAB)),
    ("seed", st.integers(0, 2**32 - 1)),
    ("max_latency_ms", st.sampled_from([1e-3, 5.0, 1e4, 1e12])),
    ("path", st.sampled_from(PATHS)),
  ):
    if draw(st.booleans()):
      setattr(m, name, draw(strat))
  m.stop_token_ids.extend(draw(st.lists(token_ids, max_size=2)))
  m.logit_bias.update(draw(st.dictionaries(token_ids, st.floats(-100, 100, width=32), max_size=2)))
  for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
    hostile = draw(
      st.sampled_from([*HOSTILE, "stop_strings", "stop_token_ids", "logit_bias", "hints", "prompt_too_long"])
    )
    if hostile in HOSTILE:
      setattr(m, hostile, draw(HOSTILE[hostile]))
    elif hostile == "stop_strings":
      m.stop_strings.extend(draw(st.sampled_from([[""], ["y" * 257], ["z"] * 17])))
    elif hostile == "stop_token_ids":
      m.stop_token_ids.append(draw(st.sampled_from([-1, VOCAB, 2**31 - 1])))
    elif hostile == "logit_bias":
      m.logit_bias[draw(st.sampled_from([-1, 0, VOCAB]))] = draw(st.sampled_from([float("inf"), float("nan"), 1.0]))
    elif hostile == "hints":
      m.hints.extend(draw(st.sampled_from([HINTS[3:], ["klingon"], ["", " "], ["x" * 300]])))
    else:
      m.prompt, m.max_tokens = "x " * 300, 6  # prompt + max_tokens past the context: OUT_OF_RANGE
  return m


def test_valid_shaped_requests_with_random_values_reach_the_model_and_get_a_documented_status(synthesizer):
  counts = {"requests": 0, "crashes": 0, "wrong": 0, "tokens": 0, "ran_explicit_path": 0, "ran_with_stops": 0}
  statuses: dict = {}
  with BackgroundServer(synthesizer, config(max_concurrent=4, max_queue=8)) as srv:
    wait_ready(srv)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = rpc.SynthesizerStub(ch)

    @settings(
      max_examples=RUN_EXAMPLES,
      deadline=None,
      database=None,
      derandomize=True,
      suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(runnable(), min_size=RUN_BATCH, max_size=RUN_BATCH))
    def batch(items):
      calls = [(m, stub.Synthesize(m, timeout=60)) for m in items]
      for m, call in calls:
        try:
          out = list(call)
          code = C.OK
          counts["tokens"] += out[-1].final.usage.tokens_out
          counts["ran_explicit_path"] += bool(m.path)
          counts["ran_with_stops"] += bool(m.stop_strings)
        except grpc.RpcError as e:
          code = e.code()
          assert e.details(), m
        counts["requests"] += 1
        counts["crashes"] += code in (C.UNKNOWN, C.INTERNAL)
        counts["wrong"] += code not in RUN_ALLOWED
        statuses[code.name] = statuses.get(code.name, 0) + 1
        assert code in RUN_ALLOWED, (code, m)

    with ch:
      batch()
      health = health_pb2_grpc.HealthStub(ch)
      assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
      final = list(stub.Synthesize(pb.SynthesizeRequest(prompt="The quick brown fox", max_tokens=4), timeout=120))
      assert final[-1].final.usage.tokens_out >= 1
    assert srv.call(lambda: srv.app.service.scheduler.wait_idle(60))
    service_statuses = dict(srv.app.service.statuses)
  print(f"fuzz (model): {counts}, statuses {statuses}")
  assert counts["requests"] == RUN_BATCH * RUN_EXAMPLES and counts["crashes"] == counts["wrong"] == 0
  assert statuses.get("OK", 0) >= counts["requests"] // 3 and counts["tokens"] > 0, statuses  # the model ran
  assert counts["ran_explicit_path"] > 0 and counts["ran_with_stops"] > 0, counts
  assert statuses.get("INVALID_ARGUMENT", 0) > 0  # and the hostile values were refused
  assert "UNKNOWN" not in service_statuses and "INTERNAL" not in service_statuses, service_statuses

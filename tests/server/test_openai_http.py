"""The OpenAI-compatible HTTP endpoint (server/http.py) driven by the official ``openai`` client and by raw
HTTP, on 127.0.0.1 over the tiny calibrated registry: the same answers as gRPC, streaming with usage, the
error body and statuses, the client token shared with gRPC, admission (429) and readiness (503), a client that
disconnects mid-stream freeing its slot, and hostile bodies refused by name while the server keeps serving."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
import types

import grpc
import openai
import pytest

from tests.server.conftest import config, wait_ready
from thoughtjax.client import Client
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import ClientsConfig, ConfigError
from thoughtjax.server.openai_request import HttpError, synthesize_request

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
TOKEN = "s3cret-client-token-0123456789"


@pytest.fixture(scope="module")
def http_served(synthesizer):
  with BackgroundServer(synthesizer, config(max_concurrent=2, max_queue=2, http_port=0)) as srv:
    wait_ready(srv)
    yield srv


_clients: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients():
  """Every client a test made is closed with it (an open socket left to the collector is a warning, an error)."""
  yield
  while _clients:
    _clients.pop().close()


def client_of(srv, key: str = "unused") -> openai.OpenAI:
  _clients.append(openai.OpenAI(base_url=f"http://127.0.0.1:{srv.app.http_port}/v1", api_key=key, max_retries=0))
  return _clients[-1]


def model_of(srv) -> str:
  return srv.app.http.model_id()


def raw(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None, **kw):
  """One HTTP request on a fresh connection: (status, parsed JSON body)."""
  conn = http.client.HTTPConnection("127.0.0.1", srv.app.http_port, timeout=120)
  try:
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})}, **kw)
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"null")
  finally:
    conn.close()


def post(srv, body, path: str = "/v1/chat/completions", **kw):
  return raw(srv, "POST", path, json.dumps(body).encode(), **kw)


def assert_serves(srv) -> None:
  """The server still answers a good request."""
  got = client_of(srv).chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=2)
  assert got.choices[0].finish_reason in ("length", "stop") and got.usage.completion_tokens >= 1


# ---- the body -> SynthesizeRequest translation (no server) --------------------------------------------------
def test_a_chat_body_becomes_the_synthesize_request_of_the_same_fields():
  m, opts = synthesize_request(
    {
      "model": "tiny",
      "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 7,
      "temperature": 0.5,
      "top_p": 0.9,
      "top_k": 3,
      "seed": 11,
      "stop": "\n",
      "logit_bias": {"5": -100, "6": 2.5},
      "n": 1,
      "stream": True,
      "stream_options": {"include_usage": True},
      "synthesis_hints": ["fast_draft"],
      "max_latency_ms": 250,
      "path": "embed, blocks[0:6), head",
      "user": "someone",
      "presence_penalty": 0,
    },
    "chat",
    "tiny",
    "rid-1",
  )
  assert [(x.role, x.content) for x in m.messages] == [("user", "ab")] and not m.prompt
  assert (m.max_tokens, m.top_k, m.seed, m.hints, m.stop_strings) == (7, 3, 11, ["fast_draft"], ["\n"])
  assert m.temperature == 0.5 and m.top_p == pytest.approx(0.9) and m.max_latency_ms == 250.0
  assert dict(m.logit_bias) == {5: -100.0, 6: 2.5} and m.path == "embed, blocks[0:6), head" and m.request_id == "rid-1"
  assert opts.stream and opts.include_usage and opts.max_tokens_field == "max_completion_tokens"
  # Unset fields take OpenAI's defaults: temperature 1, top_p 1, and as many tokens as fit (until_eos).
  m, opts = synthesize_request({"prompt": "x"}, "completion", "tiny")
  assert m.prompt == "x" and (m.temperature, m.top_p) == (1.0, 1.0) and not m.HasField("max_tokens")
  assert opts.until_eos and not opts.stream and opts.ignored == ()


@pytest.mark.parametrize(
  "response_format, schema",
  [
    ({"type": "text"}, ""),
    ({"type": "json_object"}, {"type": "object"}),
    (
      {
        "type": "json_schema",
        "json_schema": {
          "name": "person",
          "strict": True,
          "schema": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
        },
      },
      {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
    ),
  ],
)
def test_response_format_maps_onto_the_json_schema_field(response_format, schema):
  for endpoint, text in (("chat", {"messages": CHAT}), ("completion", {"prompt": PROMPT})):
    m, _ = synthesize_request({**text, "response_format": response_format}, endpoint, None)
    assert (json.loads(m.json_schema) if m.json_schema else "") == schema
    assert not m.regex and not m.grammar


def test_regex_and_grammar_extensions_map_to_their_fields_and_exclude_a_json_format():
  m, _ = synthesize_request({"prompt": "x", "regex": "[0-9]+"}, "completion", None)
  assert m.regex == "[0-9]+" and not m.json_schema
  m, _ = synthesize_request({"prompt": "x", "grammar": 'start: "a"'}, "completion", None)
  assert m.grammar == 'start: "a"'
  with pytest.raises(HttpError, match="send one") as e:
    synthesize_request({"prompt": "x", "regex": "a", "response_format": {"type": "json_object"}}, "completion", None)
  assert e.value.param == "response_format"
  m, _ = synthesize_request({"messages": [{"role": "user", "content": "x"}], "cache_salt": "tenant-a"}, "chat", None)
  assert m.cache_salt == "tenant-a"  # the prefix cache's scope (vLLM's field)


@pytest.mark.parametrize(
  "body, param, match",
  [
    ({"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ({"messages": CHAT, "response_format": "json"}, "response_format", "expected an object"),
    ({"messages": CHAT, "n": 2}, "n", "one choice per request"),
    ({"messages": CHAT, "max_tokens": -1}, "max_tokens", "expected an integer in [0,"),
    ({"messages": CHAT, "max_completion_tokens": 2**40}, "max_completion_tokens", "expected an integer in [0,"),
    ({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "differ"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature", "expected a number, got a string"),
    ({"messages": CHAT, "seed": -1}, "seed", "expected an integer"),
    ({"messages": CHAT, "stop": [1, 2]}, "stop", "array of strings"),
    ({"messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"messages": CHAT, "synthesis_hints": ["a", "b", "c", "d"]}, "synthesis_hints", "at most 3"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only with stream"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": CHAT, "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text parts"),
    ({"messages": []}, "messages", "non-empty array"),
    ({"prompt": PROMPT}, "messages", "non-empty array"),  # a completion's field is no chat field: ignored
  ],
)
def test_each_bad_body_is_a_400_naming_the_field(body, param, match):
  with pytest.raises(HttpError, match=match.replace("[", r"\[").replace("(", r"\(")) as e:
    synthesize_request(body, "chat", None)
  assert e.value.status == 400 and e.value.param == param


def test_strict_fields_refuses_an_unknown_field_by_name():
  for body, param in (({"messages": CHAT, "temprature": 0}, "temprature"), ({"prompt": PROMPT}, "prompt")):
    with pytest.raises(HttpError, match=r"unknown fields \['" + param) as e:
      synthesize_request(body, "chat", None, strict=True)
    assert e.value.status == 400 and e.value.param == param and "strict_fields" in str(e.value)


def test_another_model_is_404_model_not_found():
  with pytest.raises(HttpError, match="does not exist") as e:
    synthesize_request({"model": "gpt-4o", "messages": CHAT}, "chat", "tiny")
  assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")


# ---- the served endpoint ------------------------------------------------------------------------------------
def test_models_lists_the_served_model(http_served):
  models = client_of(http_served).models.list().data
  assert [m.id for m in models] == [model_of(http_served)] == [http_served.app.service.registry.root.name]
  assert models[0].object == "model" and models[0].owned_by == "thoughtjax" and models[0].created > 0


def test_chat_and_completion_give_what_grpc_gives_for_the_same_greedy_request(http_served):
  srv = http_served
  c = client_of(srv)
  with Client(f"127.0.0.1:{srv.port}", timeout=120) as g:
    want_chat = g.generate(messages=CHAT, max_tokens=9)
    want_text = g.generate(PROMPT, max_tokens=9)
  chat = c.chat.completions.with_raw_response.create(
    model=model_of(srv), messages=CHAT, max_tokens=9, temperature=0, extra_headers={"X-Request-Id": "http-chat-1"}
  )
  assert chat.headers["x-request-id"] == "http-chat-1"
  chat = chat.parse()
  assert chat.object == "chat.completion" and chat.id == "chatcmpl-http-chat-1" and chat.model == model_of(srv)
  choice = chat.choices[0]
  assert choice.message.role == "assistant" and choice.message.content == want_chat.text
  assert choice.finish_reason == {"stop_string": "stop"}.get(want_chat.finish_reason, want_chat.finish_reason)
  u = chat.usage
  assert (u.prompt_tokens, u.completion_tokens) == (want_chat.usage.tokens_in, want_chat.usage.tokens_out)
  assert u.total_tokens == u.prompt_tokens + u.completion_tokens
  ext = chat.model_extra["thoughtjax"]
  assert ext["request_id"] == "http-chat-1" and ext["plan"]["path"] == ext["trace"]["path"]
  assert {"kind", "predicted_ms", "path_hash"} <= set(ext["plan"]) and "total" in ext["trace"]["actual_ms"]

  text = c.completions.create(model=model_of(srv), prompt=PROMPT, max_tokens=9, temperature=0)
  assert text.object == "text_completion" and text.choices[0].text == want_text.text
  assert text.usage.completion_tokens == want_text.usage.tokens_out
  m = srv.app.service.metrics  # counted per endpoint, beside the gRPC methods
  assert m.sample("thoughtjax_requests_total", {"method": "/v1/chat/completions", "code": "OK"}) >= 1
  assert m.sample("thoughtjax_requests_total", {"method": "/v1/completions", "code": "OK"}) >= 1


def test_a_json_schema_response_format_gives_json_that_validates(http_served):
  import jsonschema

  schema = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
  }
  chat = client_of(http_served).chat.completions.create(
    model=model_of(http_served),
    messages=CHAT,
    temperature=0,
    max_tokens=190,  # the grammar bounds it: whitespace between tokens is at most a newline and 20 indents
    response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}},
  )
  choice = chat.choices[0]
  assert choice.finish_reason == "stop", choice.message.content
  jsonschema.validate(json.loads(choice.message.content), schema)
  assert any("constrained by a JSON schema" in n for n in chat.model_extra["thoughtjax"]["plan"]["notes"])


def test_a_stream_sends_role_deltas_finish_usage_and_done(http_served):
  srv = http_served
  c = client_of(srv)
  greedy = dict(model=model_of(srv), messages=CHAT, max_tokens=9, temperature=0)
  whole = c.chat.completions.create(**greedy).choices[0].message.content
  chunks = list(c.chat.completions.create(**greedy, stream=True, stream_options={"include_usage": True}))
  assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole
  finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
  assert finish in (["length"], ["stop"])
  last = chunks[-1]
  assert last.choices == [] and last.usage.completion_tokens >= 1
  assert last.model_extra["thoughtjax"]["trace"]["path"] and all(ch.usage is None for ch in chunks[:-1])
  # Raw: the event stream's framing, and the thoughtjax field on the last chunk without include_usage.
  conn = http.client.HTTPConnection("127.0.0.1", srv.app.http_port, timeout=120)
  body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
  conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
  r = conn.getresponse()
  assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
  events = [e for e in r.read().decode().split("\n\n") if e]
  conn.close()
  assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
  data = [json.loads(e[6:]) for e in events[:-1]]
  assert data[-1]["choices"][0]["finish_reason"] in ("length", "stop") and "thoughtjax" in data[-1]
  assert all(d["object"] == "text_completion" and "usage" not in d for d in data)


@pytest.mark.parametrize(
  "fields, status, param, code",
  [
    ({"temperature": -1.0}, 400, "temperature", "invalid_argument"),
    ({"max_tokens": 0}, 400, "max_tokens", "invalid_argument"),
    ({"synthesis_hints": ["poetry_in_klingon"]}, 400, "synthesis_hints", "invalid_argument"),
    ({"path": "embed, blocks[0:2, head"}, 400, "path", "invalid_argument"),
    ({"max_tokens": 250}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "invalid_argument"),
  ],
)
def test_a_request_the_servicer_refuses_is_a_400_with_the_field_and_request_id(
  http_served, fields, status, param, code
):
  c = client_of(http_served)
  with pytest.raises(openai.BadRequestError) as e:
    known = {k: v for k, v in {"messages": CHAT, **fields}.items() if k in ("messages", "max_tokens", "temperature")}
    extensions = {k: v for k, v in fields.items() if k not in known}  # the client sends them as they are
    c.chat.completions.create(model=model_of(http_served), **known, extra_body=extensions)
  err = e.value.body
  assert e.value.status_code == status and err["param"] == param and err["code"] == code
  assert err["type"] == "invalid_request_error" and "(request id " in err["message"]


def test_an_unknown_model_is_404(http_served):
  with pytest.raises(openai.NotFoundError) as e:
    client_of(http_served).chat.completions.create(model="gpt-4o", messages=CHAT)
  assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_the_client_token_guards_both_protocols(synthesizer):
  with BackgroundServer(synthesizer, config(http_port=0, clients=ClientsConfig(token=TOKEN))) as srv:
    wait_ready(srv)
    for key in ("wrong-token-0123456789",):
      with pytest.raises(openai.AuthenticationError) as e:
        client_of(srv, key).chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=2)
      assert e.value.body["type"] == "authentication_error" and "clients.token" in e.value.body["message"]
    for path in ("/v1/models", "/v1/chat/completions"):  # no Authorization header at all
      status, body = raw(srv, "GET" if path.endswith("models") else "POST", path, b"{}")
      assert status == 401 and body["error"]["code"] == "unauthenticated"
    got = client_of(srv, TOKEN).chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=2)
    assert got.usage.completion_tokens >= 1
    # gRPC: the same token in the metadata.
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
      stub = rpc.SynthesizerStub(ch)
      with pytest.raises(grpc.RpcError) as e:
        list(stub.Synthesize(pb.SynthesizeRequest(prompt=PROMPT, max_tokens=2), timeout=60))
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(f"127.0.0.1:{srv.port}", timeout=120, token=TOKEN) as g:
      assert g.generate(PROMPT, max_tokens=2).usage.tokens_out >= 1
    # With a token, the Host is not what authenticates: a request by another name with the token is answered.
    status, _ = raw(
      srv, "GET", "/v1/models", headers={"Host": "thoughtjax.internal", "Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 200


def test_a_tokenless_server_answers_only_its_own_host_names(synthesizer):
  """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example. A server
  without a client token refuses it (403, named) before any work; loopback names, the bind address and the names in
  http_allowed_hosts are answered."""
  with BackgroundServer(synthesizer, config(http_port=0, http_allowed_hosts=["Models.LAN"])) as srv:
    wait_ready(srv)
    port = srv.app.http_port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "192.168.1.20"):
      status, got = raw(srv, "POST", "/v1/chat/completions", json.dumps({"messages": CHAT}).encode(), {"Host": host})
      assert (
        status == 403 and got["error"]["code"] == "host_not_allowed" and "http_allowed_hosts" in got["error"]["message"]
      )
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "models.lan", f"MODELS.LAN:{port}"):
      status, got = raw(srv, "GET", "/v1/models", headers={"Host": host})
      assert status == 200, (host, got)
    assert_serves(srv)
  with pytest.raises(ConfigError, match="http_allowed_hosts: expected a list of host names"):
    config(http_allowed_hosts="models.lan")


def test_a_token_file_is_read_again_only_when_it_changes(tmp_path, monkeypatch):
  """The client token file is stat-ed per request and read only when it changed: a rotated secret takes effect at
  once, an unchanged one is not re-read on the event loop."""
  from pathlib import Path

  from thoughtjax.server import config as config_mod

  f = tmp_path / "token"
  f.write_text("first-secret-0123456789\n")
  clients = ClientsConfig(token_file=f)
  reads = []
  real = Path.read_text
  monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or real(self, *a, **k))
  assert [clients.bearer() for _ in range(5)] == ["first-secret-0123456789"] * 5 and reads == [f]
  f.write_text("second-secret-0123456789-rotated\n")
  assert clients.bearer() == "second-secret-0123456789-rotated" and reads == [f, f]
  f.unlink()
  with pytest.raises(config_mod.ConfigError, match="cannot read it"):
    clients.bearer()


def test_a_full_queue_is_429_and_a_warming_or_draining_server_503(synthesizer):
  gate, entered, warm = threading.Event(), threading.Semaphore(0), threading.Event()

  class Gated:
    """The synthesizer with a start that holds the turn until the test opens the gate."""

    def __getattr__(self, name):
      return getattr(synthesizer, name)

    def synthesize(self, *a, **kw):
      entered.release()
      gate.wait(60)
      return synthesizer.synthesize(*a, **kw)

  with BackgroundServer(Gated(), config(max_concurrent=1, max_queue=0, http_port=0), warm=lambda: warm.wait(60)) as srv:
    with pytest.raises(openai.InternalServerError) as e:
      client_of(srv).chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=2)
    assert e.value.status_code == 503 and "warming" in e.value.body["message"]
    warm.set()
    wait_ready(srv)
    results = []
    first = threading.Thread(
      target=lambda: results.append(client_of(srv).completions.create(model=model_of(srv), prompt=PROMPT, max_tokens=2))
    )
    first.start()
    assert entered.acquire(timeout=60)  # the first holds the only turn; no queue
    with pytest.raises(openai.RateLimitError) as e:
      client_of(srv).completions.create(model=model_of(srv), prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "resource_exhausted" and "max_queue 0" in e.value.body["message"]
    gate.set()
    first.join(120)
    assert results and results[0].usage.completion_tokens >= 1
    assert_serves(srv)
    srv.call(srv.app.begin_drain)
    status, got = post(srv, {"messages": CHAT, "max_tokens": 2})
    assert status == 503 and "draining" in got["error"]["message"] and got["error"]["code"] == "unavailable"


def test_a_full_server_refuses_before_any_costly_check(synthesizer, monkeypatch):
  """Every turn taken, no queue: a request with a large prompt and a regex is refused (429, gRPC RESOURCE_EXHAUSTED)
  before its prompt is tokenized or its constraint compiled: the request checks never run for it."""
  from thoughtjax.server import servicer as servicer_mod

  gate, entered = threading.Event(), threading.Semaphore(0)
  checked = []
  real_validate = servicer_mod.validate

  def counting_validate(m, *a, **kw):
    checked.append(m.request_id)
    return real_validate(m, *a, **kw)

  monkeypatch.setattr(servicer_mod, "validate", counting_validate)

  class Gated:
    def __getattr__(self, name):
      return getattr(synthesizer, name)

    def synthesize(self, *a, **kw):
      entered.release()
      gate.wait(60)
      return synthesizer.synthesize(*a, **kw)

  with BackgroundServer(Gated(), config(max_concurrent=1, max_queue=0, http_port=0)) as srv:
    wait_ready(srv)
    first = threading.Thread(target=lambda: post(srv, {"messages": CHAT, "max_tokens": 2}))
    first.start()
    try:
      assert entered.acquire(timeout=60)  # the first holds the only turn
      before = len(checked)
      costly = {"messages": [{"role": "user", "content": "word " * 50_000}], "max_tokens": 2}
      status, got = post(srv, {**costly, "regex": "[a-z]{1,40}( [a-z]{1,40}){0,30}"})
      assert status == 429 and got["error"]["code"] == "resource_exhausted", got
      with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        with pytest.raises(grpc.RpcError) as e:
          rpc.SynthesizerStub(ch).GetOptimalPath(
            pb.SynthesizeRequest(prompt="word " * 50_000, regex="[a-z]+"), timeout=60
          )
      assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
      assert len(checked) == before  # neither refused request was tokenized or compiled
    finally:
      gate.set()
      first.join(120)
    assert_serves(srv)


def test_a_client_that_disconnects_mid_stream_frees_its_slot_within_one_chunk(http_served):
  srv = http_served
  x = srv.app.service.registry.codec.encode("x")[-1]  # a token with text: every delta is a chunk
  stream = client_of(srv).chat.completions.create(
    model=model_of(srv),
    messages=CHAT,
    max_tokens=180,
    logit_bias={str(x): 50.0},  # no early stop
    stream=True,
    extra_headers={"X-Request-Id": "http-leaves"},
  )
  it = iter(stream)
  assert next(it).choices[0].delta.role == "assistant"
  assert next(it).choices[0].delta.content
  stream.close()  # drops the connection mid-body
  sched = srv.app.service.scheduler
  assert srv.call(lambda: sched.wait_idle(60))
  rec = next(r for r in sched.records if r.request_id == "http-leaves")
  assert rec.ended_by == "cancelled" and rec.closed and rec.tokens_out < 180
  assert rec.decode_chunks_end - rec.decode_chunks_at_cancel <= 1
  assert sched.running == 0 and sched.waiting == 0 and sched.snapshot().get("slots_in_use", 0) == 0
  assert_serves(srv)


def test_a_client_that_leaves_a_non_streaming_request_frees_its_turn(synthesizer):
  """Each delta of the run waits for a gate the test opens only after the client's socket is closed, so the
  client leaves mid-generation whatever the machine's speed; the run is then stopped, never run out."""
  import socket

  gate, generating = threading.Event(), threading.Event()

  class Gated:  # a run that forwards to the synthesizer's and runs alone (its deltas are gated here)
    def __init__(self, run):
      self.__dict__["_run"] = run

    def __getattr__(self, name):
      return getattr(self._run, name)

    request = types.SimpleNamespace(slot=lambda: None)  # runs alone

    def __iter__(self):
      return self

    def __next__(self):
      generating.set()
      gate.wait(60)
      return next(self._run)

  class Slow:
    def __getattr__(self, name):
      return getattr(synthesizer, name)

    def synthesize(self, *a, **kw):
      return Gated(synthesizer.synthesize(*a, **kw))

  with BackgroundServer(Slow(), config(http_port=0)) as srv:
    wait_ready(srv)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 120}).encode()
    with socket.create_connection(("127.0.0.1", srv.app.http_port), timeout=60) as sock:
      head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      sock.sendall(f"{head}X-Request-Id: http-gone\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
      assert generating.wait(60)  # the run is generating, nothing answered yet
    sched = srv.app.service.scheduler
    assert srv.call(
      lambda: _until(lambda: sched.running == 0)  # the server saw the client leave: the call ended, the chunk runs on
    )
    gate.set()
    assert srv.call(lambda: sched.wait_idle(60))
    rec = next(r for r in sched.records if r.request_id == "http-gone")
    assert rec.ended_by == "cancelled" and rec.closed and rec.tokens_out < 120
    assert rec.decode_chunks_end - rec.decode_chunks_at_cancel <= 1
    assert sched.running == 0
    assert_serves(srv)


async def _until(cond):
  while not cond():
    await asyncio.sleep(0)  # yield to the loop (the server's own bookkeeping), not a timed wait
  return True


# ---- attacks: each refused by name, and the server still serves -------------------------------------------------
def test_malformed_deep_or_non_object_json_is_400(http_served):
  for body, match in (
    (b'{"messages": [', "not valid JSON"),
    (b"[1, 2]", "JSON object, got a JSON array"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 200_000, "nests JSON too deeply"),
  ):
    status, got = raw(http_served, "POST", "/v1/chat/completions", body)
    assert status == 400 and match in got["error"]["message"], got
  assert_serves(http_served)


def test_a_huge_body_is_413_with_or_without_a_length(http_served):
  limit = http_served.app.config.http_max_body_bytes
  huge = json.dumps({"messages": [{"role": "user", "content": "x" * (2 * limit)}]}).encode()
  status, got = raw(http_served, "POST", "/v1/chat/completions", huge)
  assert status == 413 and "http_max_body_bytes" in got["error"]["message"]
  # Chunked, no Content-Length: refused once the cap is read, not after the whole body.
  pieces = iter([huge[i : i + 65536] for i in range(0, len(huge), 65536)])
  status, got = raw(http_served, "POST", "/v1/chat/completions", pieces, encode_chunked=True)
  assert status == 413 and got["error"]["code"] == "request_too_large"
  assert_serves(http_served)


def test_a_wrong_content_type_is_415(http_served):
  status, got = raw(http_served, "POST", "/v1/chat/completions", b"messages=hi", {"Content-Type": "text/plain"})
  assert status == 415 and "application/json" in got["error"]["message"]
  assert_serves(http_served)


def test_a_compressed_body_is_refused_unread_not_inflated(http_served):
  """A gzip body that inflates to 1 GiB of zeros (about 1 MiB on the wire, under the body cap) is a named 415: the
  server never inflates a request body."""
  import gzip

  limit = http_served.app.config.http_max_body_bytes
  bomb = gzip.compress(b"0" * (64 << 20), compresslevel=9) * 16  # 16 gzip members: 1 GiB inflated
  assert len(bomb) < limit
  for encoding in ("gzip", "deflate", "br"):
    status, got = raw(http_served, "POST", "/v1/chat/completions", bomb, {"Content-Encoding": encoding})
    assert status == 415 and "Content-Encoding" in got["error"]["message"] and encoding in got["error"]["message"]
  assert_serves(http_served)


def test_a_client_string_cannot_forge_a_log_line(http_served, caplog):
  """A model name (or any client text an error repeats) with a newline and a terminal escape is logged escaped, on
  the line of its own request."""
  forged = "x\nINFO:thoughtjax.server:request 0 answered OK\x1b[2K"
  with caplog.at_level("INFO", logger="thoughtjax.server"):
    status, got = post(http_served, {"model": forged, "messages": CHAT})
    code, details = 0, ""
    with grpc.insecure_channel(f"127.0.0.1:{http_served.port}") as ch:
      try:
        rpc.SynthesizerStub(ch).GetOptimalPath(pb.SynthesizeRequest(prompt=PROMPT, hints=[forged]), timeout=60)
      except grpc.RpcError as e:
        code, details = e.code(), e.details()
  assert status == 404 and "\\n" in got["error"]["message"]  # the client's name comes back escaped too
  assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
  logged = [r.getMessage() for r in caplog.records]
  assert sum("x\\nINFO" in m for m in logged) >= 2, logged  # both requests logged, each escaped
  assert not [m for m in logged if "\n" in m or "\x1b" in m], logged


def test_no_plan_note_or_trace_names_a_filesystem_path_or_an_exception_class(http_served, monkeypatch):
  """A request without hints on a registry without a router gets a note saying so, over both protocols, without the
  registry's path; a plan whose texts carry a path and a class name (a failed restore's) reaches clients without
  either."""
  import dataclasses

  from thoughtjax.server.messages import plan_message

  root = str(http_served.app.service.syn.registry.root)
  status, got = post(http_served, {"messages": CHAT, "max_tokens": 2})
  assert status == 200, got
  ext = json.dumps(got["thoughtjax"])
  with grpc.insecure_channel(f"127.0.0.1:{http_served.port}") as ch:
    plan = rpc.SynthesizerStub(ch).GetOptimalPath(pb.SynthesizeRequest(prompt=PROMPT, max_tokens=2), timeout=60)
  for text in (ext, str(plan)):
    assert "no hints given" in text and "train-router --registry DIR" in text, text[:2000]
    assert root not in text and "Error" not in text
  syn = http_served.app.service.syn
  real = syn.plan(PROMPT, ["general_purpose"], max_latency_ms=1e9, max_tokens=2)
  leaky = dataclasses.replace(
    real,
    reason=f"unavailable: blocks[0:2)@v1 failed restore (RestoreError) from {root}/versions/x",
    notes=(f"restoring head from {root}/versions/y failed with OSError: [Errno 5]",),
  )
  msg = plan_message(leaky, "rid")
  assert root not in str(msg) and "RestoreError" not in str(msg) and "OSError" not in str(msg)
  assert "failed restore (failure) from <path>" in msg.reason and "<path>" in msg.notes[0]


def test_negative_max_tokens_n_2_and_a_wrong_type_are_named_400s(http_served):
  model = model_of(http_served)
  for fields, param in (({"max_tokens": -5}, "max_tokens"), ({"n": 2}, "n"), ({"temperature": [1]}, "temperature")):
    status, got = post(http_served, {"model": model, "messages": CHAT, **fields})
    assert status == 400 and got["error"]["param"] == param, got
  assert_serves(http_served)


def test_an_unknown_route_or_method_is_an_openai_error(http_served):
  status, got = raw(http_served, "GET", "/v1/chat/completions")
  assert status == 405 and got["error"]["type"] == "invalid_request_error"
  status, got = raw(http_served, "POST", "/v1/engines/x/completions", b"{}")
  assert status == 404 and "error" in got
  assert_serves(http_served)


# ---- what llama-server and vLLM clients send --------------------------------------------------------------------
OTHER_SERVERS = {"min_p": 0.05, "repetition_penalty": 1.1, "cache_prompt": True}


def test_fields_of_other_servers_are_ignored_and_logged_once_by_name(http_served, caplog):
  c = client_of(http_served)
  with caplog.at_level(logging.WARNING, logger="thoughtjax.server.http"):
    for _ in range(2):
      got = c.chat.completions.create(
        model=model_of(http_served), messages=CHAT, max_tokens=2, extra_body=OTHER_SERVERS
      )
      assert got.usage.completion_tokens >= 1
      assert got.model_extra["thoughtjax"]["ignored_fields"] == sorted(OTHER_SERVERS)
  warned = [r.getMessage() for r in caplog.records if "ignoring unknown request fields" in r.getMessage()]
  assert len(warned) <= 1 and all(f in "".join(warned) for f in OTHER_SERVERS)  # once per name and server


def test_strict_fields_keeps_the_400(synthesizer):
  with BackgroundServer(synthesizer, config(http_port=0, strict_fields=True)) as srv:
    wait_ready(srv)
    status, got = post(srv, {"messages": CHAT, "max_tokens": 2, **OTHER_SERVERS})
    assert status == 400 and got["error"]["param"] == "cache_prompt" and "strict_fields" in got["error"]["message"]
    status, got = raw(srv, "POST", "/tokenize", json.dumps({"content": "x", "parse_special": True}).encode())
    assert status == 400 and got["error"]["param"] == "parse_special"


def test_unset_fields_take_openais_defaults(http_served, synthesizer):
  """Sampled at temperature 1 and top_p 1, and no max_tokens generates until the end of text or the bound:
  max_tokens_limit or the context left after the prompt, whichever is smaller."""
  from thoughtjax.server.validation import Serving, validate

  c = client_of(http_served)
  x = http_served.app.service.registry.codec.encode("x")[-1]
  got = c.completions.create(model=model_of(http_served), prompt=PROMPT, logit_bias={str(x): 50.0})  # no early stop
  context = http_served.app.service.serving.max_context
  assert got.choices[0].finish_reason == "length" and got.usage.total_tokens == context
  s = Serving.of(synthesizer)
  m, opts = synthesize_request({"prompt": PROMPT}, "completion", None)
  assert validate(m, None, s, config(max_tokens_limit=5), until_eos=opts.until_eos).max_tokens == 5
  r = validate(m, None, s, config(), until_eos=True)
  assert r.max_tokens == context - len(r.prompt_ids) and (r.sampling["temperature"], r.sampling["top_p"]) == (1, 1)
  assert validate(m, None, s, config(), until_eos=False).max_tokens == 64  # gRPC's unset max_tokens
  # until_eos_tokens bounds the prompt and its output (doubled until the prompt and 64 new tokens fit), so such a
  # request does not make an engine with a ring of max_tokens_limit that every later request decodes over.
  p = len(r.prompt_ids)
  assert p + 64 <= 128 < context
  assert validate(m, None, s, config(until_eos_tokens=128), until_eos=True).max_tokens == 128 - p
  assert validate(m, None, s, config(until_eos_tokens=32), until_eos=True).max_tokens == 128 - p  # 32 -> 64 -> 128
  long = pb.SynthesizeRequest(prompt="x" * (context + 10))
  with pytest.raises(Exception, match="fill the model's context"):
    validate(long, None, s, config(), until_eos=True)


def test_the_developer_role_is_the_system_role(http_served):
  c = client_of(http_served)
  as_developer = [{"role": "developer", "content": "Be brief."}, CHAT[1]]
  want = c.chat.completions.create(model=model_of(http_served), messages=CHAT, max_tokens=6, temperature=0)
  got = c.chat.completions.create(model=model_of(http_served), messages=as_developer, max_tokens=6, temperature=0)
  assert got.choices[0].message.content == want.choices[0].message.content


def test_a_json_body_needs_no_content_type_and_a_clearly_other_type_is_415(http_served):
  body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
  conn = http.client.HTTPConnection("127.0.0.1", http_served.app.http_port, timeout=120)
  try:
    conn.putrequest("POST", "/v1/completions")  # no Content-Type header at all
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] >= 1
  finally:
    conn.close()
  for ctype, status in (
    ("application/x-www-form-urlencoded", 200),  # curl -d's default, with a JSON body
    ("application/json; charset=utf-8", 200),
    ("text/html", 415),
    ("multipart/form-data; boundary=x", 415),
  ):
    got_status, got = raw(http_served, "POST", "/v1/completions", body, {"Content-Type": ctype})
    assert got_status == status, (ctype, got)


def test_the_model_is_named_by_its_alias_or_the_registry_folder(synthesizer):
  with BackgroundServer(synthesizer, config(http_port=0, model_name="my-model")) as srv:
    wait_ready(srv)
    c = client_of(srv)
    assert [m.id for m in c.models.list().data] == ["my-model"]
    for name in ("my-model", srv.app.service.registry.root.name):
      got = c.chat.completions.create(model=name, messages=CHAT, max_tokens=2)
      assert got.model == "my-model" and got.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as e:
      c.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'my-model'" in e.value.body["message"]


def test_health_is_503_while_loading_warming_or_draining_and_200_when_serving(synthesizer):
  loaded, warmed = threading.Event(), threading.Event()

  def load():
    assert loaded.wait(60)
    return synthesizer

  with BackgroundServer(None, config(http_port=0), load=load, warm=lambda: warmed.wait(60)) as srv:
    for state, release in (("loading", loaded), ("warming", warmed)):
      status, got = raw(srv, "GET", "/health")
      assert (status, got["status"], got["error"]["code"]) == (503, state, "unavailable"), got
      release.set()
      if state == "loading":
        srv.call(lambda: _until(lambda: srv.app.service.serving is not None))
    wait_ready(srv)
    assert raw(srv, "GET", "/health") == (200, {"status": "ok"}) == raw(srv, "GET", "/v1/health")
    srv.call(srv.app.begin_drain)
    status, got = raw(srv, "GET", "/health")
    assert status == 503 and got["status"] == "draining"


def test_metrics_tokenize_and_detokenize_on_the_http_port_take_the_client_token(synthesizer):
  with BackgroundServer(synthesizer, config(http_port=0, clients=ClientsConfig(token=TOKEN))) as srv:
    wait_ready(srv)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert raw(srv, "GET", "/health") == (200, {"status": "ok"})  # probes carry no token
    body = json.dumps({"content": PROMPT}).encode()
    for method, path, data in (("GET", "/metrics", None), ("POST", "/tokenize", body), ("POST", "/detokenize", b"{}")):
      status, got = raw(srv, method, path, data)
      assert status == 401 and got["error"]["code"] == "unauthenticated", (path, got)
    client_of(srv, TOKEN).chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=2)
    conn = http.client.HTTPConnection("127.0.0.1", srv.app.http_port, timeout=60)
    try:
      conn.request("GET", "/metrics", headers=auth)
      r = conn.getresponse()
      text = r.read().decode()
    finally:
      conn.close()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain")
    assert 'thoughtjax_requests_total{code="OK",method="/v1/chat/completions"} 1.0' in text  # the same registry

    codec = srv.app.service.registry.codec
    status, got = raw(srv, "POST", "/tokenize", body, auth)
    assert status == 200 and got["tokens"] == codec.encode(PROMPT)[1 if codec.add_bos else 0 :]
    tokens = got["tokens"]
    status, got = raw(srv, "POST", "/tokenize", json.dumps({"content": PROMPT, "add_special": True}).encode(), auth)
    assert got["tokens"] == codec.encode(PROMPT)
    status, got = raw(srv, "POST", "/tokenize", json.dumps({"content": "ab", "with_pieces": True}).encode(), auth)
    assert "".join(p["piece"] for p in got["tokens"]) == "ab" and all(isinstance(p["id"], int) for p in got["tokens"])
    status, got = raw(srv, "POST", "/detokenize", json.dumps({"tokens": tokens}).encode(), auth)
    assert (status, got) == (200, {"content": PROMPT})
    for bad in ({"tokens": [10**9]}, {"tokens": "abc"}, {"tokens": [1.5]}):
      status, got = raw(srv, "POST", "/detokenize", json.dumps(bad).encode(), auth)
      assert status == 400 and got["error"]["param"] == "tokens", got
    status, got = raw(srv, "POST", "/tokenize", json.dumps({"content": 5}).encode(), auth)
    assert status == 400 and got["error"]["param"] == "content"


def test_client_token_flag_reaches_a_server_that_requires_one(synthesizer, capsys, monkeypatch):
  from thoughtjax.cli import main

  monkeypatch.delenv("THOUGHTJAX_API_KEY", raising=False)
  with BackgroundServer(synthesizer, config(clients=ClientsConfig(token=TOKEN))) as srv:
    wait_ready(srv)
    argv = ["client", "--target", f"127.0.0.1:{srv.port}", "--prompt", PROMPT, "--max-tokens", "2", "--timeout", "60"]
    assert main([*argv, "--json"]) == 2 and "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*argv, "--json", "--token", TOKEN]) == 0
    assert json.loads(capsys.readouterr().out)["final"]["usage"]["tokensOut"] >= 1
    monkeypatch.setenv("THOUGHTJAX_API_KEY", TOKEN)  # the server's variable serves the client too
    assert main([*argv, "--json"]) == 0

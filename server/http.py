"""OpenAI-compatible HTTP on the gRPC server's event loop and engines: ``POST /v1/chat/completions``,
``POST /v1/completions`` and ``GET /v1/models``, with llama-server's ``GET /health``, ``POST /tokenize`` and
``POST /detokenize`` and the server's Prometheus ``GET /metrics`` (``http_port`` in the server config).

Transport only. A body becomes a ``thoughtjax.v1.SynthesizeRequest`` (:func:`synthesize_request`) and goes
through the servicer's own steps: the client credential (:meth:`SynthesizerService.check_client`),
validation and admission (:meth:`~SynthesizerService.admit`), then scheduling and the run
(:meth:`~SynthesizerService.responses`). The limits, the queue, the slots and the metrics are those of the
gRPC ``Synthesize``; only the framing differs.

Body fields: ``model`` (the id ``/v1/models`` lists, or the registry's folder name; another is 404
``model_not_found``; omitted: the served one), ``messages`` (text content; roles system, user, assistant, and
developer as system) or ``prompt`` (a string), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (string or list), ``logit_bias``,
``n`` (1 only), ``stream``, ``stream_options.include_usage``, ``response_format`` (``text``; ``json_object``
and ``json_schema`` map to the request's ``json_schema``). Extensions: ``top_k``, ``synthesis_hints`` (at most
3), ``max_latency_ms``, ``path``, ``regex``, ``grammar``. Unset fields take OpenAI's defaults: temperature 1,
top_p 1, and no ``max_tokens`` generates until the end of text or ``max_tokens_limit`` or the context runs out,
whichever comes first. A field OpenAI defines but this server cannot honour (tools, logprobs, penalties) is
refused unless it asks for the default. An unknown field (another server's extension: ``min_p``,
``repetition_penalty``, ``cache_prompt``) is ignored, named once in the log and in the answer's
``thoughtjax.ignored_fields``, as vLLM and llama-server do; ``strict_fields`` in the config refuses it (400) so
that a typo never silently does nothing. A body is JSON with or without a ``Content-Type``.

Answers: ``chat.completion`` / ``text_completion`` objects, or server-sent ``data:`` chunks ending with
``data: [DONE]``; the plan, the trace and the request id in a ``thoughtjax`` field (the last chunk's when
streaming). Failures carry OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with the
status of :data:`HTTP_STATUS`; a failure after a stream began is one ``data: {"error": ...}`` event. A
client that disconnects cancels its handler, which closes the run: its slot is free at the end of the
decode chunk running then.

Imports inside functions here are deferred for start-up: importing this module does not load ``server.tls``; the
functions that need them do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import ssl
import time
from collections.abc import Collection
from typing import Any, Literal

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from thoughtjax.defaults import MAX_HINTS
from thoughtjax.errors import UserError
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.server.messages import log_safe

log = logging.getLogger("thoughtjax.server.http")

C = grpc.StatusCode
HTTP_STATUS = {
  C.INVALID_ARGUMENT: 400,
  C.OUT_OF_RANGE: 400,
  C.UNAUTHENTICATED: 401,
  C.PERMISSION_DENIED: 403,
  C.RESOURCE_EXHAUSTED: 429,
  C.UNAVAILABLE: 503,
  C.DEADLINE_EXCEEDED: 504,
}  # any other status: 500
ERROR_TYPE = {
  400: "invalid_request_error",
  401: "authentication_error",
  403: "permission_error",
  404: "invalid_request_error",
  405: "invalid_request_error",
  413: "invalid_request_error",
  415: "invalid_request_error",
  429: "rate_limit_error",
  503: "server_error",
  504: "server_error",
}  # any other status: server_error
CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
HEALTH, METRICS, TOKENIZE, DETOKENIZE = "/health", "/metrics", "/tokenize", "/detokenize"
ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
# Content types a client sends by default with a JSON body (curl -d: form-urlencoded): taken when the body is
# JSON, else 415. A JSON type or none at all: parsed (400 when it is not JSON). Any other type: 415.
_LENIENT_TYPES = ("text/plain", "application/x-www-form-urlencoded")
FINISH_REASON = {"stop": "stop", "stop_string": "stop", "length": "length"}  # the engine's -> OpenAI's

# Fields OpenAI defines that this server does not implement: accepted only at their default value.
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
  "frequency_penalty": (0, 0.0),
  "presence_penalty": (0, 0.0),
  "logprobs": (False,),
  "top_logprobs": (0,),
  "tools": ([],),
  "tool_choice": ("none",),
  "functions": ([],),
  "function_call": ("none",),
  "echo": (False,),
  "best_of": (1,),
  "suffix": ("",),
  "modalities": (["text"],),
}
_IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")  # no effect on the output
_COMMON = (
  "model",
  "max_tokens",
  "temperature",
  "top_p",
  "seed",
  "stop",
  "logit_bias",
  "n",
  "stream",
  "stream_options",
  "response_format",
  "top_k",
  "synthesis_hints",
  "max_latency_ms",
  "path",
  "regex",
  "grammar",
  "cache_salt",
)
FIELDS = {
  "chat": frozenset((*_COMMON, "messages", "max_completion_tokens", *_DEFAULT_ONLY, *_IGNORED)),
  "completion": frozenset((*_COMMON, "prompt", *_DEFAULT_ONLY, *_IGNORED)),
}


class HttpError(UserError):
  """A request refused by the HTTP layer itself (before it is a SynthesizeRequest): ``status`` and OpenAI's
  ``param`` and ``code``."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code


@dataclasses.dataclass(frozen=True)
class Options:
  """How to answer a request (what the SynthesizeRequest does not say)."""

  endpoint: Literal["chat", "completion"]
  stream: bool = False
  include_usage: bool = False
  max_tokens_field: str = "max_tokens"  # the body's name for it, for errors
  until_eos: bool = False  # no max_tokens: as many as fit (OpenAI's default; server/validation.py)
  ignored: tuple[str, ...] = ()  # unknown body fields left out (strict_fields off)


def _bad(message: str, param: str | None) -> HttpError:
  return HttpError(400, message, param, "invalid_value" if param else None)


def _kind(v: Any) -> str:
  return "null" if v is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(type(v), "number")


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
  v = body.get(key)
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
    got = repr(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"a {_kind(v)}"
    raise _bad(f"{key}: expected an integer in [{lo}, {hi}], got {got}", key)
  return v


def _number(body: dict, key: str) -> float | None:
  v = body.get(key)
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise _bad(f"{key}: expected a number, got a {_kind(v)}", key)
  if not math.isfinite(v):
    raise _bad(f"{key}: expected a finite number, got {v!r}", key)
  return float(v)


def _str(body: dict, key: str) -> str | None:
  v = body.get(key)
  if v is None:
    return None
  if not isinstance(v, str):
    raise _bad(f"{key}: expected a string, got a {_kind(v)}", key)
  return v


def _text_content(content: Any, i: int) -> str:
  """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
  where = f"messages[{i}].content"
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for j, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else _kind(part)
        raise _bad(
          f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are served, got {kind!r}", "messages"
        )
      parts.append(part["text"])
    return "".join(parts)
  raise _bad(f"{where}: expected a string or a list of text parts, got a {_kind(content)}", "messages")


def _messages(body: dict) -> list[pb.ChatMessage]:
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise _bad(f"messages: expected a non-empty array of {{role, content}} objects, got {_kind(msgs)}", "messages")
  out = []
  for i, msg in enumerate(msgs):
    if not isinstance(msg, dict):
      raise _bad(f"messages[{i}]: expected an object with role and content, got a {_kind(msg)}", "messages")
    extra = sorted(k for k, v in msg.items() if v is not None and k not in ("role", "content", "name"))
    if extra:
      raise _bad(f"messages[{i}]: fields {extra} are not served (tool calls, audio); send role and content", "messages")
    role = msg.get("role")
    if not isinstance(role, str):
      raise _bad(f"messages[{i}].role: expected a string, got a {_kind(role)}", "messages")
    out.append(pb.ChatMessage(role=ROLES.get(role, role), content=_text_content(msg.get("content"), i)))
  return out


def _stop(body: dict) -> list[str]:
  v = body.get("stop")
  if v is None:
    return []
  if isinstance(v, str):
    return [v]
  if isinstance(v, list) and all(isinstance(s, str) for s in v):
    return v
  raise _bad(f"stop: expected a string or an array of strings, got a {_kind(v)}", "stop")


def _logit_bias(body: dict) -> dict[int, float]:
  v = body.get("logit_bias")
  if v is None:
    return {}
  if not isinstance(v, dict):
    raise _bad(f"logit_bias: expected an object of token id -> bias, got a {_kind(v)}", "logit_bias")
  out = {}
  for k, b in v.items():
    try:
      tid = int(k)
    except ValueError:
      raise _bad(f"logit_bias: key {k[:40]!r} is not a token id (an integer)", "logit_bias") from None
    if not -(2**31) <= tid < 2**31:
      raise _bad(f"logit_bias: token id {tid} is out of range", "logit_bias")
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
      raise _bad(f"logit_bias[{k}]: expected a finite number, got {b!r}", "logit_bias")
    out[tid] = float(b)
  return out


def _response_format(body: dict) -> str | None:
  """The request's ``json_schema`` (JSON text) for ``response_format``; None: unconstrained text."""
  v = body.get("response_format")
  if v is None:
    return None
  if not isinstance(v, dict) or not isinstance(v.get("type"), str):
    raise _bad("response_format: expected an object with a type (text, json_object or json_schema)", "response_format")
  kind = v["type"]
  if kind == "text":
    return None
  if kind == "json_object":
    return json.dumps({"type": "object"})
  if kind == "json_schema":
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
      raise _bad(
        "response_format.json_schema: expected {name, schema: {...}, strict} with the JSON Schema object in schema",
        "response_format",
      )
    return json.dumps(spec["schema"])
  raise _bad(f"response_format.type: expected text, json_object or json_schema, got {kind[:40]!r}", "response_format")


def _unknown(body: dict, known: frozenset[str], strict: bool) -> tuple[str, ...]:
  """The fields of ``body`` not in ``known``, removed from it (sorted); with ``strict`` a 400 naming them."""
  unknown = sorted(set(body) - known)
  if unknown and strict:
    raise _bad(
      f"unknown fields {unknown[:8]}; this endpoint takes {sorted(known - set(_IGNORED))} (strict_fields: true "
      f"in the server config; false ignores them)",
      unknown[0],
    )
  for k in unknown:
    del body[k]
  return tuple(unknown)


def _fields(body: Any, known: frozenset[str], strict: bool) -> tuple[dict, tuple[str, ...]]:
  """A request body as a JSON object without its null fields (OpenAI: null is the default), and the unknown
  fields it carried (:func:`_unknown`: a 400 when ``strict``); :class:`HttpError` 400 for any other JSON."""
  if not isinstance(body, dict):
    raise HttpError(400, f"the request body must be a JSON object, got a JSON {_kind(body)}")
  body = {k: v for k, v in body.items() if v is not None}
  return body, _unknown(body, known, strict)


def synthesize_request(
  body: Any,
  endpoint: Literal["chat", "completion"],
  model: str | Collection[str] | None,
  request_id: str = "",
  *,
  strict: bool = False,
) -> tuple[pb.SynthesizeRequest, Options]:
  """The SynthesizeRequest of an OpenAI ``body`` and how to answer it; :class:`HttpError` (400, 404 for a
  ``model`` other than the served ids ``model``) naming the field. Types and ranges the proto cannot hold are
  checked here; the rest (sampling ranges, context, hints, path) is the servicer's validation. ``strict``: an
  unknown field is a 400 (else it is left out and named in :attr:`Options.ignored`)."""
  body, ignored = _fields(body, FIELDS[endpoint], strict)
  for key, defaults in _DEFAULT_ONLY.items():
    if key in body and not any(body[key] == d and type(body[key]) is type(d) for d in defaults):
      raise _bad(f"{key}: not supported by this server; omit it or send {defaults[0]!r}", key)
  name = _str(body, "model")
  served = (model,) if isinstance(model, str) else tuple(model or ())
  if name is not None and served and name not in served:
    raise HttpError(
      404,
      f"The model {name[:200]!r} does not exist; this server serves {served[0]!r} (GET /v1/models)",
      "model",
      "model_not_found",
    )
  m = pb.SynthesizeRequest(request_id=request_id)
  if endpoint == "chat":
    m.messages.extend(_messages(body))
  else:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
      raise _bad(f"prompt: expected a string (arrays and token ids are not served), got a {_kind(prompt)}", "prompt")
    m.prompt = prompt
  n = body.get("n", 1)
  if isinstance(n, bool) or n != 1:
    raise _bad(f"n: this server returns one choice per request (n: 1), got {n!r}; send n requests instead", "n")
  limit = 2**32 - 1
  fields = [f for f in ("max_tokens", "max_completion_tokens") if f in body]
  got = {f: _int(body, f, 0, limit) for f in fields}  # 0 and the server's limit: the servicer's message
  if len(set(got.values())) > 1:
    raise _bad(
      f"max_tokens ({got['max_tokens']}) and max_completion_tokens ({got['max_completion_tokens']}) differ; send one",
      "max_completion_tokens",
    )
  if got:
    m.max_tokens = next(iter(got.values()))
  for key in ("temperature", "top_p", "max_latency_ms"):
    if (x := _number(body, key)) is not None:
      setattr(m, key, x)
  # OpenAI's defaults, not the gRPC ones (greedy): sampled at temperature 1 over the whole distribution.
  for key in ("temperature", "top_p"):
    if not m.HasField(key):
      setattr(m, key, 1.0)
  if (k := _int(body, "top_k", 0, limit)) is not None:
    m.top_k = k
  if (s := _int(body, "seed", 0, 2**64 - 1)) is not None:
    m.seed = s
  m.stop_strings.extend(_stop(body))
  for tid, b in _logit_bias(body).items():
    m.logit_bias[tid] = b
  hints = body.get("synthesis_hints", [])
  if not isinstance(hints, list) or not all(isinstance(h, str) for h in hints):
    raise _bad(f"synthesis_hints: expected an array of hint names, got a {_kind(hints)}", "synthesis_hints")
  if len(hints) > MAX_HINTS:
    raise _bad(f"synthesis_hints: at most {MAX_HINTS} (priority order), got {len(hints)}", "synthesis_hints")
  m.hints.extend(hints)
  for key in ("path", "regex", "grammar", "cache_salt"):
    if (x := _str(body, key)) is not None:
      setattr(m, key, x)
  schema = _response_format(body)
  if schema is not None:
    if m.regex or m.grammar:
      raise _bad("response_format (JSON) and regex/grammar constrain the same output: send one", "response_format")
    m.json_schema = schema
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise _bad(f"stream: expected true or false, got a {_kind(stream)}", "stream")
  so = body.get("stream_options", {})
  if not isinstance(so, dict) or set(so) - {"include_usage"} or not isinstance(so.get("include_usage", False), bool):
    raise _bad("stream_options: expected {include_usage: true|false}", "stream_options")
  if so and not stream:
    raise _bad("stream_options: only with stream: true", "stream_options")
  max_field = fields[-1] if fields else "max_tokens"
  return m, Options(endpoint, stream, bool(so.get("include_usage", False)), max_field, not got, ignored)


# The servicer's messages start with the request field ("max_tokens: ...", "sampling: temperature ...").
_LEADING = re.compile(r"^(?:sampling: )?([a-z_]+)")
_PARAM = {
  "max_tokens": "max_tokens",
  "temperature": "temperature",
  "top_p": "top_p",
  "top_k": "top_k",
  "seed": "seed",
  "logit_bias": "logit_bias",
  "stop_strings": "stop",
  "hints": "synthesis_hints",
  "max_latency_ms": "max_latency_ms",
  "path": "path",
  "messages": "messages",
  "json_schema": "response_format",
  "regex": "regex",
  "grammar": "grammar",
}


def param_of(message: str, opts: Options | None) -> str | None:
  """The body field a servicer message names (None: none known)."""
  got = _LEADING.match(message)
  name = got and _PARAM.get(got.group(1))
  if name == "max_tokens" and opts is not None:
    return opts.max_tokens_field
  if name is None and ("prompt" in message or "give exactly one" in message):
    return "messages" if opts is not None and opts.endpoint == "chat" else "prompt"
  return name


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
  return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param, "code": code}}


def _json(data: dict, status: int = 200, headers: dict | None = None) -> web.Response:
  return web.json_response(data, status=status, headers=headers, dumps=lambda d: json.dumps(d, ensure_ascii=False))


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
  """The name of a Host header, without its port, lower case (``[::1]:8080`` -> ``::1``)."""
  h = header.strip().lower()
  if h.startswith("["):
    return h[1 : h.find("]")] if "]" in h else h
  return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class _ConnectionGate:
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


class OpenAIHttp:
  """The endpoint of one :class:`~thoughtjax.server.servicer.SynthesizerService` (``start`` returns the bound port)."""

  def __init__(self, service):
    self.service = service
    self.runner: web.AppRunner | None = None
    self._listener: asyncio.Server | None = None
    self.created = int(time.time())
    self._warned: set[str] = set()  # unknown fields named in the log once each, not on every request

  # ---- lifecycle -------------------------------------------------------------------------
  async def start(self, bind: str, port: int) -> int:
    cfg = self.service.config
    app = web.Application(client_max_size=cfg.http_max_body_bytes, middlewares=[self._hosts, self._errors])
    self._allowed_hosts = frozenset({*LOOPBACK_HOSTS, bind.strip("[]").lower(), *cfg.http_allowed_hosts}) - {
      "0.0.0.0",
      "::",
      "",
    }
    app.router.add_post(CHAT, self.chat)
    app.router.add_post(COMPLETIONS, self.completions)
    app.router.add_get(MODELS, self.models)
    app.router.add_get(HEALTH, self.health)
    app.router.add_get("/v1" + HEALTH, self.health)
    app.router.add_get(METRICS, self.metrics)
    app.router.add_post(TOKENIZE, self.tokenize)
    app.router.add_post(DETOKENIZE, self.detokenize)
    # handler_cancellation: a client that disconnects cancels its handler, and so its run, at once.
    # auto_decompress off: a compressed request body is refused by name (_body), never inflated (a small gzip
    # body can inflate to gigabytes before any limit sees it).
    # keepalive_timeout: aiohttp closes a connection whose handler still waits for a whole request head this long
    # after the connection opened or its last response ended (http_idle_timeout_s). lingering_time: how long the
    # unread rest of a refused body is drained before the close, at most the body's own timeout.
    self.runner = web.AppRunner(
      app,
      handler_cancellation=True,
      access_log=None,
      shutdown_timeout=cfg.grace_s,
      auto_decompress=False,
      keepalive_timeout=cfg.http_idle_timeout_s,
      lingering_time=min(10.0, cfg.http_body_timeout_s),
    )
    await self.runner.setup()
    gate = _ConnectionGate(self.runner.server, cfg.http_max_connections, self.service)
    try:
      self._listener = await asyncio.get_running_loop().create_server(
        gate, bind.strip("[]") or None, port, ssl=ssl_context(cfg.tls), reuse_address=True
      )
    except OSError:
      await self.runner.cleanup()
      raise
    return int(self._listener.sockets[0].getsockname()[1])

  async def stop(self) -> None:
    if self._listener is not None:
      self._listener.close()  # no new connections; those open finish under the runner's shutdown below
      self._listener = None
    if self.runner is not None:
      await self.runner.cleanup()
      self.runner = None

  # ---- helpers -------------------------------------------------------------------------
  def model_id(self) -> str | None:
    """The served model's id (None while the registry loads)."""
    s = self.service
    if s.config.model_name is not None:
      return s.config.model_name
    return None if s.serving is None else s.serving.registry.root.name

  def model_names(self) -> tuple[str, ...]:
    """The ids a request may name: the served one (``model_name``, the alias) and the registry's folder name."""
    s = self.service
    folder = () if s.serving is None else (s.serving.registry.root.name,)
    return tuple(dict.fromkeys(x for x in (self.model_id(), *folder) if x is not None))

  async def _tool_body(self, request: web.Request, method: str, known: frozenset[str]) -> dict:
    """The JSON object body of a llama-server style call (/tokenize, /detokenize) once the client is let in and
    the model is loaded; its unknown fields logged (or refused under strict_fields)."""
    self.service.check_client(request.headers.get("Authorization"), method)
    self.service.check_loaded()
    body, ignored = _fields(await self._body(request), known, self._strict)
    self._ignoring(ignored, method)
    return body

  def _ignoring(self, fields: tuple[str, ...], method: str) -> None:
    """Log the unknown fields a request carried, each name once per server (clients repeat them every call)."""
    new = [f for f in fields if f not in self._warned]
    if new:
      self._warned.update(new)
      log.warning(
        "%s: ignoring unknown request fields %s (not used by this server; strict_fields: true refuses them); "
        "each is logged once",
        method,
        [f[:64] for f in new[:16]],
      )

  def _refusal(self, e: BaseException, method: str, request_id: str | None = None, opts: Options | None = None):
    """The status and the OpenAI error body of ``e`` (an :class:`HttpError` or a servicer failure)."""
    if isinstance(e, HttpError):
      self.service.answered(method, "NOT_FOUND" if e.status == 404 else "INVALID_ARGUMENT")
      log.info("%s refused %d: %s", method, e.status, log_safe(e))
      return e.status, error_body(e.status, str(e), e.param, e.code)
    code, message = self.service.failure(e, method, request_id)
    status = HTTP_STATUS.get(code, 500)
    param = param_of(str(e), opts) if status == 400 else None
    name = "context_length_exceeded" if code == C.OUT_OF_RANGE else code.name.lower()
    return status, error_body(status, message, param, name)

  def _error(self, e: BaseException, method: str, request_id: str | None = None, opts: Options | None = None):
    status, body = self._refusal(e, method, request_id, opts)
    response = _json(body, status)
    if status == 408:  # the rest of the body may still come: the connection ends with this answer
      response.force_close()
    return response

  @web.middleware
  async def _hosts(self, request: web.Request, handler):
    """Without a client token, only a Host this server is known by (DNS rebinding: a web page whose name now resolves
    to this machine sends its own name as Host)."""
    clients = self.service.config.clients
    if clients.token is None and clients.token_file is None:
      host = host_name(request.headers.get("Host", ""))
      if host not in self._allowed_hosts:
        self.service.answered("HTTP", "HTTP_403")
        message = (
          f"Host {host[:100]!r} is not one this server answers without a client token; connect by a loopback name "
          f"or the bind address, or (the operator) set a client token (--api-key) or list the name in "
          f"http_allowed_hosts"
        )
        log.info("HTTP refused 403: %s", log_safe(message))
        return _json(error_body(403, message, None, "host_not_allowed"), 403)
    return await handler(request)

  @web.middleware
  async def _errors(self, request: web.Request, handler):
    """aiohttp's own refusals (unknown route, wrong method, body too large) in OpenAI's error body."""
    try:
      return await handler(request)
    except web.HTTPException as e:
      if e.status < 400:
        raise
      self.service.answered("HTTP", f"HTTP_{e.status}")  # not the path: a client must not mint label values
      return _json(error_body(e.status, f"{request.method} {request.path[:200]}: {e.reason}"), e.status)

  async def _body(self, request: web.Request) -> Any:
    limit = self.service.config.http_max_body_bytes
    # aiohttp reads an absent Content-Type as application/octet-stream: look at the header itself.
    ctype = request.content_type if "Content-Type" in request.headers else None
    json_type = ctype is None or ctype == "application/json" or ctype.endswith("+json")
    if not json_type and ctype not in _LENIENT_TYPES:
      raise HttpError(415, f"Content-Type: expected application/json, got {ctype!r}; send the body as JSON")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
      raise HttpError(
        415, f"Content-Encoding: {encoding[:40]!r} bodies are not accepted (never inflated); send the body uncompressed"
      )
    if request.content_length is not None and request.content_length > limit:
      raise HttpError(
        413,
        f"the request body is {request.content_length} bytes, the server takes at most {limit} "
        f"(http_max_body_bytes); send a shorter prompt",
        None,
        "request_too_large",
      )
    timeout = self.service.config.http_body_timeout_s
    try:
      async with asyncio.timeout(timeout):  # a body sent slowly, or never, does not hold the connection
        raw = await request.read()  # at most client_max_size (= limit) bytes, else HTTPRequestEntityTooLarge
    except TimeoutError:
      raise HttpError(
        408,
        f"the request body did not arrive within {timeout:g} s (http_body_timeout_s); send it whole",
        None,
        "request_timeout",
      ) from None
    except web.HTTPRequestEntityTooLarge:
      raise HttpError(
        413,
        f"the request body exceeds {limit} bytes (http_max_body_bytes); send a shorter prompt",
        None,
        "request_too_large",
      ) from None
    try:
      return _parse_json(raw)
    except HttpError:
      if not json_type:  # a form or plain text that is not JSON after all: the type said so
        raise HttpError(
          415, f"Content-Type: expected application/json, got {ctype!r} with a body that is not JSON; send JSON"
        ) from None
      raise

  # ---- endpoints -------------------------------------------------------------------------
  async def health(self, request: web.Request) -> web.Response:
    """llama-server's probe: 200 ``{"status": "ok"}`` when serving, 503 while loading, warming or draining. No
    client token (a probe or load balancer carries none); it says only what grpc.health.v1 says."""
    s = self.service
    state = "draining" if s.draining else "loading" if s.serving is None else "warming" if not s.ready else None
    if state is None:
      return _json({"status": "ok"})
    message = {
      "draining": "the server is draining (shutting down)",
      "loading": "the server is loading its registry",
      "warming": "the server is warming up",
    }[state]
    return _json({"status": state, **error_body(503, message, None, "unavailable")}, 503)

  async def metrics(self, request: web.Request) -> web.Response:
    """The Prometheus text of the server's metrics (the registry the metrics port serves), behind the client
    token when one is set: the series name paths, hints and request counts."""
    try:
      self.service.check_client(request.headers.get("Authorization"), METRICS)
    except Exception as e:
      return self._error(e, METRICS)
    return web.Response(
      body=generate_latest(self.service.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )

  async def tokenize(self, request: web.Request) -> web.Response:
    """llama-server's ``{"content": TEXT, "add_special": false, "with_pieces": false}`` -> ``{"tokens": [...]}``
    with the served model's tokenizer (``add_special``: the BOS the model's prompts start with, if any;
    ``with_pieces``: each token as ``{"id", "piece"}``)."""
    try:
      body = await self._tool_body(request, TOKENIZE, frozenset(("content", "add_special", "with_pieces")))
      text = _str(body, "content")
      if text is None:
        raise _bad("content: expected the text to tokenize, a string", "content")
      flags = {k: body.get(k, False) for k in ("add_special", "with_pieces")}
      for k, v in flags.items():
        if not isinstance(v, bool):
          raise _bad(f"{k}: expected true or false, got a {_kind(v)}", k)
      codec = self.service.registry.codec
      ids = await _on_worker(lambda: _encode(codec, text, flags["add_special"]))
      if flags["with_pieces"]:
        ids = await _on_worker(lambda: [{"id": t, "piece": codec.decode([t], skip_special=False)} for t in ids])
    except Exception as e:
      return self._error(e, TOKENIZE)
    self.service.answered(TOKENIZE, "OK")
    return _json({"tokens": ids})

  async def detokenize(self, request: web.Request) -> web.Response:
    """llama-server's ``{"tokens": [ID, ...]}`` -> ``{"content": TEXT}`` (special tokens written out)."""
    try:
      body = await self._tool_body(request, DETOKENIZE, frozenset(("tokens",)))
      ids = body.get("tokens", [])
      vocab = self.service.serving.vocab
      if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _bad(f"tokens: expected an array of token ids (integers), got a {_kind(ids)}", "tokens")
      bad = next((t for t in ids if not 0 <= t < vocab), None)
      if bad is not None:
        raise _bad(f"tokens: id {bad} is outside the vocabulary [0, {vocab}); send ids /tokenize gave", "tokens")
      codec = self.service.registry.codec
      text = await _on_worker(lambda: codec.decode(ids, skip_special=False))
    except Exception as e:
      return self._error(e, DETOKENIZE)
    self.service.answered(DETOKENIZE, "OK")
    return _json({"content": text})

  @property
  def _strict(self) -> bool:
    return self.service.config.strict_fields

  async def models(self, request: web.Request) -> web.Response:
    try:
      self.service.check_client(request.headers.get("Authorization"), MODELS)
      self.service.check_loaded()
    except Exception as e:
      return self._error(e, MODELS)
    self.service.answered(MODELS, "OK")
    entry = {"id": self.model_id(), "object": "model", "created": self.created, "owned_by": "thoughtjax"}
    return _json({"object": "list", "data": [entry]})

  async def chat(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, "chat", CHAT)

  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, "completion", COMPLETIONS)

  async def _generate(self, request: web.Request, endpoint, method: str) -> web.StreamResponse:
    t_arrival = time.perf_counter()
    svc, opts = self.service, None
    try:
      svc.check_client(request.headers.get("Authorization"), method)
      body = await self._body(request)
      rid = request.headers.get("X-Request-Id", "")
      m, opts = synthesize_request(body, endpoint, self.model_names(), rid, strict=self._strict)
      self._ignoring(opts.ignored, method)
      r = await svc.admit(m, None, until_eos=opts.until_eos)
    except Exception as e:
      return self._error(e, method, None, opts)
    out = _Answer(endpoint, self.model_id() or "", r.request_id, opts)
    async with contextlib.aclosing(svc.responses(r, None, t_arrival)) as responses:
      try:
        plan = (await anext(responses)).plan  # admitted, given a turn, planned (and restored) before any byte
      except Exception as e:
        return self._error(e, method, r.request_id, opts)
      out.plan = plan
      if not opts.stream:
        try:
          async for x in responses:
            out.add(x)
        except Exception as e:
          return self._error(e, method, r.request_id, opts)
        svc.answered(method, "OK")
        return _json(out.whole(), headers={"x-request-id": r.request_id})
      sse = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "x-request-id": r.request_id}
      )
      await sse.prepare(request)
      within = svc.config.http_write_timeout_s
      try:
        try:
          await _send(sse, out.first_chunk(), within)
          async for x in responses:
            for chunk in out.chunks(x):
              await _send(sse, chunk, within)
        except (_Stalled, ConnectionError):
          raise
        except Exception as e:
          _, err = self._refusal(e, method, r.request_id, opts)
          await _send(sse, err, within)
          return sse
        svc.answered(method, "OK")
        await _send(sse, b"data: [DONE]\n\n", within)
        async with asyncio.timeout(within):
          await sse.write_eof()
      except (_Stalled, TimeoutError):  # the client stopped reading: reset (a close would wait for it to read)
        log.warning(
          "request %s: %s client took no data for %g s (http_write_timeout_s); connection reset",
          r.request_id,
          method,
          within,
        )
        if request.transport is not None:
          request.transport.abort()
      except ConnectionError:  # the client left; closing the responses frees the slot
        log.info("request %s: %s client disconnected", r.request_id, method)
      return sse


def _parse_json(raw: bytes) -> Any:
  """``raw`` as JSON, or a 400 :class:`HttpError` saying why not."""
  try:
    return json.loads(raw.decode("utf-8"))  # decoded here: json.loads would guess UTF-16 from bytes
  except UnicodeDecodeError:
    raise HttpError(400, "the request body is not UTF-8 text; send UTF-8 JSON") from None
  except RecursionError:
    raise HttpError(400, "the request body nests JSON too deeply; send a flat request object") from None
  except json.JSONDecodeError as e:
    raise HttpError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


async def _on_worker(fn):
  """``fn()`` on the loop's executor: tokenizing a body up to http_max_body_bytes long must not hold the loop."""
  return await asyncio.get_running_loop().run_in_executor(None, fn)


def _encode(codec, text: str, add_special: bool) -> list[int]:
  """``text``'s token ids; the BOS the codec puts first only with ``add_special`` (llama-server's default: none)."""
  ids = codec.encode(text)
  bos = getattr(codec, "bos_id", None)
  if not add_special and getattr(codec, "add_bos", False) and bos is not None and ids[:1] == [bos]:
    ids = ids[1:]
  return ids


class _Stalled(Exception):
  """A streamed event the client did not take within http_write_timeout_s."""


async def _send(sse: web.StreamResponse, data: dict | bytes, within: float) -> None:
  """One server-sent event (``data`` as JSON, or bytes as they are); :class:`_Stalled` when its write (it waits
  while the socket's buffers are full) has not finished within ``within`` seconds."""
  event = data if isinstance(data, bytes) else b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
  try:
    async with asyncio.timeout(within):
      await sse.write(event)
  except TimeoutError:
    raise _Stalled from None


class _Answer:
  """One request's OpenAI objects, built from the servicer's plan, deltas and final message."""

  def __init__(self, endpoint: str, model: str, request_id: str, opts: Options):
    self.endpoint, self.model, self.request_id, self.opts = endpoint, model, request_id, opts
    self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id
    self.created = int(time.time())
    self.plan: pb.Plan | None = None
    self.text: list[str] = []
    self.final: pb.Final | None = None

  def add(self, x: pb.SynthesizeResponse) -> None:
    if x.WhichOneof("kind") == "delta":
      self.text.append(x.delta.text)
    elif x.WhichOneof("kind") == "final":
      self.final = x.final

  def _object(self, chunk: bool) -> str:
    if self.endpoint == "chat":
      return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"

  def _head(self, chunk: bool) -> dict:
    return {"id": self.id, "object": self._object(chunk), "created": self.created, "model": self.model}

  def usage(self) -> dict:
    u = self.final.usage
    return {"prompt_tokens": u.tokens_in, "completion_tokens": u.tokens_out, "total_tokens": u.tokens_in + u.tokens_out}

  def extension(self) -> dict:
    """The ``thoughtjax`` field: request id, the engine's finish reason, plan, trace and compute."""
    proto = lambda msg: MessageToDict(msg, preserving_proto_field_name=True)
    out = {"request_id": self.request_id, "plan": proto(self.plan)}
    if self.opts.ignored:
      out["ignored_fields"] = list(self.opts.ignored)
    if self.final is not None:
      out.update(
        finish_reason=self.final.finish_reason,
        trace=proto(self.final.trace),
        compute_seconds=self.final.usage.compute_seconds,
      )
    return out

  def finish_reason(self) -> str:
    return FINISH_REASON.get(self.final.finish_reason, "stop")

  def _choice(self, text: str, finish: str | None, chunk: bool) -> dict:
    if self.endpoint == "chat":
      key = "delta" if chunk else "message"
      body = {"content": text} if chunk else {"role": "assistant", "content": text}
      return {"index": 0, key: body, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

  def whole(self) -> dict:
    return {
      **self._head(False),
      "choices": [self._choice("".join(self.text), self.finish_reason(), False)],
      "usage": self.usage(),
      "thoughtjax": self.extension(),
    }

  def _chunk(self, choices: list, **extra) -> dict:
    out = {**self._head(True), "choices": choices, **extra}
    if self.opts.include_usage and "usage" not in out:
      out["usage"] = None  # OpenAI: null on every chunk but the last
    return out

  def first_chunk(self) -> dict:
    if self.endpoint == "chat":
      return self._chunk(
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]
      )
    return self._chunk([self._choice("", None, True)])

  def chunks(self, x: pb.SynthesizeResponse) -> list[dict]:
    kind = x.WhichOneof("kind")
    if kind == "delta":
      return [self._chunk([self._choice(x.delta.text, None, True)])] if x.delta.text else []
    if kind != "final":
      return []
    self.final = x.final
    last = self._chunk([self._choice("", self.finish_reason(), True)])
    if not self.opts.include_usage:
      return [{**last, "thoughtjax": self.extension()}]
    return [last, self._chunk([], usage=self.usage(), thoughtjax=self.extension())]


def ssl_context(tls) -> ssl.SSLContext | None:
  """The HTTP endpoint's TLS from the gRPC server's ``tls`` settings (client certificates required when
  ``client_ca`` is set), so the endpoint is never a plaintext way around them. None: plaintext."""
  if not tls.enabled:
    return None
  from thoughtjax.server.tls import _read

  _read(tls.cert, "cert"), _read(tls.key, "key")  # a readable PEM each, or the ConfigError naming the key
  ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
  ctx.load_cert_chain(tls.cert, tls.key)
  if tls.mutual:
    _read(tls.client_ca, "client_ca")
    ctx.load_verify_locations(tls.client_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
  return ctx

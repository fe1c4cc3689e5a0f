"""OpenAI-compatible HTTP on the gRPC server's event loop and engines: ``POST /v1/chat/completions``,
``POST /v1/completions`` and ``GET /v1/models``, with llama-server's ``GET /health``, ``POST /tokenize`` and
``POST /detokenize`` and the server's Prometheus ``GET /metrics`` (``http_port`` in the server config).

Transport only. A body becomes a ``thoughtjax.v1.SynthesizeRequest``
(:func:`~thoughtjax.server.openai_request.synthesize_request`, which states the body fields) and goes
through the servicer's own steps: the client credential (:meth:`SynthesizerService.check_client`),
validation and admission (:meth:`~SynthesizerService.admit`), then scheduling and the run
(:meth:`~SynthesizerService.responses`). The limits, the queue, the slots and the metrics are those of the
gRPC ``Synthesize``; only the framing differs. Who may connect (the connection cap, the Host names answered
without a client token) is ``server/http_access.py``. An unknown body field is named once in the log (and
refused under ``strict_fields``). A body is JSON with or without a ``Content-Type``.

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
import json
import logging
import time
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.server.http_access import ConnectionGate, allowed_hosts, host_name
from thoughtjax.server.messages import log_safe
from thoughtjax.server.openai_request import (
  HttpError,
  Options,
  body_fields,
  error_body,
  invalid_value,
  json_kind,
  param_of,
  parse_json,
  str_field,
  synthesize_request,
)

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
CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
HEALTH, METRICS, TOKENIZE, DETOKENIZE = "/health", "/metrics", "/tokenize", "/detokenize"
# Content types a client sends by default with a JSON body (curl -d: form-urlencoded): taken when the body is
# JSON, else 415. A JSON type or none at all: parsed (400 when it is not JSON). Any other type: 415.
_LENIENT_TYPES = ("text/plain", "application/x-www-form-urlencoded")
FINISH_REASON = {"stop": "stop", "stop_string": "stop", "length": "length"}  # the engine's -> OpenAI's


def _json(data: dict, status: int = 200, headers: dict | None = None) -> web.Response:
  return web.json_response(data, status=status, headers=headers, dumps=lambda d: json.dumps(d, ensure_ascii=False))


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
    from thoughtjax.server.tls import ssl_context  # deferred: importing this module does not load server.tls

    cfg = self.service.config
    app = web.Application(client_max_size=cfg.http_max_body_bytes, middlewares=[self._hosts, self._errors])
    self._allowed_hosts = allowed_hosts(bind, cfg.http_allowed_hosts)
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
    gate = ConnectionGate(self.runner.server, cfg.http_max_connections, self.service)
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
    body, ignored = body_fields(await self._body(request), known, self._strict)
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
      return parse_json(raw)
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
      text = str_field(body, "content")
      if text is None:
        raise invalid_value("content: expected the text to tokenize, a string", "content")
      flags = {k: body.get(k, False) for k in ("add_special", "with_pieces")}
      for k, v in flags.items():
        if not isinstance(v, bool):
          raise invalid_value(f"{k}: expected true or false, got a {json_kind(v)}", k)
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
        raise invalid_value(f"tokens: expected an array of token ids (integers), got a {json_kind(ids)}", "tokens")
      bad = next((t for t in ids if not 0 <= t < vocab), None)
      if bad is not None:
        raise invalid_value(
          f"tokens: id {bad} is outside the vocabulary [0, {vocab}); send ids /tokenize gave", "tokens"
        )
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

"""The OpenAI request body as a ``thoughtjax.v1.SynthesizeRequest``, and OpenAI's error body.

:func:`synthesize_request` turns a ``/v1/chat/completions`` or ``/v1/completions`` body into a SynthesizeRequest and
the :class:`Options` of its answer, or raises :class:`HttpError` naming the field; :func:`parse_json` and
:func:`body_fields` are the steps every JSON body takes (also ``/tokenize`` and ``/detokenize``). :func:`param_of`
names the body field a servicer message is about and :func:`error_body` is the ``{"error": {...}}`` object every
failure carries. Pure: no aiohttp, no servicer; the transport is ``server/http.py``.

Body fields: ``model`` (the id ``/v1/models`` lists, or the registry's folder name; another is 404
``model_not_found``; omitted: the served one), ``messages`` (text content; roles system, user, assistant, and
developer as system) or ``prompt`` (a string), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop`` (string or list), ``logit_bias``,
``n`` (1 only), ``stream``, ``stream_options.include_usage``, ``response_format`` (``text``; ``json_object``
and ``json_schema`` map to the request's ``json_schema``). Extensions: ``top_k``, ``synthesis_hints`` (at most
3), ``max_latency_ms``, ``path``, ``regex``, ``grammar``. Unset fields take OpenAI's defaults: temperature 1,
top_p 1, and no ``max_tokens`` generates until the end of text or the config's ``until_eos_tokens``,
``max_tokens_limit`` or the context runs out, whichever comes first. A field OpenAI defines but this server cannot honour (tools, logprobs, penalties) is
refused unless it asks for the default. An unknown field (another server's extension: ``min_p``,
``repetition_penalty``, ``cache_prompt``) is left out and returned to the caller, which names it once in the log
and in the answer's ``thoughtjax.ignored_fields``, as vLLM and llama-server do; ``strict`` (``strict_fields`` in the
config) refuses it (400) so that a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Collection
from typing import Any, Literal

from thoughtjax.defaults import MAX_HINTS
from thoughtjax.errors import UserError
from thoughtjax.proto.v1 import synthesis_pb2 as pb

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
ROLES = {"developer": "system"}  # OpenAI's newer name for the system role

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


def invalid_value(message: str, param: str | None) -> HttpError:
  """A 400 about body field ``param`` (OpenAI's code ``invalid_value``; none when no field is named)."""
  return HttpError(400, message, param, "invalid_value" if param else None)


def json_kind(v: Any) -> str:
  """The JSON type of a decoded value, for messages (``object``, ``array``, ``string``, ``number``, ...)."""
  return "null" if v is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(type(v), "number")


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
  v = body.get(key)
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
    got = repr(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"a {json_kind(v)}"
    raise invalid_value(f"{key}: expected an integer in [{lo}, {hi}], got {got}", key)
  return v


def _number(body: dict, key: str) -> float | None:
  v = body.get(key)
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise invalid_value(f"{key}: expected a number, got a {json_kind(v)}", key)
  if not math.isfinite(v):
    raise invalid_value(f"{key}: expected a finite number, got {v!r}", key)
  return float(v)


def str_field(body: dict, key: str) -> str | None:
  """``body[key]`` as a string, None when absent; a 400 naming ``key`` for any other JSON."""
  v = body.get(key)
  if v is None:
    return None
  if not isinstance(v, str):
    raise invalid_value(f"{key}: expected a string, got a {json_kind(v)}", key)
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
        kind = part.get("type") if isinstance(part, dict) else json_kind(part)
        raise invalid_value(
          f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are served, got {kind!r}", "messages"
        )
      parts.append(part["text"])
    return "".join(parts)
  raise invalid_value(f"{where}: expected a string or a list of text parts, got a {json_kind(content)}", "messages")


def _messages(body: dict) -> list[pb.ChatMessage]:
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise invalid_value(
      f"messages: expected a non-empty array of {{role, content}} objects, got {json_kind(msgs)}", "messages"
    )
  out = []
  for i, msg in enumerate(msgs):
    if not isinstance(msg, dict):
      raise invalid_value(
        f"messages[{i}]: expected an object with role and content, got a {json_kind(msg)}", "messages"
      )
    extra = sorted(k for k, v in msg.items() if v is not None and k not in ("role", "content", "name"))
    if extra:
      raise invalid_value(
        f"messages[{i}]: fields {extra} are not served (tool calls, audio); send role and content", "messages"
      )
    role = msg.get("role")
    if not isinstance(role, str):
      raise invalid_value(f"messages[{i}].role: expected a string, got a {json_kind(role)}", "messages")
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
  raise invalid_value(f"stop: expected a string or an array of strings, got a {json_kind(v)}", "stop")


def _logit_bias(body: dict) -> dict[int, float]:
  v = body.get("logit_bias")
  if v is None:
    return {}
  if not isinstance(v, dict):
    raise invalid_value(f"logit_bias: expected an object of token id -> bias, got a {json_kind(v)}", "logit_bias")
  out = {}
  for k, b in v.items():
    try:
      tid = int(k)
    except ValueError:
      raise invalid_value(f"logit_bias: key {k[:40]!r} is not a token id (an integer)", "logit_bias") from None
    if not -(2**31) <= tid < 2**31:
      raise invalid_value(f"logit_bias: token id {tid} is out of range", "logit_bias")
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
      raise invalid_value(f"logit_bias[{k}]: expected a finite number, got {b!r}", "logit_bias")
    out[tid] = float(b)
  return out


def _response_format(body: dict) -> str | None:
  """The request's ``json_schema`` (JSON text) for ``response_format``; None: unconstrained text."""
  v = body.get("response_format")
  if v is None:
    return None
  if not isinstance(v, dict) or not isinstance(v.get("type"), str):
    raise invalid_value(
      "response_format: expected an object with a type (text, json_object or json_schema)", "response_format"
    )
  kind = v["type"]
  if kind == "text":
    return None
  if kind == "json_object":
    return json.dumps({"type": "object"})
  if kind == "json_schema":
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
      raise invalid_value(
        "response_format.json_schema: expected {name, schema: {...}, strict} with the JSON Schema object in schema",
        "response_format",
      )
    return json.dumps(spec["schema"])
  raise invalid_value(
    f"response_format.type: expected text, json_object or json_schema, got {kind[:40]!r}", "response_format"
  )


def _unknown(body: dict, known: frozenset[str], strict: bool) -> tuple[str, ...]:
  """The fields of ``body`` not in ``known``, removed from it (sorted); with ``strict`` a 400 naming them."""
  unknown = sorted(set(body) - known)
  if unknown and strict:
    raise invalid_value(
      f"unknown fields {unknown[:8]}; this endpoint takes {sorted(known - set(_IGNORED))} (strict_fields: true "
      f"in the server config; false ignores them)",
      unknown[0],
    )
  for k in unknown:
    del body[k]
  return tuple(unknown)


def body_fields(body: Any, known: frozenset[str], strict: bool) -> tuple[dict, tuple[str, ...]]:
  """A request body as a JSON object without its null fields (OpenAI: null is the default), and the unknown
  fields it carried (:func:`_unknown`: a 400 when ``strict``); :class:`HttpError` 400 for any other JSON."""
  if not isinstance(body, dict):
    raise HttpError(400, f"the request body must be a JSON object, got a JSON {json_kind(body)}")
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
  body, ignored = body_fields(body, FIELDS[endpoint], strict)
  for key, defaults in _DEFAULT_ONLY.items():
    if key in body and not any(body[key] == d and type(body[key]) is type(d) for d in defaults):
      raise invalid_value(f"{key}: not supported by this server; omit it or send {defaults[0]!r}", key)
  name = str_field(body, "model")
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
      raise invalid_value(
        f"prompt: expected a string (arrays and token ids are not served), got a {json_kind(prompt)}", "prompt"
      )
    m.prompt = prompt
  n = body.get("n", 1)
  if isinstance(n, bool) or n != 1:
    raise invalid_value(
      f"n: this server returns one choice per request (n: 1), got {n!r}; send n requests instead", "n"
    )
  limit = 2**32 - 1
  fields = [f for f in ("max_tokens", "max_completion_tokens") if f in body]
  got = {f: _int(body, f, 0, limit) for f in fields}  # 0 and the server's limit: the servicer's message
  if len(set(got.values())) > 1:
    raise invalid_value(
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
    raise invalid_value(
      f"synthesis_hints: expected an array of hint names, got a {json_kind(hints)}", "synthesis_hints"
    )
  if len(hints) > MAX_HINTS:
    raise invalid_value(f"synthesis_hints: at most {MAX_HINTS} (priority order), got {len(hints)}", "synthesis_hints")
  m.hints.extend(hints)
  for key in ("path", "regex", "grammar", "cache_salt"):
    if (x := str_field(body, key)) is not None:
      setattr(m, key, x)
  schema = _response_format(body)
  if schema is not None:
    if m.regex or m.grammar:
      raise invalid_value(
        "response_format (JSON) and regex/grammar constrain the same output: send one", "response_format"
      )
    m.json_schema = schema
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise invalid_value(f"stream: expected true or false, got a {json_kind(stream)}", "stream")
  so = body.get("stream_options", {})
  if not isinstance(so, dict) or set(so) - {"include_usage"} or not isinstance(so.get("include_usage", False), bool):
    raise invalid_value("stream_options: expected {include_usage: true|false}", "stream_options")
  if so and not stream:
    raise invalid_value("stream_options: only with stream: true", "stream_options")
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
  """OpenAI's ``{"error": {"message", "type", "param", "code"}}``, its type that of ``status`` (:data:`ERROR_TYPE`)."""
  return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param, "code": code}}


def parse_json(raw: bytes) -> Any:
  """``raw`` as JSON, or a 400 :class:`HttpError` saying why not."""
  try:
    return json.loads(raw.decode("utf-8"))  # decoded here: json.loads would guess UTF-16 from bytes
  except UnicodeDecodeError:
    raise HttpError(400, "the request body is not UTF-8 text; send UTF-8 JSON") from None
  except RecursionError:
    raise HttpError(400, "the request body nests JSON too deeply; send a flat request object") from None
  except json.JSONDecodeError as e:
    raise HttpError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None

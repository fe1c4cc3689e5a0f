"""A Python client of the thoughtjax gRPC server (``thoughtjax serve``).

>>> from thoughtjax.client import Client
>>> with Client("127.0.0.1:50051") as c:
...   c.plan("Write a haiku", hints=["general_purpose"], max_latency_ms=2000).path
...   for piece in c.stream("Write a haiku", hints=["general_purpose"], max_tokens=32): print(piece, end="")
...   c.last_final.trace.actual_ms            # the trace of the last finished stream
...   c.last_trailer.fields["tokens-out"]     # the same figures from the trailing metadata

The trace and usage also come in the trailing metadata (``thoughtjax-trace-bin``, ``thoughtjax-usage-bin``
and text keys ``x-thoughtjax-*``), for proxies, logs and clients that read metadata only: :func:`read_trailer`.

A failed call raises :class:`ClientError` with the gRPC ``code`` and the server's message (which says the fix).
TLS: ``ca`` (PEM bytes or path) verifies the server; ``cert``/``key`` add a client certificate (mTLS).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from thoughtjax.errors import UserError

# Trailing metadata of a finished Synthesize stream (gRPC conventions: lowercase keys, "-bin" for bytes).
TRACE_KEY = "thoughtjax-trace-bin"  # a serialized thoughtjax.v1.Trace
USAGE_KEY = "thoughtjax-usage-bin"  # a serialized thoughtjax.v1.Usage
TEXT_PREFIX = "x-thoughtjax-"  # billing figures as text: tokens-in, tokens-out, compute-seconds, path-hash, ...


class ClientError(UserError, RuntimeError):
  """A call the server refused or could not finish: ``code`` (grpc.StatusCode) and the server's message."""

  def __init__(self, code: grpc.StatusCode, details: str, method: str):
    super().__init__(f"{method}: {code.name}: {details}")
    self.code, self.details, self.method = code, details, method


@dataclasses.dataclass(frozen=True)
class Trailer:
  """What a stream's trailing metadata carried: ``trace`` and ``usage`` (``thoughtjax.v1`` messages, None
  when absent) and the ``x-thoughtjax-*`` text ``fields`` without the prefix (e.g. ``fields["tokens-out"]``)."""

  trace: object | None
  usage: object | None
  fields: dict


def read_trailer(metadata) -> Trailer:
  """The thoughtjax part of a call's trailing metadata (``call.trailing_metadata()``: pairs of key, value)."""
  from thoughtjax.proto.v1 import synthesis_pb2 as pb

  trace = usage = None
  fields = {}
  for key, value in metadata or ():
    if key == TRACE_KEY:
      trace = pb.Trace.FromString(value)
    elif key == USAGE_KEY:
      usage = pb.Usage.FromString(value)
    elif key.startswith(TEXT_PREFIX):
      fields[key[len(TEXT_PREFIX) :]] = value
  return Trailer(trace, usage, fields)


def _pem(v: bytes | str | os.PathLike | None) -> bytes | None:
  if v is None or isinstance(v, bytes):
    return v
  return Path(v).expanduser().read_bytes()


def request(
  prompt: str | None = None,
  hints: Sequence[str] = (),
  *,
  messages: Sequence[dict] | None = None,
  max_latency_ms: float | None = None,
  max_tokens: int | None = None,
  temperature: float | None = None,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int | None = None,
  logit_bias: dict | None = None,
  stop_strings: Sequence[str] = (),
  stop_token_ids: Sequence[int] = (),
  path: str | None = None,
  registry_sequence: int | None = None,
  request_id: str = "",
  json_schema: str | dict | None = None,
  regex: str | None = None,
  grammar: str | None = None,
  cache_salt: str = "",
):
  """A ``thoughtjax.v1.SynthesizeRequest`` (unset optional fields take the server's defaults); ``json_schema``
  (JSON text or a dict), ``regex`` or ``grammar``: the output constraint, at most one; ``cache_salt``: the prefix
  cache's scope (keys are reused only between requests with the same salt)."""
  from thoughtjax.proto.v1 import synthesis_pb2 as pb

  m = pb.SynthesizeRequest(
    prompt=prompt or "",
    hints=list(hints),
    stop_strings=list(stop_strings),
    stop_token_ids=list(stop_token_ids),
    path=path or "",
    request_id=request_id,
    cache_salt=cache_salt,
  )
  for msg in messages or ():
    m.messages.add(role=msg["role"], content=msg["content"])
  for k, v in (logit_bias or {}).items():
    m.logit_bias[int(k)] = float(v)
  for name, v in (
    ("max_latency_ms", max_latency_ms),
    ("max_tokens", max_tokens),
    ("temperature", temperature),
    ("top_k", top_k),
    ("top_p", top_p),
    ("seed", seed),
    ("registry_sequence", registry_sequence),
    ("json_schema", json_schema if json_schema is None or isinstance(json_schema, str) else json.dumps(json_schema)),
    ("regex", regex),
    ("grammar", grammar),
  ):
    if v is not None:
      setattr(m, name, v)
  return m


class Client:
  """One channel to a server; methods take :func:`request`'s arguments. ``timeout``: seconds per call."""

  def __init__(
    self,
    target: str,
    *,
    ca=None,
    cert=None,
    key=None,
    timeout: float | None = None,
    options: Sequence[tuple[str, object]] = (),
    token: str | None = None,
  ):
    from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc

    self.target, self.timeout = target, timeout
    # The server's bearer token (admin.token for ReloadRegistry and RegistryStats, clients.token for the other
    # calls when the server asks for one); send it over TLS only.
    self.metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    if ca is not None or cert is not None:
      creds = grpc.ssl_channel_credentials(_pem(ca), _pem(key), _pem(cert))
      self.channel = grpc.secure_channel(target, creds, options=list(options))
    else:
      self.channel = grpc.insecure_channel(target, options=list(options))
    self.stub = rpc.SynthesizerStub(self.channel)
    self.last_final = None
    self.last_plan = None
    self.last_trailer: Trailer | None = None

  def _call(self, method: str, *args, **kwargs):
    try:
      return getattr(self.stub, method)(
        *args, timeout=kwargs.pop("timeout", self.timeout), metadata=self.metadata, **kwargs
      )
    except grpc.RpcError as e:
      raise ClientError(e.code(), e.details(), method) from None

  def plan(self, prompt=None, hints=(), **kwargs):
    """GetOptimalPath: the plan (``thoughtjax.v1.Plan``), nothing run."""
    timeout = kwargs.pop("timeout", self.timeout)
    return self._call("GetOptimalPath", request(prompt, hints, **kwargs), timeout=timeout)

  def synthesize(self, prompt=None, hints=(), **kwargs) -> Iterator:
    """Synthesize: every ``SynthesizeResponse`` (the plan, the deltas, the final message) as it arrives; once
    the stream ends, its trailing metadata is on ``last_trailer``."""
    timeout = kwargs.pop("timeout", self.timeout)
    call = self.stub.Synthesize(request(prompt, hints, **kwargs), timeout=timeout, metadata=self.metadata)
    self.last_trailer = None
    try:
      for r in call:
        kind = r.WhichOneof("kind")
        if kind == "plan":
          self.last_plan = r.plan
        elif kind == "final":
          self.last_final = r.final
        yield r
      self.last_trailer = read_trailer(call.trailing_metadata())
    except grpc.RpcError as e:
      raise ClientError(e.code(), e.details(), "Synthesize") from None
    finally:
      call.cancel()  # a consumer that stops early cancels the stream on the server

  def stream(self, prompt=None, hints=(), **kwargs) -> Iterator[str]:
    """The generated text as it arrives; the plan and the final message land on ``last_plan``/``last_final``."""
    for r in self.synthesize(prompt, hints, **kwargs):
      if r.WhichOneof("kind") == "delta" and r.delta.text:
        yield r.delta.text

  def generate(self, prompt=None, hints=(), **kwargs):
    """Run to the end; the final message (``text``, ``finish_reason``, ``usage``, ``trace``)."""
    for _ in self.synthesize(prompt, hints, **kwargs):
      pass
    return self.last_final

  def list_thoughtlets(self):
    from thoughtjax.proto.v1 import synthesis_pb2 as pb

    return self._call("ListThoughtlets", pb.ListThoughtletsRequest())

  def registry_stats(self):
    from thoughtjax.proto.v1 import synthesis_pb2 as pb

    return self._call("RegistryStats", pb.RegistryStatsRequest())

  def reload_registry(self):
    from thoughtjax.proto.v1 import synthesis_pb2 as pb

    return self._call("ReloadRegistry", pb.ReloadRegistryRequest())

  def health(self, service: str = "") -> str:
    """``SERVING``, ``NOT_SERVING``, ... from grpc.health.v1 Check."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
      r = health_pb2_grpc.HealthStub(self.channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=self.timeout
      )
    except grpc.RpcError as e:
      raise ClientError(e.code(), e.details(), "Health.Check") from None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

  def close(self) -> None:
    self.channel.close()

  def __enter__(self) -> Client:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

"""The grpc.aio server: the ``thoughtjax.v1.Synthesizer`` servicer over a
:class:`~thoughtjax.synthesis.synthesize.Synthesizer`, plus health, reflection, TLS, keepalive and drain.

Transport only: validation of the wire request, the status of each failure, and scheduling through one
small interface (:class:`server.scheduling.Scheduler`; :class:`~server.scheduling.SimpleScheduler` runs one
generation per request today, the continuous-batching slot engine replaces it later without touching this
module). Planning, restore, compile and generation are the library's.

Validation (parsing, tokenization, checks) happens on a worker thread before any model work, so a malformed
request costs well under a millisecond and never reaches the scheduler.
Requests carry the raw bytes to the handlers (the servicer parses them), so a message that is not a valid
protobuf (including a string field that is not UTF-8) is INVALID_ARGUMENT, not INTERNAL.

Status of each failure:
  INVALID_ARGUMENT     malformed message, empty prompt, prompt and messages both or neither, > 3 hints,
                       unknown hint (the valid list in the message), a sampling value past its type, the model
                       (top_k above the vocabulary, token ids outside it) or non-finite, too many or too long
                       stop strings (max_stop_strings, max_stop_chars), invalid, unknown or too long explicit
                       path (max_path_layers), bad request_id
  OUT_OF_RANGE         prompt tokens + max_tokens beyond the model's context
  RESOURCE_EXHAUSTED   every turn taken and the waiting queue full (at once, before any work); a ReloadRegistry
                       within admin.reload_interval_s of the last
  UNAVAILABLE          loading the registry or warming up (health NOT_SERVING), or draining
  UNAUTHENTICATED      an admin call (ReloadRegistry, RegistryStats) with no credential; any other call without
                       the configured client token (clients.token), or with another
  PERMISSION_DENIED    an admin call with a wrong token or a client certificate not in admin.identities
  FAILED_PRECONDITION  a pinned registry sequence that is not the one served; no path left after a needed
                       thoughtlet failed verification; a ReloadRegistry whose new sequence fails verification
                       or has no calibration that can serve it (the old sequence keeps serving)
  DEADLINE_EXCEEDED    the deadline passed while waiting or generating (the generation stops at the next chunk)
  INTERNAL             a bug: "internal error" and the request id, nothing else

Messages name the field, the limit and the fix, end with the request id, and carry no filesystem path
(replaced by ``<path>``), exception class name or traceback; the server log has the full detail under the id.

Request fields: ``prompt`` is plain text; ``messages`` go through the registry tokenizer's chat template.
``max_latency_ms`` unset: the call's remaining deadline is the budget (no deadline: no budget).
Trace and billing travel twice: in the final message and in the trailing metadata (gRPC conventions:
lowercase keys, ``-bin`` for binary): ``thoughtjax-trace-bin`` and ``thoughtjax-usage-bin`` (the serialized
``Trace`` and ``Usage``), and text keys ``x-thoughtjax-*`` (request id, path hash, registry sequence, tokens,
compute seconds, degraded, finish reason, program cache) that proxies and access logs can read without the
proto. :func:`thoughtjax.client.read_trailer` reads them back.

The OpenAI-compatible HTTP endpoint (server/http.py) runs on the same loop through the same steps
(:meth:`SynthesizerService.check_client`, :meth:`~SynthesizerService.admit`,
:meth:`~SynthesizerService.responses`, :meth:`~SynthesizerService.failure`).

Idle release (scale to zero, ``idle_release_s`` in the config): a path no request has run for that long drops
its slot engines (KV caches), its composed models (the synthesizer's and the explicit paths'), the drafts composed
over it and the registry's resident copies of thoughtlets no other resident path reads (the stored router's too
once nothing stays resident); then the heap is trimmed, so the process's RSS falls back near its start-up size.
Compiled programs stay (in memory and on disk): coming back costs a restore from the registry, not a compile;
with ``idle_release_programs`` they go too once no path is resident, and coming back compiles (from the
persistent compilation cache).
Health stays SERVING; the next request restores what it needs (:meth:`SynthesizerService.release_idle`, run by
:class:`ServerApp` off the event loop; :mod:`thoughtjax.serving.idle` keeps a release from overlapping any
request's start).

Reload: everything one registry sequence serves with (registry, synthesizer, composed explicit paths) is one
:class:`_Serving`; a request takes the current one when it arrives and keeps it to its end, and
``ReloadRegistry`` builds the next one off the event loop (open under the serving trust policy, verify every
current thoughtlet's signature and digests, a calibration valid for the new sequence, warm the configured
hints) and swaps the reference. Streams in flight finish on the version they started with; a failure leaves
the old version serving, is answered FAILED_PRECONDITION naming it and is counted (RegistryStats, metrics).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.config import ServerConfig
from server.metrics import FAILURE_FIELDS, ServerMetrics, failure_totals
from server.proto.thoughtjax.v1 import synthesis_pb2 as pb
from server.scheduling import DeadlineExpired, QueueFull, Scheduler, make_scheduler
from server.tls import server_credentials
from thoughtjax.errors import UserError
from thoughtjax.serving.idle import IdleTracker, drop_compiled_programs, trim_memory

log = logging.getLogger("thoughtjax.server")

SERVICE = pb.DESCRIPTOR.services_by_name["Synthesizer"].full_name
MAX_REQUEST_ID = 128
DEFAULT_MAX_TOKENS = 64
ROLES = ("system", "user", "assistant")
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Refused(Exception):
  """A request refused with ``code``; ``message`` says what to fix."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


def status_of(e: BaseException) -> grpc.StatusCode | None:
  """The status of a library or scheduler error (None: not a user error, a bug: it propagates)."""
  from thoughtjax.registry import RegistryError, UnknownThoughtletError
  from thoughtjax.synthesis.planner import NoPathError, SequenceMismatchError

  if isinstance(e, _Refused):
    return e.code
  if isinstance(e, QueueFull):
    return grpc.StatusCode.RESOURCE_EXHAUSTED
  if isinstance(e, DeadlineExpired):
    return grpc.StatusCode.DEADLINE_EXCEEDED
  if isinstance(e, (SequenceMismatchError, NoPathError)):
    return grpc.StatusCode.FAILED_PRECONDITION
  if isinstance(e, UnknownThoughtletError):
    return grpc.StatusCode.INVALID_ARGUMENT
  if isinstance(e, RegistryError):
    return grpc.StatusCode.FAILED_PRECONDITION
  if isinstance(e, UserError):
    return grpc.StatusCode.INVALID_ARGUMENT
  return None


# An absolute or home-relative filesystem path (not a URL's path, not blocks[a:b) or a/b words).
_ABS_PATH = re.compile(r"(?<![\w:/.~-])~?/[^\s'\"`,;()\[\]{}<>]+")


def public_message(text: str, limit: int = 2000) -> str:
  """``text`` as a client may read it: filesystem paths replaced by ``<path>``, at most ``limit`` characters."""
  text = _ABS_PATH.sub("<path>", text)
  return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Request:
  """A validated SynthesizeRequest, in the library's terms."""

  request_id: str
  prompt_ids: tuple[int, ...]
  hints: tuple[str, ...]  # as given (the synthesizer normalizes and reports corrections)
  max_latency_ms: float
  max_tokens: int
  sampling: dict
  path: str | None
  pin_sequence: int | None
  serving: _Serving | None = dataclasses.field(default=None, compare=False, repr=False)  # what it runs on


@dataclasses.dataclass(eq=False)
class _Serving:
  """Everything one registry sequence serves with; ``ReloadRegistry`` swaps the whole object at once and a
  request keeps the one it arrived under. ``owned``: opened by the server (a reload), closed by it."""

  syn: Any
  registry: Any
  max_context: int
  vocab: int
  num_layers: int
  owned: bool = False
  paths: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # path -> Model
  paths_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  @classmethod
  def of(cls, syn, owned: bool = False) -> _Serving:
    reg = syn.registry
    cfg = reg.config
    return cls(syn, reg, int(cfg.max_context), int(cfg.vocab_size), int(cfg.num_layers), owned)

  @property
  def sequence(self) -> int:
    return int(self.syn.calibration.sequence)


@dataclasses.dataclass
class _Reload:
  """What one ReloadRegistry prepared (``serving`` None: nothing to switch to)."""

  serving: _Serving | None
  published: int
  calibration: str = ""
  dropped: tuple[str, ...] = ()
  warmed: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()


class SynthesizerService:
  """The servicer: one synthesizer, one scheduler, the server's readiness (see the module docstring)."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig,
    scheduler: Scheduler | None = None,
    metrics: ServerMetrics | None = None,
  ):
    self.config = config
    # None until the registry is loaded (``install``): the server listens first and answers UNAVAILABLE.
    self.serving: _Serving | None = None if synthesizer is None else _Serving.of(synthesizer)
    self.scheduler = scheduler or make_scheduler(config)  # config.scheduler: continuous (slot engines) or simple
    self.ready = False
    self.draining = False
    self.statuses: collections.Counter[str] = collections.Counter()  # status name -> answers
    # ReloadRegistry: results, and the registries it replaced (their counters stay in the totals).
    self.reloads: dict[str, Any] = {"switched": 0, "unchanged": 0, "refused": 0, "last_refusal": None}
    self._retired: list[_Serving] = []
    self._refused_failures: collections.Counter[str] = collections.Counter()
    self._reload_lock = asyncio.Lock()
    self._last_reload: float | None = None  # time.monotonic() of the last reload taken
    self._count_lock = threading.Lock()
    self.metrics = metrics or ServerMetrics()
    self.metrics.bind(
      self.scheduler.snapshot, self.failure_totals, lambda: 0 if self.serving is None else self.serving.sequence
    )
    # ---- idle release (scale to zero) ----
    self.idle = IdleTracker(config.idle_release)
    self.metrics.bind_residency(lambda: len(self.resident_paths()))

  def install(self, synthesizer) -> None:
    """Serve ``synthesizer`` (the registry a server started without has been loaded)."""
    self.serving = _Serving.of(synthesizer)

  @property
  def syn(self):
    return self.serving.syn

  @property
  def registry(self):
    return self.serving.registry

  def failure_totals(self) -> dict:
    """Registry refusal counters over the server's life: the serving registry, the ones reloads replaced,
    and the new sequences a reload refused."""
    with self._count_lock:
      refused = dict(self._refused_failures)
    current = () if self.serving is None else (self.serving.registry.stats(),)
    return failure_totals(*current, *(s.registry.stats() for s in self._retired), refused)

  def close(self) -> None:
    """Release the registries the server opened itself (reloads)."""
    for s in [*self._retired, *([] if self.serving is None else [self.serving])]:
      if s.owned:
        s.registry.close()

  # ---- wiring -------------------------------------------------------------------------
  def handler(self) -> grpc.GenericRpcHandler:
    """Method handlers taking raw request bytes (parsed here, so malformed bytes are INVALID_ARGUMENT)."""
    unary = lambda fn, out: grpc.unary_unary_rpc_method_handler(fn, response_serializer=out.SerializeToString)
    return grpc.method_handlers_generic_handler(
      SERVICE,
      {
        "GetOptimalPath": unary(self.GetOptimalPath, pb.Plan),
        "Synthesize": grpc.unary_stream_rpc_method_handler(
          self.Synthesize, response_serializer=pb.SynthesizeResponse.SerializeToString
        ),
        "ListThoughtlets": unary(self.ListThoughtlets, pb.ListThoughtletsResponse),
        "RegistryStats": unary(self.RegistryStats, pb.RegistryStatsResponse),
        "ReloadRegistry": unary(self.ReloadRegistry, pb.ReloadRegistryResponse),
      },
    )

  def _answered(self, method: str, code: str) -> None:
    self.statuses[code] += 1
    self.metrics.answered(method, code)

  def failure(self, e: BaseException, method: str = "", request_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """``e``'s status and a short message with the request id, counted; the full detail (exception class,
    paths, traceback) goes to the server log under that id only. Every transport answers failures with it."""
    rid = request_id or uuid.uuid4().hex
    code = status_of(e)
    if code is None:  # a bug: the client learns only that it happened and where to look
      log.error("request %s: %s failed", rid, method or "call", exc_info=e)
      self._answered(method, "INTERNAL")
      return grpc.StatusCode.INTERNAL, f"internal error; the server log has the details under request id {rid}"
    log.info("request %s: %s answered %s: %s: %s", rid, method or "call", code.name, type(e).__name__, e)
    self._answered(method, code.name)
    return code, f"{public_message(str(e))} (request id {rid})"

  async def _abort(self, context, e: BaseException, method: str = "", request_id: str | None = None):
    await context.abort(*self.failure(e, method, request_id))

  def check_client(self, authorization: str | None, method: str) -> None:
    """Non-admin calls: the ``clients`` bearer token when one is configured, else UNAUTHENTICATED (a missing
    and a wrong token alike: neither names a client). ``authorization``: the header's value as sent."""
    try:
      token = self.config.clients.bearer()
    except UserError as e:  # an unreadable token file: the operator's to fix, not the client's
      log.error("clients token: %s", e)
      raise _Refused(
        grpc.StatusCode.UNAVAILABLE, f"{method}: the server cannot read its client token; the server log says why"
      ) from None
    if token is None:
      return
    if authorization is None:
      raise _Refused(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{method}: this server needs a client token; send 'authorization: Bearer TOKEN' (clients.token in the "
        f"server config)",
      )
    if not hmac.compare_digest(str(authorization).encode(), f"Bearer {token}".encode()):
      raise _Refused(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{method}: the authorization is not this server's client token; send 'authorization: Bearer TOKEN' with "
        f"the token of clients.token in the server config",
      )

  def _authorize(self, context, method: str) -> None:
    """Admin calls (ReloadRegistry, RegistryStats): the configured bearer token or an allowed client
    certificate identity, else UNAUTHENTICATED (no credential) or PERMISSION_DENIED."""
    a = self.config.admin
    if a.open:
      return
    try:
      token = a.bearer()
    except UserError as e:  # an unreadable token file: the operator's to fix, not the client's
      log.error("admin token: %s", e)
      raise _Refused(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is an admin call and the server cannot read its admin token; the server log says why",
      ) from None
    if token is None and not a.identities:
      raise _Refused(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is an admin call and this server allows no admin client; set admin.token, admin.token_file "
        f"or admin.identities in the server config",
      )
    given = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    identities = [i.decode(errors="replace") for i in context.peer_identities() or ()]
    if given is not None:
      if token is not None and hmac.compare_digest(str(given).encode(), f"Bearer {token}".encode()):
        return
      raise _Refused(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is an admin call and the authorization metadata is not this server's admin token; send "
        f"'authorization: Bearer TOKEN' with the token of admin.token in the server config",
      )
    if any(i in a.identities for i in identities):
      return
    if not identities:
      raise _Refused(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{method} is an admin call: send 'authorization: Bearer TOKEN' (the server's admin.token) or connect "
        f"with a client certificate the server allows (admin.identities)",
      )
    raise _Refused(
      grpc.StatusCode.PERMISSION_DENIED,
      f"{method} is an admin call and this client certificate is not in the server's admin.identities; use an "
      f"allowed certificate or the admin bearer token",
    )

  def _limit_reload(self) -> None:
    """RESOURCE_EXHAUSTED within ``admin.reload_interval_s`` of the last reload (each re-hashes the registry)."""
    now, interval = time.monotonic(), self.config.admin.reload_interval_s
    if self._last_reload is not None and now - self._last_reload < interval:
      raise _Refused(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"ReloadRegistry: the last reload was {now - self._last_reload:.1f} s ago and the server takes one per "
        f"{interval:g} s (admin.reload_interval_s); retry in {interval - (now - self._last_reload):.1f} s",
      )
    self._last_reload = now

  # ---- validation ---------------------------------------------------------------------
  @staticmethod
  def _parse(raw: bytes, cls):
    msg = cls()
    try:
      msg.ParseFromString(raw)
    except DecodeError as e:
      raise _Refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid {cls.DESCRIPTOR.full_name} ({e}): malformed protobuf, or a "
        f"string field that is not valid UTF-8; send UTF-8 text in a message built from "
        f"server/proto/thoughtjax/v1/synthesis.proto",
      ) from None
    return msg

  def _check_loaded(self) -> None:
    if self.serving is None:
      raise _Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is still loading its registry (health NOT_SERVING); retry when grpc.health.v1 reports SERVING",
      )

  def _check_serving(self) -> None:
    if self.draining:
      raise _Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is draining (shutting down); send the request to another replica or retry after it restarts",
      )
    self._check_loaded()
    if not self.ready:
      raise _Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is warming up (health NOT_SERVING); retry when grpc.health.v1 reports SERVING",
      )

  def validate(self, m: pb.SynthesizeRequest, deadline_s: float | None, serving: _Serving | None = None) -> Request:
    """A :class:`Request` on ``serving`` (default: the current one), or :class:`_Refused` naming the field
    (no model work; tokenization only)."""
    from thoughtjax.decode.masks import grammars_for
    from thoughtjax.sampling import SamplingParams
    from thoughtjax.synthesis.hints import normalize_hints

    bad = lambda msg: _Refused(grpc.StatusCode.INVALID_ARGUMENT, msg)
    s = serving or self.serving
    rid = m.request_id or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID or not rid.isprintable() or not rid.isascii():
      raise bad(
        f"request_id: expected at most {MAX_REQUEST_ID} printable ASCII characters, got {len(rid)} "
        f"characters {rid[:40]!r}; send a shorter id or none (one is generated)"
      )
    codec = s.registry.codec
    if bool(m.prompt) == bool(m.messages):
      raise bad(
        "give exactly one of prompt (plain text) and messages (chat), got "
        + ("both" if m.prompt else "neither (an empty prompt)")
      )
    if m.prompt:
      text = m.prompt
    else:
      for i, msg in enumerate(m.messages):
        if msg.role not in ROLES:
          raise bad(f"messages[{i}].role: expected one of {list(ROLES)}, got {msg.role!r}")
        if not msg.content:
          raise bad(f"messages[{i}].content is empty; give text or drop the message")
      if getattr(codec, "chat_template", None) is None:
        raise bad("this registry's tokenizer has no chat template; send prompt (plain text) instead of messages")
      text = codec.render_chat([{"role": x.role, "content": x.content} for x in m.messages])
    ids = codec.encode(text)
    if not ids:
      raise bad("the prompt is empty after tokenization; give at least one token of text")
    try:
      normalize_hints(list(m.hints), s.syn.dictionary)
    except UserError as e:
      raise bad(f"hints: {e}") from None
    n = int(m.max_tokens) if m.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if not 1 <= n <= self.config.max_tokens_limit:
      raise bad(f"max_tokens: expected 1..{self.config.max_tokens_limit} (the server's max_tokens_limit), got {n}")
    if len(ids) + n > s.max_context:
      raise _Refused(
        grpc.StatusCode.OUT_OF_RANGE,
        f"prompt ({len(ids)} tokens) + max_tokens ({n}) = {len(ids) + n} exceeds the model's context "
        f"of {s.max_context} tokens; shorten the prompt or lower max_tokens",
      )
    if m.HasField("max_latency_ms"):
      budget = m.max_latency_ms
      if not math.isfinite(budget) or budget <= 0:
        raise bad(
          f"max_latency_ms: expected a finite number of milliseconds > 0, got {budget}; leave it unset for the "
          f"call's deadline"
        )
    else:
      budget = math.inf if deadline_s is None else max(deadline_s * 1e3, 1e-3)
    stops = list(m.stop_strings)
    cfg = self.config
    if len(stops) > cfg.max_stop_strings:
      raise bad(
        f"stop_strings: {len(stops)} given, the server takes at most {cfg.max_stop_strings} (max_stop_strings); "
        f"send fewer"
      )
    for i, stop in enumerate(stops):
      if not stop:
        raise bad(f"stop_strings[{i}]: an empty stop string would stop at once; drop it")
      if len(stop) > cfg.max_stop_chars:
        raise bad(
          f"stop_strings[{i}]: {len(stop)} characters, the server takes at most {cfg.max_stop_chars} per stop "
          f"string (max_stop_chars); send a shorter one"
        )
    sampling = dict(
      temperature=float(m.temperature) if m.HasField("temperature") else 0.0,
      top_k=int(m.top_k),
      top_p=float(m.top_p) if m.HasField("top_p") else 1.0,
      seed=int(m.seed),
      logit_bias={int(k): float(v) for k, v in m.logit_bias.items()} or None,
      stop_token_ids=tuple(m.stop_token_ids),
      stop_strings=tuple(stops),
    )
    for field in ("json_schema", "regex", "grammar"):
      if getattr(m, field):
        sampling[field] = getattr(m, field)
    try:
      # The library's one check of every numeric field (types' ranges, finiteness, the vocabulary).
      params = SamplingParams(max_tokens=n, **sampling)
      params.check_model(s.vocab)
    except UserError as e:
      raise bad(f"sampling: {e}") from None
    if params.constraint is not None:
      try:  # compiled against the tokenizer now (then cached), so a bad one is refused before any model work
        grammars_for(codec, s.vocab).check(params.constraint)
      except UserError as e:
        raise bad(str(e)) from None
    path = m.path or None
    if path is not None:
      self._check_path(path, s)
    pin = int(m.registry_sequence) if m.HasField("registry_sequence") else None
    served = s.sequence
    if pin is not None and pin != served:
      raise _Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"registry_sequence: the request pins {pin}, this server plans at sequence {served}; pin "
        f"{served}, or send it to a server of sequence {pin}",
      )
    return Request(rid, tuple(ids), tuple(m.hints), float(budget), n, sampling, path, pin, s)

  def _check_path(self, path: str, s: _Serving) -> None:
    """An explicit path's syntax and size: at most ``max_path_layers`` pieces and layers (default twice the
    model's layers), counted before anything is parsed or read, so a huge path costs no manifest reads."""
    from thoughtjax.paths import parse_path

    limit = self.config.max_path_layers or 2 * s.num_layers
    why = f"the server's limit is {limit} (max_path_layers; default twice the model's {s.num_layers} layers)"
    pieces = path.count(",") + 1
    if pieces > limit:
      raise _Refused(
        grpc.StatusCode.INVALID_ARGUMENT, f"path: {pieces} pieces; {why}. Send a shorter path or let the server plan"
      )
    try:
      refs = parse_path(path)
    except UserError as e:
      raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"path: {e}") from None
    layers = sum(b - a for a, b in (r.span for r in refs if r.span is not None))
    if layers > limit:
      raise _Refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"path: runs {layers} layers; {why}. Send a shorter path or let the server plan",
      )

  # ---- the library calls (on worker threads) ----------------------------------------------
  def _plan(self, r: Request):
    from thoughtjax.sampling import SamplingParams

    return r.serving.syn.plan(
      list(r.prompt_ids),
      list(r.hints) or None,
      max_latency_ms=r.max_latency_ms,
      max_tokens=r.max_tokens,
      pin_sequence=r.pin_sequence,
      constraint=SamplingParams(max_tokens=r.max_tokens, **r.sampling).constraint,
    )

  @staticmethod
  def _path_model(path: str, s: _Serving):
    from thoughtjax.compose import compose

    with s.paths_lock:
      got = s.paths.get(path)
      if got is not None:
        s.paths.move_to_end(path)
        return got
    model = compose(path, s.registry, kernels=s.syn.kernels)
    with s.paths_lock:
      s.paths[path] = model
      while len(s.paths) > 4:
        s.paths.popitem(last=False)
    return model

  @staticmethod
  def _path_types(path: str, s: _Serving) -> _PathShape:
    """An explicit path resolved and type-checked against ``s``'s manifests, no weights restored (a path
    already composed for a Synthesize is reused)."""
    from thoughtjax.assembly import check_chain, path_hash, resolve

    with s.paths_lock:
      got = s.paths.get(path)
    if got is not None:
      return _PathShape(got.path, tuple(got.refs), got.path_hash)
    links = resolve(path, s.registry)
    check_chain(links)
    refs = tuple(n if v is None else f"{n}@{v}" for link in links for n, v in link.units)
    return _PathShape(", ".join(str(link.ref) for link in links), refs, path_hash(links))

  def _start(self, r: Request):
    if r.path is not None:
      return _PathRun(self._path_model(r.path, r.serving), r, r.serving.registry.sequence)
    return r.serving.syn.synthesize(
      list(r.prompt_ids),
      list(r.hints) or None,
      max_latency_ms=r.max_latency_ms,
      max_tokens=r.max_tokens,
      pin_sequence=r.pin_sequence,
      **r.sampling,
    )

  # ---- idle release (scale to zero) ----------------------------------------------------------
  def resident_paths(self) -> set[str]:
    """Path hashes whose engines or composed models are resident, or that a request holds."""
    s = self.serving
    if s is None:
      return set()
    out = {m.path_hash for m in s.syn.models()} | set(self.idle.resident())
    with s.paths_lock:
      out |= {m.path_hash for m in s.paths.values()}
    paths = getattr(self.scheduler, "resident_paths", None)
    return out | (paths() if paths is not None else set())

  def release_idle(self, now: float | None = None) -> list[str]:
    """Release every path unused for ``idle_release_s`` at ``now`` (default: the tracker's clock) that no
    request holds and whose engines hold no work: its engines, composed models, drafts, and the resident
    weights no other path reads; then trim the heap. Returns the path hashes released. Worker thread: it
    closes idle driver threads and collects garbage. Skipped (nothing released, tried again later) while a
    request is between its turn and its path, or a run is being drained."""
    s = self.serving
    if s is None or self.idle.idle_s is None:
      return []
    self.idle.seen(self.resident_paths())
    if not self.idle.due(now) or self.scheduler.snapshot().get("draining", 0):
      return []  # a run being closed may still read its model
    released: list[str] = []
    with self.idle.releasing() as clear:
      if not clear:
        return []
      for path in self.idle.due(now):  # again: a request may have taken one meanwhile
        if not self.idle.held(path) and self._release_path(path, s):
          self.idle.forget(path)
          released.append(path)
      if released and self._evict_unused(s) and self.config.idle_release_programs:
        drop_compiled_programs()  # scaled to zero: nothing runs or starts (the gate), so nothing needs them
        s.syn.forget_compiled()
    if released:
      freed = trim_memory()
      self.metrics.idle_releases.inc(len(released))
      log.info("released %d idle paths (%s); %s", len(released), ", ".join(released), freed)
    return released

  def _release_path(self, path: str, s: _Serving) -> bool:
    """Drop the references ``s`` and the scheduler hold to ``path``'s weights; False when its engines are busy."""
    from thoughtjax.speculative import forget_drafts

    release = getattr(self.scheduler, "release_path", None)
    if release is not None and not release(path):
      return False
    models = s.syn.drop_models({path})
    with s.paths_lock:
      models += [s.paths.pop(k) for k in [k for k, m in s.paths.items() if m.path_hash == path]]
    for m in models:
      forget_drafts(m.parts)
    return True

  def _evict_unused(self, s: _Serving) -> bool:
    """Evict from the registry's resident set every thoughtlet no resident model reads; with none left, the
    stored router (and every draft) goes too. True when none is left (scaled to zero)."""
    from thoughtjax.speculative import forget_drafts
    from thoughtjax.synthesis.router_store import ROUTER_NAME, forget_router, loaded_router

    with s.paths_lock:
      models = [*s.syn.models(), *s.paths.values()]
    models += getattr(self.scheduler, "resident_models", list)()
    keep = {ref for m in models for ref in m.refs}
    router = loaded_router(s.registry)
    if not models:  # scaled to zero
      forget_router(s.registry)
      forget_drafts()
    elif router is not None:
      keep |= set(router.model.refs)
      keep |= {r for r in s.registry.stats().resident if r.startswith(f"{ROUTER_NAME}@")}
    s.registry.evict_except(keep)
    return not models

  # ---- methods ------------------------------------------------------------------------
  async def admit(self, m: pb.SynthesizeRequest, time_remaining: float | None) -> Request:
    """The server serving and ``m`` validated: the first step of a request on either transport (after its
    credential is checked). ``time_remaining``: the call's deadline in seconds (None: none)."""
    self._check_serving()
    # Tokenizing a prompt up to max_message_bytes long must not hold the event loop.
    return await asyncio.get_running_loop().run_in_executor(None, self.validate, m, time_remaining)

  async def _request(self, raw: bytes, context, method: str) -> Request:
    self.check_client(_metadata(context, "authorization"), method)
    m = self._parse(raw, pb.SynthesizeRequest)
    return await self.admit(m, context.time_remaining())

  async def GetOptimalPath(self, raw: bytes, context) -> pb.Plan:
    r = None
    try:
      r = await self._request(raw, context, "GetOptimalPath")
      if r.path is not None:
        # Resolved and type-checked from manifests only: a plan restores nothing.
        model = await asyncio.get_running_loop().run_in_executor(None, self._path_types, r.path, r.serving)
        plan = _explicit_plan(model, r, r.serving.registry.sequence)
      else:
        plan = _plan_message(await asyncio.get_running_loop().run_in_executor(None, self._plan, r), r.request_id)
    except Exception as e:
      await self._abort(context, e, "GetOptimalPath", r and r.request_id)
    self._answered("GetOptimalPath", "OK")
    return plan

  async def Synthesize(self, raw: bytes, context):
    t_arrival = time.perf_counter()
    try:
      r = await self._request(raw, context, "Synthesize")
    except Exception as e:
      await self._abort(context, e, "Synthesize")
      return
    # Closed however the call ends (a cancelled call included): that releases the request's turn.
    async with contextlib.aclosing(self.responses(r, context.time_remaining(), t_arrival)) as out:
      try:
        async for response in out:
          if response.WhichOneof("kind") == "final":
            self._answered("Synthesize", "OK")
            context.set_trailing_metadata(trailer(response.final, r.request_id))
          yield response
      except Exception as e:
        await self._abort(context, e, "Synthesize", r.request_id)

  async def responses(
    self, r: Request, time_remaining: float | None, t_arrival: float
  ) -> AsyncIterator[pb.SynthesizeResponse]:
    """Schedule ``r`` (admission, queue, deadline) and yield its plan, its deltas and its final message,
    with the latency metrics; the one run path of every transport. A failure raises (:func:`status_of` gives
    its status); the caller answers it and counts the OK. Closing the iterator early cancels the run: its
    slot is free at the end of the decode chunk running then."""
    deadline = None if time_remaining is None else time.monotonic() + time_remaining
    t_admit, started = time.perf_counter(), []
    holding = {"path": None, "ended": False}  # the path this request holds against idle release
    holding_lock = threading.Lock()

    def start():
      started.append(time.perf_counter())  # the scheduler gave the request its turn: the queue wait ends
      with self.idle.starting():  # no idle release drops what this composes from meanwhile
        run = self._start(r)
        model = getattr(run, "model", None)
        with holding_lock:
          if model is not None and not holding["ended"]:
            holding["path"] = model.path_hash
            self.idle.hold(model.path_hash)
      return run

    stream = self.scheduler.stream(start, request_id=r.request_id, deadline=deadline)
    run, last, t_prev = None, None, None
    try:
      async for item in stream:
        if run is None:
          run = item
          yield pb.SynthesizeResponse(request_id=r.request_id, plan=_run_plan(run, r))
          continue
        last = item
        if item.token_ids or item.text:
          now = time.perf_counter()
          if t_prev is None:
            self.metrics.first_token(now - t_arrival)
          else:
            self.metrics.tokens(now - t_prev, len(item.token_ids))
          t_prev = now
          yield pb.SynthesizeResponse(request_id=r.request_id, delta=pb.Delta(token_ids=item.token_ids, text=item.text))
    finally:
      await stream.aclose()
      with holding_lock:
        holding["ended"] = True
        if holding["path"] is not None:
          self.idle.let_go(holding["path"])
    final = _final(run, last, (started[0] - t_admit) * 1e3 if started else None)
    ran = run.generation.trace.first_token is not None
    self.metrics.finished(final.trace, final.usage, final.trace.program_cache_hit if ran else None)
    yield pb.SynthesizeResponse(request_id=r.request_id, final=final)

  async def ListThoughtlets(self, raw: bytes, context) -> pb.ListThoughtletsResponse:
    try:
      self.check_client(_metadata(context, "authorization"), "ListThoughtlets")
      self._parse(raw, pb.ListThoughtletsRequest)
      self._check_loaded()
      reg = self.serving.registry
      out = pb.ListThoughtletsResponse(registry_sequence=reg.sequence)
      for name in reg.names:
        mf = reg.manifest(name)
        t = pb.Thoughtlet(
          name=mf.name,
          version=mf.version,
          kind=mf.kind.value,
          versioned_hash=mf.versioned_hash,
          param_bytes=mf.param_bytes,
          description=mf.signature.description,
          tags=list(mf.signature.tags),
          signed=mf.signed_by is not None,
        )
        if mf.layers is not None:
          t.layer_start, t.layer_end = mf.layers
        out.thoughtlets.append(t)
    except Exception as e:
      await self._abort(context, e, "ListThoughtlets")
    self._answered("ListThoughtlets", "OK")
    return out

  async def RegistryStats(self, raw: bytes, context) -> pb.RegistryStatsResponse:
    try:
      self._parse(raw, pb.RegistryStatsRequest)
      self._check_loaded()
      self._authorize(context, "RegistryStats")
    except Exception as e:
      await self._abort(context, e, "RegistryStats")
    s = self.serving
    snap = self.scheduler.snapshot()
    # The serving registry's stats, with refusal counters totalled over the server's life (versions a
    # reload replaced or refused included: a refused reload must stay visible after the fact).
    stats = {**s.registry.stats().to_json(), **self.failure_totals(), "reload": dict(self.reloads)}
    self._answered("RegistryStats", "OK")
    return pb.RegistryStatsResponse(
      registry_sequence=s.registry.sequence,
      signed=s.registry.signed,
      stats_json=json.dumps(stats, default=str),
      planner_json=json.dumps(
        {**s.syn.planner.counters.snapshot(), "scheduler": snap, "statuses": dict(self.statuses)}, default=str
      ),
      in_flight=snap["running"],
      waiting=snap["waiting"],
    )

  async def ReloadRegistry(self, raw: bytes, context) -> pb.ReloadRegistryResponse:
    try:
      self._parse(raw, pb.ReloadRegistryRequest)
      self._check_loaded()
      self._authorize(context, "ReloadRegistry")
      self._limit_reload()
      async with self._reload_lock:  # one reload at a time; requests keep flowing meanwhile
        old = self.serving
        got = await asyncio.get_running_loop().run_in_executor(None, self._prepare_reload, old)
        if got.serving is not None:
          self.serving = got.serving  # the switch: one reference; admitted requests keep `old`
          self._retire(old)
    except Exception as e:
      await self._abort(context, e, "ReloadRegistry")
    switched = got.serving is not None
    self.reloads["switched" if switched else "unchanged"] += 1
    self.metrics.reloads.labels("switched" if switched else "unchanged").inc()
    if switched:
      log.info(
        "switched to registry sequence %d (was %d; calibration %s)", got.published, old.sequence, got.calibration
      )
    self._answered("ReloadRegistry", "OK")
    return pb.ReloadRegistryResponse(
      serving_sequence=self.serving.sequence,
      published_sequence=got.published,
      switched=switched,
      previous_sequence=old.sequence,
      calibration=got.calibration,
      dropped_paths=list(got.dropped),
      warmed_paths=list(got.warmed),
      notes=list(got.notes),
    )

  def _prepare_reload(self, old: _Serving) -> _Reload:
    """On a worker thread: the next :class:`_Serving`, opened, verified, calibrated and warmed; or nothing
    when the published sequence is the one served. A failure is counted and refused, ``old`` untouched."""
    from thoughtjax.registry import Registry
    from thoughtjax.synthesis.synthesize import Synthesizer

    fresh = None
    try:
      # The index: its signature under the serving trust policy, and never a sequence lower than one seen.
      fresh = Registry.open(old.registry.root, trust=old.registry.trust)
      if fresh.sequence == old.sequence:
        fresh.close()
        return _Reload(None, old.sequence)
      # Every current thoughtlet's manifest signature and file digests, before anything is switched.
      fresh.verify(deep=False)
      calibration, how, dropped, notes = calibration_for(fresh, old.syn.calibration)
      syn = Synthesizer(
        fresh,
        calibration,
        old.syn.dictionary,
        kernels=old.syn.kernels,
        keep_paths=old.syn.keep_paths,
        learn=old.syn.learn,
      )
      w = self.config.warm
      warmed = syn.warm(w.hints, prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens) if w.hints else []
      return _Reload(_Serving.of(syn, owned=True), fresh.sequence, how, tuple(dropped), tuple(warmed), tuple(notes))
    except Exception as e:
      seq = "" if fresh is None else f" sequence {fresh.sequence}"
      message = (
        e.args[0]
        if isinstance(e, _Refused)
        else (
          f"ReloadRegistry: the registry{seq} was refused: {e}. "
          f"Still serving sequence {old.sequence}; republish the failed thoughtlet (or restore the registry "
          f"from a backup), check it with thoughtjax registry verify, then call ReloadRegistry again"
        )
      )
      with self._count_lock:
        if fresh is not None:
          for field, n in failure_totals(fresh.stats()).items():
            self._refused_failures[field] += n
        elif (field := _failure_field(e)) is not None:  # refused while opening: its counters went with it
          self._refused_failures[field] += 1
        self.reloads["refused"] += 1
        self.reloads["last_refusal"] = public_message(message)
      self.metrics.reloads.labels("refused").inc()
      log.error("ReloadRegistry of %s refused (%s): %s", old.registry.root, type(e).__name__, message)
      if fresh is not None:
        fresh.close()
      if status_of(e) is None:
        raise
      raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, message) from None

  def _retire(self, old: _Serving) -> None:
    """``old`` stops taking requests; streams in flight hold their own models. Its counters stay in the
    totals; its resident weights are dropped now (when the server opened it) and its lease at stop."""
    from thoughtjax.synthesis.router_store import forget_router

    self._retired.append(old)
    if old.owned:
      old.registry.evict_all()
    old.paths.clear()
    old.syn.drop_models()  # its composed models: the new sequence composes its own
    forget_router(old.registry)


def _metadata(context, key: str) -> str | None:
  """The value of the call's metadata ``key`` (lowercase), or None."""
  return next((v for k, v in context.invocation_metadata() or () if k == key), None)


def _failure_field(e: BaseException) -> str | None:
  from thoughtjax.registry import IntegrityError, RestoreError, RollbackError, SignatureDowngradeError, SignatureError

  for cls, kind in (
    (SignatureDowngradeError, "downgrade"),
    (SignatureError, "signature"),
    (IntegrityError, "integrity"),
    (RollbackError, "rollback"),
    (RestoreError, "restore"),
  ):
    if isinstance(e, cls):
      return FAILURE_FIELDS[kind]
  return None


def calibration_for(registry, previous) -> tuple[Any, str, list[str], list[str]]:
  """A calibration valid for ``registry``'s sequence: its stored one (``"stored"``), else ``previous`` (of an
  older sequence) restricted to the paths whose thoughtlet versions are all still current (``"derived"``,
  with the dropped paths and a note saying so). Refused (FAILED_PRECONDITION naming ``thoughtjax registry
  calibrate``) when the full path changed: then no path's quality or latency is known at the new sequence."""
  from thoughtjax.synthesis.calibration import Calibration
  from thoughtjax.synthesis.calibration_store import MissingCalibrationError, read_calibration

  try:
    return read_calibration(registry), "stored", [], []
  except MissingCalibrationError:
    pass
  current = registry.current
  changed = lambda c: sorted({u.ref for u in c.units if current.get(u.name) != u.version})
  fix = f"calibrate it (thoughtjax registry calibrate {registry.root}) and call ReloadRegistry again"
  full = changed(previous.full)
  if full:
    now = ", ".join(f"{ref.split('@')[0]}@{current.get(ref.split('@')[0], '(removed)')}" for ref in full)
    raise _Refused(
      grpc.StatusCode.FAILED_PRECONDITION,
      f"ReloadRegistry: registry {registry.root} sequence {registry.sequence} has no calibration, and the one of "
      f"sequence {previous.sequence} cannot serve it: the full path's thoughtlets {full} are no longer current "
      f"(now {now}), so no path's quality or latency is known. Still serving sequence {previous.sequence}; {fix}",
    )
  kept = [c for c in previous.candidates if not changed(c)]
  dropped = [c.path for c in previous.candidates if changed(c)]
  hashes = {c.path_hash for c in kept}
  calibration = Calibration(
    registry.sequence,
    previous.fingerprint,
    kept,
    {h: q for h, q in previous.quality.items() if h in hashes},
    previous.latency,
    dict(current),
  )
  note = (
    f"registry sequence {registry.sequence} has no calibration: serving with the quality and latency recorded "
    f"at sequence {previous.sequence} for the {len(kept)} paths whose thoughtlet versions are unchanged"
    + (f"; {len(dropped)} paths whose thoughtlets changed are not offered until you {fix}" if dropped else "")
  )
  return calibration, "derived", dropped, [note]


class _PathRun:
  """An explicit path's generation, shaped like a SynthesisResult for the scheduler and the final message."""

  def __init__(self, model, r: Request, sequence: int):
    from thoughtjax.sampling import SamplingParams

    self.model, self.request, self.sequence = model, r, sequence
    self.t0 = time.perf_counter()
    self.generation = model.stream_batch([list(r.prompt_ids)], SamplingParams(max_tokens=r.max_tokens, **r.sampling))
    self.text = ""

  def __iter__(self):
    return self

  def __next__(self):
    d = next(self.generation)
    self.text += d.text
    return d

  def cancel(self) -> None:
    self.generation.cancel()

  def close(self) -> None:
    self.generation.close()


def _plan_message(plan, request_id: str) -> pb.Plan:
  j = plan.to_json()
  out = pb.Plan(
    path=plan.path,
    refs=list(plan.refs),
    path_hash=plan.path_hash,
    kind=plan.kind,
    hints=list(plan.hints),
    predicted_ms={k: float(v) for k, v in j["predicted_ms"].items()},
    degraded=plan.degraded,
    reason=plan.reason,
    notes=list(plan.notes),
    registry_sequence=plan.sequence,
    max_tokens=plan.max_tokens,
    quality_json=json.dumps(j["quality"]),
    request_id=request_id,
    corrected_hints=[pb.HintCorrection(given=a, corrected=b) for a, b in plan.corrected_hints],
    rejected=[pb.Rejection(path=x.path, path_hash=x.path_hash, why=x.why, detail=x.detail) for x in plan.rejected],
  )
  if plan.tokens_that_fit is not None:
    out.tokens_that_fit = plan.tokens_that_fit
  return out


@dataclasses.dataclass(frozen=True)
class _PathShape:
  """What a plan says of an explicit path (a composed Model has the same three attributes)."""

  path: str
  refs: tuple[str, ...]
  path_hash: str


def _explicit_plan(model, r: Request, sequence: int) -> pb.Plan:
  return pb.Plan(
    path=model.path,
    refs=list(model.refs),
    path_hash=model.path_hash,
    kind="explicit",
    reason="explicit path from the request (not planned)",
    registry_sequence=sequence,
    max_tokens=r.max_tokens,
    request_id=r.request_id,
  )


def _run_plan(run, r: Request) -> pb.Plan:
  if isinstance(run, _PathRun):
    return _explicit_plan(run.model, r, run.sequence)
  return _plan_message(run.plan, r.request_id)


def _final(run, last, queue_ms: float | None = None) -> pb.Final:
  """The final message of ``run`` (on the sequence it started with); ``queue_ms``: its wait for a turn."""
  out = _final_of(run, last)
  if queue_ms is not None:
    out.trace.actual_ms["queue"] = queue_ms
  gt = run.generation.trace
  out.trace.program_cache_hit = gt.first_token is not None and gt.compile_s == 0.0
  reused = getattr(gt, "prefix_cache_tokens", None)  # set by a slot engine that has a prefix cache
  if reused is not None:
    out.trace.prefix_cache_tokens = reused
  return out


def trailer(final: pb.Final, request_id: str) -> tuple[tuple[str, str | bytes], ...]:
  """The trailing metadata of a finished stream: the final message's trace and usage (see the module
  docstring; :func:`thoughtjax.client.read_trailer` is the reader)."""
  from thoughtjax.client import TEXT_PREFIX, TRACE_KEY, USAGE_KEY

  t, u = final.trace, final.usage
  text = {
    "request-id": request_id,
    "finish-reason": final.finish_reason,
    "path-hash": t.path_hash,
    "registry-sequence": str(t.registry_sequence),
    "degraded": "true" if t.degraded else "false",
    "program-cache": "hit" if t.program_cache_hit else "miss",
    **({"prefix-cache-tokens": str(t.prefix_cache_tokens)} if t.HasField("prefix_cache_tokens") else {}),
    "tokens-in": str(u.tokens_in),
    "tokens-out": str(u.tokens_out),
    "compute-seconds": f"{u.compute_seconds:.6f}",
    "predicted-ms": f"{t.predicted_ms.get('total', 0.0):.3f}",
    "actual-ms": f"{t.actual_ms.get('total', 0.0):.3f}",
  }
  if t.degraded:  # metadata text must be printable ASCII
    text["degraded-reason"] = "".join(ch if " " <= ch <= "~" else "?" for ch in t.reason)[:512]
  return (
    (TRACE_KEY, t.SerializeToString()),
    (USAGE_KEY, u.SerializeToString()),
    *((TEXT_PREFIX + k, v) for k, v in text.items()),
  )


def _final_of(run, last) -> pb.Final:
  reason = (last.finish_reason if last is not None and last.finished else None) or "length"
  gt = run.generation.trace
  if isinstance(run, _PathRun):
    sequence = run.sequence
    actual = {
      "compile": gt.compile_s * 1e3,
      "prefill": (gt.prefill_s or 0.0) * 1e3,
      "decode": (gt.decode_s or 0.0) * 1e3,
      "total": ((gt.end or time.perf_counter()) - run.t0) * 1e3,
    }
    tokens_in, tokens_out = len(run.request.prompt_ids), sum(gt.tokens_out)
    trace = pb.Trace(
      path=run.model.path,
      path_hash=run.model.path_hash,
      refs=run.model.refs,
      actual_ms=actual,
      registry_sequence=sequence,
      reason="explicit path",
      decode_chunks=gt.decode_chunks,
    )
    compute = sum(actual.get(s, 0.0) for s in ("compile", "prefill", "decode")) / 1e3
    return pb.Final(
      finish_reason=reason,
      text=run.text,
      trace=trace,
      usage=pb.Usage(tokens_in=tokens_in, tokens_out=tokens_out, compute_seconds=compute),
    )
  t = run.trace
  trace = pb.Trace(
    path=t.path,
    path_hash=t.path_hash,
    refs=list(t.refs),
    hints=list(t.hints),
    degraded=t.degraded,
    reason=t.reason,
    predicted_ms={k: float(v) for k, v in t.predicted_ms.items()},
    actual_ms={k: float(v) for k, v in t.actual_ms.items()},
    registry_sequence=run.plan.sequence,
    corrected_hints=[pb.HintCorrection(given=a, corrected=b) for a, b in run.plan.corrected_hints],
    decode_chunks=gt.decode_chunks,
  )
  return pb.Final(
    finish_reason=t.finish_reason or reason,
    text=run.text,
    trace=trace,
    usage=pb.Usage(tokens_in=t.tokens_in, tokens_out=t.tokens_out, compute_seconds=t.compute_seconds),
  )


# ------------------------------------------------------------------------------ assembly
class ServerApp:
  """One server: the servicer, grpc.health.v1 (NOT_SERVING while warming, SERVING when ready, NOT_SERVING
  while draining) and reflection, on ``config.address`` with TLS/mTLS by config.

  ``load``: with ``synthesizer`` None, called on a worker thread after the port is bound to make the
  synthesizer (open, build or calibrate the registry: minutes on a first start); until it returns health says
  NOT_SERVING and every call is UNAVAILABLE. ``warm``: called on a worker thread after that and before
  SERVING (default: warm the configured hints' plans). ``start()`` returns the bound port; ``drain()`` is
  what SIGTERM runs."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig | None = None,
    *,
    load: Callable[[], Any] | None = None,
    warm: Callable[[], Any] | None = None,
    scheduler: Scheduler | None = None,
  ):
    if (synthesizer is None) == (load is None):
      raise ValueError("ServerApp: give a synthesizer or a load function that makes one, not both or neither")
    self.config = config or ServerConfig()
    self.service = SynthesizerService(synthesizer, self.config, scheduler)
    self._load = load
    self.load_error: BaseException | None = None
    self.health = health.aio.HealthServicer()
    self._warm_fn = warm if warm is not None else self._default_warm
    self.server: grpc.aio.Server | None = None
    self.port: int | None = None
    self.metrics_port: int | None = None  # the Prometheus endpoint's port (config metrics_port; None: off)
    self.http = None  # the OpenAI-compatible endpoint (server/http.py; config http_port)
    self.http_port: int | None = None
    self.warm_error: BaseException | None = None
    self._warm_task: asyncio.Task | None = None
    self._idle_task: asyncio.Task | None = None  # idle release (config idle_release_s), from SERVING on
    self._stopped = asyncio.Event()

  def _default_warm(self):
    w = self.config.warm
    if not w.hints:
      return []
    return self.service.syn.warm(w.hints, prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens)

  async def _set_health(self, status) -> None:
    for name in ("", SERVICE):
      await self.health.set(name, status)

  async def start(self) -> int:
    """Bind, start serving (health NOT_SERVING), warm in the background; returns the bound port."""
    from server.config import ConfigError

    cfg = self.config
    await self._set_health(_NOT_SERVING)
    self.server = grpc.aio.server(options=cfg.grpc_options())
    self.server.add_generic_rpc_handlers((self.service.handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
    creds = server_credentials(cfg.tls)
    try:
      port = (
        self.server.add_secure_port(cfg.address, creds)
        if creds is not None
        else self.server.add_insecure_port(cfg.address)
      )
    except RuntimeError as e:
      raise ConfigError(f"cannot bind {cfg.address} ({e}); pick a free --port or another bind address") from None
    self.port = port
    await self.server.start()
    if cfg.metrics_port is not None:
      try:
        self.metrics_port = self.service.metrics.serve(cfg.metrics_bind, cfg.metrics_port)
      except OSError as e:
        await self.server.stop(0)
        raise ConfigError(
          f"cannot serve metrics on {cfg.metrics_bind}:{cfg.metrics_port} ({e}); pick a free metrics_port "
          f"(0: any free port) or set it to null"
        ) from None
    if cfg.http_port is not None:
      from server.http import OpenAIHttp  # imported here: aiohttp is loaded only when the endpoint is on

      self.http = OpenAIHttp(self.service)
      try:
        self.http_port = await self.http.start(cfg.bind, cfg.http_port)
      except OSError as e:
        await self.stop(0)
        raise ConfigError(
          f"cannot serve HTTP on {cfg.bind}:{cfg.http_port} ({e}); pick a free http_port (0: any free port) or "
          f"set it to null"
        ) from None
    self._warm_task = asyncio.get_running_loop().create_task(self._warm())
    log.info(
      "thoughtjax server on %s:%d (%s)",
      cfg.bind,
      port,
      "mTLS" if cfg.tls.mutual else "TLS" if cfg.tls.enabled else "plaintext",
    )
    return port

  async def _warm(self) -> None:
    loop = asyncio.get_running_loop()
    if self.service.serving is None:
      try:
        syn = await _on_daemon_thread(self._load)
      except Exception as e:  # stays NOT_SERVING; serve() stops the server with it
        self.load_error = self.warm_error = e
        log.error("loading the registry failed, health stays NOT_SERVING: %s: %s", type(e).__name__, e)
        return
      self.service.install(syn)
      log.info("registry sequence %d loaded", self.service.serving.sequence)
    try:
      await loop.run_in_executor(None, self._warm_fn)
    except Exception as e:  # stays NOT_SERVING; the error is logged and kept
      self.warm_error = e
      log.error("warming failed, health stays NOT_SERVING: %s: %s", type(e).__name__, e)
      return
    if not self.service.draining:
      self.service.ready = True
      await self._set_health(_SERVING)
      if self.service.idle.idle_s is not None:
        self._idle_task = loop.create_task(self._release_when_idle())

  async def _release_when_idle(self) -> None:
    """Run :meth:`SynthesizerService.release_idle` on a worker when the next path may be due, until stopped.
    Health stays SERVING throughout: a request after a release restores what it needs."""
    loop = asyncio.get_running_loop()
    idle_s = self.service.idle.idle_s
    floor = min(1.0, max(0.05, idle_s / 100))  # a pass that was skipped (a start or drain in flight) retries
    while True:
      nxt = self.service.idle.next_due_in()
      await asyncio.sleep(max(floor, min(idle_s / 4 if nxt is None else nxt + 0.01, idle_s)))
      try:
        await loop.run_in_executor(None, self.service.release_idle)
      except Exception:  # never stops the timer; the next pass tries again
        log.exception("idle release failed")

  async def wait_ready(self) -> bool:
    """Until warming ended; True when the server is SERVING."""
    if self._warm_task is not None:
      await asyncio.shield(self._warm_task)
    return self.service.ready

  async def begin_drain(self) -> None:
    """Health NOT_SERVING, new calls UNAVAILABLE; calls in flight continue."""
    self.service.draining = True
    await self.health.enter_graceful_shutdown()

  async def drain(self, grace: float | None = None) -> None:
    """SIGTERM: stop taking calls, let the streams in flight finish up to ``grace`` seconds, then stop."""
    grace = self.config.grace_s if grace is None else grace
    await self.begin_drain()
    t0 = time.monotonic()
    await self.service.scheduler.wait_idle(grace)
    await self.stop(max(0.0, grace - (time.monotonic() - t0)))

  async def stop(self, grace: float | None = 0) -> None:
    if self._warm_task is not None and not self._warm_task.done():
      self._warm_task.cancel()
    if self._idle_task is not None:
      self._idle_task.cancel()
    if self.http is not None:
      await self.http.stop()
    if self.server is not None:
      await self.server.stop(grace)
    close = getattr(self.service.scheduler, "close", None)
    if close is not None:
      close()
    self.service.metrics.stop()
    self.service.close()
    self._stopped.set()

  async def wait(self) -> None:
    await self._stopped.wait()


async def _on_daemon_thread(fn: Callable[[], Any]) -> Any:
  """``fn()`` on a thread of its own that does not hold up the process's exit (a registry build may take
  minutes; a SIGTERM meanwhile must not wait for it, as it would for the loop's default executor)."""
  loop = asyncio.get_running_loop()
  done = loop.create_future()

  def settle(result, error):
    if not done.done():
      done.set_exception(error) if error is not None else done.set_result(result)

  def run():
    try:
      result, error = fn(), None
    except BaseException as e:
      result, error = None, e
    try:
      loop.call_soon_threadsafe(settle, result, error)
    except RuntimeError:  # the loop has ended (the server stopped meanwhile)
      pass

  threading.Thread(target=run, name="thoughtjax-load", daemon=True).start()
  return await done


async def serve(
  synthesizer,
  config: ServerConfig,
  *,
  load: Callable[[], Any] | None = None,
  on_port: Callable[[int], None] | None = None,
  on_metrics_port: Callable[[int], None] | None = None,
  on_http_port: Callable[[int], None] | None = None,
) -> None:
  """Run until SIGTERM or SIGINT (then drain, see :meth:`ServerApp.drain`). With ``load`` (and no
  ``synthesizer``) the port is bound first and the registry loaded behind NOT_SERVING; a load that fails
  stops the server and raises its error."""
  import signal

  app = ServerApp(synthesizer, config, load=load)
  port = await app.start()
  if on_port is not None:
    on_port(port)
  if on_metrics_port is not None and app.metrics_port is not None:
    on_metrics_port(app.metrics_port)
  if on_http_port is not None and app.http_port is not None:
    on_http_port(app.http_port)
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, lambda: loop.create_task(app.drain()))

  async def stop_if_load_fails():
    await app.wait_ready()
    if app.load_error is not None:
      await app.stop(0)

  watch = loop.create_task(stop_if_load_fails())
  await app.wait()
  watch.cancel()
  if app.load_error is not None:
    raise app.load_error


class BackgroundServer:
  """A server on its own event loop thread (tests, notebooks): ``with BackgroundServer(syn, cfg) as s:``
  then ``s.port``; ``s.call(coroutine_function)`` runs on the server's loop."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig | None = None,
    *,
    load: Callable[[], Any] | None = None,
    warm: Callable[[], Any] | None = None,
    scheduler: Scheduler | None = None,
    timeout: float = 60.0,
  ):
    self._args = (synthesizer, config or ServerConfig(port=0))
    self._kwargs = dict(load=load, warm=warm, scheduler=scheduler)
    self.timeout = timeout
    self.loop: asyncio.AbstractEventLoop | None = None
    self.app: ServerApp | None = None
    self.port: int | None = None

  def __enter__(self) -> BackgroundServer:
    started = threading.Event()
    failure: list[BaseException] = []

    async def main():
      try:
        self.app = ServerApp(*self._args, **self._kwargs)
        self.port = await self.app.start()
      except BaseException as e:
        failure.append(e)
        return
      finally:
        started.set()
      await self.app.wait()

    def run():
      self.loop = asyncio.new_event_loop()
      try:
        self.loop.run_until_complete(main())
      finally:
        self.loop.close()

    self._thread = threading.Thread(target=run, name="thoughtjax-server", daemon=True)
    self._thread.start()
    if not started.wait(self.timeout):
      raise TimeoutError(f"the server did not start within {self.timeout} s")
    if failure:
      self._thread.join(self.timeout)
      raise failure[0]
    return self

  def call(self, fn: Callable[[], Any], timeout: float | None = None):
    """Run the coroutine ``fn()`` on the server's loop; its result."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    async def runner():
      # The result is handed over inside the coroutine: a call that stops the server (and so ends the
      # loop) still delivers it.
      try:
        done.set_result(await fn())
      except BaseException as e:
        done.set_exception(e)

    self.loop.call_soon_threadsafe(lambda: self.loop.create_task(runner()))
    return done.result(timeout or self.timeout)

  def __exit__(self, *exc) -> None:
    if self.app is not None and not self.app._stopped.is_set():
      try:
        self.call(lambda: self.app.stop(0))
      except RuntimeError:  # the loop ended meanwhile (drained)
        pass
    self._thread.join(self.timeout)

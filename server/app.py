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
                       unknown hint (the valid list in the message), bad sampling value, bad token id,
                       invalid or unknown explicit path, bad request_id
  OUT_OF_RANGE         prompt tokens + max_tokens beyond the model's context
  RESOURCE_EXHAUSTED   every turn taken and the waiting queue full (at once, before any work)
  UNAVAILABLE          warming up (health NOT_SERVING) or draining
  FAILED_PRECONDITION  a pinned registry sequence that is not the one served; no path left after a needed
                       thoughtlet failed verification; ReloadRegistry of a newer sequence (restart to switch)
  DEADLINE_EXCEEDED    the deadline passed while waiting or generating (the generation stops at the next chunk)

Request fields: ``prompt`` is plain text; ``messages`` go through the registry tokenizer's chat template.
``max_latency_ms`` unset: the call's remaining deadline is the budget (no deadline: no budget).
``ReloadRegistry`` re-reads the index on disk with the serving trust policy and reports both sequences; a
newer one is FAILED_PRECONDITION (this version switches by restart; hot reload is issue 11 item 6).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.config import ServerConfig
from server.proto.thoughtjax.v1 import synthesis_pb2 as pb
from server.scheduling import DeadlineExpired, QueueFull, Scheduler, SimpleScheduler
from server.tls import server_credentials
from thoughtjax.errors import UserError

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


def _finite(value: float, name: str, fix: str) -> float:
  if not math.isfinite(value):
    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: expected a finite number, got {value}; {fix}")
  return float(value)


class SynthesizerService:
  """The servicer: one synthesizer, one scheduler, the server's readiness (see the module docstring)."""

  def __init__(self, synthesizer, config: ServerConfig, scheduler: Scheduler | None = None):
    self.syn, self.config = synthesizer, config
    self.registry = synthesizer.registry
    self.scheduler = scheduler or SimpleScheduler(config.max_concurrent, config.max_queue)
    self.ready = False
    self.draining = False
    self.max_context = int(self.registry.config.max_context)
    self.vocab = int(self.registry.config.vocab_size)
    self._paths: collections.OrderedDict[str, Any] = collections.OrderedDict()  # explicit path -> Model
    self._paths_lock = threading.Lock()
    self.statuses: collections.Counter[str] = collections.Counter()  # status name -> answers

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

  async def _abort(self, context, e: BaseException):
    code = status_of(e)
    if code is None:
      self.statuses["UNKNOWN"] += 1
      raise e
    self.statuses[code.name] += 1
    await context.abort(code, f"{type(e).__name__}: {e}" if not isinstance(e, _Refused) else str(e))

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

  def _check_serving(self) -> None:
    if self.draining:
      raise _Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is draining (shutting down); send the request to another replica or retry after it restarts",
      )
    if not self.ready:
      raise _Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is warming up (health NOT_SERVING); retry when grpc.health.v1 reports SERVING",
      )

  def validate(self, m: pb.SynthesizeRequest, deadline_s: float | None) -> Request:
    """A :class:`Request`, or :class:`_Refused` naming the field (no model work; tokenization only)."""
    from thoughtjax.paths import parse_path
    from thoughtjax.sampling import SamplingParams
    from thoughtjax.synthesis.hints import normalize_hints

    bad = lambda msg: _Refused(grpc.StatusCode.INVALID_ARGUMENT, msg)
    rid = m.request_id or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID or not rid.isprintable() or not rid.isascii():
      raise bad(
        f"request_id: expected at most {MAX_REQUEST_ID} printable ASCII characters, got {len(rid)} "
        f"characters {rid[:40]!r}; send a shorter id or none (one is generated)"
      )
    codec = self.registry.codec
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
      normalize_hints(list(m.hints), self.syn.dictionary)
    except UserError as e:
      raise bad(f"hints: {e}") from None
    n = int(m.max_tokens) if m.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if not 1 <= n <= self.config.max_tokens_limit:
      raise bad(f"max_tokens: expected 1..{self.config.max_tokens_limit} (the server's max_tokens_limit), got {n}")
    if len(ids) + n > self.max_context:
      raise _Refused(
        grpc.StatusCode.OUT_OF_RANGE,
        f"prompt ({len(ids)} tokens) + max_tokens ({n}) = {len(ids) + n} exceeds the model's context "
        f"of {self.max_context} tokens; shorten the prompt or lower max_tokens",
      )
    if m.HasField("max_latency_ms"):
      budget = m.max_latency_ms
      if math.isnan(budget) or budget <= 0:
        raise bad(
          f"max_latency_ms: expected a number of milliseconds > 0, got {budget}; leave it unset for the call's deadline"
        )
    else:
      budget = math.inf if deadline_s is None else max(deadline_s * 1e3, 1e-3)
    fix = "send a finite value"
    temperature = _finite(m.temperature, "temperature", fix) if m.HasField("temperature") else 0.0
    top_p = _finite(m.top_p, "top_p", fix) if m.HasField("top_p") else 1.0
    for tok in list(m.stop_token_ids) + list(m.logit_bias):
      if not 0 <= tok < self.vocab:
        raise bad(
          f"token id {tok} (stop_token_ids or logit_bias) is outside the vocabulary [0, {self.vocab}); "
          f"send ids the registry's tokenizer produces"
        )
    bias = {int(k): _finite(v, f"logit_bias[{k}]", fix) for k, v in m.logit_bias.items()}
    if any(not s for s in m.stop_strings):
      raise bad("stop_strings: an empty stop string would stop at once; drop it")
    sampling = dict(
      temperature=temperature,
      top_k=int(m.top_k),
      top_p=top_p,
      seed=int(m.seed),
      logit_bias=bias or None,
      stop_token_ids=tuple(m.stop_token_ids),
      stop_strings=tuple(m.stop_strings),
    )
    try:
      SamplingParams(max_tokens=n, **sampling)
    except UserError as e:
      raise bad(f"sampling: {e}") from None
    path = m.path or None
    if path is not None:
      try:
        parse_path(path)
      except UserError as e:
        raise bad(f"path: {e}") from None
    pin = int(m.registry_sequence) if m.HasField("registry_sequence") else None
    served = self.syn.calibration.sequence
    if pin is not None and pin != served:
      raise _Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"registry_sequence: the request pins {pin}, this server plans at sequence {served}; pin "
        f"{served}, or send it to a server of sequence {pin}",
      )
    return Request(rid, tuple(ids), tuple(m.hints), float(budget), n, sampling, path, pin)

  # ---- the library calls (on worker threads) ----------------------------------------------
  def _plan(self, r: Request):
    return self.syn.plan(
      list(r.prompt_ids),
      list(r.hints) or None,
      max_latency_ms=r.max_latency_ms,
      max_tokens=r.max_tokens,
      pin_sequence=r.pin_sequence,
    )

  def _path_model(self, path: str):
    from thoughtjax.compose import compose

    with self._paths_lock:
      got = self._paths.get(path)
      if got is not None:
        self._paths.move_to_end(path)
        return got
    model = compose(path, self.registry, kernels=self.syn.kernels)
    with self._paths_lock:
      self._paths[path] = model
      while len(self._paths) > 4:
        self._paths.popitem(last=False)
    return model

  def _start(self, r: Request):
    if r.path is not None:
      return _PathRun(self._path_model(r.path), r, self.registry.sequence)
    return self.syn.synthesize(
      list(r.prompt_ids),
      list(r.hints) or None,
      max_latency_ms=r.max_latency_ms,
      max_tokens=r.max_tokens,
      pin_sequence=r.pin_sequence,
      **r.sampling,
    )

  # ---- methods ------------------------------------------------------------------------
  async def _request(self, raw: bytes, context) -> Request:
    m = self._parse(raw, pb.SynthesizeRequest)
    self._check_serving()
    # Tokenizing a prompt up to max_message_bytes long must not hold the event loop.
    return await asyncio.get_running_loop().run_in_executor(None, self.validate, m, context.time_remaining())

  async def GetOptimalPath(self, raw: bytes, context) -> pb.Plan:
    try:
      r = await self._request(raw, context)
      if r.path is not None:
        model = await asyncio.get_running_loop().run_in_executor(None, self._path_model, r.path)
        plan = _explicit_plan(model, r, self.registry.sequence)
      else:
        plan = _plan_message(await asyncio.get_running_loop().run_in_executor(None, self._plan, r), r.request_id)
    except Exception as e:
      await self._abort(context, e)
    self.statuses["OK"] += 1
    return plan

  async def Synthesize(self, raw: bytes, context):
    try:
      r = await self._request(raw, context)
    except Exception as e:
      await self._abort(context, e)
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    stream = self.scheduler.stream(lambda: self._start(r), request_id=r.request_id, deadline=deadline)
    run, last = None, None
    try:
      async for item in stream:
        if run is None:
          run = item
          yield pb.SynthesizeResponse(request_id=r.request_id, plan=_run_plan(run, r, self.registry.sequence))
          continue
        last = item
        if item.token_ids or item.text:
          yield pb.SynthesizeResponse(request_id=r.request_id, delta=pb.Delta(token_ids=item.token_ids, text=item.text))
    except Exception as e:
      await self._abort(context, e)
    finally:
      await stream.aclose()
    self.statuses["OK"] += 1
    yield pb.SynthesizeResponse(request_id=r.request_id, final=_final(run, last, self.registry.sequence))

  async def ListThoughtlets(self, raw: bytes, context) -> pb.ListThoughtletsResponse:
    try:
      self._parse(raw, pb.ListThoughtletsRequest)
      out = pb.ListThoughtletsResponse(registry_sequence=self.registry.sequence)
      for name in self.registry.names:
        mf = self.registry.manifest(name)
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
      await self._abort(context, e)
    self.statuses["OK"] += 1
    return out

  async def RegistryStats(self, raw: bytes, context) -> pb.RegistryStatsResponse:
    try:
      self._parse(raw, pb.RegistryStatsRequest)
    except Exception as e:
      await self._abort(context, e)
    snap = self.scheduler.snapshot()
    self.statuses["OK"] += 1
    return pb.RegistryStatsResponse(
      registry_sequence=self.registry.sequence,
      signed=self.registry.signed,
      stats_json=json.dumps(self.registry.stats().to_json(), default=str),
      planner_json=json.dumps(
        {**self.syn.planner.counters.snapshot(), "scheduler": snap, "statuses": dict(self.statuses)}, default=str
      ),
      in_flight=snap["running"],
      waiting=snap["waiting"],
    )

  async def ReloadRegistry(self, raw: bytes, context) -> pb.ReloadRegistryResponse:
    from thoughtjax.registry import Registry

    try:
      self._parse(raw, pb.ReloadRegistryRequest)

      def published() -> int:
        with Registry.open(self.registry.root, trust=self.registry.trust) as fresh:
          return fresh.sequence

      seq = await asyncio.get_running_loop().run_in_executor(None, published)
      serving = self.syn.calibration.sequence
      if seq != serving:
        raise _Refused(
          grpc.StatusCode.FAILED_PRECONDITION,
          f"registry {self.registry.root} is published at sequence {seq}, this server serves {serving}; "
          f"this version switches sequences by restart: calibrate the new sequence (thoughtjax registry "
          f"calibrate) and restart thoughtjax serve (replicas one at a time)",
        )
    except Exception as e:
      await self._abort(context, e)
    self.statuses["OK"] += 1
    return pb.ReloadRegistryResponse(serving_sequence=serving, published_sequence=seq)


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


def _explicit_plan(model, r: Request, sequence: int) -> pb.Plan:
  return pb.Plan(
    path=model.path,
    refs=model.refs,
    path_hash=model.path_hash,
    kind="explicit",
    reason="explicit path from the request (not planned)",
    registry_sequence=sequence,
    max_tokens=r.max_tokens,
    request_id=r.request_id,
  )


def _run_plan(run, r: Request, sequence: int) -> pb.Plan:
  return _explicit_plan(run.model, r, sequence) if isinstance(run, _PathRun) else _plan_message(run.plan, r.request_id)


def _final(run, last, sequence: int) -> pb.Final:
  reason = (last.finish_reason if last is not None and last.finished else None) or "length"
  gt = run.generation.trace
  if isinstance(run, _PathRun):
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

  ``warm``: called on a worker thread after the port is bound and before SERVING (default: warm the
  configured hints' plans). ``start()`` returns the bound port; ``drain()`` is what SIGTERM runs."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig | None = None,
    *,
    warm: Callable[[], Any] | None = None,
    scheduler: Scheduler | None = None,
  ):
    self.config = config or ServerConfig()
    self.service = SynthesizerService(synthesizer, self.config, scheduler)
    self.health = health.aio.HealthServicer()
    self._warm_fn = warm if warm is not None else self._default_warm
    self.server: grpc.aio.Server | None = None
    self.port: int | None = None
    self.warm_error: BaseException | None = None
    self._warm_task: asyncio.Task | None = None
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
    self._warm_task = asyncio.get_running_loop().create_task(self._warm())
    log.info(
      "thoughtjax server on %s:%d (%s)",
      cfg.bind,
      port,
      "mTLS" if cfg.tls.mutual else "TLS" if cfg.tls.enabled else "plaintext",
    )
    return port

  async def _warm(self) -> None:
    try:
      await asyncio.get_running_loop().run_in_executor(None, self._warm_fn)
    except Exception as e:  # stays NOT_SERVING; the error is logged and kept
      self.warm_error = e
      log.error("warming failed, health stays NOT_SERVING: %s: %s", type(e).__name__, e)
      return
    if not self.service.draining:
      self.service.ready = True
      await self._set_health(_SERVING)

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
    if self.server is not None:
      await self.server.stop(grace)
    close = getattr(self.service.scheduler, "close", None)
    if close is not None:
      close()
    self._stopped.set()

  async def wait(self) -> None:
    await self._stopped.wait()


async def serve(synthesizer, config: ServerConfig, *, on_port: Callable[[int], None] | None = None) -> None:
  """Run until SIGTERM or SIGINT (then drain, see :meth:`ServerApp.drain`)."""
  import signal

  app = ServerApp(synthesizer, config)
  port = await app.start()
  if on_port is not None:
    on_port(port)
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, lambda: loop.create_task(app.drain()))
  await app.wait()


class BackgroundServer:
  """A server on its own event loop thread (tests, notebooks): ``with BackgroundServer(syn, cfg) as s:``
  then ``s.port``; ``s.call(coroutine_function)`` runs on the server's loop."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig | None = None,
    *,
    warm: Callable[[], Any] | None = None,
    scheduler: Scheduler | None = None,
    timeout: float = 60.0,
  ):
    self._args = (synthesizer, config or ServerConfig(port=0))
    self._kwargs = dict(warm=warm, scheduler=scheduler)
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

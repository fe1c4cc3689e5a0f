"""The ``thoughtjax.v1.Synthesizer`` servicer over a :class:`~thoughtjax.synthesis.synthesize.Synthesizer`.

Transport only: credentials, readiness, the request checked (:mod:`thoughtjax.server.validation`), scheduling through one
small interface (:class:`thoughtjax.server.scheduling.Scheduler`; :class:`~thoughtjax.server.scheduling.SimpleScheduler` runs one
generation per request, :class:`~thoughtjax.server.scheduling.ContinuousScheduler` the continuous-batching slot engines),
the answers built (:mod:`thoughtjax.server.messages`) and reloads (:mod:`thoughtjax.server.reload`). Planning, restore, compile and
generation are the library's. Handlers take the raw request bytes and parse them, so a message that is not a
valid protobuf is INVALID_ARGUMENT, not INTERNAL.

Status of each failure:
  INVALID_ARGUMENT     malformed message, empty prompt, prompt and messages both or neither, > 3 hints,
                       unknown hint (the valid list in the message), a sampling value past its type, the model
                       (top_k above the vocabulary, token ids outside it) or non-finite, too many or too long
                       stop strings (max_stop_strings, max_stop_chars), invalid, unknown or too long explicit
                       path (max_path_layers), bad request_id
  OUT_OF_RANGE         prompt tokens + max_tokens beyond the model's context
  RESOURCE_EXHAUSTED   every turn taken and the waiting queue full (at once, before any work); a ReloadRegistry
                       within admin.reload_interval_s of the last; no disk space left to copy a thoughtlet's
                       files for its verified restore
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
:class:`thoughtjax.server.app.ServerApp` off the event loop; :mod:`thoughtjax.serving.idle` keeps a release from
overlapping any request's start).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from thoughtjax.assembly import check_chain, path_hash, resolve
from thoughtjax.compose import compose
from thoughtjax.decode.speculative import forget_drafts
from thoughtjax.errors import UserError
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.sampling import SamplingParams
from thoughtjax.server.config import ServerConfig
from thoughtjax.server.messages import (
  PathRun,
  PathShape,
  explicit_plan,
  final_message,
  log_safe,
  plan_message,
  public_message,
  run_plan,
  status_of,
  trailer,
)
from thoughtjax.server.metrics import ServerMetrics, failure_totals
from thoughtjax.server.reload import Reloader
from thoughtjax.server.scheduling import QueueFull, Scheduler, make_scheduler
from thoughtjax.server.validation import Refused, Request, Serving, parse, validate
from thoughtjax.serving.idle import IdleTracker, drop_compiled_programs, trim_memory
from thoughtjax.synthesis.router_store import ROUTER_NAME, forget_router, loaded_router

log = logging.getLogger("thoughtjax.server")

SERVICE = pb.DESCRIPTOR.services_by_name["Synthesizer"].full_name


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
    self.serving: Serving | None = None if synthesizer is None else Serving.of(synthesizer)
    # Request checks (tokenizing, compiling a constraint) on two workers of their own, at most max_concurrent +
    # max_queue in flight (admit).
    self._validation_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="thoughtjax-validate")
    self._validating = 0
    self.scheduler = scheduler or make_scheduler(config)  # config.scheduler: continuous (slot engines) or simple
    self.ready = False
    self.draining = False
    self.statuses: collections.Counter[str] = collections.Counter()  # status name -> answers
    self.metrics = metrics or ServerMetrics()
    # ReloadRegistry: its counts, and the registries it replaced (their counters stay in the totals).
    self.reloader = Reloader(config, self.metrics, pool=self.scheduler.pool)
    self.metrics.bind(
      self.scheduler.snapshot, self.failure_totals, lambda: 0 if self.serving is None else self.serving.sequence
    )
    # ---- idle release (scale to zero) ----
    self.idle = IdleTracker(config.idle_release)
    self.metrics.bind_residency(lambda: len(self.resident_paths()))

  def install(self, synthesizer) -> None:
    """Serve ``synthesizer`` (the registry a server started without has been loaded)."""
    self.serving = Serving.of(synthesizer)

  @property
  def syn(self):
    return self.serving.syn

  @property
  def registry(self):
    return self.serving.registry

  def failure_totals(self) -> dict:
    """Registry refusal counters over the server's life: the serving registry, the ones reloads replaced,
    and the new sequences a reload refused."""
    refused = self.reloader.refused_failures()
    current = () if self.serving is None else (self.serving.registry.stats(),)
    return failure_totals(*current, *(s.registry.stats() for s in self.reloader.retired), refused)

  def close(self) -> None:
    """Release the registries the server opened itself (reloads) and the request checks' workers."""
    self._validation_pool.shutdown(wait=False, cancel_futures=True)
    for s in [*self.reloader.retired, *([] if self.serving is None else [self.serving])]:
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

  def answered(self, method: str, code: str) -> None:
    """Count an answer to ``method``: ``code`` is a gRPC status name (or ``HTTP_<status>`` from the HTTP front)."""
    self.statuses[code] += 1
    self.metrics.answered(method, code)

  def failure(self, e: BaseException, method: str = "", request_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """``e``'s status and a short message with the request id, counted; the full detail (exception class,
    paths, traceback) goes to the server log under that id only. Every transport answers failures with it."""
    rid = request_id or uuid.uuid4().hex
    code = status_of(e)
    if code is None:  # a bug: the client learns only that it happened and where to look
      log.error("request %s: %s failed", rid, method or "call", exc_info=e)
      self.answered(method, "INTERNAL")
      return grpc.StatusCode.INTERNAL, f"internal error; the server log has the details under request id {rid}"
    log.info("request %s: %s answered %s: %s: %s", rid, method or "call", code.name, type(e).__name__, log_safe(e))
    self.answered(method, code.name)
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
      raise Refused(
        grpc.StatusCode.UNAVAILABLE, f"{method}: the server cannot read its client token; the server log says why"
      ) from None
    if token is None:
      return
    if authorization is None:
      raise Refused(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{method}: this server needs a client token; send 'authorization: Bearer TOKEN' (clients.token in the "
        f"server config)",
      )
    if not hmac.compare_digest(str(authorization).encode(), f"Bearer {token}".encode()):
      raise Refused(
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
      raise Refused(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is an admin call and the server cannot read its admin token; the server log says why",
      ) from None
    if token is None and not a.identities:
      raise Refused(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is an admin call and this server allows no admin client; set admin.token, admin.token_file "
        f"or admin.identities in the server config",
      )
    given = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    identities = [i.decode(errors="replace") for i in context.peer_identities() or ()]
    if given is not None:
      if token is not None and hmac.compare_digest(str(given).encode(), f"Bearer {token}".encode()):
        return
      raise Refused(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method} is an admin call and the authorization metadata is not this server's admin token; send "
        f"'authorization: Bearer TOKEN' with the token of admin.token in the server config",
      )
    if any(i in a.identities for i in identities):
      return
    if not identities:
      raise Refused(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{method} is an admin call: send 'authorization: Bearer TOKEN' (the server's admin.token) or connect "
        f"with a client certificate the server allows (admin.identities)",
      )
    raise Refused(
      grpc.StatusCode.PERMISSION_DENIED,
      f"{method} is an admin call and this client certificate is not in the server's admin.identities; use an "
      f"allowed certificate or the admin bearer token",
    )

  # ---- readiness ----------------------------------------------------------------------
  def check_loaded(self) -> None:
    """Refuse with UNAVAILABLE until the registry is loaded (every transport checks it first)."""
    if self.serving is None:
      raise Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is still loading its registry (health NOT_SERVING); retry when grpc.health.v1 reports SERVING",
      )

  def _check_serving(self) -> None:
    if self.draining:
      raise Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is draining (shutting down); send the request to another replica or retry after it restarts",
      )
    self.check_loaded()
    if not self.ready:
      raise Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the server is warming up (health NOT_SERVING); retry when grpc.health.v1 reports SERVING",
      )

  # ---- the library calls (on worker threads) ----------------------------------------------
  def _plan(self, r: Request):
    return r.serving.syn.plan(
      list(r.prompt_ids),
      list(r.hints) or None,
      max_latency_ms=r.max_latency_ms,
      max_tokens=r.max_tokens,
      pin_sequence=r.pin_sequence,
      constraint=SamplingParams(max_tokens=r.max_tokens, **r.sampling).constraint,
      load=self.scheduler.load(),
    )

  @staticmethod
  def _path_model(path: str, s: Serving):
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
  def _path_types(path: str, s: Serving) -> PathShape:
    """An explicit path resolved and type-checked against ``s``'s manifests, no weights restored (a path
    already composed for a Synthesize is reused)."""
    with s.paths_lock:
      got = s.paths.get(path)
    if got is not None:
      return PathShape(got.path, tuple(got.refs), got.path_hash)
    links = resolve(path, s.registry)
    check_chain(links)
    refs = tuple(n if v is None else f"{n}@{v}" for link in links for n, v in link.units)
    return PathShape(", ".join(str(link.ref) for link in links), refs, path_hash(links))

  def _start(self, r: Request):
    if r.path is not None:
      return PathRun(self._path_model(r.path, r.serving), r, r.serving.registry.sequence)
    return r.serving.syn.synthesize(
      list(r.prompt_ids),
      list(r.hints) or None,
      max_latency_ms=r.max_latency_ms,
      max_tokens=r.max_tokens,
      pin_sequence=r.pin_sequence,
      book=self.scheduler.book(),
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
    return out | self.scheduler.resident_paths()

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

  def _release_path(self, path: str, s: Serving) -> bool:
    """Drop the references ``s`` and the scheduler hold to ``path``'s weights; False when its engines are busy."""
    if not self.scheduler.release_path(path):
      return False
    models = s.syn.drop_models({path})
    with s.paths_lock:
      models += [s.paths.pop(k) for k in [k for k, m in s.paths.items() if m.path_hash == path]]
    for m in models:
      forget_drafts(m.parts)
    return True

  def _evict_unused(self, s: Serving) -> bool:
    """Evict from the registry's resident set every thoughtlet no resident model reads; with none left, the
    stored router (and every draft) goes too. True when none is left (scaled to zero)."""
    with s.paths_lock:
      models = [*s.syn.models(), *s.paths.values()]
    models += self.scheduler.resident_models()
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
  async def admit(self, m: pb.SynthesizeRequest, time_remaining: float | None, *, until_eos: bool = False) -> Request:
    """The server serving and ``m`` validated: the first step of a request on either transport (after its
    credential is checked). ``time_remaining``: the call's deadline in seconds (None: none); ``until_eos``: an
    unset ``max_tokens`` means as many as fit (OpenAI's default, :func:`validate`)."""
    self._check_serving()
    # Admission before any costly work: a full server refuses at once, before tokenizing the prompt or compiling
    # its constraint; validations in flight are bounded as the queue is, on a pool of their own (planning and
    # idle release keep the default one).
    self.scheduler.shed_if_full(m.request_id or "(no id)")
    bound = self.config.max_concurrent + self.config.max_queue
    if self._validating >= bound:
      raise QueueFull(
        f"request {m.request_id or '(no id)'}: {self._validating} requests are being checked (at most "
        f"max_concurrent + max_queue = {bound}); retry with backoff"
      )
    # Tokenizing a prompt up to max_message_bytes long must not hold the event loop.
    # ``self.serving`` is read on the worker: a reload that switched meanwhile is taken.
    check = self._validation_pool.submit(validate, m, time_remaining, self.serving, self.config, until_eos=until_eos)
    self._validating += 1  # the event loop's own counter, given back once the check has ended or was dropped
    loop = asyncio.get_running_loop()
    check.add_done_callback(lambda _: _call_soon(loop, self._checked))
    limit = self.config.validation_timeout_s
    try:
      # A client that leaves (this coroutine cancelled) or a check past its time drops the check if it has not
      # started; one running (a constraint compiling, bounded by llguidance's limits) ends on its own, unread.
      return await asyncio.wait_for(asyncio.wrap_future(check), limit)
    except TimeoutError:
      raise QueueFull(
        f"request {m.request_id or '(no id)'}: its checks (tokenizing the prompt, compiling its constraint) did not "
        f"end within validation_timeout_s ({limit:g} s); retry with backoff, or send a simpler constraint"
      ) from None

  def _checked(self) -> None:
    self._validating -= 1

  async def _request(self, raw: bytes, context, method: str) -> Request:
    self.check_client(_metadata(context, "authorization"), method)
    m = parse(raw, pb.SynthesizeRequest)
    return await self.admit(m, context.time_remaining())

  async def GetOptimalPath(self, raw: bytes, context) -> pb.Plan:
    r = None
    try:
      r = await self._request(raw, context, "GetOptimalPath")
      if r.path is not None:
        # Resolved and type-checked from manifests only: a plan restores nothing.
        model = await asyncio.get_running_loop().run_in_executor(None, self._path_types, r.path, r.serving)
        plan = explicit_plan(model, r, r.serving.registry.sequence)
      else:
        plan = plan_message(await asyncio.get_running_loop().run_in_executor(None, self._plan, r), r.request_id)
    except Exception as e:
      await self._abort(context, e, "GetOptimalPath", r and r.request_id)
    self.answered("GetOptimalPath", "OK")
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
            self.answered("Synthesize", "OK")
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
        with holding_lock:
          if not holding["ended"]:
            holding["path"] = run.model.path_hash
            self.idle.hold(run.model.path_hash)
      return run

    stream = self.scheduler.stream(start, request_id=r.request_id, deadline=deadline, cache_scope=r.cache_salt)
    run, last, t_prev = None, None, None
    try:
      async for item in stream:
        if run is None:
          run = item
          yield pb.SynthesizeResponse(request_id=r.request_id, plan=run_plan(run, r))
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
    final = final_message(run, last, (started[0] - t_admit) * 1e3 if started else None)
    final.prompt_token_ids.extend(r.prompt_ids)
    ran = run.generation.trace.first_token is not None
    self.metrics.finished(final.trace, final.usage, final.trace.program_cache_hit if ran else None)
    # The prefix cache's reuse is told to a salted request (its own scope's: no other client's prompt shows in it),
    # or to every client where the operator allows it (prefix_cache.report_reuse); the metrics count it either way.
    if not (r.cache_salt or self.config.prefix_cache.report_reuse):
      final.trace.ClearField("prefix_cache_tokens")
    yield pb.SynthesizeResponse(request_id=r.request_id, final=final)

  async def ListThoughtlets(self, raw: bytes, context) -> pb.ListThoughtletsResponse:
    try:
      self.check_client(_metadata(context, "authorization"), "ListThoughtlets")
      parse(raw, pb.ListThoughtletsRequest)
      self.check_loaded()
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
    self.answered("ListThoughtlets", "OK")
    return out

  async def RegistryStats(self, raw: bytes, context) -> pb.RegistryStatsResponse:
    try:
      parse(raw, pb.RegistryStatsRequest)
      self.check_loaded()
      self._authorize(context, "RegistryStats")
    except Exception as e:
      await self._abort(context, e, "RegistryStats")
    s = self.serving
    snap = self.scheduler.snapshot()
    # The serving registry's stats, with refusal counters totalled over the server's life (versions a
    # reload replaced or refused included: a refused reload must stay visible after the fact).
    stats = {**s.registry.stats().to_json(), **self.failure_totals(), "reload": dict(self.reloader.counts)}
    self.answered("RegistryStats", "OK")
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
      parse(raw, pb.ReloadRegistryRequest)
      self.check_loaded()
      self._authorize(context, "ReloadRegistry")
      self.reloader.limit()
      async with self.reloader.lock:  # one reload at a time; requests keep flowing meanwhile
        old = self.serving
        got = await asyncio.get_running_loop().run_in_executor(None, self.reloader.prepare, old)
        if got.serving is not None:
          self.serving = got.serving  # the switch: one reference; admitted requests keep `old`
          self.reloader.retire(old)
    except Exception as e:
      await self._abort(context, e, "ReloadRegistry")
    switched = got.serving is not None
    self.reloader.taken(switched)
    if switched:
      log.info(
        "switched to registry sequence %d (was %d; calibration %s)", got.published, old.sequence, got.calibration
      )
    self.answered("ReloadRegistry", "OK")
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


def _call_soon(loop: asyncio.AbstractEventLoop, fn) -> None:
  """``fn`` on ``loop``, from any thread; nothing once the loop has closed (the server stopped)."""
  with contextlib.suppress(RuntimeError):
    loop.call_soon_threadsafe(fn)


def _metadata(context, key: str) -> str | None:
  """The value of the call's metadata ``key`` (lowercase), or None."""
  return next((v for k, v in context.invocation_metadata() or () if k == key), None)

"""The simplest correct scheduler: one request runs one generation, a bounded number at once, a bounded
number waiting (beyond it: :class:`QueueFull` at once), deadlines and cancellation that stop the
generation at the next decode chunk.

This is the one interface the servicer schedules through (:class:`Scheduler`). :class:`ContinuousScheduler`
(continuous batching, issue 11 item 3: the slot engines of ``thoughtjax/serving/``) implements the same
``stream``/``wait_idle``/``snapshot`` methods and is the default (``scheduler:`` in the server config,
:func:`make_scheduler`); the servicer does not change.

Threads: the event loop never runs model work. A request's planning, restore and compile (``start``) and
each decode chunk (one ``next()`` of the run) run on a worker thread, one at a time per request. When the
call ends for any reason (finished, cancelled, deadline, connection closed) the run is cancelled, drained
on a worker (the in-flight chunk, then only host work: the ``cancelled`` delta) and closed; only then is
its turn released. The number of decode chunks between the cancel and the end is recorded per request.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

from thoughtjax.defaults import MIN_POOL_RING
from thoughtjax.errors import UserError
from thoughtjax.serving.pool import EnginePool, PoolFull, Reservation
from thoughtjax.synthesis.latency_load import Load


class QueueFull(UserError, RuntimeError):
  """Every turn is taken and the waiting queue is full; retry later or raise max_queue."""


class DeadlineExpired(UserError, TimeoutError):
  """The call's deadline passed before the request could finish."""


@dataclasses.dataclass
class RequestRecord:
  """What one request did in the scheduler (the last few are kept; tests and RegistryStats read them)."""

  request_id: str
  queue_s: float = 0.0
  ended_by: str = ""  # "finished", "cancelled" (client, deadline or error), "failed" (start raised)
  decode_chunks_at_cancel: int | None = None  # when the server learned the call ended early
  decode_chunks_end: int | None = None
  tokens_out: int | None = None
  closed: bool = False  # the generation was closed (no further device work possible)
  cancel_to_free_s: float | None = None  # continuous batching: from the slot's cancel to its release


class Run(Protocol):
  """What ``start`` returns (a :class:`~thoughtjax.synthesis.synthesize.SynthesisResult`, or a
  :class:`~thoughtjax.decode.request.RequestRun` on a given path), not started: an iterator of deltas with
  ``cancel()``/``close()``, its checked ``request`` (a :class:`~thoughtjax.decode.request.ModelRequest`) and, once
  started, a ``generation`` whose ``trace`` counts decode chunks. The scheduler runs it alone (:meth:`start`) or in
  a slot engine (:meth:`run_in`)."""

  generation: Any  # None until start() or run_in()
  request: Any
  plan: Any  # a synthesized run's plan (its predicted stages), None on a given path
  reservation: Reservation | None  # the row its plan reserved in an engine pool, released once it is in its engine

  def __next__(self) -> Any: ...

  def start(self) -> None:
    """Run the request alone (on the caller's thread: a worker)."""

  def run_in(self, stream) -> None:
    """Take deltas from ``stream`` (a slot engine's run of ``request.slot()``) instead."""

  def cancel(self) -> None: ...

  def close(self) -> None: ...


class Scheduler(Protocol):
  def stream(
    self, start: Callable[[], Run], *, request_id: str, deadline: float | None = None, cache_scope: str = ""
  ) -> AsyncIterator[Any]:
    """Admit (or raise :class:`QueueFull` at once), wait for a turn (``deadline``: ``time.monotonic()``
    seconds, :class:`DeadlineExpired` past it), run ``start`` and yield the run, then each delta.
    ``cache_scope``: the request's prefix-cache scope (a slot engine reuses keys within a scope only)."""

  async def wait_idle(self, timeout: float | None = None) -> bool: ...

  def shed_if_full(self, request_id: str) -> None:
    """:class:`QueueFull` at once when no turn and no queue place is left (before any costly work)."""

  def snapshot(self) -> dict: ...

  def book(self) -> ContinuousScheduler | None:
    """What a Synthesize plans under (one plan at a time, each reserving its row in the engine pool: a
    :class:`~thoughtjax.synthesis.synthesize.LoadBook`), or None where requests decode alone."""

  def load(self) -> Load | None:
    """The slot engines' streams now, or None where requests decode alone."""

  @property
  def pool(self) -> EnginePool | None:
    """The slot engines requests run in, or None where they decode alone."""

  def resident_paths(self) -> set[str]:
    """Path hashes whose engines are resident."""

  def resident_models(self) -> list:
    """The composed models those engines hold."""

  def release_path(self, path_hash: str) -> bool:
    """Drop the engines of ``path_hash``; False when one is in use (nothing dropped)."""

  def close(self) -> None: ...


_END = object()


def _started(start: Callable[[], Run]) -> Run:
  """``start()``'s run, started alone (a worker's job)."""
  run = start()
  run.start()
  return run


def _next(run: Run):
  try:
    return next(run)
  except StopIteration:
    return _END


def _unreserve(run: Run | None) -> None:
  """Release the pool reservation its plan made, if any (a synthesized run that joins a slot engine). ``None``: the
  call ended before its run was made (a refused request), so nothing was reserved."""
  if run is not None and run.reservation is not None:
    run.reservation.release()


def _hand_back(loop: asyncio.AbstractEventLoop, scheduler: SimpleScheduler, record: RequestRecord) -> None:
  """Give a drained request's turn back on the serving loop (from its release thread). Once that loop is closed
  (the server stopped while the request drained) nothing waits for the turn, so only the counters move."""
  try:
    loop.call_soon_threadsafe(scheduler._freed, record)
  except RuntimeError:
    if not loop.is_closed():
      raise
    scheduler._count(record)


class SimpleScheduler:
  """``max_concurrent`` requests generating at once, ``max_queue`` waiting (see the module docstring)."""

  def __init__(self, max_concurrent: int, max_queue: int, *, keep_records: int = 256):
    self.max_concurrent, self.max_queue = max_concurrent, max_queue
    # One worker per running request's chunk, one per request being drained, one spare.
    self._executor = concurrent.futures.ThreadPoolExecutor(
      2 * max_concurrent + 1, thread_name_prefix="thoughtjax-request"
    )
    self._turns: asyncio.Semaphore | None = None
    self._held = 0  # turns acquired and not yet given back
    self._changed: asyncio.Event | None = None  # set (and replaced) on every change of the counts
    self.waiting = self.running = self.draining = 0
    self.shed = self.completed = self.cancelled = self.failed = 0
    self.records: collections.deque[RequestRecord] = collections.deque(maxlen=keep_records)

  def _bind(self) -> None:
    if self._turns is None:  # made on the serving loop
      self._turns = asyncio.Semaphore(self.max_concurrent)
      self._changed = asyncio.Event()

  def snapshot(self) -> dict:
    return {
      "waiting": self.waiting,
      "running": self.running,
      "draining": self.draining,
      "shed": self.shed,
      "completed": self.completed,
      "cancelled": self.cancelled,
      "failed": self.failed,
      "max_concurrent": self.max_concurrent,
      "max_queue": self.max_queue,
    }

  @property
  def idle(self) -> bool:
    return self.waiting == 0 and self.running == 0 and self.draining == 0

  # Requests decode alone here: no engines, no load to plan under.
  @property
  def pool(self) -> EnginePool | None:
    return None

  def book(self) -> ContinuousScheduler | None:
    return None

  def load(self) -> Load | None:
    return None

  def resident_paths(self) -> set[str]:
    return set()

  def resident_models(self) -> list:
    return []

  def release_path(self, path_hash: str) -> bool:
    return True

  @property
  def free_turns(self) -> int:
    """Turns no request holds: ``max_concurrent`` once every request gave its turn back (a leaked turn shows
    here)."""
    return self.max_concurrent - self._held

  async def wait_idle(self, timeout: float | None = None) -> bool:
    """Wait until nothing waits, runs or drains; False when ``timeout`` seconds passed first."""
    self._bind()

    async def until_idle():
      while True:
        changed = self._changed  # taken before the check: a change after it sets this one (no lost wake-up)
        if self.idle:
          return
        await changed.wait()

    try:
      await asyncio.wait_for(until_idle(), timeout)
      return True
    except TimeoutError:
      return False

  def _notify(self) -> None:
    """Wake whoever waits for a change (on the serving loop; synchronous: no task is left behind when the loop
    closes right after)."""
    if self._changed is not None:
      changed, self._changed = self._changed, asyncio.Event()
      changed.set()

  def shed_if_full(self, request_id: str) -> None:
    """:class:`QueueFull` (counted as shed) when every turn is taken and the queue is full: a server asks before
    any costly work on a request (tokenizing, compiling its constraint), and again when it admits it."""
    if self.waiting + self.running >= self.max_concurrent + self.max_queue:
      self.shed += 1
      raise QueueFull(
        f"request {request_id}: {self.running} requests running (max_concurrent "
        f"{self.max_concurrent}) and {self.waiting} waiting (max_queue {self.max_queue}); "
        f"retry with backoff, or raise max_queue/max_concurrent in the server config"
      )

  async def _admit(self, request_id: str, deadline: float | None) -> RequestRecord:
    """Admit (or :class:`QueueFull` at once), then wait for a turn (:class:`DeadlineExpired` past
    ``deadline``); returns the request's record with its queue wait, counted as running."""
    self._bind()
    self.shed_if_full(request_id)
    record = RequestRecord(request_id)
    self.waiting += 1
    t0 = time.monotonic()
    try:
      timeout = None if deadline is None else max(0.0, deadline - t0)
      await asyncio.wait_for(self._turns.acquire(), timeout)
    except TimeoutError:
      raise DeadlineExpired(
        f"request {request_id}: the deadline passed after {time.monotonic() - t0:.3f} s "
        f"waiting for a turn ({self.running} running); give a longer deadline or retry"
      ) from None
    finally:
      self.waiting -= 1
      self._notify()
    self._held += 1
    self.running += 1
    record.queue_s = time.monotonic() - t0
    return record

  async def stream(
    self, start: Callable[[], Run], *, request_id: str, deadline: float | None = None, cache_scope: str = ""
  ) -> AsyncIterator[Any]:
    del cache_scope  # one generation per request: no prefix cache to scope
    record = await self._admit(request_id, deadline)
    loop = asyncio.get_running_loop()
    run: list[Run] = []
    inflight: list[concurrent.futures.Future] = []
    ended = "cancelled"
    try:
      inflight.append(self._executor.submit(_started, start))
      run.append(await asyncio.wrap_future(inflight[-1]))
      yield run[0]
      while True:
        if deadline is not None and time.monotonic() >= deadline:
          raise DeadlineExpired(
            f"request {request_id}: the deadline passed while generating; give a longer deadline or fewer max_tokens"
          )
        inflight.append(self._executor.submit(_next, run[0]))
        d = await asyncio.wrap_future(inflight[-1])
        if d is _END:
          ended = "finished"
          return
        yield d
    except BaseException:
      first = inflight[0] if inflight else None
      if not run and first is not None and first.done() and not first.cancelled() and first.exception():
        ended = "failed"
      raise
    finally:
      self._release(run, inflight, record, ended, loop)

  def _release(self, run: list, inflight: list, record: RequestRecord, ended: str, loop) -> None:
    """Cancel, drain and close the run on a worker, then give the turn back on the loop."""
    record.ended_by = ended
    if run and ended != "finished":
      record.decode_chunks_at_cancel = run[0].generation.trace.decode_chunks
    self.running -= 1
    self.draining += 1

    def finish():
      try:
        concurrent.futures.wait(inflight)  # the chunk in flight (the generator is not reentrant)
        r = run[0] if run else None
        if r is None and inflight and not inflight[0].cancelled() and inflight[0].exception() is None:
          r = inflight[0].result()  # the call ended while its run was starting
          record.decode_chunks_at_cancel = r.generation.trace.decode_chunks
        if r is not None:
          r.cancel()  # no-op for a finished run; otherwise it ends before its next device call
          for _ in iter(lambda: _next(r), _END):
            pass
          r.close()
          record.closed = True
          record.decode_chunks_end = r.generation.trace.decode_chunks
          record.tokens_out = sum(r.generation.trace.tokens_out)
      finally:
        _hand_back(loop, self, record)

    threading.Thread(target=finish, name=f"thoughtjax-release-{record.request_id}", daemon=True).start()

  def _freed(self, record: RequestRecord) -> None:
    self._held -= 1
    self._turns.release()
    self._count(record)
    self._notify()

  def _count(self, record: RequestRecord) -> None:
    """The request's ending in the counters (on the loop, or in its release thread once the loop is closed)."""
    self.draining -= 1
    self.records.append(record)
    if record.ended_by == "finished":
      self.completed += 1
    elif record.ended_by == "failed":
      self.failed += 1
    else:
      self.cancelled += 1

  def close(self) -> None:
    self._executor.shutdown(wait=False, cancel_futures=True)


class ContinuousScheduler(SimpleScheduler):
  """Continuous batching (issue 11 item 3): per path, one :class:`~thoughtjax.serving.SlotEngine` of
  ``max_concurrent`` slots sharing one decode program, stepped by one driver thread while any slot is in use.

  A request takes a turn (``max_concurrent`` turns over all paths, ``max_queue`` waiting, beyond it
  :class:`QueueFull` at once), runs ``start`` (plan, restore, compose) on a worker, and is refused with
  :class:`DeadlineExpired` before it takes a slot when the plan's predicted compile + prefill + decode does not
  fit in the call's remaining deadline. It is then submitted to its engine's driver, which prefills the
  requests waiting at that moment together in one program call (at most one prefill call between two decode
  chunks), sends each first token at once, places each in a free slot, and it joins at the next decode chunk;
  its deltas come back from the driver. When the call ends early (cancelled, connection closed, deadline) its
  slot (or its place in the driver's queue) is cancelled and freed at the end of the chunk running then; the
  turn is released once the slot is free. Chunks between cancel and free are recorded (:class:`RequestRecord`).

  The engines live in ``self.pool`` (:class:`~thoughtjax.serving.pool.EnginePool`: per path and ring length, at
  most ``max_engines``, a prefix cache of ``prefix_cache_bytes`` each). A request holds a lease on its engine from
  the moment it is handed the driver until its slot is free (or it never got one), so an engine with queued,
  prefilling or placed work, or one handed to a request that has not submitted yet, is never evicted or released
  (:meth:`release_path`, the server's idle release); a request whose path needs an engine when every one is in
  use is shed with :class:`QueueFull`. A run whose ``request.slot()`` is None (a speculative plan, a batch) runs
  alone, as in :class:`SimpleScheduler`.

  A Synthesize plans through :meth:`planning` (the servicer hands this scheduler to the synthesizer as its load
  book): one plan at a time, each under the engines' load plus the rows the plans before it reserved
  (:meth:`reserve`); a reservation is released once its request is in its engine, or when it gave up.
  """

  def __init__(
    self,
    max_concurrent: int,
    max_queue: int,
    *,
    max_engines: int = 4,
    cache_len: int = MIN_POOL_RING,
    keep_records: int = 256,
    prefix_cache_bytes: int = 0,
    prefix_block_tokens: int = 16,
    layout: str | None = None,
  ):
    super().__init__(max_concurrent, max_queue, keep_records=keep_records)
    self._pool = EnginePool(
      max_concurrent,
      max_engines=max_engines,
      cache_len=cache_len,
      prefix_cache_bytes=prefix_cache_bytes,
      prefix_block_tokens=prefix_block_tokens,
      layout=layout,
    )
    self.refused_deadline = 0
    self._planning = threading.Lock()  # one plan at a time (see planning)

  def snapshot(self) -> dict:
    return {
      **super().snapshot(),
      "scheduler": "continuous",
      **self.pool.stats(),
      "refused_deadline": self.refused_deadline,
    }

  def _lease(self, model, tokens: int):
    """The pool's driver for the request, with a lease (worker thread); a full pool sheds the request."""
    try:
      return self.pool.lease(model, tokens)
    except PoolFull as e:
      self.shed += 1
      raise QueueFull(str(e)) from None

  @property
  def pool(self) -> EnginePool:
    return self._pool

  def book(self) -> ContinuousScheduler:
    return self

  def load(self) -> Load:
    """The engines' streams now, what a plan joining them is predicted under."""
    return Load.of_pool(self.pool)

  def release_path(self, path_hash: str) -> bool:
    """Close the engines of ``path_hash`` unless one is in use (:meth:`EnginePool.release_path`)."""
    return self.pool.release_path(path_hash)

  def resident_models(self) -> list:
    return self.pool.resident_models()

  def resident_paths(self) -> set[str]:
    return self.pool.resident_paths()

  async def stream(
    self, start: Callable[[], Run], *, request_id: str, deadline: float | None = None, cache_scope: str = ""
  ) -> AsyncIterator[Any]:
    record = await self._admit(request_id, deadline)
    loop = asyncio.get_running_loop()
    box: dict[str, Any] = {}  # "start", "insert": futures; "run", "slot": what they gave
    ended = "cancelled"
    try:
      box["start"] = self._executor.submit(start)
      run = box["run"] = await asyncio.wrap_future(box["start"])
      row = run.request.slot()
      self._refuse_late(run, request_id, deadline)  # a run that goes alone too (e.g. a speculative plan)
      if row is None:
        box["alone"] = self._executor.submit(run.start)
        await asyncio.wrap_future(box["alone"])
        yield run
        async for d in self._alone(run, box, request_id, deadline):
          yield d
        ended = "finished"
        return
      ids, params = row
      # The driver comes with a lease (released once the slot is free): kept in the box, so a call that ends
      # while it is being handed out still gives it back.
      box["driver"] = self._executor.submit(self._lease, run.request.model, len(ids) + params.max_tokens)
      driver = await asyncio.wrap_future(box["driver"])
      ready: asyncio.Queue = asyncio.Queue()

      # The driver prefills it with the others waiting then; its first token goes out as soon as that call ends.
      def submit():
        slot = driver.submit_checked(  # checked once, by the plan's Model.request
          run.request, on_delta=lambda d: loop.call_soon_threadsafe(ready.put_nowait, d), scope=cache_scope
        )
        # Its row counts in the engine from now: released here, not once back on the loop, so no plan meanwhile
        # sees it twice (in the engine and as reserved).
        _unreserve(run)
        return slot

      box["insert"] = self._executor.submit(submit)
      slot = box["slot"] = await asyncio.wrap_future(box["insert"])
      run.run_in(slot)
      yield run
      while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        try:
          d = await asyncio.wait_for(ready.get(), remaining)
        except TimeoutError:
          raise DeadlineExpired(
            f"request {request_id}: the deadline passed while generating; give a longer deadline or fewer max_tokens"
          ) from None
        if d is None:  # the slot ended: let the run finish its trace (or raise the engine's error)
          for _ in iter(lambda: _next(run), _END):
            pass
          ended = "finished" if slot.error is None else "failed"
          return
        yield next(run)
    except BaseException:
      f, alone = box.get("start"), box.get("alone")
      if "run" not in box and f is not None and f.done() and not f.cancelled() and f.exception():
        ended = "failed"
      if alone is not None and alone.done() and not alone.cancelled() and alone.exception():
        ended = "failed"  # it could not start alone (e.g. its draft did not resolve)
      raise
    finally:
      self._release_slot(box, record, ended, loop)

  @contextlib.contextmanager
  def planning(self) -> Iterator[Load]:
    r"""The engines' load for one plan, every other plan held off until the block ends: a plan that joins an engine
    :meth:`reserve`\ s its row inside the block, so requests that arrive together are planned one after another,
    each under the load of those planned before it (not all under the load before any was placed). Only the plan
    is serialized; restoring and composing its path happen after the block."""
    with self._planning:
      yield self.load()

  def reserve(self, path_hash: str, tokens: int) -> Reservation:
    """Count a request just planned onto ``path_hash`` (``tokens`` prompt + new tokens) in the load of the plans
    after it, until released (this scheduler releases it once the request is in its engine, or gave up)."""
    return self.pool.reserve(path_hash, tokens)

  def _refuse_late(self, run, request_id: str, deadline: float | None) -> None:
    """DeadlineExpired when the plan's predicted compile + prefill + decode outlasts the deadline."""
    plan = run.plan
    if deadline is None or plan is None:
      return
    p = plan.predicted
    need_ms = p.compile + p.prefill + p.decode
    left_ms = (deadline - time.monotonic()) * 1e3
    if need_ms > left_ms:
      self.refused_deadline += 1
      run.close()
      raise DeadlineExpired(
        f"request {request_id}: path {plan.path} is predicted to need {need_ms:.0f} ms (compile {p.compile:.0f}, "
        f"prefill {p.prefill:.0f}, decode {p.decode:.0f}) and the deadline leaves {max(left_ms, 0):.0f} ms; "
        f"refused before taking a slot: give a longer deadline, a max_latency_ms budget or fewer max_tokens"
      )

  async def _alone(self, run, box, request_id: str, deadline: float | None) -> AsyncIterator[Any]:
    while True:
      if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExpired(
          f"request {request_id}: the deadline passed while generating; give a longer deadline or fewer max_tokens"
        )
      box["next"] = self._executor.submit(_next, run)
      d = await asyncio.wrap_future(box["next"])
      if d is _END:
        return
      yield d

  def _release_slot(self, box: dict, record: RequestRecord, ended: str, loop) -> None:
    """Cancel the request's slot (freed at the end of the chunk running), then give the turn back on the loop."""
    record.ended_by = ended
    slot = box.get("slot")
    if slot is not None and ended != "finished":
      record.decode_chunks_at_cancel = slot.trace.decode_chunks
      slot.cancel()
    self.running -= 1
    self.draining += 1

    def finish():
      try:
        futures = [box[k] for k in ("start", "alone", "driver", "insert", "next") if k in box]
        concurrent.futures.wait(futures)  # work in flight ends first (a run submitted late is cancelled below)
        s, submitted = box.get("slot"), box.get("insert")
        if s is None and submitted is not None and not submitted.cancelled() and submitted.exception() is None:
          s = submitted.result()  # the call ended while its request was being submitted
        if s is not None:
          s.cancel()
          s.freed.wait()
          if s.cancelled_at is not None:
            # A run that ended on its own while cancel() was being called was free before the cancel: 0.
            record.cancel_to_free_s = max(0.0, s.freed_at - s.cancelled_at)
          record.decode_chunks_end = s.trace.decode_chunks
          record.tokens_out = sum(s.trace.tokens_out)
        else:
          r = box.get("run")
          f = box.get("start")
          if r is None and f is not None and not f.cancelled() and f.exception() is None:
            r = f.result()
          if r is not None:
            if "next" in box:  # ran alone
              r.cancel()
              for _ in iter(lambda: _next(r), _END):
                pass
            r.close()
            # A run that never started (the call ended before it was given a slot or started alone): 0 and 0.
            t = r.generation.trace if r.generation is not None else None
            chunks = 0 if t is None else t.decode_chunks
            record.decode_chunks_at_cancel = record.decode_chunks_at_cancel or chunks
            record.decode_chunks_end = chunks
            record.tokens_out = 0 if t is None else sum(t.tokens_out)
        record.closed = True
      finally:
        f = box.get("start")
        run = box.get("run")
        if run is None and f is not None and not f.cancelled() and f.exception() is None:
          run = f.result()
        _unreserve(run)
        got = box.get("driver")
        if got is not None and not got.cancelled() and got.exception() is None:
          self.pool.give_back(got.result())  # its slot is free (or it never took one)
        _hand_back(loop, self, record)

    threading.Thread(target=finish, name=f"thoughtjax-release-{record.request_id}", daemon=True).start()

  def close(self) -> None:
    self.pool.close()
    super().close()


def make_scheduler(config) -> Scheduler:
  """The scheduler a server config names (``scheduler: continuous|simple``)."""
  if config.scheduler == "continuous":
    return ContinuousScheduler(
      config.max_concurrent,
      config.max_queue,
      prefix_cache_bytes=config.prefix_cache.max_mb << 20,
      prefix_block_tokens=config.prefix_cache.block_tokens,
      layout=config.engine_layout,
    )
  return SimpleScheduler(config.max_concurrent, config.max_queue)

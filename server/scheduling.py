"""The simplest correct scheduler: one request runs one generation, a bounded number at once, a bounded
number waiting (beyond it: :class:`QueueFull` at once), deadlines and cancellation that stop the
generation at the next decode chunk.

This is the one interface the servicer schedules through (:class:`Scheduler`). The slot engine of
continuous batching (issue 11 item 3, ``thoughtjax/serving/``) replaces :class:`SimpleScheduler` behind the
same ``stream``/``wait_idle``/``snapshot`` methods; the servicer does not change.

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
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from thoughtjax.errors import UserError


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


class Run(Protocol):
  """What ``start`` returns: an iterator of deltas with ``cancel()``/``close()`` and a ``generation``
  whose ``trace`` counts decode chunks (a :class:`~thoughtjax.synthesis.synthesize.SynthesisResult`)."""

  generation: Any

  def __next__(self) -> Any: ...

  def cancel(self) -> None: ...

  def close(self) -> None: ...


class Scheduler(Protocol):
  def stream(self, start: Callable[[], Run], *, request_id: str, deadline: float | None = None) -> AsyncIterator[Any]:
    """Admit (or raise :class:`QueueFull` at once), wait for a turn (``deadline``: ``time.monotonic()``
    seconds, :class:`DeadlineExpired` past it), run ``start`` and yield the run, then each delta."""

  async def wait_idle(self, timeout: float | None = None) -> bool: ...

  def snapshot(self) -> dict: ...


_END = object()


def _next(run: Run):
  try:
    return next(run)
  except StopIteration:
    return _END


class SimpleScheduler:
  """``max_concurrent`` requests generating at once, ``max_queue`` waiting (see the module docstring)."""

  def __init__(self, max_concurrent: int, max_queue: int, *, keep_records: int = 256):
    self.max_concurrent, self.max_queue = max_concurrent, max_queue
    # One worker per running request's chunk, one per request being drained, one spare.
    self._executor = concurrent.futures.ThreadPoolExecutor(
      2 * max_concurrent + 1, thread_name_prefix="thoughtjax-request"
    )
    self._turns: asyncio.Semaphore | None = None
    self._changed: asyncio.Condition | None = None
    self.waiting = self.running = self.draining = 0
    self.shed = self.completed = self.cancelled = self.failed = 0
    self.records: collections.deque[RequestRecord] = collections.deque(maxlen=keep_records)

  def _bind(self) -> None:
    if self._turns is None:  # made on the serving loop
      self._turns = asyncio.Semaphore(self.max_concurrent)
      self._changed = asyncio.Condition()

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

  async def wait_idle(self, timeout: float | None = None) -> bool:
    """Wait until nothing waits, runs or drains; False when ``timeout`` seconds passed first."""
    self._bind()

    async def until_idle():
      async with self._changed:
        await self._changed.wait_for(lambda: self.idle)

    try:
      await asyncio.wait_for(until_idle(), timeout)
      return True
    except TimeoutError:
      return False

  def _notify(self) -> None:
    async def notify():
      async with self._changed:
        self._changed.notify_all()

    asyncio.get_running_loop().create_task(notify())

  async def stream(
    self, start: Callable[[], Run], *, request_id: str, deadline: float | None = None
  ) -> AsyncIterator[Any]:
    self._bind()
    if self.waiting + self.running >= self.max_concurrent + self.max_queue:
      self.shed += 1
      raise QueueFull(
        f"request {request_id}: {self.running} requests running (max_concurrent "
        f"{self.max_concurrent}) and {self.waiting} waiting (max_queue {self.max_queue}); "
        f"retry with backoff, or raise max_queue/max_concurrent in the server config"
      )
    loop = asyncio.get_running_loop()
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
    self.running += 1
    record.queue_s = time.monotonic() - t0
    run: list[Run] = []
    inflight: list[concurrent.futures.Future] = []
    ended = "cancelled"
    try:
      inflight.append(self._executor.submit(start))
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
        loop.call_soon_threadsafe(self._freed, record)

    threading.Thread(target=finish, name=f"thoughtjax-release-{record.request_id}", daemon=True).start()

  def _freed(self, record: RequestRecord) -> None:
    self.draining -= 1
    self._turns.release()
    self.records.append(record)
    if record.ended_by == "finished":
      self.completed += 1
    elif record.ended_by == "failed":
      self.failed += 1
    else:
      self.cancelled += 1
    self._notify()

  def close(self) -> None:
    self._executor.shutdown(wait=False, cancel_futures=True)

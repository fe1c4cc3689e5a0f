"""The thread that drives a :class:`~thoughtjax.serving.slots.SlotEngine`: :class:`SlotDriver` queues requests
from any thread, prefills those waiting one prefill chunk at a time between two decode chunks, and steps while any
slot is in use; :func:`generate_in_slots` runs a list of requests through one engine and
returns their runs."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

from thoughtjax.decode.request import ModelRequest
from thoughtjax.decode.stream import Delta
from thoughtjax.sampling import (
  SamplingParams,
)
from thoughtjax.serving.errors import ConstraintsRefused, SlotRequestError, SlotsClosed
from thoughtjax.serving.slot_prefill import PrefillJob
from thoughtjax.serving.slot_run import Prefilled, SlotRun
from thoughtjax.serving.slots import SlotEngine


class SlotDriver:
  """A thread that runs one :class:`SlotEngine`: it prefills the requests waiting (``submit``), places them in
  free slots and steps while any slot is in use (idle otherwise). A prefill takes every waiting request in the
  oldest one's prefill group (:meth:`SlotEngine.prefill_group`), up to the free slots; waiting requests beyond the
  free slots stay queued in order. A prefill runs chunk by chunk (:meth:`SlotEngine.prefill_job`): between two
  decode chunks the driver runs at most ``prefills_between_chunks`` prefill chunks while slots are in use, so a
  long prompt never stalls the streams for more than that (chunks run back to back when no slot is in use, e.g.
  the first prefill of a burst)."""

  def __init__(self, engine: SlotEngine, prefills_between_chunks: int = 1):
    if prefills_between_chunks < 1:
      raise SlotRequestError(f"prefills_between_chunks must be >= 1, got {prefills_between_chunks}")
    self.engine, self.prefills_between_chunks = engine, int(prefills_between_chunks)
    self._cond = threading.Condition()
    self._closed = False
    self._pending: collections.deque[SlotRun] = collections.deque()
    self._prefilling = 0  # runs taken from the queue and not yet placed (or ended): see busy
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._loop, name="thoughtjax-slot-driver", daemon=True)
    self._thread.start()

  @property
  def waiting(self) -> int:
    """Requests submitted and not yet prefilled."""
    return len(self._pending)

  @property
  def alive(self) -> bool:
    """The driver's thread runs (False once closed)."""
    return self._thread.is_alive()

  @property
  def closed(self) -> bool:
    """:meth:`close` has begun: new requests are refused (the thread may still be ending its chunk)."""
    return self._closed

  def on_driver_thread(self) -> bool:
    """Whether the calling thread is the driver's own (the one that prefills, steps and delivers deltas)."""
    return threading.current_thread() is self._thread

  @property
  def rows(self) -> int:
    """Streams in the engine's slots, being prefilled or placed, or queued for it: what it will decode."""
    with self._cond:
      return len(self._pending) + self._prefilling + self.engine.active

  @property
  def busy(self) -> bool:
    """Work queued, being prefilled or placed, or in a slot: closing the driver now would end it."""
    with self._cond:
      return bool(self._pending) or self._prefilling > 0 or self.engine.active > 0

  def submit(
    self,
    prompt_ids: Sequence[int],
    params: SamplingParams | None = None,
    *,
    on_delta: Callable[[Delta | None], None] | None = None,
    scope: str = "",
  ) -> SlotRun:
    """Queue a request for the driver's next prefill call; returns its run at once (its first delta comes
    when the prefill ran). The engine's limits are checked here (:class:`SlotRequestError`). ``scope``: its
    prefix-cache scope. Any thread."""
    return self._queue(SlotRun(self.engine, self.engine.request(prompt_ids, params, scope), on_delta))

  def submit_checked(
    self, request: ModelRequest, *, on_delta: Callable[[Delta | None], None] | None = None, scope: str = ""
  ) -> SlotRun:
    """:meth:`submit` a request the model already checked (:meth:`SlotEngine.checked`: not checked again)."""
    return self._queue(SlotRun(self.engine, self.engine.checked(request, scope), on_delta))

  def _queue(self, run: SlotRun) -> SlotRun:
    with self._cond:
      if self._closed:
        raise SlotsClosed(f"the slot driver of path {self.engine.model.path!r} was closed")
      self._pending.append(run)
      self._cond.notify_all()
    return run

  def insert(self, pre: Prefilled, on_delta=None) -> SlotRun:
    """Insert a prefilled request now (a slot must be free) and wake the driver."""
    run = self.engine.insert(pre, on_delta=on_delta)
    self.wake()
    return run

  def place(self, run: SlotRun, pre: Prefilled) -> None:
    """:meth:`SlotEngine.place` an admitted run and wake the driver."""
    self.engine.place(run, pre)
    self.wake()

  def wake(self) -> None:
    with self._cond:
      self._cond.notify_all()

  def _take(self) -> tuple[list[SlotRun], list[SlotRun]]:
    """(cancelled runs to end, runs to prefill now); called holding the condition."""
    dropped = [r for r in self._pending if r.cancel_requested]
    if dropped:
      self._pending = collections.deque(r for r in self._pending if not r.cancel_requested)
    batch: list[SlotRun] = []
    free = self.engine.free
    if self._pending and free:
      group = self.engine.prefill_group
      want = group(self._pending[0].ids, self._pending[0].scope)
      keep: collections.deque[SlotRun] = collections.deque()
      for r in self._pending:
        (batch if len(batch) < free and group(r.ids, r.scope) == want else keep).append(r)
      self._pending = keep
    return dropped, batch

  def _loop(self) -> None:
    stalls = 0  # prefill chunks since the last decode chunk that made slots in use wait
    job: tuple[list[SlotRun], PrefillJob] | None = None  # the prefill under way: its runs and its chunks
    while True:
      with self._cond:
        if job is None:
          self._cond.wait_for(lambda: self._closed or self.engine.active > 0 or bool(self._pending))
        if self._closed:
          if job is not None:
            self._prefilling = 0
            for run in job[0]:
              run.abandon(SlotsClosed(f"the slot driver of path {self.engine.model.path!r} was closed"))
          return
        dropped, batch = [], []
        prefill = stalls < self.prefills_between_chunks or not self.engine.active
        if prefill and job is None:
          dropped, batch = self._take()
          self._prefilling = len(batch)
      for run in dropped:
        run.abandon()
      if batch:
        job = self._begin(batch)
      if job is not None and prefill:
        stalls += self.engine.active > 0
        job = self._advance(*job)
      elif self.engine.active:
        try:
          self.engine.step()
        except BaseException as e:  # every request in a slot gets the error; the driver goes on
          self.error = e
          self.engine.fail(e)
        stalls = 0

  def _begin(self, batch: list[SlotRun]) -> tuple[list[SlotRun], PrefillJob] | None:
    """The prefill of ``batch`` (:meth:`SlotEngine.prefill_job`), not run yet. A run whose constraint cannot give
    its first mask ends with that error; the others are prefilled without it. None when none is left."""
    try:
      return batch, self.engine.prefill_job(batch)
    except ConstraintsRefused as e:
      errors = {id(m): err for m, err in e.refused}
      rest = []
      for run in batch:
        err = errors.get(id(run.matcher)) if run.matcher is not None else None
        if err is None:
          rest.append(run)
        else:
          run.abandon(err)
      if not rest or len(rest) == len(batch):
        self._failed(batch, e if rest else None)
        return None
      return self._begin(rest)
    except BaseException as e:
      self._failed(batch, e)
      return None

  def _advance(self, batch: list[SlotRun], job: PrefillJob) -> tuple[list[SlotRun], PrefillJob] | None:
    """Run the next chunk of ``job``; each run whose prompt ended in it gets its first token out, then a free slot
    (it decodes while the longer prompts of its batch go on). None once the job ended (or failed: its runs not in
    a slot yet get the error; those in slots go on)."""
    try:
      ended = job.advance()
      ready = job.take_ready()
      for i, pre in ready:
        self.engine.deliver(batch[i], pre)
      for i, pre in ready:
        self.engine.place(batch[i], pre)
    except BaseException as e:
      self._failed(batch, e)
      return None
    with self._cond:
      self._prefilling = 0 if ended else self._prefilling - len(ready)
    return None if ended else (batch, job)

  def _failed(self, batch: list[SlotRun], error: BaseException | None) -> None:
    """End the runs of a prefill that failed with ``error`` (None: they ended already) and forget it."""
    if error is not None:
      self.error = error
      for run in batch:
        if not run.finished and run.slot is None:
          run.abandon(error)
    with self._cond:
      self._prefilling = 0

  def close(self) -> None:
    """Stop; runs still in a slot or waiting end with an error (nobody would step them again)."""
    with self._cond:
      self._closed = True
      pending, self._pending = list(self._pending), collections.deque()
      self._cond.notify_all()
    self._thread.join(timeout=60)
    error = SlotsClosed(f"the slot driver of path {self.engine.model.path!r} was closed")
    for run in pending:
      run.abandon(error)
    self.engine.fail(error)


def generate_in_slots(
  engine: SlotEngine, requests: Sequence[tuple[Sequence[int], SamplingParams]], arrivals: Sequence[int] | None = None
) -> list[SlotRun]:
  """Run ``requests`` through ``engine`` on this thread, request i inserted before decode chunk
  ``arrivals[i]`` (default: all at once; a request that finds no free slot waits for one; requests inserted
  before the same chunk are prefilled together). Returns the runs, ended. For tests, notebooks and benchmarks."""
  arrivals = list(arrivals) if arrivals is not None else [0] * len(requests)
  pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
  runs: list[SlotRun | None] = [None] * len(requests)
  chunk = 0
  while pending or engine.active:
    now = [i for i in pending if arrivals[i] <= chunk][: engine.free]  # prefilled together
    if now:
      pending = [i for i in pending if i not in now]
      for i, run in zip(now, engine.insert_batch([requests[i] for i in now]), strict=True):
        runs[i] = run
    engine.step()
    chunk += 1
  return runs

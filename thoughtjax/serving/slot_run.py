"""A request in a slot engine, as the engine and its caller see it: :class:`SlotRequest` (checked against the
engine's limits, no device work yet), :class:`Prefilled` (after its prefill, keys still on the device, ready to take
a slot) and :class:`SlotRun` (in the engine: deltas to iterate as they come, ``cancel()`` from any thread).

The engine (:class:`~thoughtjax.serving.slots.SlotEngine`) drives a run through its engine-side methods
(:meth:`SlotRun.placed`, :meth:`SlotRun.stepped`, :meth:`SlotRun.push`, :meth:`SlotRun.end`) on its own thread;
a caller uses the rest. A run's slot is freed, and its free callbacks taken, under the engine's ``cancel_lock``."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax

from thoughtjax.constraint import Matcher
from thoughtjax.decode.stream import Delta, Rows, Trace
from thoughtjax.sampling import SamplingParams


class RunHost(Protocol):
  """What a run needs of the engine it runs in (:class:`~thoughtjax.serving.slots.SlotEngine` is one)."""

  cancel_lock: threading.Lock  # a run's slot is freed, and its free callbacks taken, under it
  chunks: int  # decode chunks the engine has run

  def cancel(self, run: SlotRun) -> None: ...


@dataclasses.dataclass
class Prefilled:
  """A request after its prefill, ready to take a slot (its keys stay on the device until inserted).

  Requests prefilled in one call share ``kv`` and ``token``; ``row`` is this request's row in them."""

  ids: list[int]
  params: SamplingParams
  kv: tuple  # per path block: (k, v) [P, K, S, E], row ``row``'s prompt key i at index i
  token: jax.Array  # [P] i32, each row's first token
  done: bool
  count: int
  trace: Trace
  rows: Rows
  row: int = 0
  batch: int = 1  # requests prefilled in the same call (padding rows not counted)
  matcher: Matcher | None = None  # a constrained request's grammar state, past its first token
  scope: str = ""  # its prefix-cache scope (a client's cache_salt): blocks are shared within a scope only


class SlotRequest(NamedTuple):
  """A request checked against the engine's limits, with its trace and row bookkeeping (no device work yet)."""

  ids: list[int]
  params: SamplingParams
  trace: Trace
  rows: Rows
  matcher: Matcher | None = None  # a constrained request's grammar state
  scope: str = ""  # prefix-cache scope (see Prefilled.scope)


class SlotRun:
  """One request in a slot engine: iterate for :class:`~thoughtjax.decode.stream.Delta`s (blocking until the
  engine produced them), ``cancel()`` from any thread, ``trace`` as a Generation's.

  ``slot`` is the slot it held (None when it finished at its prefill); ``chunks_at_cancel`` and
  ``chunks_at_free`` are the engine's decode chunks when ``cancel`` came and when the slot was freed;
  ``prefill_batch`` how many requests shared its prefill; ``max_prefills_between_chunks`` the most prefill chunks
  (program calls) the engine ran between two of its decode chunks (how long it stalled);
  :attr:`mean_width` the mean rows of the decode steps it took part in.
  """

  def __init__(self, engine: RunHost, req: SlotRequest | Prefilled, on_delta: Callable[[Delta | None], None] | None):
    self.engine, self.ids, self.params, self.trace, self.rows = engine, req.ids, req.params, req.trace, req.rows
    self.matcher = req.matcher  # a constrained request's grammar state (the driver prefills it from the run)
    self.scope = req.scope  # its prefix-cache scope
    self.slot: int | None = None
    self.prefill_batch: int | None = None  # requests prefilled together with this one
    self.max_prefills_between_chunks = 0  # most prefill chunks run between two of its decode chunks
    self._prefills_mark = 0  # engine.prefill_chunks at its last chunk (or when it took its slot)
    self.steps_taken = 0  # decode steps of the chunks it was in
    self.rows_stepped = 0  # the sum over those steps of the rows each computed
    self.on_delta = on_delta
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self.freed = threading.Event()
    self._on_free: list[Callable[[], None]] = []
    self.cancel_requested = False
    self.chunks_at_cancel: int | None = None
    self.chunks_at_free: int | None = None
    self.cancelled_at: float | None = None  # time.perf_counter() of cancel() and of the slot's release
    self.freed_at: float | None = None
    self.finish_reason: str | None = None
    self.error: BaseException | None = None
    self.token_ids: list[int] = []
    self.text = ""

  @property
  def mean_width(self) -> float | None:
    """The mean rows of the decode steps it took part in (the engine's width, padded as it computes), or None
    before its first chunk: how many streams its decode shared the steps with."""
    return self.rows_stepped / self.steps_taken if self.steps_taken else None

  # ---- engine side ------------------------------------------------------------------
  def placed(self, slot: int, prefill_chunks: int) -> None:
    """It holds ``slot`` from now; ``prefill_chunks``: the engine's count of prefill chunks at that moment."""
    self.slot, self._prefills_mark = slot, prefill_chunks

  def stepped(self, steps: int, width: int, prefill_chunks: int) -> None:
    """It took part in a decode chunk of ``steps`` steps over ``width`` rows; ``prefill_chunks`` as above."""
    self.trace.decode_chunks += 1
    self.steps_taken += steps
    self.rows_stepped += width * steps
    stalled, self._prefills_mark = prefill_chunks - self._prefills_mark, prefill_chunks
    self.max_prefills_between_chunks = max(self.max_prefills_between_chunks, stalled)

  def push(self, d: Delta) -> None:
    self.token_ids.extend(d.token_ids)
    self.text += d.text
    if d.finished:
      self.finish_reason = d.finish_reason
    self._queue.put(d)
    if self.on_delta is not None:
      self.on_delta(d)

  def end(self, error: BaseException | None = None) -> None:
    """No more deltas: the slot (if any) is free again."""
    self.error = error
    self.trace.end = self.freed_at = time.perf_counter()
    self.trace.tokens_out = list(self.rows.counts)
    self._queue.put(None)
    if self.on_delta is not None:
      self.on_delta(None)
    with self.engine.cancel_lock:
      self.freed.set()
      callbacks, self._on_free = self._on_free, []
    for fn in callbacks:
      fn()

  def abandon(self, error: BaseException | None = None) -> None:
    """End a run that holds no slot: cancelled (``error`` None: its rows end as cancelled) or failed. A run
    that ended already is left alone."""
    if self.freed.is_set():
      return
    if error is None:
      self.trace.cancelled = True
      for d in self.rows.cancel():
        self.push(d)
    self.chunks_at_free = self.engine.chunks
    self.end(error)

  # ---- user side --------------------------------------------------------------------
  def when_freed(self, fn: Callable[[], None]) -> None:
    """Call ``fn`` (on the engine's thread) once the slot is free; at once if it already is."""
    with self.engine.cancel_lock:
      if not self.freed.is_set():
        self._on_free.append(fn)
        return
    fn()

  @property
  def finished(self) -> bool:
    return self.freed.is_set()

  def __iter__(self) -> SlotRun:
    return self

  def __next__(self) -> Delta:
    d = self._queue.get()
    if d is None:
      self._queue.put(None)  # later calls end too
      if self.error is not None:
        raise self.error
      raise StopIteration
    return d

  def deltas(self) -> list[Delta]:
    """Every delta produced so far, without waiting (the run must have ended, or some are missed later)."""
    out = []
    while True:
      try:
        d = self._queue.get_nowait()
      except queue.Empty:
        return out
      if d is None:
        self._queue.put(None)
        return out
      out.append(d)

  def cancel(self) -> None:
    self.engine.cancel(self)

  def close(self) -> None:
    self.cancel()

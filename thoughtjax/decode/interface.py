"""The decode program interface: what plain, speculative and slot programs share, and the one host loop over it.

In the spirit of JetStream's engine API, a program is compiled for one key (a :class:`DecodeKey`; paths of one
shape share it, their weights are arguments) and drives a device state the host never copies back whole:

>>> state = program.init_state(inputs.parts)   # empty rows, on the device the parts live on
>>> state = program.prefill(inputs, state)     # every prompt into its row, its first token sampled
>>> state = program.advance(inputs, state)     # up to key.chunk decode steps (speculative: draft/verify iterations)
>>> out, count, done = program.read(state)     # row r's tokens so far at out[r, :count[r]]

``prefill`` and ``advance`` donate the state they are given. The three families:

* :class:`~thoughtjax.decode.program.Program` (and its layer-indexed form): the rows are the request's prompts,
  left-padded to one bucket;
* :class:`~thoughtjax.decode.speculative.SpecProgram`: the same rows; its advance is a draft/verify iteration;
* :class:`~thoughtjax.serving.slot_program.SlotProgram`: the rows are a ring of slots; ``prefill`` puts prompts into free
  slots at the shared cursor, and a slot engine also prefills a request apart and ``insert``s it while other slots
  decode (continuous batching).

:func:`run_chunks` is the one host loop of a call that runs alone: prefill, then one ``advance`` per round, each
only after the previous round's deltas were taken, so cancelling or abandoning the call stops the device work at
the next round.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from thoughtjax.decode.stream import Delta, Rows, Trace
from thoughtjax.sampling import SamplingArrays, SamplingMode
from thoughtjax.transformer import path_shape


@dataclasses.dataclass(frozen=True)
class DecodeKey:
  """What a compiled decode program is keyed by; every program family's key extends it
  (:class:`~thoughtjax.decode.program.ProgramKey`, the speculative ``SpecKey``, the serving ``SlotKey``).
  :data:`~thoughtjax.decode.program.PROGRAMS` holds a program under its key's :meth:`shape`, so paths of one
  structure share it: weights are arguments."""

  layers: tuple[int, ...]  # path as layer indices, repeats allowed

  def shape(self) -> DecodeKey:
    """This key with its path numbered by position (:func:`~thoughtjax.transformer.path_shape`)."""
    return dataclasses.replace(self, layers=path_shape(self.layers))


@dataclasses.dataclass
class CompileTime:
  """What a :meth:`_CompileClock.measure` block spent: ``seconds`` tracing, lowering and compiling, and
  ``cache_misses``, the programs it compiled because JAX's persistent compilation cache did not hold them (0 with
  ``seconds`` > 0: every program it needed was loaded from that cache, or the cache is off)."""

  seconds: float = 0.0
  cache_misses: int = 0


class _CompileClock:
  """Seconds JAX spends tracing, lowering and compiling in the calling thread, and the persistent-cache misses.

  Fed by ``jax.monitoring`` time spans and events; nested traces (a jitted kernel inside the program)
  overlap their parent, so the union of the spans is measured, not their sum.
  """

  EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
  )
  MISS = "/jax/compilation_cache/cache_misses"

  def __init__(self):
    self._local = threading.local()
    jax.monitoring.register_event_time_span_listener(self._on_span)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_span(self, event: str, start: float, end: float, **_):
    spans = getattr(self._local, "spans", None)
    if spans is not None and event in self.EVENTS:
      spans.append((start, end))

  def _on_event(self, event: str, **_):
    if event == self.MISS and getattr(self._local, "spans", None) is not None:
      self._local.misses += 1

  @contextlib.contextmanager
  def measure(self) -> Iterator[CompileTime]:
    """``with CLOCK.measure() as t:`` ... then ``t.seconds`` and ``t.cache_misses`` hold what the block spent."""
    outer, outer_misses = getattr(self._local, "spans", None), getattr(self._local, "misses", 0)
    spans: list[tuple[float, float]] = []
    self._local.spans, self._local.misses = spans, 0
    out = CompileTime()
    try:
      yield out
    finally:
      out.cache_misses = self._local.misses
      self._local.spans, self._local.misses = outer, outer_misses + out.cache_misses
      if outer is not None:
        outer.extend(spans)
      total, reach = 0.0, float("-inf")
      for a, b in sorted(spans):
        if b > reach:
          total += b - max(a, reach)
          reach = b
      out.seconds = total


COMPILE_CLOCK = _CompileClock()


class DecodeInputs(NamedTuple):
  """What a program call reads besides its state: the path's weights and one request's arrays."""

  parts: Any  # the path's parts (a program of the layer-indexed form: its stacked parts)
  prompt: Any  # [B, T] i32 left-padded token ids (plain programs also take a TemplatePrompt)
  pad: jax.Array  # [B] i32 left padding
  samp: SamplingArrays  # per-row sampling settings
  vocab_ids: jax.Array | None = None  # a speculative draft's truncated vocabulary
  mode: SamplingMode | None = None  # a slot program's sampling mode (plain and speculative keys hold theirs)


class Tokens(NamedTuple):
  """A state's tokens as device arrays: row r's at ``out[r, :count[r]]`` (-1 past them); ``done[r]``: it stopped."""

  out: jax.Array  # [B, W] i32
  count: jax.Array  # [B] i32
  done: jax.Array  # [B] bool


class DecodeProgram(abc.ABC):
  """One compiled decode program (see the module docstring)."""

  key: DecodeKey  # the path's shape and what the family adds

  @abc.abstractmethod
  def init_state(self, parts=None) -> Any:
    """The empty state, committed to the one device ``parts`` live on (an uncommitted one would make the first
    call after it compile the program again)."""

  @abc.abstractmethod
  def prefill(self, inputs: DecodeInputs, state) -> Any:
    """Every prompt of ``inputs`` into its row, its first token sampled; ``state`` is donated."""

  @abc.abstractmethod
  def advance(self, inputs: DecodeInputs, state) -> Any:
    """Up to ``key.chunk`` decode steps of every row still running; ``state`` is donated."""

  @abc.abstractmethod
  def read(self, state) -> Tokens:
    """The state's tokens (device arrays; the caller fetches them)."""


def _fetch(program: DecodeProgram, state) -> Tokens:
  """The state's tokens on the host, in one transfer."""
  return Tokens(*jax.device_get(tuple(program.read(state))))


def run_chunks(
  program: DecodeProgram,
  inputs: DecodeInputs,
  rows: Rows,
  trace: Trace,
  cancelled: threading.Event,
  *,
  before: Callable[[DecodeInputs], DecodeInputs] | None = None,
  after: Callable[[Any, list[int]], None] | None = None,
  finish: Callable[[Any], None] | None = None,
) -> Iterator[Delta]:
  """The host loop of one call: prefill, then one ``advance`` per round, each after the last deltas were taken.

  ``before(inputs)`` gives each call's inputs (a constrained batch: every row's allowed-token mask from its
  matcher); ``after(tokens, seen)`` sees each call's host tokens before they become deltas (the matchers
  consume them); ``finish(state)`` runs once at the end with the last state (None when no device work ran).
  """
  n = len(rows.finished)
  seen = [0] * n
  state = None
  call = before or (lambda i: i)
  try:
    if cancelled.is_set():  # cancelled before it started: no device work at all
      trace.cancelled = True
      yield from rows.cancel()
      return
    trace.device_start = time.perf_counter()
    with COMPILE_CLOCK.measure() as compiled:
      state = program.prefill(call(inputs), program.init_state(inputs.parts))
      tokens = _fetch(program, state)
    trace.compile_s, trace.compile_misses = compiled.seconds, compiled.cache_misses
    trace.first_token = time.perf_counter()
    while True:
      if after is not None:
        after(tokens, seen)
      for r in range(n):
        c = int(tokens.count[r])
        d = rows.emit(r, [int(t) for t in tokens.out[r, seen[r] : c]], bool(tokens.done[r]), c)
        seen[r] = c
        if d is not None:
          yield d
      if rows.all_finished:
        return
      if cancelled.is_set():
        trace.cancelled = True
        yield from rows.cancel()
        return
      state = program.advance(call(inputs), state)
      trace.decode_chunks += 1
      tokens = _fetch(program, state)
  finally:
    trace.end = time.perf_counter()
    trace.tokens_out = list(rows.counts)
    if finish is not None:
      finish(state)

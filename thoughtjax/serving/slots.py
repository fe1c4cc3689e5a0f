"""Continuous batching over one path: a fixed number of slots sharing one compiled decode program.

>>> engine = SlotEngine(model, slots=8)                  # one path (one Model), 8 slots
>>> run = engine.insert([1, 2, 3], SamplingParams(max_tokens=32))   # prefill, then a free slot
>>> while engine.active: engine.step()                   # one decode chunk for every slot in use
>>> [d.text for d in run.deltas()]                        # what the request produced

Or with a :class:`~thoughtjax.serving.driver.SlotDriver`, a thread that prefills waiting requests and steps while
any slot is in use: ``driver.submit(ids, params)`` returns a :class:`SlotRun` at once, to iterate (deltas as they
are produced) or ``cancel()`` from any thread.

Prefill: requests waiting at the same moment are prefilled together, in one call of the engine's prefill program
(:meth:`SlotEngine.prefill_batch`: prompts left-padded to their shared prompt bucket T, rows padded to a power of
two P, one [P, T] program call; only the last position goes through the head), and each row's keys are written
into its own slot. A request's prefill is computed as in its alone run (same left padding, positions, mask and
first-token sampling), so its first token and keys are the alone run's. :meth:`SlotEngine.prefill` takes no slot
and touches no engine state (any thread); :meth:`SlotEngine.insert` writes the keys into a free slot and the
request joins at the next decode chunk. A server splits insert in two: :meth:`SlotEngine.admit` hands out the
prefill's token at once, :meth:`SlotEngine.place` takes the slot once the chunk running ends. A driver does all
of it on its thread: ``driver.submit(ids, params)`` queues a request; between two decode chunks the driver runs at most one prefill call (every request waiting in the oldest one's prompt
bucket, up to the free slots), so a running stream waits for at most one prefill between its chunks
(``SlotRun.max_prefills_between_chunks``).

Prefix cache (``prefix_cache=``, a :class:`~thoughtjax.serving.prefix.PrefixCache`; off by default, on in the
server): after each prefill the prompt's full blocks of keys are kept by token prefix; a later prompt that starts
with cached blocks (at most its length - 1 tokens: the first token still comes from a forward over the prompt's
last token) prefills only the rest (:meth:`SlotProgram._prefill_after_impl`: the cached keys stay where the
prefill would have put them, the rest attends to them at the positions that follow), one program per (rows,
prefix bucket, rest bucket) like the whole prompt's. Requests waiting together are grouped by the program they
need (:meth:`SlotEngine.prefill_group`); the trace's ``prefix_cache_tokens`` says how many tokens were reused.
Only prompt keys are cached, never generated ones.

Decode: one program per (mode, bias on/off), compiled once per slot layout (:func:`slot_program`): up to ``chunk`` steps,
ending early when every active row has stopped. A chunk computes W rows, the next power of two of the slots in
use (at most N; free slots pad it and are ignored): with fewer, their caches and settings are gathered into a
W-row program and written back after it (:meth:`SlotProgram._chunk_rows_impl`), so one stream on a 16-slot
engine pays a one-row step. Per-slot sampling
settings are arrays (:class:`~thoughtjax.sampling.SamplingArrays`, [N] rows). While any slot holds a constrained
request (json_schema, regex, grammar) the engine runs the one-step program of the same layout, each slot's
allowed-token mask written from its grammar matcher before the step; the others allow every token. A slot is freed at the end of
the chunk in which its row stopped (stop ids, EOS, max_tokens, a stop string found on the host) or at the
end of the chunk running when ``cancel`` came (at once if none runs), and is reused.

Cache layout: per path block, K and V of shape [N, K, S, E] form a ring over one write cursor ``c`` shared by
every slot (the number of decode steps the engine has run): each step writes all slots' new keys at index
``c mod S``, so the model's attention (one scalar write index) runs unchanged. A request joining at cursor
``c`` with ``n`` prompt tokens gets its prompt keys at absolute positions ``[c - n, c)``: its start is
``c - n``, its RoPE position at cursor ``c'`` is ``c' - start``, and ring index ``s`` (absolute position
``c' - ((c' - s) mod S)``) is visible to it when that position is ``>= start``. A request fits when
``n + max_tokens <= S``, so its keys never wrap onto themselves; other slots live in other rows. The state
(:class:`~thoughtjax.decode.state.DecodeState`) and the decode step (:func:`~thoughtjax.decode.state.decode_chunk`)
are those of plain generation, whose pool of rows is filled once by its prefill and whose ring never wraps.

Exactness: greedy tokens of a request in a slot equal those of the request alone through ``Model.generate``
(tested with staggered arrivals, different lengths and cancelled neighbours); sampled tokens follow the
same distribution, keyed by (seed, engine step, the slot's row among the W computed) rather than the alone run's (seed, step, row 0). With the
prefix cache the keys of a cached prefix were computed by an earlier prefill of the same tokens at the same
positions: equal to the alone run's up to float rounding (tested: greedy and seeded tokens equal those without
the cache).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.constraint import ConstraintError, Matcher
from thoughtjax.decode.interface import COMPILE_CLOCK
from thoughtjax.decode.masks import ALL, grammars_for
from thoughtjax.decode.program import bucket
from thoughtjax.decode.request import ModelRequest
from thoughtjax.decode.state import DecodeState
from thoughtjax.decode.stream import Delta, Rows, Trace
from thoughtjax.defaults import DEFAULT_SLOT_CACHE_LEN
from thoughtjax.sampling import (
  SamplingArrays,
  SamplingMode,
  SamplingParams,
  program_mode,
  sampling_arrays,
  stop_ids_for,
)
from thoughtjax.serving.errors import ConstraintsRefused, SlotRequestError, SlotsFull
from thoughtjax.serving.prefix import PrefixCache
from thoughtjax.serving.slot_program import SlotProgram, slot_program
from thoughtjax.transformer import GraphDefs

DEFAULT_SLOTS = 8
DEFAULT_STOP_WIDTH = 16


@dataclasses.dataclass
class Prefilled:
  """A request after its prefill, ready to take a slot (its keys stay on the device until inserted).

  Requests prefilled in one call share ``kv`` and ``token``; ``row`` is this request's row in them."""

  ids: list[int]
  params: SamplingParams
  kv: tuple  # per path block: (k, v) [P, K, T, E], row ``row``'s prompt left-padded in [:, :, T - n:]
  token: jax.Array  # [P] i32, each row's first token
  done: bool
  count: int
  trace: Trace
  rows: Rows
  row: int = 0
  batch: int = 1  # requests prefilled in the same call (padding rows not counted)
  matcher: Matcher | None = None  # a constrained request's grammar state, past its first token
  scope: str = ""  # its prefix-cache scope (a client's cache_salt): blocks are shared within a scope only


class _Request(NamedTuple):
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
  ``prefill_batch`` how many requests shared its prefill call; ``max_prefills_between_chunks`` the most prefill
  calls the engine ran between two of its decode chunks (how long it stalled, in program calls);
  :attr:`mean_width` the mean rows of the decode steps it took part in.
  """

  def __init__(self, engine: SlotEngine, req: _Request | Prefilled, on_delta: Callable[[Delta | None], None] | None):
    self.engine, self.ids, self.params, self.trace, self.rows = engine, req.ids, req.params, req.trace, req.rows
    self.matcher = req.matcher  # a constrained request's grammar state (the driver prefills it from the run)
    self.scope = req.scope  # its prefix-cache scope
    self.slot: int | None = None
    self.prefill_batch: int | None = None  # requests prefilled in the same program call as this one
    self.max_prefills_between_chunks = 0  # most prefill calls run between two of its decode chunks
    self._prefills_mark = 0  # engine.prefill_calls at its last chunk (or when it took its slot)
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
  def _placed(self, slot: int, prefill_calls: int) -> None:
    """It holds ``slot`` from now; ``prefill_calls``: the engine's count of prefill calls at that moment."""
    self.slot, self._prefills_mark = slot, prefill_calls

  def _stepped(self, steps: int, width: int, prefill_calls: int) -> None:
    """It took part in a decode chunk of ``steps`` steps over ``width`` rows; ``prefill_calls`` as above."""
    self.trace.decode_chunks += 1
    self.steps_taken += steps
    self.rows_stepped += width * steps
    stalled, self._prefills_mark = prefill_calls - self._prefills_mark, prefill_calls
    self.max_prefills_between_chunks = max(self.max_prefills_between_chunks, stalled)

  def _push(self, d: Delta) -> None:
    self.token_ids.extend(d.token_ids)
    self.text += d.text
    if d.finished:
      self.finish_reason = d.finish_reason
    self._queue.put(d)
    if self.on_delta is not None:
      self.on_delta(d)

  def _end(self, error: BaseException | None = None) -> None:
    """No more deltas: the slot (if any) is free again."""
    self.error = error
    self.trace.end = self.freed_at = time.perf_counter()
    self.trace.tokens_out = list(self.rows.counts)
    self._queue.put(None)
    if self.on_delta is not None:
      self.on_delta(None)
    with self.engine._cancel_lock:
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
        self._push(d)
    self.chunks_at_free = self.engine.chunks
    self._end(error)

  # ---- user side --------------------------------------------------------------------
  def when_freed(self, fn: Callable[[], None]) -> None:
    """Call ``fn`` (on the engine's thread) once the slot is free; at once if it already is."""
    with self.engine._cancel_lock:
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


class SlotEngine:
  """N slots over one path's model (see the module docstring). Thread-safe: ``prefill`` runs anywhere,
  ``insert``/``step`` serialize on the engine, ``cancel`` never waits for a chunk."""

  def __init__(
    self,
    model,
    slots: int = DEFAULT_SLOTS,
    *,
    cache_len: int | None = None,
    chunk: int | None = None,
    stop_width: int = DEFAULT_STOP_WIDTH,
    prefix_cache: PrefixCache | None = None,
  ):
    if slots < 1:
      raise SlotRequestError(f"slots must be >= 1, got {slots}")
    self.model, self.slots = model, int(slots)
    self.cfg = model.config
    self.cache_len = int(min(cache_len or DEFAULT_SLOT_CACHE_LEN, self.cfg.max_context))
    self.chunk = int(chunk or model.chunk)
    if self.chunk < 1 or self.cache_len < 2:
      raise SlotRequestError(f"chunk must be >= 1 and cache_len >= 2, got chunk={self.chunk} cache_len={cache_len}")
    self.stop_width, self.layers, self.kernels = stop_width, tuple(model.layers), model.kernels
    self.defs = GraphDefs.from_model(model.module)
    self.parts = model.parts.by_position(self.layers)  # the programs are keyed by the path's shape
    self._lock = threading.RLock()  # engine state: insert, step, free
    self._cancel_lock = threading.Lock()
    self._runs: list[SlotRun | None] = [None] * self.slots
    self._cancelled: set[int] = set()
    self.chunks = 0  # decode chunks run
    self.rows_computed = 0  # rows those chunks computed (each: the slots in use, padded to a power of two)
    self.prefill_calls = 0  # prefill program calls run
    self.prefill_rows = 0  # requests those calls prefilled
    self._stats_lock = threading.Lock()
    self.steps = 0  # decode steps run (the cursor)
    self.freed_total = 0
    self.chunk_seconds: collections.deque[float] = collections.deque(maxlen=1024)  # wall time of recent chunks
    self._step_ms: collections.deque[tuple[int, float]] = collections.deque(maxlen=8)  # (width, ms per step)
    N, V = self.slots, self.cfg.vocab_size
    self._host = dict(
      temperature=np.zeros(N, np.float32),
      top_k=np.zeros(N, np.int32),
      top_p=np.ones(N, np.float32),
      seed=np.zeros(N, np.uint32),
      max_new=np.ones(N, np.int32),
      stop_ids=np.full((N, stop_width), -1, np.int32),
    )
    self._bias = np.zeros((N, V), np.float32)
    self._modes = [SamplingMode.GREEDY] * N
    self._has_bias = [False] * N
    self._samp: tuple | None = None  # (has_bias, SamplingArrays) on the device, rebuilt after an insert
    self.program = slot_program(self.defs, self.cfg, self.layers, self.slots, self.cache_len, self.chunk, self.kernels)
    # Constrained slots: their grammar matchers, and the allowed-token masks of every slot. While any slot
    # holds a constrained request the engine steps one token per call (each mask depends on the token before).
    self._matchers: list[Matcher | None] = [None] * N
    self._words: np.ndarray | None = None
    self._state = self.program.init()
    # Prompt keys by token prefix (None: off). A path whose blocks keep no keys (bridges only) has none to reuse.
    keyed = [i for i in self.layers if i >= 0]
    self.prefix_cache = prefix_cache if keyed else None
    self._zero_block: jax.Array | None = None  # a prefix row's padding block

  # ---- host API ----------------------------------------------------------------------
  @property
  def active(self) -> int:
    """Slots holding a request."""
    return sum(r is not None for r in self._runs)

  @property
  def free(self) -> int:
    return self.slots - self.active

  def runs(self) -> list[SlotRun | None]:
    """The request in each slot (None: free)."""
    return list(self._runs)

  @property
  def state(self) -> DecodeState:
    """The slots' device state (KV caches, last tokens, counters) as of the last insert or step; read only: the
    engine replaces it at each insert and step."""
    return self._state

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Hold the engine for the block: no insert, place, step or free runs meanwhile; a prefill still does, and a
    cancel is applied at the next step. Re-entrant on the holding thread. For a caller that must see work wait
    on the engine (a request prefilled but not placed, one queued behind it)."""
    with self._lock:
      yield

  def request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, scope: str = "") -> _Request:
    """Check a request against the engine's limits (:class:`SlotRequestError` names the limit and the fix) and the
    model's (:meth:`Model.request <thoughtjax.model.Model.request>`), and make its trace and row bookkeeping; no
    device work. ``scope``: its prefix-cache scope (blocks are reused within a scope only). Any thread."""
    params = params or SamplingParams()
    ids = [int(t) for t in prompt_ids]
    self._check_limits(ids, params)
    return self._request_of(self.model.request([ids], params), ids, params, scope)

  def checked(self, request: ModelRequest, scope: str = "") -> _Request:
    """:meth:`request` for one the model already checked (``Model.request`` of one plain prompt on this engine's
    path, e.g. a synthesized request's): only the engine's own limits are checked here."""
    row = request.slot()
    if row is None or request.model.path_hash != self.model.path_hash:
      raise SlotRequestError(
        "a slot engine runs one plain prompt on its own path; run a batch or a drafted request alone "
        "(Model.run), or submit it to the engine of its path"
      )
    ids, params = list(row[0]), row[1]
    self._check_limits(ids, params)
    return self._request_of(request, ids, params, scope)

  def _check_limits(self, ids: list[int], params: SamplingParams) -> None:
    if len(ids) + params.max_tokens > self.cache_len:
      raise SlotRequestError(
        f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} exceeds "
        f"the slot engine's cache of {self.cache_len} tokens; shorten the prompt, lower max_tokens or make the "
        f"engine with a larger cache_len (at most the model's context, {self.cfg.max_context})"
      )
    stops = stop_ids_for(params, self.model.codec.eos_ids)
    if len(stops) > self.stop_width:
      raise SlotRequestError(
        f"{len(stops)} stop ids (stop_token_ids and end-of-sequence ids) exceed the slot engine's "
        f"stop_width of {self.stop_width}; send fewer stop ids or make the engine with a larger stop_width"
      )

  def _request_of(self, request: ModelRequest, ids: list[int], params: SamplingParams, scope: str) -> _Request:
    # The trace names the program the request would run alone in, from its token ids (as the engine takes it).
    key = self.model.program_key(dataclasses.replace(request, template=None, user=None))
    trace = Trace(key, [ids], time.perf_counter(), tokens_out=[0])
    c = params.constraint
    matcher = None if c is None else self._grammars.matcher(c)
    stops = stop_ids_for(params, self.model.codec.eos_ids)
    return _Request(ids, params, trace, Rows(self.model.codec, [params], [stops]), matcher, scope)

  @property
  def _grammars(self):
    return grammars_for(self.model.codec, self.cfg.vocab_size)

  def prefill(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Prefilled:
    """Run one request's prefill; takes no slot. Any thread."""
    return self.prefill_batch([(prompt_ids, params)])[0]

  def prefill_batch(self, requests: Sequence[tuple[Sequence[int], SamplingParams | None]]) -> list[Prefilled]:
    """Prefill requests together in one program call (prompts padded to the longest one's bucket); takes no
    slot. Any thread."""
    return self._prefill([self.request(ids, params) for ids, params in requests])

  def prefill_group(self, prompt_ids: Sequence[int], scope: str = "") -> tuple:
    """The prefill program a prompt would go through now: ("whole", prompt bucket), or ("rest", bucket of the
    tokens after its cached prefix) when the prefix cache holds some of it. Requests of one group share a prefill
    call (:class:`~thoughtjax.serving.driver.SlotDriver`, :meth:`insert_batch`); a peek, nothing is counted."""
    n = len(prompt_ids)
    cache = self.prefix_cache
    have = 0 if cache is None else cache.peek(prompt_ids, self._reuse_limit(prompt_ids, scope), scope)
    return ("rest", bucket(n - have)) if have else ("whole", bucket(n))

  def _reuse_limit(self, ids: Sequence[int], scope: str) -> int:
    """The most prompt tokens a prefix-cache hit may reuse: all but the last (the first token comes from a forward
    over it), and none when the prefix cached now would not shrink the prefill's bucket (the call would cost the
    same, in a program of its own, split from the batch's other prefills)."""
    n = len(ids)
    have = self.prefix_cache.peek(ids, n - 1, scope)
    return n - 1 if have and bucket(n - have) < bucket(n) else 0

  def prefill_runs(self, runs: Sequence[SlotRun]) -> list[Prefilled]:
    """Prefill runs made before their prefill (a driver's queue: :meth:`SlotDriver.submit`) as :meth:`prefill_batch`
    does requests, each with the run's own trace, rows and grammar state; takes no slot."""
    return self._prefill([_Request(r.ids, r.params, r.trace, r.rows, r.matcher, r.scope) for r in runs])

  def _prefill(self, reqs: Sequence[_Request]) -> list[Prefilled]:
    """The prefill of ``reqs``: one program call for those whose prompt starts with a cached prefix (only the
    rest is computed), one for the others; then each prompt's new full blocks go into the prefix cache. Every
    constraint gives its first mask before any call: :class:`ConstraintsRefused` names those that cannot, with
    nothing of any request changed."""
    constrained = any(r.matcher is not None for r in reqs)
    refused, scratch = [], np.empty(self._grammars.words, np.uint32) if constrained else None
    for r in reqs:
      if r.matcher is not None:
        try:
          r.matcher.fill(scratch)
        except ConstraintError as e:
          refused.append((r.matcher, e))
    if refused:
      raise ConstraintsRefused(refused)
    cache = self.prefix_cache
    if cache is None:
      return self._prefill_call(reqs, None)
    chains = [cache.lookup(r.ids, self._reuse_limit(r.ids, r.scope), r.scope) for r in reqs]
    for r, chain in zip(reqs, chains, strict=True):
      r.trace.prefix_cache_tokens = len(chain) * cache.block_tokens
    out: list[Prefilled | None] = [None] * len(reqs)
    for part in ([i for i, c in enumerate(chains) if c], [i for i, c in enumerate(chains) if not c]):
      if part:
        got = self._prefill_call([reqs[i] for i in part], [chains[i] for i in part] if chains[part[0]] else None)
        for i, pre in zip(part, got, strict=True):
          out[i] = pre
    self._keep_prefixes(out)
    return out

  def _keep_prefixes(self, pres: Sequence[Prefilled]) -> None:
    """Put each prompt's full blocks not cached yet into the prefix cache (one cut per prefill call)."""
    cache, B = self.prefix_cache, self.prefix_cache.block_tokens
    cut: dict[int, jax.Array] = {}
    for pre in pres:
      first, full = cache.first_missing(pre.ids, pre.scope), len(pre.ids) // B
      if first >= full:
        continue
      key = id(pre.kv)
      if key not in cut:
        P, _, T, _ = next(k for layer, (k, _) in zip(self.layers, pre.kv, strict=True) if layer >= 0).shape
        pad = np.full(P, T, np.int32)
        for q in pres:
          if q.kv is pre.kv:
            pad[q.row] = T - len(q.ids)
        cut[key] = self.program.blocks(pre.kv, jnp.asarray(pad), B)
      arrays = [_block_at(cut[key], jnp.int32(pre.row), jnp.int32(j)) for j in range(first, full)]
      cache.add(pre.ids, first, arrays, pre.scope)

  def _prefill_call(self, reqs: Sequence[_Request], chains: Sequence[list] | None) -> list[Prefilled]:
    """One prefill program call for ``reqs``: whole prompts (``chains`` None), or each prompt after its cached
    prefix (``chains[p]``: its blocks' keys)."""
    n = len(reqs)
    have = [0] * n if chains is None else [len(c) * self.prefix_cache.block_tokens for c in chains]
    T = bucket(max(len(r.ids) - h for r, h in zip(reqs, have, strict=True)))
    P = bucket(n, 1)
    tokens = np.zeros((P, T), np.int32)
    pad = np.full(P, T - 1, np.int32)  # padding rows: one token, inert
    for p, (r, h) in enumerate(zip(reqs, have, strict=True)):
      rest = r.ids[h:]
      tokens[p, T - len(rest) :] = rest
      pad[p] = T - len(rest)
    params = [r.params for r in reqs]
    has_bias = any(p.logit_bias for p in params)
    samp = sampling_arrays(params, P, self.cfg.vocab_size, self.stop_width, self.model.codec.eos_ids, has_bias)
    masked = [p for p, r in enumerate(reqs) if r.matcher is not None]
    if masked:
      words = np.full((P, self._grammars.words), ALL, np.uint32)
      for p in masked:
        reqs[p].matcher.fill(words[p])
      samp = samp._replace(allowed=jax.device_put(words))
    started = time.perf_counter()
    with COMPILE_CLOCK.measure() as compiled:
      if chains is None:
        kv, token, done = self.program.prefill_rows(
          self.parts, jnp.asarray(tokens), jnp.asarray(pad), samp, program_mode(params)
        )
      else:
        kv, token, done = self.program.prefill_after(
          self.parts,
          self._prefix_rows(chains, P),
          jnp.asarray(tokens),
          jnp.asarray(pad),
          jnp.asarray(np.array(have + [0] * (P - n), np.int32)),
          samp,
          program_mode(params),
        )
      done = jax.device_get(done)
    if masked:
      first_tokens = jax.device_get(token)
      for p in masked:
        reqs[p].matcher.consume(int(first_tokens[p]))
    first = time.perf_counter()
    with self._stats_lock:
      self.prefill_calls += 1
      self.prefill_rows += n
    out = []
    for p, r in enumerate(reqs):
      r.trace.device_start, r.trace.first_token, r.trace.compile_s = started, first, compiled.seconds
      out.append(
        Prefilled(
          r.ids,
          r.params,
          kv,
          token,
          bool(done[p]),
          1,
          r.trace,
          r.rows,
          row=p,
          batch=n,
          matcher=r.matcher,
          scope=r.scope,
        )
      )
    return out

  def _prefix_rows(self, chains: Sequence[list], P: int) -> tuple:
    """The block arrays of a :meth:`SlotProgram._prefill_after_impl` call: P rows of NB blocks (NB: the longest
    chain's block bucket), each row's chain right-aligned after zero blocks."""
    if self._zero_block is None:
      # Made like a cached block (committed to its device where those are), so a call's arguments keep one
      # signature however many of its rows are padding: a fresh array would be uncommitted and compile anew.
      self._zero_block = jnp.zeros_like(next(b for c in chains for b in c))
    B = self.prefix_cache.block_tokens
    NB = bucket(max(len(c) for c in chains) * B, B) // B
    rows = [*chains, *([[]] * (P - len(chains)))]
    return tuple(a for c in rows for a in [self._zero_block] * (NB - len(c)) + list(c))

  def warm(
    self,
    prompt_len: int,
    modes: Sequence[SamplingMode] = (SamplingMode.GREEDY,),
    biases: Sequence[bool] = (False, True),
  ) -> None:
    """Compile what the first requests of ``prompt_len`` tokens run, so they compile nothing: in each mode, without
    and with a logit bias, the prefill of every batch size (1, 2, 4, ... up to the slots) for prompts of that
    length (its bucket) and the insert of their keys; the decode chunk at every width a chunk computes (1, 2, 4,
    ... and all the slots), run with no slot active. With a prefix cache, also the cut of a new prompt's blocks
    into the cache, and the prefill after the prefix that a prompt of that length reuses when it comes again (all
    its full blocks but the last token's) with the insert of its keys."""
    T = bucket(prompt_len)
    hit = self._repeat_hit(prompt_len)
    params = SamplingParams()  # the mode and the bias's presence, not the settings, shape the program
    for mode, bias in ((m, b) for m in modes for b in biases):
      P = 1
      while True:
        samp = sampling_arrays([params] * P, P, self.cfg.vocab_size, self.stop_width, self.model.codec.eos_ids, bias)
        # From host arrays, as requests come: the transfer of each shape is compiled too.
        tokens, pad = jnp.asarray(np.zeros((P, T), np.int32)), jnp.asarray(np.full((P,), T - 1, np.int32))
        kv, token, _ = self.program.prefill_rows(self.parts, tokens, pad, samp, mode)
        self._warm_insert(kv, token)
        if self.prefix_cache is not None:  # a new prompt's blocks are cut from its prefill's keys into the cache
          block = _block_at(self.program.blocks(kv, pad, self.prefix_cache.block_tokens), jnp.int32(0), jnp.int32(0))
        if hit is not None:
          have, Ts = hit
          # Cached blocks as the cache holds them: outputs of _block_at, placed on the device, which a program
          # call takes as a committed argument (a fresh array is not, and would compile a program of its own).
          blocks = [block] * (have // self.prefix_cache.block_tokens)
          kv, token, _ = self.program.prefill_after(
            self.parts,
            self._prefix_rows([blocks] * P, P),
            jnp.asarray(np.zeros((P, Ts), np.int32)),
            jnp.asarray(np.full((P,), Ts - (prompt_len - have), np.int32)),
            jnp.asarray(np.full((P,), have, np.int32)),
            samp,
            mode,
          )
          self._warm_insert(kv, token)
        if P >= self.slots:
          break
        P *= 2
      self._warm_chunks(mode, bias)
    jax.block_until_ready(self._state)

  def _warm_chunks(self, mode: SamplingMode, bias: bool) -> None:
    """Run the decode chunk at every width :func:`width` gives, with no slot active: each compiles, none steps
    (the loop stops before its first step), the state stays as it was."""
    with self._lock:
      samp = self._slot_arrays(bias)
      W = 1
      while W < self.slots:
        rows, active = jnp.asarray(np.arange(W, dtype=np.int32)), jnp.asarray(np.zeros(W, bool))
        self._state, _, _ = self.program.chunk_rows(self.parts, samp, self._state, rows, active, mode)
        W *= 2
      self._state, _, _ = self.program.chunk(
        self.parts, samp, self._state, jnp.asarray(np.zeros(self.slots, bool)), mode
      )

  def _repeat_hit(self, prompt_len: int) -> tuple[int, int] | None:
    """(tokens reused, rest's bucket) of a prompt of ``prompt_len`` tokens whose prefix is cached, or None when
    this engine keeps no prefix cache or such a hit is not taken (:meth:`_reuse_limit`)."""
    if self.prefix_cache is None or prompt_len < 2:
      return None
    have = (prompt_len - 1) // self.prefix_cache.block_tokens * self.prefix_cache.block_tokens
    if not have or bucket(prompt_len - have) >= bucket(prompt_len):
      return None
    return have, bucket(prompt_len - have)

  def _warm_insert(self, kv, token) -> None:
    """Insert warm-up keys into a free slot (its row is ignored by the chunk and rewritten by the next insert)."""
    with self._lock:
      if self.free:
        b = self._runs.index(None)
        self._state = self.program.insert(
          self._state, kv, jnp.int32(b), jnp.int32(0), jnp.int32(1), token, (jnp.bool_(True), jnp.int32(1))
        )

  def insert(
    self,
    request: Prefilled | Sequence[int],
    params: SamplingParams | None = None,
    *,
    on_delta: Callable[[Delta | None], None] | None = None,
  ) -> SlotRun:
    """Put a request into a free slot (prefilling it first when given token ids); it joins at the next
    decode chunk. A request that finished at its prefill takes no slot. ``on_delta(delta)`` is called on
    the engine's thread for each delta, then ``on_delta(None)`` when the run ended.
    Raises :class:`SlotsFull` when no slot is free. (:meth:`admit` then :meth:`place`.)"""
    pre = request if isinstance(request, Prefilled) else self.prefill(request, params)
    run = self.admit(pre, on_delta=on_delta)
    self.place(run, pre)
    return run

  def insert_batch(
    self,
    requests: Sequence[Prefilled | tuple[Sequence[int], SamplingParams | None]],
    *,
    on_delta: Callable[[Delta | None], None] | None = None,
  ) -> list[SlotRun]:
    """:meth:`insert` several requests; those given as token ids are prefilled together, one program call per
    prompt bucket. Raises :class:`SlotsFull` when fewer slots are free than requests that need one."""
    pre: list[Prefilled | None] = [r if isinstance(r, Prefilled) else None for r in requests]
    todo = [i for i, p in enumerate(pre) if p is None]
    for group in _by_group([(i, self.request(*requests[i])) for i in todo], self.prefill_group):
      for (i, _), p in zip(group, self._prefill([r for _, r in group]), strict=True):
        pre[i] = p
    runs = [self.admit(p, on_delta=on_delta) for p in pre]
    for run, p in zip(runs, pre, strict=True):
      self.place(run, p)
    return runs

  def admit(self, pre: Prefilled, *, on_delta: Callable[[Delta | None], None] | None = None) -> SlotRun:
    """The request's run with its prefill's delta delivered at once (its first token does not wait for the
    chunk running); it takes no slot until :meth:`place`. A request that finished at its prefill ends here."""
    run = SlotRun(self, pre, on_delta)
    self.deliver(run, pre)
    return run

  def deliver(self, run: SlotRun, pre: Prefilled) -> None:
    """The prefill's first token to ``run`` (and its end when it stopped there); ``pre`` is its prefill
    (:meth:`admit` does this for a run made from its prefill, a driver for the runs it queued)."""
    run.prefill_batch = pre.batch
    token = int(jax.device_get(pre.token)[pre.row])
    d = pre.rows.emit(0, [token], pre.done, pre.count)
    if d is not None:
      run._push(d)
    if pre.rows.all_finished:
      run.chunks_at_free = self.chunks
      run._end()

  def place(self, run: SlotRun, pre: Prefilled) -> None:
    """Write an admitted run's prompt keys into a free slot (waits for the chunk running); it joins at the next
    chunk. A run cancelled meanwhile ends here without a slot; a finished one is left alone."""
    with self._lock:
      if run.freed.is_set() or run.slot is not None:
        return
      if run.cancel_requested:
        run.abandon()
        return
      try:
        b = self._runs.index(None)
      except ValueError:
        raise SlotsFull(
          f"all {self.slots} slots of the engine for path {self.model.path!r} hold requests; wait until one is "
          f"freed, or queue the request (a SlotDriver or the server's scheduler does)"
        ) from None
      p = pre.params
      h = self._host
      h["temperature"][b], h["top_k"][b], h["top_p"][b] = p.temperature, p.top_k, p.top_p
      h["seed"][b], h["max_new"][b] = p.seed, p.max_tokens
      h["stop_ids"][b] = -1
      h["stop_ids"][b, : len(pre.rows.stops[0])] = pre.rows.stops[0]
      self._bias[b] = 0.0
      for tok, bias in (p.logit_bias or {}).items():
        self._bias[b, int(tok)] += bias
      self._modes[b], self._has_bias[b] = p.mode, bool(p.logit_bias)
      self._matchers[b] = pre.matcher
      self._samp = None
      self._state = self.program.insert(
        self._state,
        pre.kv,
        jnp.int32(b),
        jnp.int32(pre.row),
        jnp.int32(len(pre.ids)),
        pre.token,
        (jnp.bool_(pre.done), jnp.int32(pre.count)),
      )
      run._placed(b, self.prefill_calls)
      self._runs[b] = run
      with self._cancel_lock:  # a cancel that came while this waited for the chunk: freed at the next step
        if run.cancel_requested:
          self._cancelled.add(b)

  def cancel(self, run: SlotRun) -> None:
    """End ``run``: its slot is freed at the end of the chunk now running (at once when none runs) with a
    last delta of finish_reason ``cancelled``. Any thread; a finished run is left alone."""
    with self._cancel_lock:
      if run.freed.is_set() or run.cancel_requested:
        return
      run.cancel_requested = True
      run.cancelled_at = time.perf_counter()
      run.chunks_at_cancel = self.chunks
      if run.slot is not None:
        self._cancelled.add(run.slot)
    if self._lock.acquire(blocking=False):  # no chunk running: free it now
      try:
        self._free_cancelled()
      finally:
        self._lock.release()

  def _free(self, b: int, error: BaseException | None = None) -> None:
    """Free slot ``b``; its run ends (with ``error``: its iterator raises it)."""
    run = self._runs[b]
    self.freed_total += 1  # before the slot reads as free: whoever sees it free sees it counted
    self._runs[b] = None
    self._matchers[b] = None
    run.chunks_at_free = self.chunks
    run._end(error)

  def _free_cancelled(self) -> None:
    with self._cancel_lock:
      cancelled, self._cancelled = self._cancelled, set()
    for b in sorted(cancelled):
      run = self._runs[b]
      if run is None:
        continue
      run.trace.cancelled = True
      for d in run.rows.cancel():
        run._push(d)
      self._free(b)

  def _sampling(self) -> tuple[bool, SamplingArrays]:
    if self._samp is None:
      live = [b for b, r in enumerate(self._runs) if r is not None]
      arrays = self._slot_arrays(any(self._has_bias[b] for b in live))
      self._samp = (_widest({self._modes[b] for b in live}), arrays)
    return self._samp

  def _slot_arrays(self, bias: bool) -> SamplingArrays:
    """Every slot's sampling settings on the device, with the slots' logit biases when ``bias``."""
    h = self._host
    return SamplingArrays(
      *(jnp.asarray(h[k]) for k in ("temperature", "top_k", "top_p", "seed", "max_new", "stop_ids")),
      jnp.asarray(self._bias) if bias else None,
    )

  def step(self) -> dict[int, list[int]]:
    """One decode chunk for every slot in use; returns each slot's new token ids. Slots whose row stopped
    (or that were cancelled meanwhile) are freed at the end of the chunk."""
    with self._lock:
      self._free_cancelled()
      live = [b for b, r in enumerate(self._runs) if r is not None]
      if not live:
        return {}
      mode, samp = self._sampling()
      program, constrained = self.program, [b for b in live if self._matchers[b] is not None]
      if constrained:
        program, samp, refused = self._masked_step(samp, constrained)
        if refused:  # those slots ended with their constraint's error; the others step
          live = [b for b in live if b not in refused]
          constrained = [b for b in constrained if b not in refused]
          if not live:
            return {}
      active = np.zeros(self.slots, bool)
      active[live] = True
      t0 = time.perf_counter()
      W = width(len(live), self.slots)
      if W < self.slots:  # compute only the slots in use (padded to a power of two with free ones)
        rows = live + [b for b in range(self.slots) if b not in set(live)][: W - len(live)]
        self._state, out, steps = program.chunk_rows(
          self.parts, samp, self._state, jnp.asarray(np.asarray(rows, np.int32)), jnp.asarray(active[rows]), mode
        )
      else:
        self._state, out, steps = program.chunk(self.parts, samp, self._state, jnp.asarray(active), mode)
      out, done, count, steps = jax.device_get((out, self._state.done, self._state.count, steps))
      refused = {}
      for b in constrained:  # out holds -1 where a slot sampled nothing (it had stopped)
        try:
          for t in out[b][out[b] >= 0]:
            self._matchers[b].consume(int(t))
        except ConstraintError as e:
          refused[b] = e
      self.chunk_seconds.append(time.perf_counter() - t0)
      if not constrained:
        self._step_ms.append((W, self.chunk_seconds[-1] * 1e3 / max(int(steps), 1)))
      self.chunks += 1
      self.rows_computed += W
      self.steps += int(steps)
      new: dict[int, list[int]] = {}
      for b in live:
        run = self._runs[b]
        run._stepped(int(steps), W, self.prefill_calls)
        if b in refused:
          self._free(b, refused[b])
          continue
        ids = [int(t) for t in out[b] if t >= 0]
        new[b] = ids
        d = run.rows.emit(0, ids, bool(done[b]), int(count[b]))
        if d is not None:
          run._push(d)
        if run.rows.all_finished:
          self._free(b)
      self._free_cancelled()
      return new

  def recent_step(self) -> tuple[int, float] | None:
    """(width, median wall ms per decode step) of the latest chunks at the width of the last one (a chunk of
    constrained slots, stepping once per call, excluded), or None before any chunk: what one step costs now,
    beside whatever else runs on the machine."""
    got = list(self._step_ms)
    if not got:
      return None
    w = got[-1][0]
    return w, float(np.median([ms for width, ms in got if width == w]))

  def _masked_step(self, samp: SamplingArrays, constrained: list[int]) -> tuple[SlotProgram, SamplingArrays, set[int]]:
    """The one-step program and sampling arrays carrying every slot's allowed-token mask (unconstrained slots
    allow everything), and the slots whose matcher refused to give one (past llguidance's limits): each of those
    runs ends with its :class:`~thoughtjax.constraint.ConstraintError` here, and its slot is free."""
    if self._words is None:
      self._words = np.full((self.slots, self._grammars.words), ALL, np.uint32)
    self._words[:] = ALL
    refused = set()
    for b in constrained:
      try:
        self._matchers[b].fill(self._words[b])
      except ConstraintError as e:
        self._words[b] = ALL
        refused.add(b)
        self._free(b, e)
    program = slot_program(self.defs, self.cfg, self.layers, self.slots, self.cache_len, 1, self.kernels)
    return program, samp._replace(allowed=jax.device_put(self._words)), refused

  def fail(self, error: BaseException) -> None:
    """End every run in a slot with ``error`` (a device failure): their iterators raise it."""
    with self._lock:
      for b, run in enumerate(self._runs):
        if run is not None:
          self._runs[b] = None
          run.chunks_at_free = self.chunks
          run._end(error)


def width(live: int, slots: int) -> int:
  """The rows a decode chunk computes for ``live`` slots in use: the next power of two, at most ``slots`` (a few
  compiled widths serve every occupancy). The latency model prices a joining stream by it."""
  return min(1 << max(int(live) - 1, 0).bit_length(), max(int(slots), 1))


def _widest(modes: set[SamplingMode]) -> SamplingMode:
  """The least capable sampler that serves every slot (as :func:`~thoughtjax.sampling.program_mode`)."""
  for m in (SamplingMode.SAMPLE_TOP_P, SamplingMode.SAMPLE):
    if m in modes:
      return m
  return SamplingMode.GREEDY


def _by_group(items: Sequence[tuple], group: Callable[[Sequence[int], str], tuple]) -> list[list[tuple]]:
  """(key, request) pairs grouped by the request's prefill group (:meth:`SlotEngine.prefill_group`), in order of
  first appearance."""
  groups: dict[tuple, list[tuple]] = {}
  for item in items:
    groups.setdefault(group(item[1].ids, item[1].scope), []).append(item)
  return list(groups.values())


@jax.jit
def _block_at(blocks: jax.Array, row: jax.Array, j: jax.Array) -> jax.Array:
  """Block ``j`` of row ``row`` of a :meth:`SlotProgram._blocks_impl` cut, as its own array (one program per cut
  shape, whatever the indices)."""
  return jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(blocks, row, 0, False), j, 0, False)

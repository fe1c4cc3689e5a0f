"""Continuous batching over one path: a fixed number of slots sharing one compiled decode program.

>>> engine = SlotEngine(model, slots=8)                  # one path (one Model), 8 slots
>>> run = engine.insert([1, 2, 3], SamplingParams(max_tokens=32))   # prefill, then a free slot
>>> while engine.active: engine.step()                   # one decode chunk for every slot in use
>>> [d.text for d in run.deltas()]                        # what the request produced

Or with a :class:`~thoughtjax.serving.driver.SlotDriver`, a thread that prefills waiting requests and steps while
any slot is in use: ``driver.submit(ids, params)`` returns a :class:`SlotRun` at once, to iterate (deltas as they
are produced) or ``cancel()`` from any thread.

Prefill: requests waiting at the same moment are prefilled together, whatever their lengths
(:meth:`SlotEngine.prefill_batch`), in chunks of ``prefill_chunk`` prompt tokens
(:class:`~thoughtjax.serving.slot_program.ChunkedPrefill`): longest prompt first, row p's key i written at index i
of [N, K, S, E] prefill caches (N: the slots, S: the ring's length); a chunk computes only the rows whose prompts
reach into it, padded to a power of two R, one call of one program per R; a row's first token is sampled from its
last prompt position, in the chunk where its prompt ends, and from then on it is ready for a slot while the longer
prompts go on. So the prefill programs are a fixed few (one per R), compiled by :meth:`SlotEngine.warm` before any
request. A request's prefill computes the keys and first token of its alone run (same positions, causal mask and
first-token sampling, up to float rounding). :meth:`SlotEngine.prefill` takes no slot
and touches no engine state (any thread); :meth:`SlotEngine.insert` writes the keys into a free slot and the
request joins at the next decode chunk. A server splits insert in two: :meth:`SlotEngine.admit` hands out the
prefill's token at once, :meth:`SlotEngine.place` takes the slot once the chunk running ends. A driver does all
of it on its thread: ``driver.submit(ids, params)`` queues a request; between two decode chunks the driver runs at
most one prefill (every request waiting in the oldest one's prefill group, up to the free slots), so a running
stream waits for at most one prefill between its chunks (``SlotRun.max_prefills_between_chunks``).

Prefix cache (``prefix_cache=``, a :class:`~thoughtjax.serving.prefix.PrefixCache`; off by default, on in the
server): after each prefill the prompt's full blocks of keys are kept by token prefix; a later prompt that starts
with cached blocks (at most its length - 1 tokens: the first token still comes from a forward over the prompt's
last token) gets them written into its prefill caches and prefills only the rest, from the first token after them,
when that saves a chunk. Requests waiting together are grouped by the tokens they reuse
(:meth:`SlotEngine.prefill_group`); the trace's ``prefix_cache_tokens`` says how many tokens were reused.
Only prompt keys are cached, never generated ones.

Decode: one program per sampling mode, compiled once per slot layout (:func:`slot_program`): up to ``chunk`` steps,
ending early when every active row has stopped. A chunk computes W rows, the next power of two of the slots in
use (at most N; free slots pad it and are ignored): with fewer, their caches and settings are gathered into a
W-row program and written back after it (:meth:`SlotProgram.decode`), so one stream on a 16-slot
engine pays a one-row step. Per-slot sampling
settings are arrays (:class:`~thoughtjax.sampling.SamplingArrays`, [N] rows). A constrained request (json_schema,
regex, grammar) decodes in the same chunks as the others: before each chunk its allowed-token mask is written from
its grammar matcher (the other slots allow every token) and holds for the chunk's first step; its later tokens are
sampled freely and checked against the matcher after the chunk, which keeps them up to the first it refuses and
takes back the rest (:meth:`SlotProgram.take_back <thoughtjax.serving.slot_program.SlotProgram.take_back>`: the row's
keys move forward so that its next key goes at the cursor). So a constrained slot gets at least one token per chunk
and its neighbours keep their multi-step chunks. Exact: greedy, a token the grammar allows that is the free
argmax is the masked argmax; sampling with temperature alone, a free draw kept when allowed is a draw from the
masked distribution (a refused one is drawn again under the mask at the next chunk); with top-k or top-p the mask
changes which tokens those keep, so such a row keeps only its masked token. A slot is freed at the end of
the chunk in which its row stopped (stop ids, EOS, max_tokens, a stop string found on the host) or at the
end of the chunk running when ``cancel`` came (at once if none runs), and is reused.

Cache layout: per path block, K and V of shape [N, K, S, E] form a ring over one write cursor ``c`` shared by
every slot (the number of decode steps the engine has run): each step writes all slots' new keys at index
``c mod S``, so the model's attention (one scalar write index) runs unchanged. A request joining at cursor
``c`` with ``n`` prompt tokens gets its prompt keys at absolute positions ``[c - n, c)``: its start is
``c - n``, its RoPE position at cursor ``c'`` is ``c' - start``, and ring index ``s`` (absolute position
``c' - ((c' - s) mod S)``) is visible to it when that position is ``>= start``. A request fits when
``n + max_tokens <= S``, so its keys never wrap onto themselves; other slots live in other rows. Layer-indexed
(``layout="indexed"``, the model's layout by default; never for a path with a bridge) the pairs are one, [positions,
N, K, S, E], and the programs loop over the stacked layer weights (:mod:`thoughtjax.decode.indexed`). The state
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
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.constraint import ConstraintError, Matcher
from thoughtjax.decode.masks import ALL
from thoughtjax.decode.request import ModelRequest
from thoughtjax.decode.state import DecodeState
from thoughtjax.decode.stream import Delta, Rows, Trace
from thoughtjax.defaults import DEFAULT_PREFILL_CHUNK, DEFAULT_SLOT_CACHE_LEN
from thoughtjax.sampling import (
  SamplingArrays,
  SamplingMode,
  SamplingParams,
  stop_ids_for,
)
from thoughtjax.serving.errors import SlotRequestError, SlotsFull
from thoughtjax.serving.prefix import PrefixCache
from thoughtjax.serving.slot_prefill import PrefillJob, SlotPrefill
from thoughtjax.serving.slot_program import SlotProgram, slot_program
from thoughtjax.serving.slot_run import Prefilled, SlotRequest, SlotRun
from thoughtjax.transformer import GraphDefs

DEFAULT_SLOTS = 8
DEFAULT_STOP_WIDTH = 16


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
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    layout: str | None = None,
  ):
    if slots < 1:
      raise SlotRequestError(f"slots must be >= 1, got {slots}")
    self.model, self.slots = model, int(slots)
    self.cfg = model.config
    self.cache_len = int(min(cache_len or DEFAULT_SLOT_CACHE_LEN, self.cfg.max_context))
    self.chunk = int(chunk or model.chunk)
    if self.chunk < 1 or self.cache_len < 2 or prefill_chunk < 1:
      raise SlotRequestError(
        f"chunk and prefill_chunk must be >= 1 and cache_len >= 2, got chunk={self.chunk} "
        f"prefill_chunk={prefill_chunk} cache_len={cache_len}"
      )
    self.prefill_chunk = int(prefill_chunk)
    self.stop_width, self.layers, self.kernels = stop_width, tuple(model.layers), model.kernels
    self.defs = GraphDefs.from_model(model.module)
    bridged = any(i < 0 for i in self.layers)
    if layout == "indexed" and bridged:
      raise SlotRequestError("a path with a bridge has no layer-indexed form; use layout='unrolled'")
    # None: the model's own layout (thoughtjax.load picks it per weight form), unrolled for a path with a bridge
    self.layout = layout or ("unrolled" if bridged else model.layout)
    self.parts = model.program_parts(self.layout)
    self._lock = threading.RLock()  # engine state: insert, step, free
    self.cancel_lock = threading.Lock()  # a run's slot freed (and its free callbacks taken) under it
    self._runs: list[SlotRun | None] = [None] * self.slots
    self._cancelled: set[int] = set()
    self.chunks = 0  # decode chunks run
    self.rows_computed = 0  # rows those chunks computed (each: the slots in use, padded to a power of two)
    self.steps = 0  # decode steps run (the cursor)
    self.taken_back = 0  # constrained slots' tokens refused by their matcher after a chunk, and those after them
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
    self._samp: tuple | None = None  # (mode, SamplingArrays) on the device, rebuilt after an insert
    self.program = self._program(self.chunk)
    # Constrained slots: their grammar matchers, and the allowed-token masks of every slot (for a chunk's first
    # step; later steps are checked against the matchers after the chunk).
    self._matchers: list[Matcher | None] = [None] * N
    self._words: np.ndarray | None = None
    self._ahead = [0] * N  # per constrained slot: free tokens it tries per chunk (:meth:`_next_ahead`)
    self._state = self.program.init_state()
    # Prompt keys by token prefix (None: off). A path whose blocks keep no keys (bridges only) has none to reuse.
    keyed = [i for i in self.layers if i >= 0]
    self.prefix_cache = prefix_cache if keyed else None
    self.prefiller = SlotPrefill(model, self.program, self.parts, stop_width, self.prefix_cache)

  def _program(self, chunk: int) -> SlotProgram:
    """The engine's slot program with ``chunk`` decode steps per call."""
    return slot_program(
      self.defs, self.cfg, self.layers, self.slots, self.cache_len, chunk, self.kernels, self.prefill_chunk, self.layout
    )

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

  def request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, scope: str = "") -> SlotRequest:
    """Check a request against the engine's limits (:class:`SlotRequestError` names the limit and the fix) and the
    model's (:meth:`Model.request <thoughtjax.model.Model.request>`), and make its trace and row bookkeeping; no
    device work. ``scope``: its prefix-cache scope (blocks are reused within a scope only). Any thread."""
    params = params or SamplingParams()
    ids = [int(t) for t in prompt_ids]
    self._check_limits(ids, params)
    return self._request_of(self.model.request([ids], params), ids, params, scope)

  def checked(self, request: ModelRequest, scope: str = "") -> SlotRequest:
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

  def _request_of(self, request: ModelRequest, ids: list[int], params: SamplingParams, scope: str) -> SlotRequest:
    # The trace names the program the request would run alone in, from its token ids (as the engine takes it).
    key = self.model.program_key(dataclasses.replace(request, template=None, user=None))
    trace = Trace(key, [ids], time.perf_counter(), tokens_out=[0])
    c = params.constraint
    matcher = None if c is None else self._grammars.matcher(c)
    stops = stop_ids_for(params, self.model.codec.eos_ids)
    return SlotRequest(ids, params, trace, Rows(self.model.codec, [params], [stops]), matcher, scope)

  @property
  def _grammars(self):
    return self.prefiller.grammars

  @property
  def prefill_calls(self) -> int:
    """Prefills run (each of one or more chunks)."""
    return self.prefiller.calls

  @property
  def prefill_chunks(self) -> int:
    """Prefill chunks (program calls) run."""
    return self.prefiller.chunks

  @property
  def prefill_chunk_rows(self) -> int:
    """Rows those chunks computed: each chunk the prompts that reach into it, padded to a power of two."""
    return self.prefiller.chunk_rows

  @property
  def prefill_rows(self) -> int:
    """Requests those calls prefilled."""
    return self.prefiller.rows

  def prefill_group(self, prompt_ids: Sequence[int], scope: str = "") -> tuple:
    """The prefill program a prompt would go through now (:meth:`SlotPrefill.group
    <thoughtjax.serving.slot_prefill.SlotPrefill.group>`); requests of one group share a prefill call."""
    return self.prefiller.group(prompt_ids, scope)

  def prefill(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Prefilled:
    """Run one request's prefill; takes no slot. Any thread."""
    return self.prefill_batch([(prompt_ids, params)])[0]

  def prefill_batch(self, requests: Sequence[tuple[Sequence[int], SamplingParams | None]]) -> list[Prefilled]:
    """Prefill requests together, longest prompt first (each chunk computes the rows its prompts reach); takes no
    slot. Any thread."""
    return self.prefiller.run([self.request(ids, params) for ids, params in requests])

  def prefill_runs(self, runs: Sequence[SlotRun]) -> list[Prefilled]:
    """Prefill runs made before their prefill (a driver's queue: :meth:`SlotDriver.submit`) as :meth:`prefill_batch`
    does requests, each with the run's own trace, rows and grammar state; takes no slot."""
    return self.prefiller.run([SlotRequest(r.ids, r.params, r.trace, r.rows, r.matcher, r.scope) for r in runs])

  def prefill_job(self, runs: Sequence[SlotRun]) -> PrefillJob:
    """:meth:`prefill_runs`, to run one prefill chunk at a time (:class:`~thoughtjax.serving.slot_prefill.PrefillJob`),
    so a driver steps the slots in use between chunks. :class:`ConstraintsRefused` here, before any device work,
    when a constraint cannot give its first mask."""
    return self.prefiller.begin([SlotRequest(r.ids, r.params, r.trace, r.rows, r.matcher, r.scope) for r in runs])

  def warm(self, modes: Sequence[SamplingMode] = (SamplingMode.GREEDY,)) -> None:
    """Compile everything a request of any length the engine holds runs, so requests compile nothing: in each
    sampling mode (a logit bias or none runs the same programs), the prefill chunk of every number of rows it
    computes (1, 2, 4, ... up to the slots) and the insert of a row's keys; the decode chunk at every width a chunk computes (1, 2, 4, ... and all the
    slots), run with no slot active. With a prefix cache, also the cut of a prompt's blocks into the cache and
    their writing back before a prefill that reuses them."""
    for mode in modes:
      self.prefiller.warm(mode, self._warm_insert)
      self._warm_chunks(mode)
    jax.block_until_ready(self._state)

  def _warm_chunks(self, mode: SamplingMode) -> None:
    """Compile the decode chunk at every width it computes (:meth:`SlotProgram.warm_decode
    <thoughtjax.serving.slot_program.SlotProgram.warm_decode>`); the state stays as it was."""
    with self._lock:
      self._state = self.program.warm_decode(self.parts, self._slot_arrays(), self._state, mode)

  def _warm_insert(self, kv, token) -> None:
    """Insert warm-up keys into a free slot (its row is ignored by the chunk and rewritten by the next insert)."""
    with self._lock:
      if self.free:
        b = self._runs.index(None)
        self._state = self.program.insert(self._state, kv, b, 0, 1, token, True, 1)

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
      for (i, _), p in zip(group, self.prefiller.run([r for _, r in group]), strict=True):
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
      run.push(d)
    if pre.rows.all_finished:
      run.chunks_at_free = self.chunks
      run.end()

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
      self._modes[b] = p.mode
      self._matchers[b] = pre.matcher
      self._ahead[b] = 1
      self._samp = None
      self._state = self.program.insert(self._state, pre.kv, b, pre.row, len(pre.ids), pre.token, pre.done, pre.count)
      run.placed(b, self.prefill_chunks)
      self._runs[b] = run
      with self.cancel_lock:  # a cancel that came while this waited for the chunk: freed at the next step
        if run.cancel_requested:
          self._cancelled.add(b)

  def cancel(self, run: SlotRun) -> None:
    """End ``run``: its slot is freed at the end of the chunk now running (at once when none runs) with a
    last delta of finish_reason ``cancelled``. Any thread; a finished run is left alone."""
    with self.cancel_lock:
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
    run.end(error)

  def _free_cancelled(self) -> None:
    with self.cancel_lock:
      cancelled, self._cancelled = self._cancelled, set()
    for b in sorted(cancelled):
      run = self._runs[b]
      if run is None:
        continue
      run.trace.cancelled = True
      for d in run.rows.cancel():
        run.push(d)
      self._free(b)

  def _sampling(self) -> tuple[SamplingMode, SamplingArrays]:
    if self._samp is None:
      live = [b for b, r in enumerate(self._runs) if r is not None]
      self._samp = (_widest({self._modes[b] for b in live}), self._slot_arrays())
    return self._samp

  def _slot_arrays(self) -> SamplingArrays:
    """Every slot's sampling settings on the device, logit biases included (zeros where a slot has none: one
    program serves requests with and without one)."""
    h = self._host
    return SamplingArrays(
      *(jnp.asarray(h[k]) for k in ("temperature", "top_k", "top_p", "seed", "max_new", "stop_ids")),
      jnp.asarray(self._bias),
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
      limit = self.chunk
      if constrained:
        samp, refused = self._masks(samp, constrained)
        if refused:  # those slots ended with their constraint's error; the others step
          live = [b for b in live if b not in refused]
          constrained = [b for b in constrained if b not in refused]
          if not live:
            return {}
        limit = 1 + min((self._ahead[b] for b in constrained), default=self.chunk)
      t0 = time.perf_counter()
      self._state, out, steps, W = program.decode(self.parts, samp, self._state, live, mode, limit)
      out, done, count, steps = jax.device_get((out, self._state.done, self._state.count, steps))
      out, done, count, refused = np.array(out), np.array(done), np.array(count), {}
      for b in constrained:  # out holds -1 where a slot sampled nothing (it had stopped)
        got = [int(t) for t in out[b] if t >= 0]
        try:
          kept = self._checked(b, got)
        except ConstraintError as e:
          refused[b] = e
          continue
        self._ahead[b] = self._next_ahead(b, kept, len(got))
        if kept < len(got):  # take back the tokens from the first one its constraint refused
          count[b], done[b] = count[b] - (len(got) - kept), False
          self.taken_back += len(got) - kept
          self._state = program.take_back(self._state, b, int(count[b]), got[kept - 1], int(steps) - kept)
          out[b, kept:] = -1
      self.chunk_seconds.append(time.perf_counter() - t0)
      self._step_ms.append((W, self.chunk_seconds[-1] * 1e3 / max(int(steps), 1)))
      self.chunks += 1
      self.rows_computed += W
      self.steps += int(steps)
      new: dict[int, list[int]] = {}
      for b in live:
        run = self._runs[b]
        run.stepped(int(steps), W, self.prefill_chunks)
        if b in refused:
          self._free(b, refused[b])
          continue
        ids = [int(t) for t in out[b] if t >= 0]
        new[b] = ids
        d = run.rows.emit(0, ids, bool(done[b]), int(count[b]))
        if d is not None:
          run.push(d)
        if run.rows.all_finished:
          self._free(b)
      self._free_cancelled()
      return new

  def recent_step(self) -> tuple[int, float] | None:
    """(width, median wall ms per decode step) of the latest chunks at the width of the last one, or None before
    any chunk: what one step costs now, beside whatever else runs on the machine."""
    got = list(self._step_ms)
    if not got:
      return None
    w = got[-1][0]
    return w, float(np.median([ms for width, ms in got if width == w]))

  def _checked(self, b: int, tokens: list[int]) -> int:
    """How many of constrained slot ``b``'s chunk ``tokens`` it keeps, each consumed by its matcher: the first
    (sampled under its mask; a refusal raises :class:`~thoughtjax.constraint.ConstraintError`), then the later
    ones up to the first the matcher refuses, when a free draw the grammar allows is a masked draw (greedy, or a
    temperature without top-k or top-p; see the module docstring)."""
    if not tokens:
      return 0
    matcher = self._matchers[b]
    matcher.consume(tokens[0])
    if not self._free_draws_count(b):
      return 1
    for i, t in enumerate(tokens[1:], 1):
      try:
        matcher.consume(t)
      except ConstraintError:
        return i
    return len(tokens)

  def _free_draws_count(self, b: int) -> bool:
    """A free draw that constrained slot ``b``'s grammar allows is a draw under its mask: greedy, or a temperature
    without top-k or top-p (with those, the mask changes which tokens they keep)."""
    h = self._host
    return not (h["temperature"][b] > 0 and (h["top_k"][b] > 0 or h["top_p"][b] < 1))

  def _next_ahead(self, b: int, kept: int, got: int) -> int:
    """How many free tokens constrained slot ``b`` tries in the next chunk, which runs one step more than the
    fewest any constrained slot tries: after a chunk whose tokens it kept all, twice as many (at most the chunk's
    length less one); after one where its matcher refused a token, the free tokens it kept before it; none for a
    slot that keeps only its masked token. So the engine runs whole chunks while the constrained slots' free
    choices stay in their languages, and one step per call, as every slot did beside a constrained one before,
    where they leave them."""
    if not self._free_draws_count(b):
      return 0
    if kept < got:
      return max(kept - 1, 0)
    return min(max(2 * self._ahead[b], 1), self.chunk - 1)

  def _masks(self, samp: SamplingArrays, constrained: list[int]) -> tuple[SamplingArrays, set[int]]:
    """The sampling arrays carrying every slot's allowed-token mask for the next step (unconstrained slots allow
    everything), and the slots whose matcher refused to give one (past llguidance's limits): each of those runs
    ends with its :class:`~thoughtjax.constraint.ConstraintError` here, and its slot is free."""
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
    return samp._replace(allowed=jax.device_put(self._words)), refused

  def fail(self, error: BaseException) -> None:
    """End every run in a slot with ``error`` (a device failure): their iterators raise it."""
    with self._lock:
      for b, run in enumerate(self._runs):
        if run is not None:
          self._runs[b] = None
          run.chunks_at_free = self.chunks
          run.end(error)


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

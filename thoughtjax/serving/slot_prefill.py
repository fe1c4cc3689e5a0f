"""The prefill side of a slot engine: requests waiting together prefilled in one program call, before any slot.

:class:`SlotPrefill` holds what a prefill reads (the engine's slot program and path parts, its stop-set width, its
prefix cache) and counts its calls; it touches no slot and no engine state, so any thread may run it. The slot
engine (:class:`~thoughtjax.serving.slots.SlotEngine`) inserts what it returns (:class:`~thoughtjax.serving.slot_run.
Prefilled`) into its slots. How a prefill is computed (left padding, the prefix cache's reuse, exactness) is in
:mod:`thoughtjax.serving.slots`."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from thoughtjax.constraint import ConstraintError
from thoughtjax.decode.interface import COMPILE_CLOCK
from thoughtjax.decode.masks import ALL, grammars_for
from thoughtjax.sampling import SamplingMode, SamplingParams, program_mode, sampling_arrays
from thoughtjax.serving.errors import ConstraintsRefused
from thoughtjax.serving.prefix import PrefixCache
from thoughtjax.serving.slot_program import ChunkedPrefill, SlotProgram
from thoughtjax.serving.slot_run import Prefilled, SlotRequest


class SlotPrefill:
  """Prefill program calls of one slot engine (see the module docstring). ``calls`` and ``rows``: the calls run and
  the requests they prefilled; ``chunks`` and ``chunk_rows``: their chunks and the rows those computed.
  Thread-safe."""

  def __init__(self, model, program: SlotProgram, parts, stop_width: int, prefix_cache: PrefixCache | None):
    self.model, self.cfg, self.program, self.parts = model, model.config, program, parts
    self.stop_width, self.prefix_cache = stop_width, prefix_cache
    self.keyed = sum(i >= 0 for i in model.layers)  # path blocks with keys: a prefix-cache block's first axis
    self.calls = 0
    self.rows = 0
    self.chunks = 0
    self.chunk_rows = 0  # rows those chunks computed (the prompts each reached, padded to a power of two)
    self._lock = threading.Lock()
    # Prefill caches a finished prefill handed back, for the next to compute into: allocating and zeroing the
    # caches of every slot over the ring took most of a one-chunk prefill (230 of 400 ms, 16 slots x 512).
    self._spare = None

  @property
  def grammars(self):
    return grammars_for(self.model.codec, self.cfg.vocab_size)

  def group(self, prompt_ids: Sequence[int], scope: str = "") -> tuple:
    """The prefill call a prompt would go through now: ("from", tokens of it the prefix cache gives, 0 on a miss).
    Requests of one group share a prefill call (:class:`~thoughtjax.serving.driver.SlotDriver`,
    :meth:`SlotEngine.insert_batch <thoughtjax.serving.slots.SlotEngine.insert_batch>`), whatever their lengths; a
    peek, nothing is counted."""
    return ("from", self._reuse(prompt_ids, scope))

  def _reuse(self, ids: Sequence[int], scope: str) -> int:
    """The prompt tokens a prefix-cache hit reuses (whole blocks): at most all but the last (the first token comes
    from a forward over it), and none when the prefix cached now would not save a prefill chunk (the call would
    cost the same, split from the batch's other prefills)."""
    if self.prefix_cache is None:
      return 0
    n, C = len(ids), self.program.prefill_tokens
    have = self.prefix_cache.peek(ids, n - 1, scope)
    return have if have and -(-(n - have) // C) < -(-n // C) else 0

  def run(self, reqs: Sequence[SlotRequest]) -> list[Prefilled]:
    """The prefill of ``reqs`` run to its end (:meth:`begin`): each request's :class:`Prefilled`, in order."""
    job = self.begin(reqs)
    while not job.advance():
      pass
    return job.result

  def begin(self, reqs: Sequence[SlotRequest]) -> PrefillJob:
    """The prefill of ``reqs``, to run one chunk at a time (:class:`PrefillJob`): one chunked prefill for those whose
    prompts start with cached prefixes of one length (only the rest is computed), one for the others; at its end
    each prompt's new full blocks go into the prefix cache. Every constraint gives its first mask here, before any
    device work: :class:`ConstraintsRefused` names those that cannot, with nothing of any request changed."""
    constrained = any(r.matcher is not None for r in reqs)
    refused, scratch = [], np.empty(self.grammars.words, np.uint32) if constrained else None
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
      return PrefillJob(self, reqs, [(list(range(len(reqs))), 0, ())])
    chains = [cache.lookup(r.ids, self._reuse(r.ids, r.scope), r.scope) for r in reqs]
    groups = []
    for have in sorted({len(c) * cache.block_tokens for c in chains}):
      part = [i for i, c in enumerate(chains) if len(c) * cache.block_tokens == have]
      for i in part:
        reqs[i].trace.prefix_cache_tokens = have
      groups.append((part, have, [chains[i] for i in part] if have else ()))
    return PrefillJob(self, reqs, groups)

  def keep_prefixes(self, pres: Sequence[Prefilled]) -> None:
    """Put each prompt's full blocks not cached yet into the prefix cache."""
    cache, B = self.prefix_cache, self.prefix_cache.block_tokens
    for pre in pres:
      first, full = cache.first_missing(pre.ids, pre.scope), len(pre.ids) // B
      if first < full:
        cache.add(
          pre.ids,
          first,
          [self.program.prefix_block(pre.kv, pre.row, j, B, self.keyed) for j in range(first, full)],
          pre.scope,
        )

  def count_chunk(self, rows: int) -> None:
    with self._lock:
      self.chunks += 1
      self.chunk_rows += rows

  def open(self, reqs: Sequence[SlotRequest], start: int, chains: Sequence[list]) -> tuple[ChunkedPrefill, list[int]]:
    """The chunked prefill (:class:`~thoughtjax.serving.slot_program.ChunkedPrefill`) of ``reqs`` (longest prompt
    first), padded to the engine's slots with empty rows: whole prompts (``start`` 0), or each prompt from ``start``
    on, its first ``start`` tokens' keys given by its cached blocks (``chains[p]``); and the rows whose constraint
    masked their first token."""
    n, P = len(reqs), self.program.slots
    prompts = [r.ids for r in reqs] + [[]] * (P - n)  # padding rows: empty, never computed
    params = [r.params for r in reqs]
    # Logit biases always (zeros where a request has none): one program serves requests with and without.
    samp = sampling_arrays(params, P, self.cfg.vocab_size, self.stop_width, self.model.codec.eos_ids, True)
    masked = [p for p, r in enumerate(reqs) if r.matcher is not None]
    if masked:
      words = np.full((P, self.grammars.words), ALL, np.uint32)
      for p in masked:
        reqs[p].matcher.fill(words[p])
      samp = samp._replace(allowed=jax.device_put(words))
    mode = program_mode(params)
    with self._lock:
      scratch, self._spare = self._spare, None
    job = ChunkedPrefill(self.program, self.parts, prompts, samp, mode, start=start, prefix=chains, scratch=scratch)
    return job, masked

  def give_back(self, scratch) -> None:
    """Keep the prefill caches of a prefill whose rows' keys were all copied out, for the next :meth:`open`."""
    with self._lock:
      self._spare = scratch

  def finish(
    self,
    reqs: Sequence[SlotRequest],
    job: ChunkedPrefill,
    rows: Sequence[int],
    masked: list[int],
    started: float,
    compile_s: float,
  ) -> list[Prefilled]:
    """The :class:`Prefilled` of each of ``rows`` of ``job`` (of :meth:`open` on ``reqs``), whose prompts ended in
    its last chunk: its first token, whether it stopped, and its keys copied out of the job's caches (which go on
    to the next chunk); a constrained request's matcher takes its first token."""
    kv, token, done = job.result
    token, done = jax.device_get((token, done))
    first = time.perf_counter()
    out = []
    for p in rows:
      r = reqs[p]
      if p in masked:
        r.matcher.consume(int(token[p]))
      r.trace.device_start, r.trace.first_token, r.trace.compile_s = started, first, compile_s
      out.append(
        Prefilled(
          r.ids,
          r.params,
          self.program.row_keys(kv, p),
          np.asarray(token[p : p + 1]),
          bool(done[p]),
          1,
          r.trace,
          r.rows,
          row=0,
          batch=len(reqs),
          matcher=r.matcher,
          scope=r.scope,
        )
      )
    return out

  def count_call(self, rows: int) -> None:
    with self._lock:
      self.calls += 1
      self.rows += rows

  def warm(self, mode: SamplingMode, insert: Callable[..., None]) -> None:
    """Compile the prefill chunk of every number of rows it computes (1, 2, 4, ... and all the slots; prompts of
    any lengths, with a logit bias or none: one chunk program serves them) in ``mode``, the copy of a row's keys
    out of it; with a prefix cache, also the cut of a prompt's blocks into it and the writing of cached blocks
    before a prefill. ``insert(kv, token)`` gets a row's keys (the engine compiles their insert)."""
    P = self.program.slots
    params = SamplingParams()  # the mode, not the settings, shapes the program
    samp = sampling_arrays([params] * P, P, self.cfg.vocab_size, self.stop_width, self.model.codec.eos_ids, True)
    R = 1
    while True:
      R = min(R, P)
      kv, token, _ = self.program.prefill_prompts(self.parts, [[0]] * R + [[]] * (P - R), samp, mode)
      if R == P:
        break
      R *= 2
    row = self.program.row_keys(kv, 0)
    if self.prefix_cache is not None and self.prefix_cache.block_tokens < self.program.cache_len:
      # A new prompt's blocks are cut from its prefill's keys into the cache, and written back before a prefill
      # that reuses them.
      B = self.prefix_cache.block_tokens
      block = self.program.prefix_block(row, 0, 0, B, self.keyed)
      self.program.prefill_prompts(self.parts, [[0] * (B + 1)] * P, samp, mode, start=B, prefix=[[block]] * P)
    insert(row, token[:1])


class PrefillJob:
  """A slot engine's prefill of requests waiting together (:meth:`SlotPrefill.begin`), one chunk per
  :meth:`advance`: its groups (requests that reuse the same number of cached tokens) one after another, each group's
  requests longest prompt first. A request is ready (:meth:`take_ready`) after the chunk in which its prompt ended,
  so a short prompt does not wait for the long ones it was prefilled with. Once :meth:`advance` returned True,
  :attr:`result` holds each request's :class:`Prefilled`, in order."""

  def __init__(
    self, prefiller: SlotPrefill, reqs: Sequence[SlotRequest], groups: list[tuple[list[int], int, Sequence]]
  ):
    self._prefiller, self._reqs, self._groups = prefiller, list(reqs), collections.deque(groups)
    self._out: list[Prefilled | None] = [None] * len(reqs)
    self._ready: list[int] = []
    self._open: tuple | None = None  # (indices, ChunkedPrefill, masked rows, started, compile seconds)
    self.result: list[Prefilled] | None = None

  def advance(self) -> bool:
    """Run the next chunk; True when the prefill ended."""
    if self._open is None:
      part, start, chains = self._groups[0]
      order = sorted(range(len(part)), key=lambda k: -len(self._reqs[part[k]].ids))  # longest first
      part, chains = [part[k] for k in order], [chains[k] for k in order] if chains else chains
      job, masked = self._prefiller.open([self._reqs[i] for i in part], start, chains)
      self._open = (part, job, masked, time.perf_counter(), 0.0)
    part, job, masked, started, compile_s = self._open
    got: list[Prefilled] = []
    with COMPILE_CLOCK.measure() as compiled:
      job.advance()
      self._prefiller.count_chunk(job.computed)
      if job.ended:
        reqs = [self._reqs[i] for i in part]
        got = self._prefiller.finish(reqs, job, job.ended, masked, started, compile_s + compiled.seconds)
    for p, pre in zip(job.ended, got, strict=True):
      self._out[part[p]] = pre
      self._ready.append(part[p])
    if not job.done:
      self._open = (part, job, masked, started, compile_s + compiled.seconds)
      return False
    self._prefiller.give_back(job.result[0])  # every row's keys were copied out when its prompt ended
    self._prefiller.count_call(len(part))
    self._groups.popleft()
    self._open = None
    if self._groups:
      return False
    if self._prefiller.prefix_cache is not None:
      self._prefiller.keep_prefixes(self._out)
    self.result = self._out
    return True

  def take_ready(self) -> list[tuple[int, Prefilled]]:
    """(index in the requests, its :class:`Prefilled`) of each request that became ready since the last call."""
    ready, self._ready = self._ready, []
    return [(i, self._out[i]) for i in ready]

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
from thoughtjax.decode.program import bucket
from thoughtjax.sampling import SamplingMode, SamplingParams, program_mode, sampling_arrays
from thoughtjax.serving.errors import ConstraintsRefused
from thoughtjax.serving.prefix import PrefixCache
from thoughtjax.serving.slot_program import ChunkedPrefill, SlotProgram
from thoughtjax.serving.slot_run import Prefilled, SlotRequest


class SlotPrefill:
  """Prefill program calls of one slot engine (see the module docstring). ``calls`` and ``rows``: the calls run and
  the requests they prefilled. Thread-safe."""

  def __init__(self, model, program: SlotProgram, parts, stop_width: int, prefix_cache: PrefixCache | None):
    self.model, self.cfg, self.program, self.parts = model, model.config, program, parts
    self.stop_width, self.prefix_cache = stop_width, prefix_cache
    self.calls = 0
    self.rows = 0
    self.chunks = 0
    self._lock = threading.Lock()

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
          pre.ids, first, [self.program.prefix_block(pre.kv, pre.row, j, B) for j in range(first, full)], pre.scope
        )

  def count_chunk(self) -> None:
    with self._lock:
      self.chunks += 1

  def open(self, reqs: Sequence[SlotRequest], start: int, chains: Sequence[list]) -> tuple[ChunkedPrefill, list[int]]:
    """The chunked prefill (:class:`~thoughtjax.serving.slot_program.ChunkedPrefill`) of ``reqs``, rows padded to a
    power of two: whole prompts (``start`` 0), or each prompt from ``start`` on, its first ``start`` tokens' keys
    given by its cached blocks (``chains[p]``); and the rows whose constraint masked their first token."""
    n = len(reqs)
    P = bucket(n, 1)
    prompts = [r.ids for r in reqs] + [[0]] * (P - n)  # padding rows: one token, inert
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
    return ChunkedPrefill(self.program, self.parts, prompts, samp, mode, start=start, prefix=chains), masked

  def close(
    self, reqs: Sequence[SlotRequest], job: ChunkedPrefill, masked: list[int], started: float, compile_s: float
  ) -> list[Prefilled]:
    """Each request's :class:`Prefilled` once ``job`` (of :meth:`open`) is done; a constrained request's matcher
    takes its first token."""
    kv, token, done = job.result
    done = jax.device_get(done)
    if masked:
      first_tokens = jax.device_get(token)
      for p in masked:
        reqs[p].matcher.consume(int(first_tokens[p]))
    first = time.perf_counter()
    with self._lock:
      self.calls += 1
      self.rows += len(reqs)
    out = []
    for p, r in enumerate(reqs):
      r.trace.device_start, r.trace.first_token, r.trace.compile_s = started, first, compile_s
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
          batch=len(reqs),
          matcher=r.matcher,
          scope=r.scope,
        )
      )
    return out

  def warm(self, P: int, mode: SamplingMode, insert: Callable[..., None]) -> None:
    """Compile the prefill of ``P`` prompts (any lengths, with a logit bias or none: one chunk program serves them)
    in ``mode``; with a prefix cache, also the cut of a prompt's blocks into it and the writing of cached
    blocks before a prefill. ``insert(kv, token)`` gets the call's keys (the engine compiles their insert)."""
    params = SamplingParams()  # the mode, not the settings, shapes the program
    samp = sampling_arrays([params] * P, P, self.cfg.vocab_size, self.stop_width, self.model.codec.eos_ids, True)
    kv, token, _ = self.program.prefill_prompts(self.parts, [[0]] * P, samp, mode)
    if self.prefix_cache is not None and self.prefix_cache.block_tokens < self.program.cache_len:
      # A new prompt's blocks are cut from its prefill's keys into the cache, and written back before a prefill
      # that reuses them.
      B = self.prefix_cache.block_tokens
      block = self.program.prefix_block(kv, 0, 0, B)
      self.program.prefill_prompts(self.parts, [[0] * (B + 1)] * P, samp, mode, start=B, prefix=[[block]] * P)
    insert(kv, token)


class PrefillJob:
  """A slot engine's prefill of requests waiting together (:meth:`SlotPrefill.begin`), one chunk per
  :meth:`advance`: its groups (requests that reuse the same number of cached tokens) one after another. Once
  :meth:`advance` returned True, :attr:`result` holds each request's :class:`Prefilled`, in order."""

  def __init__(
    self, prefiller: SlotPrefill, reqs: Sequence[SlotRequest], groups: list[tuple[list[int], int, Sequence]]
  ):
    self._prefiller, self._reqs, self._groups = prefiller, list(reqs), collections.deque(groups)
    self._out: list[Prefilled | None] = [None] * len(reqs)
    self._open: tuple | None = None  # (indices, ChunkedPrefill, masked rows, started, compile seconds)
    self.result: list[Prefilled] | None = None

  def advance(self) -> bool:
    """Run the next chunk; True when the prefill ended."""
    if self._open is None:
      part, start, chains = self._groups[0]
      job, masked = self._prefiller.open([self._reqs[i] for i in part], start, chains)
      self._open = (part, job, masked, time.perf_counter(), 0.0)
    part, job, masked, started, compile_s = self._open
    with COMPILE_CLOCK.measure() as compiled:
      job.advance()
      self._prefiller.count_chunk()
      if job.done:
        got = self._prefiller.close([self._reqs[i] for i in part], job, masked, started, compile_s + compiled.seconds)
    if not job.done:
      self._open = (part, job, masked, started, compile_s + compiled.seconds)
      return False
    for i, pre in zip(part, got, strict=True):
      self._out[i] = pre
    self._groups.popleft()
    self._open = None
    if self._groups:
      return False
    if self._prefiller.prefix_cache is not None:
      self._prefiller.keep_prefixes(self._out)
    self.result = self._out
    return True

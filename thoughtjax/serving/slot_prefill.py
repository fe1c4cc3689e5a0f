"""The prefill side of a slot engine: requests waiting together prefilled in one program call, before any slot.

:class:`SlotPrefill` holds what a prefill reads (the engine's slot program and path parts, its stop-set width, its
prefix cache) and counts its calls; it touches no slot and no engine state, so any thread may run it. The slot
engine (:class:`~thoughtjax.serving.slots.SlotEngine`) inserts what it returns (:class:`~thoughtjax.serving.slot_run.
Prefilled`) into its slots. How a prefill is computed (left padding, the prefix cache's reuse, exactness) is in
:mod:`thoughtjax.serving.slots`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.constraint import ConstraintError
from thoughtjax.decode.interface import COMPILE_CLOCK
from thoughtjax.decode.masks import ALL, grammars_for
from thoughtjax.decode.program import bucket
from thoughtjax.sampling import SamplingMode, SamplingParams, program_mode, sampling_arrays
from thoughtjax.serving.errors import ConstraintsRefused
from thoughtjax.serving.prefix import PrefixCache
from thoughtjax.serving.slot_program import SlotProgram
from thoughtjax.serving.slot_run import Prefilled, SlotRequest


class SlotPrefill:
  """Prefill program calls of one slot engine (see the module docstring). ``calls`` and ``rows``: the calls run and
  the requests they prefilled. Thread-safe."""

  def __init__(self, model, program: SlotProgram, parts, stop_width: int, prefix_cache: PrefixCache | None):
    self.model, self.cfg, self.program, self.parts = model, model.config, program, parts
    self.layers, self.stop_width, self.prefix_cache = tuple(model.layers), stop_width, prefix_cache
    self.calls = 0
    self.rows = 0
    self._lock = threading.Lock()
    self._zero_block: jax.Array | None = None  # a prefix row's padding block

  @property
  def grammars(self):
    return grammars_for(self.model.codec, self.cfg.vocab_size)

  def group(self, prompt_ids: Sequence[int], scope: str = "") -> tuple:
    """The prefill program a prompt would go through now: ("whole", prompt bucket), or ("rest", bucket of the
    tokens after its cached prefix) when the prefix cache holds some of it. Requests of one group share a prefill
    call (:class:`~thoughtjax.serving.driver.SlotDriver`, :meth:`SlotEngine.insert_batch <thoughtjax.serving.slots.SlotEngine.insert_batch>`); a peek, nothing is counted."""
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

  def run(self, reqs: Sequence[SlotRequest]) -> list[Prefilled]:
    """The prefill of ``reqs``: one program call for those whose prompt starts with a cached prefix (only the
    rest is computed), one for the others; then each prompt's new full blocks go into the prefix cache. Every
    constraint gives its first mask before any call: :class:`ConstraintsRefused` names those that cannot, with
    nothing of any request changed."""
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
      return self._call(reqs, None)
    chains = [cache.lookup(r.ids, self._reuse_limit(r.ids, r.scope), r.scope) for r in reqs]
    for r, chain in zip(reqs, chains, strict=True):
      r.trace.prefix_cache_tokens = len(chain) * cache.block_tokens
    out: list[Prefilled | None] = [None] * len(reqs)
    for part in ([i for i, c in enumerate(chains) if c], [i for i, c in enumerate(chains) if not c]):
      if part:
        got = self._call([reqs[i] for i in part], [chains[i] for i in part] if chains[part[0]] else None)
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
      arrays = [block_at(cut[key], jnp.int32(pre.row), jnp.int32(j)) for j in range(first, full)]
      cache.add(pre.ids, first, arrays, pre.scope)

  def _call(self, reqs: Sequence[SlotRequest], chains: Sequence[list] | None) -> list[Prefilled]:
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
      words = np.full((P, self.grammars.words), ALL, np.uint32)
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
          self.prefix_rows(chains, P),
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
    with self._lock:
      self.calls += 1
      self.rows += n
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

  def prefix_rows(self, chains: Sequence[list], P: int) -> tuple:
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

  def repeat_hit(self, prompt_len: int) -> tuple[int, int] | None:
    """(tokens reused, rest's bucket) of a prompt of ``prompt_len`` tokens whose prefix is cached, or None when
    the engine keeps no prefix cache or such a hit is not taken (:meth:`_reuse_limit`)."""
    if self.prefix_cache is None or prompt_len < 2:
      return None
    have = (prompt_len - 1) // self.prefix_cache.block_tokens * self.prefix_cache.block_tokens
    if not have or bucket(prompt_len - have) >= bucket(prompt_len):
      return None
    return have, bucket(prompt_len - have)

  def warm(self, prompt_len: int, P: int, mode: SamplingMode, bias: bool, insert: Callable[..., None]) -> None:
    """Compile the prefill of ``P`` prompts of ``prompt_len`` tokens (its bucket) in ``mode``, with or without a
    logit bias; with a prefix cache, also the cut of their blocks into it and the prefill after the prefix such a
    prompt reuses when it comes again (:meth:`repeat_hit`). ``insert(kv, token)`` gets each call's keys (the
    engine compiles their insert)."""
    T = bucket(prompt_len)
    params = SamplingParams()  # the mode and the bias's presence, not the settings, shape the program
    samp = sampling_arrays([params] * P, P, self.cfg.vocab_size, self.stop_width, self.model.codec.eos_ids, bias)
    # From host arrays, as requests come: the transfer of each shape is compiled too.
    tokens, pad = jnp.asarray(np.zeros((P, T), np.int32)), jnp.asarray(np.full((P,), T - 1, np.int32))
    kv, token, _ = self.program.prefill_rows(self.parts, tokens, pad, samp, mode)
    insert(kv, token)
    if self.prefix_cache is None:
      return
    # A new prompt's blocks are cut from its prefill's keys into the cache.
    block = block_at(self.program.blocks(kv, pad, self.prefix_cache.block_tokens), jnp.int32(0), jnp.int32(0))
    hit = self.repeat_hit(prompt_len)
    if hit is None:
      return
    have, Ts = hit
    # Cached blocks as the cache holds them: outputs of block_at, placed on the device, which a program call takes
    # as a committed argument (a fresh array is not, and would compile a program of its own).
    blocks = [block] * (have // self.prefix_cache.block_tokens)
    kv, token, _ = self.program.prefill_after(
      self.parts,
      self.prefix_rows([blocks] * P, P),
      jnp.asarray(np.zeros((P, Ts), np.int32)),
      jnp.asarray(np.full((P,), Ts - (prompt_len - have), np.int32)),
      jnp.asarray(np.full((P,), have, np.int32)),
      samp,
      mode,
    )
    insert(kv, token)


@jax.jit
def block_at(blocks: jax.Array, row: jax.Array, j: jax.Array) -> jax.Array:
  """Block ``j`` of row ``row`` of a :meth:`SlotProgram._blocks_impl` cut, as its own array (one program per cut
  shape, whatever the indices)."""
  return jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(blocks, row, 0, False), j, 0, False)

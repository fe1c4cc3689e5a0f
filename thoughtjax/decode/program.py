"""Programs: a layer path compiled into one XLA program; the jit boundary of generation and scoring.

Model code never calls ``jax.jit``. Plain generation (:class:`Program`, and its layer-indexed form in
:mod:`thoughtjax.decode.indexed`) and scoring (:data:`score_logits`) are compiled here; the other programs
that serve requests are the slot programs of continuous batching (:mod:`thoughtjax.serving.slots`) and the
self-speculative programs (:mod:`thoughtjax.decode.speculative`), and :mod:`thoughtjax.exported` wraps what it
loads. Elsewhere ``jax.jit`` compiles what no request runs: thoughtlet profiling (one thoughtlet alone),
calibration's quality measurements, the router's features and training, bridge training, and the
benchmarks.

A program serves one :class:`ProgramKey` (a :class:`~thoughtjax.decode.interface.DecodeKey`, which every program
family's key extends): path shape, batch bucket, prompt bucket, new-token bucket, stop-set width, sampling mode, bias
on/off, decode chunk, kernels, template widths, masked; and the graph definitions and model config it was built for.
It implements the decode program interface (:class:`~thoughtjax.decode.interface.DecodeProgram`: ``init_state``,
``prefill``, ``advance``, ``read``) with one compiled executable, ``_advance(parts, prompt, pad, sampling,
state)``, which runs, inside XLA,

* on an empty state (no prompt in yet, :meth:`Program.prefill`): the prefill over the left-padded prompt
  [B, T] and the first sampled token, so the first token is out after one prefill;
* on later calls (:meth:`Program.advance`): up to ``chunk`` decode steps in a ``lax.while_loop`` over the KV
  cache, ending early when every row has stopped.

Plain generation is a pool of B rows filled by that one prefill and never refilled: its state is the
:class:`~thoughtjax.decode.state.DecodeState` a slot engine's pool keeps, and its decode chunk is the same traced
step (:func:`~thoughtjax.decode.state.decode_chunk`) over a ring of ``T + N`` slots that never wraps.

Tokens reach the host after every call (short fixed-size chunks), so a caller that stops
asking stops the device work at the next chunk. A variant that pushes each token out through
an ``io_callback`` from inside one long loop (:meth:`Program.run_with_callback`) exists for
comparison; its host sink returns whether to stop, so it too ends at the next step. JAX does
not write programs with host callbacks to the persistent compilation cache, so every new process
would recompile it; see BENCHMARKS.md for the measured trade-off.

Weights are arguments: a program is keyed by its path's shape (:func:`~thoughtjax.transformer.path_shape`, the
number of blocks and where bridges sit), not by which layers it holds, and runs on the path's parts
:meth:`~thoughtjax.transformer.PathParts.by_position`. Every 30-layer path shares one program, whichever layers
it repeats or skips.

Programs of every family (this module's, the server's slot programs, the speculative programs) live in
:data:`PROGRAMS` (each under its key's :meth:`DecodeKey.shape`), one thread-safe LRU with a size bound that
counts hits, misses and evictions; compiled executables also persist on disk through JAX's cache.

Layout: prompts are left-padded, so every row's next token goes to the same cache
slot; row b's RoPE positions are ``slot - pad[b]`` and slots before ``pad[b]`` are
masked out.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from thoughtjax import cachedir, exported, settings
from thoughtjax.decode import layout
from thoughtjax.decode import state as state_lib
from thoughtjax.decode.interface import DecodeInputs, DecodeKey, DecodeProgram, Tokens
from thoughtjax.decode.state import DecodeState
from thoughtjax.kernels.template_embed import template_embed
from thoughtjax.sampling import SamplingMode, sample

# GraphDefs, PathParts and merge_path live with the model; re-exported here for old imports.
from thoughtjax.transformer import (
  Block,
  Embed,
  GraphDefs,
  Head,
  PathParts,
  merge_path,
  path_config,
  run_path,
)

DEFAULT_CHUNK = 8


def compilation_cache_dir(directory: str | os.PathLike | None = None) -> Path:
  """The folder of JAX's persistent compilation cache: ``directory``, else the settings' ``compile_cache``, else
  ``<cache>/xla`` (made 0700, or refused with :class:`~thoughtjax.cachedir.UnsafeCacheError`)."""
  where = directory or settings.current().compile_cache
  return Path(cachedir.private_dir(where, "the XLA compilation cache") if where else cachedir.cache_subdir("xla"))


def configure_compilation_cache(directory: str | os.PathLike | None = None) -> str:
  """Turn on JAX's persistent compilation cache, small programs included.

  JAX loads the compiled programs it finds there and runs them unchecked, so the directory must be writable by
  this user alone: created 0700, else refused with :class:`~thoughtjax.cachedir.UnsafeCacheError`."""
  path = str(compilation_cache_dir(directory))
  jax.config.update("jax_compilation_cache_dir", path)
  # JAX skips programs that compile in under 1 s unless told otherwise.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path


def bucket(n: int, minimum: int = 16) -> int:
  """Smallest power of two >= max(n, minimum)."""
  size = minimum
  while size < n:
    size *= 2
  return size


@dataclasses.dataclass(frozen=True)
class ProgramKey(DecodeKey):
  """A plain generation program's key: path, batch, prompt and output buckets, stop-set width, sampling mode,
  bias, decode chunk, kernels, template widths, masks and layer layout."""

  batch: int  # B
  prompt_len: int  # T
  max_new: int  # N
  stop_width: int  # M
  mode: SamplingMode
  has_bias: bool
  chunk: int = DEFAULT_CHUNK
  kernels: str | None = None  # implementation of both kernels (sampler, template embed); None = per backend
  template: tuple[int, int] | None = None  # (P1, P2): prompts arrive as TemplatePrompt
  masked: bool = False  # sampling takes per-row allowed-token bitmasks (constrained decoding; chunk 1)
  layout: str = "unrolled"  # "indexed": one loop over stacked layer weights (thoughtjax.decode.indexed)

  @property
  def cache_len(self) -> int:  # S
    return self.prompt_len + self.max_new


class TemplatePrompt(NamedTuple):
  """A chat prompt as the template's fixed rows around each row's user tokens.

  The prefill embeds it with the fused template-embedding kernel, left-padded to T:
  row b holds prefix rows, ``user_ids[b, :user_lengths[b]]`` rows and suffix rows.
  """

  prefix_rows: jax.Array  # [P1, D]
  suffix_rows: jax.Array  # [P2, D]
  user_ids: jax.Array  # [B, T - P1 - P2] i32
  user_lengths: jax.Array  # [B] i32


def sequence_logits(defs: GraphDefs, layers: tuple[int, ...], parts: PathParts, tokens):
  """Causal logits [B, T, V] of a path over whole sequences ``tokens`` [B, T] (traced code: :data:`score_logits`
  is it compiled; a caller that differentiates through it, as bridge training does, traces it itself)."""
  embed, blocks, head = merge_path(defs, parts, layers)
  B, T = tokens.shape
  positions, mask = layout.causal(B, T)
  caches = list(layout.empty_caches(path_config(blocks), layers, B, T)) if blocks else []
  return run_path(embed, blocks, head, tokens, positions, caches, jnp.zeros((), jnp.int32), mask)[0]


# Scoring: causal forward over whole sequences [B, T] -> logits [B, T, V].
score_logits = jax.jit(sequence_logits, static_argnums=(0, 1))


def on_device_of(state, parts: PathParts | None):
  """``state`` committed to the one device ``parts`` live on (as it is when they span none or several)."""
  leaves = jax.tree.leaves(parts) if parts is not None else []
  devices = {d for leaf in leaves if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}
  return jax.device_put(state, next(iter(devices))) if len(devices) == 1 else state


class Program(DecodeProgram):
  """One compiled generation program; see the module docstring."""

  def __init__(self, key: ProgramKey, defs: GraphDefs, cfg):
    self.key, self.defs, self.cfg = key, defs, cfg
    # A later process loads the exported program instead of tracing and lowering it again; it is keyed by the
    # program key, graph definitions and model config (the state argument, 4, is donated).
    self._advance = exported.wrap(
      jax.jit(self._advance_impl, donate_argnums=(4,)), key=(key, defs, cfg), donate_argnums=(4,), out_like=4
    )
    self._init = jax.jit(self._init_impl)
    self._callback_run = jax.jit(self._callback_impl)

  # ---- traced code -------------------------------------------------------------
  def _modules(self, parts: PathParts) -> tuple[Embed, list[Block], Head]:
    return merge_path(self.defs, parts, self.key.layers)

  def _run(self, parts, tokens, positions, caches, write_at, mask, embeddings=None, *, last=False):
    """The path over tokens [B, T] (or ``embeddings`` [B, T, D]): logits [B, T, V] (``last``: [B, 1, V], the last
    position's) and the new caches."""
    embed, blocks, head = self._modules(parts)
    logits, caches = run_path(embed, blocks, head, tokens, positions, caches, write_at, mask, embeddings, last=last)
    return logits, tuple(caches)

  def _init_caches(self) -> tuple:
    k = self.key
    return layout.empty_caches(self.cfg, k.layers, k.batch, k.cache_len)

  def _init_impl(self) -> DecodeState:
    k = self.key
    return state_lib.empty(self._init_caches(), k.batch, k.max_new, free=False)

  def _prefill(self, parts, prompt, pad, samp, state):
    """The prefill of every row at ring slots [0, T) (row b's prompt from ``pad[b]``, so it starts there) and its
    first token, sampled as step 0."""
    k = self.key
    T = k.prompt_len
    positions, mask = layout.prefill(pad, T, k.cache_len)
    embeddings = None
    if isinstance(prompt, TemplatePrompt):
      embeddings = template_embed(
        prompt.prefix_rows,
        prompt.suffix_rows,
        nnx.merge(self.defs.embed, parts.embed).table[...],
        prompt.user_ids,
        prompt.user_lengths,
        total_len=T,
        left_pad=True,
        implementation=k.kernels,
      )
      prompt = None
    logits, caches = self._run(
      parts, prompt, positions, state.caches, jnp.zeros((), jnp.int32), mask, embeddings, last=True
    )
    token, stop = sample(logits[:, -1], samp, jnp.zeros((), jnp.int32), k.mode, k.kernels)
    return state_lib.prefilled(state, caches, pad, T, token, stop, samp)

  def _decode_chunk(self, parts, prompt, pad, samp, state, steps=None):
    """Up to ``steps`` (default the key's chunk) decode steps: the one decode step of every pool
    (:func:`~thoughtjax.decode.state.decode_chunk`); step n (the prefill's token is step 0) writes at slot
    T + n - 1 and samples step n, and no step writes past T + N - 2 (N tokens in all)."""
    del prompt, pad
    k = self.key
    T = k.prompt_len
    return state_lib.decode_chunk(
      lambda *a: self._run(parts, *a),
      state,
      samp,
      jnp.ones(k.batch, bool),
      k.mode,
      k.kernels,
      steps=k.chunk if steps is None else steps,
      ring=k.cache_len,
      base=T - 1,
      limit=T + k.max_new - 1,
    )[0]

  def _advance_impl(self, parts, prompt, pad, samp, state):
    empty = state.cursor == 0  # no prompt in yet
    return jax.lax.cond(empty, self._prefill, self._decode_chunk, parts, prompt, pad, samp, state)

  # ---- host API (thoughtjax.decode.interface.DecodeProgram) ---------------------------------
  def init_state(self, parts: PathParts | None = None) -> DecodeState:
    """The empty state, committed to the one device ``parts`` live on: the program returns a committed state,
    and an uncommitted first one would make the first decode chunk compile the program again."""
    return on_device_of(self._init(), parts)

  def prefill(self, inputs: DecodeInputs, state: DecodeState) -> DecodeState:
    """The prefill of every row and its first token (``state`` empty, donated). Prefill and decode chunks are
    one executable that branches on whether the state is empty: one compile per key, one exported program."""
    return self._advance(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, state)

  def advance(self, inputs: DecodeInputs, state: DecodeState) -> DecodeState:
    """Up to ``chunk`` decode steps (``state`` donated)."""
    return self._advance(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, state)

  def read(self, state: DecodeState) -> Tokens:
    # A row runs from the first step until it stops, so its tokens are the first count[r] columns of out.
    return Tokens(state.out, state.count, state.done)

  def lower(self, inputs: DecodeInputs):
    """The lowered program of these inputs' shapes (HLO inspection)."""
    state = jax.eval_shape(self._init_impl)
    return self._advance.trace(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, state).lower()

  def run_with_callback(self, parts, prompt, pad, samp, on_token: Callable[[int, np.ndarray, np.ndarray], bool]):
    """Prefill and the whole decode loop in one call; ``on_token(step, tokens[B], done[B])``
    runs on the host after every step and returns True to stop early."""
    slot = _CALLBACKS.register(on_token)
    try:
      return jax.block_until_ready(self._callback_run(parts, prompt, pad, samp, jnp.int32(slot)))
    finally:
      _CALLBACKS.release(slot)

  def _callback_impl(self, parts, prompt, pad, samp, slot):
    k = self.key
    T = k.prompt_len

    def emit(st):
      step = st.cursor - (T - 1)  # tokens generated so far (every row that runs has this many)
      return io_callback(
        _CALLBACKS.dispatch,
        jax.ShapeDtypeStruct((), jnp.bool_),
        slot,
        step,
        jax.lax.dynamic_index_in_dim(st.out, step - 1, axis=1, keepdims=False),
        st.done,
        ordered=True,
      )

    state = self._prefill(parts, prompt, pad, samp, self._init_impl())
    cancel = emit(state)

    def cond(c):
      st, cancel = c
      return (st.cursor < T + k.max_new - 1) & ~jnp.all(st.done) & ~cancel

    def body(c):
      st, _ = c
      st = self._decode_chunk(parts, None, pad, samp, st, steps=1)
      return st, emit(st)

    return jax.lax.while_loop(cond, body, (state, cancel))[0]


def loop_copies(hlo: str, cache_shape: tuple[int, ...]) -> tuple[int, int]:
  """(copies, copies shaped like ``cache_shape``) among the top-level instructions of a compiled
  program's decode loop: the ``while`` whose body (with what it calls) holds the most dots and fusions.

  ``hlo``: ``compiled.as_text()``. Fused computations are skipped: a copy inside a fusion writes no
  buffer of its own. A decode step that updates its KV caches in place has no cache-shaped copy.
  """
  comps = {}
  for chunk in re.split(r"\n(?=\S)", hlo):
    m = re.match(r"(?:ENTRY )?%?([\w.\-]+) ", chunk)
    if m and "{" in chunk.split("\n", 1)[0]:
      comps[m.group(1)] = chunk

  def called(text):
    names = set(re.findall(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)", text))
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
      names.update(n.strip().lstrip("%") for n in group.split(","))
    return names

  def reach(name):
    seen, todo = set(), [name]
    while todo:
      n = todo.pop()
      if n not in seen and n in comps and "fused" not in n:
        seen.add(n)
        todo.extend(called(comps[n]))
    return seen

  best, most = set(), -1
  for text in comps.values():
    for body in re.findall(r"while\(.*?body=%?([\w.\-]+)", text):
      names = reach(body)
      work = sum(len(re.findall(r"\b(?:dot|fusion|custom-call)\(", comps[n])) for n in names)
      if work > most:
        best, most = names, work
  shape = "[" + ",".join(str(d) for d in cache_shape) + "]"
  lines = [line for n in best for line in comps[n].split("\n") if re.search(r"= \S+ copy(?:-start)?\(", line)]
  return len(lines), sum(f"= f32{shape}" in line for line in lines)


class _CallbackTable:
  """Host sinks for io_callback programs, addressed by a slot number passed as data
  (so one compiled program serves every request)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._sinks: dict[int, Callable] = {}
    self._next = 0

  def register(self, fn) -> int:
    with self._lock:
      self._next += 1
      self._sinks[self._next] = fn
      return self._next

  def release(self, slot: int) -> None:
    with self._lock:
      self._sinks.pop(slot, None)

  def dispatch(self, slot, step, tokens, done):
    fn = self._sinks.get(int(slot))
    stop = bool(fn(int(step), np.asarray(tokens), np.asarray(done))) if fn else True
    return np.asarray(stop)


_CALLBACKS = _CallbackTable()


@dataclasses.dataclass(frozen=True)
class CacheStats:
  hits: int
  misses: int
  evictions: int
  size: int
  capacity: int


class ProgramCache:
  """Programs by everything that changes them: key, graph definitions and model config.

  One least-recently-used map for every program family (plain, slot and speculative programs), holding at
  most ``capacity`` programs (each holds its compiled executables); safe to share between threads. XLA
  executables also persist on disk via JAX's cache, so an evicted program that comes back recompiles from
  there. A program still in use when evicted keeps working: its holder keeps the reference.
  """

  def __init__(self, capacity: int | None = None):
    if capacity is None:
      capacity = settings.current().program_cache
    if capacity < 1:
      raise ValueError(
        f"program cache capacity must be >= 1, got {capacity} (set THOUGHTJAX_PROGRAM_CACHE to a positive number)"
      )
    self.capacity = capacity
    self._programs: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
    self._lock = threading.Lock()
    self.hits = self.misses = self.evictions = 0

  def get(self, key: DecodeKey, defs: GraphDefs, cfg, make: Callable[..., Any] | None = None) -> Any:
    """The program of ``key``'s :meth:`~DecodeKey.shape` for these graph definitions and model config: it runs
    any path of that shape, given the path's parts :meth:`~thoughtjax.transformer.PathParts.by_position`.
    ``make(shape_key, defs, cfg)`` builds a missing one (default :class:`Program`; the layer-indexed form, the
    speculative and the slot programs pass their own). Building a program only wraps functions in
    ``jax.jit``: compiling happens at its first call, outside this cache's lock."""
    shape = key.shape()
    ident = (shape, defs, cfg)
    with self._lock:
      prog = self._programs.get(ident)
      if prog is not None:
        self.hits += 1
        self._programs.move_to_end(ident)
        return prog
      self.misses += 1
      prog = self._programs[ident] = (make or Program)(shape, defs, cfg)
      while len(self._programs) > self.capacity:
        self._programs.popitem(last=False)
        self.evictions += 1
      return prog

  def __len__(self) -> int:
    return len(self._programs)

  def held(self, kind: type) -> int:
    """How many cached programs are instances of ``kind`` (e.g. the server's slot programs)."""
    with self._lock:
      return sum(isinstance(p, kind) for p in self._programs.values())

  def clear(self) -> int:
    """Forget every program (a server scaled to zero); returns how many. Counted as evictions."""
    with self._lock:
      n = len(self._programs)
      self._programs.clear()
      self.evictions += n
      return n

  def stats(self) -> CacheStats:
    with self._lock:
      return CacheStats(self.hits, self.misses, self.evictions, len(self._programs), self.capacity)


PROGRAMS = ProgramCache()

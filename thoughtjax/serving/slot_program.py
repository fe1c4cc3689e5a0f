"""The compiled programs of a slot layout: :class:`SlotProgram` (the decode program interface over N slots whose
requests join and leave between chunks), keyed by :class:`SlotKey` and shared by every engine of that layout
(:func:`slot_program`). :class:`~thoughtjax.serving.slots.SlotEngine` drives them; the cache layout, the prefill
and the decode chunk are described in :mod:`thoughtjax.serving.slots`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from thoughtjax.decode import indexed, layout
from thoughtjax.decode import program as program_lib
from thoughtjax.decode import state as state_lib
from thoughtjax.decode.interface import DecodeInputs, DecodeKey, DecodeProgram, Tokens
from thoughtjax.decode.state import DecodeState
from thoughtjax.defaults import DEFAULT_PREFILL_CHUNK
from thoughtjax.sampling import (
  SamplingArrays,
  SamplingMode,
  sample,
)
from thoughtjax.serving.errors import SlotRequestError
from thoughtjax.transformer import GraphDefs, merge_path, path_config, rope_tables


@dataclasses.dataclass(frozen=True)
class SlotKey(DecodeKey):
  """A slot program's key: the path, the number of slots, the ring's length, decode steps per chunk, kernels, the
  layer layout (``"indexed"``: ``layers`` are the positions the program holds, the path is data)."""

  slots: int
  cache_len: int
  chunk: int
  kernels: str | None
  prefill: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per prefill chunk (at most the ring's length)
  layout: str = "unrolled"


class SlotProgram(DecodeProgram):
  """The compiled functions of one slot layout (shared by every engine of that layout; see :func:`slot_program`).

  It is the decode program interface (:class:`~thoughtjax.decode.interface.DecodeProgram`) over N slots:
  :meth:`prefill` puts N prompts into the N slots, :meth:`advance` runs a decode chunk of every slot in use,
  :meth:`read` gives each slot's tokens; a :class:`~thoughtjax.serving.slots.SlotEngine` uses the same executables piecewise
  through the methods below (:meth:`prefill_prompts` of waiting requests apart, :meth:`insert` into a free slot,
  :meth:`decode` of the slots in use, :meth:`take_back`), so requests join and leave between chunks. Its jitted
  functions are its own: nothing outside this module calls them.

  In the ``"unrolled"`` layout every block of the path is traced into each program and the caches are one (keys,
  values) pair per path block, [N, K, S, E]; in the ``"indexed"`` one (:mod:`thoughtjax.decode.indexed`) the
  programs loop over stacked layer weights, take :class:`~thoughtjax.decode.indexed.StackedParts`, and the caches
  are one pair [positions, N, K, S, E]: a fraction of the executable, compiled in a fraction of the time, and
  every path of at most that many positions over the same stack runs it."""

  def __init__(self, key: SlotKey, defs: GraphDefs, cfg):
    self.key, self.defs, self.cfg, self.layers, self.kernels = key, defs, cfg, key.layers, key.kernels
    self.slots, self.cache_len, self.steps_per_chunk = key.slots, key.cache_len, key.chunk
    self.prefill_tokens = min(key.prefill, key.cache_len)
    self.indexed = key.layout == "indexed"
    self._axis = 1 if self.indexed else 0  # the slot (row) axis of a cache array
    # Per cache pair: whether it holds keys (a bridge's pair is a placeholder).
    self._keeps = (True,) if self.indexed else tuple(i >= 0 for i in self.layers)
    self._init = jax.jit(self._init_impl)
    self._chunk = jax.jit(self._chunk_impl, static_argnums=(4,), donate_argnums=(2,))
    self._chunk_rows = jax.jit(self._chunk_rows_impl, static_argnums=(5,), donate_argnums=(2,))
    self._scratch = jax.jit(self._scratch_impl, static_argnums=(0,))
    self._put_block = jax.jit(self._put_block_impl, donate_argnums=(0,))
    self._prefill_chunk = jax.jit(self._prefill_chunk_impl, static_argnums=(8, 9), donate_argnums=(1,))
    self._row_keys = jax.jit(self._row_keys_impl)
    self._block = jax.jit(self._block_impl, static_argnums=(3, 4))
    self._insert = jax.jit(self._insert_impl, donate_argnums=(0,))
    self._rewind = jax.jit(self._rewind_impl, donate_argnums=(0,))

  # ---- traced code (under jit) -------------------------------------------------------------------
  def _init_impl(self) -> DecodeState:
    N = self.slots
    return state_lib.empty(self._empty(N), N, self.cache_len, free=True)

  def _empty(self, rows: int):
    """Zero caches of ``rows`` rows over the ring, in this program's layout."""
    if self.indexed:
      return indexed.empty_caches(self.cfg, len(self.layers), rows, self.cache_len)
    return layout.empty_caches(self.cfg, self.layers, rows, self.cache_len)

  def _at(self, slot) -> tuple:
    """The index of one slot (or rows, an index array) of a cache array."""
    return (slice(None),) * self._axis + (slot,)

  def _modules(self, parts, *, decode: bool = False):
    """(embed, head, config, run_blocks) of the path in ``parts``; ``run_blocks(x, cos, sin, caches, write_at,
    mask) -> (x, caches)`` runs its blocks in order (traced code). In the indexed layout a decode step of the ring
    (``decode``) reads each row's keys by blocks, a prefill chunk the slots before its end only
    (:func:`~thoughtjax.decode.indexed.run_blocks`)."""
    if self.indexed:
      embed, head = nnx.merge(self.defs.embed, parts.embed), nnx.merge(self.defs.head, parts.head)
      reads = "blocks" if decode else "prefix"
      return embed, head, self.cfg, functools.partial(indexed.run_blocks, self.defs, parts, reads=reads)
    embed, blocks, head = merge_path(self.defs, parts, self.layers)

    def run_blocks(x, cos, sin, caches, write_at, mask):
      out = []
      for block, (ck, cv) in zip(blocks, caches, strict=True):
        x, ck, cv = block(x, cos, sin, ck, cv, write_at, mask)
        out.append((ck, cv))
      return x, tuple(out)

    return embed, head, path_config(blocks), run_blocks

  # ---- the decode program interface (a pool of N slots filled at once) --------------------------
  def init_state(self, parts=None) -> DecodeState:
    return program_lib.on_device_of(self._init(), parts)

  def prefill(self, inputs: DecodeInputs, state: DecodeState) -> DecodeState:
    """The N prompts of ``inputs`` ([N, T], left-padded) prefilled together, prompt p into slot p at the
    cursor; ``inputs.mode`` is their sampling mode, ``inputs.samp`` has N rows (a slot's prompt + max_tokens
    must fit the ring). ``state`` is donated."""
    tokens = np.asarray(jax.device_get(inputs.prompt))
    P, T = tokens.shape
    if P != self.slots or inputs.mode is None:
      raise SlotRequestError(f"a slot program's prefill takes {self.slots} prompts and a sampling mode; got {P}")
    pad = np.asarray(jax.device_get(inputs.pad))
    prompts = [tokens[p, pad[p] :].tolist() for p in range(P)]
    order = sorted(range(P), key=lambda p: -len(prompts[p]))  # a chunked prefill takes its rows longest first
    samp = jax.tree.map(lambda x: x[np.asarray(order)], inputs.samp)
    kv, token, done = self.prefill_prompts(inputs.parts, [prompts[p] for p in order], samp, inputs.mode)
    for row, p in enumerate(order):
      state = self.insert(state, kv, p, row, len(prompts[p]), token, done[row], 1)
    return state

  def prefill_prompts(self, parts, prompts, samp: SamplingArrays, mode: SamplingMode, *, start: int = 0, prefix=()):
    """The chunked prefill of P prompts (longest first) run to its end (:class:`ChunkedPrefill`, which states the
    layout): (caches [P, K, S, E] per path block, first tokens [P], stopped [P])."""
    job = ChunkedPrefill(self, parts, prompts, samp, mode, start=start, prefix=prefix)
    while not job.done:
      job.advance()
    return job.result

  def advance(self, inputs: DecodeInputs, state: DecodeState) -> DecodeState:
    """One decode chunk of every slot still running (``state`` donated)."""
    state, _, _, _ = self.decode(inputs.parts, inputs.samp, state, range(self.slots), inputs.mode)
    return state

  def read(self, state: DecodeState) -> Tokens:
    return Tokens(state.out, state.count, state.done)

  # ---- what an engine drives ---------------------------------------------------------------------
  def decode(self, parts, samp: SamplingArrays, state: DecodeState, live, mode: SamplingMode, steps: int | None = None):
    """One decode chunk of the slots ``live`` (at most ``steps`` steps, default the chunk's), computed on W rows:
    the next power of two of the slots in use (:func:`width`), padded with free ones, so one stream on a 16-slot
    engine pays a one-row step. ``state`` is donated. Returns (state, tokens [N, chunk] (-1: none), steps run, W)."""
    live = list(live)
    W = width(len(live), self.slots)
    taken = set(live)
    rows = live + [b for b in range(self.slots) if b not in taken][: W - len(live)]
    state, out, n = self._run_rows(parts, samp, state, rows, len(live), mode, steps)
    return state, out, n, W

  def warm_decode(self, parts, samp: SamplingArrays, state: DecodeState, mode: SamplingMode) -> DecodeState:
    """Compile the decode chunk at every width :meth:`decode` computes (1, 2, 4, ... and all the slots) by running
    it with no slot active: none steps (the loop stops before its first step), the state stays as it was."""
    W = 1
    while True:
      W = min(W, self.slots)
      state, _, _ = self._run_rows(parts, samp, state, list(range(W)), 0, mode, None)
      if W == self.slots:
        return state
      W *= 2

  def _run_rows(self, parts, samp, state, rows: list[int], active: int, mode, steps: int | None):
    """The chunk on slots ``rows`` (all of them: the whole program; fewer: gathered), the first ``active`` in use."""
    limit = jnp.int32(self.steps_per_chunk if steps is None else steps)
    on = np.arange(len(rows)) < active
    if len(rows) == self.slots:
      whole = np.zeros(self.slots, bool)
      whole[rows] = on
      return self._chunk(parts, samp, state, jnp.asarray(whole), mode, limit)
    return self._chunk_rows(parts, samp, state, jnp.asarray(np.asarray(rows, np.int32)), jnp.asarray(on), mode, limit)

  def insert(self, state: DecodeState, kv, slot: int, row: int, n: int, token, done, count) -> DecodeState:
    """Write row ``row`` of a prefill's keys ``kv`` (its prompt of ``n`` tokens; ``token`` [P] the prefill's first
    tokens) into slot ``slot`` at the cursor, with its stopped flag and token count (:meth:`_insert_impl`);
    ``state`` is donated."""
    return self._insert(
      state, kv, jnp.int32(slot), jnp.int32(row), jnp.int32(n), token, (jnp.bool_(done), jnp.int32(count))
    )

  def take_back(self, state: DecodeState, slot: int, keep: int, token: int, shift: int) -> DecodeState:
    """Slot ``slot`` keeps its first ``keep`` tokens, the last of them ``token``; its keys move ``shift`` ring slots
    forward (:meth:`_rewind_impl`). ``state`` is donated."""
    return self._rewind(state, jnp.int32(slot), jnp.int32(keep), jnp.int32(token), jnp.int32(shift))

  def row_keys(self, kv, row: int):
    """Row ``row`` of a prefill's keys ``kv`` as keys of their own ([1, K, S, E] per path block), so that the
    prefill's caches can go on to its next chunk (they are donated to it) while this row waits for its slot."""
    return self._row_keys(kv, jnp.int32(row))

  def prefix_block(self, kv, row: int, j: int, block_tokens: int, keyed: int):
    """Block ``j`` of row ``row`` of a prefill's keys, as the prefix cache keeps it (:meth:`_block_impl`; ``keyed``:
    the path's blocks with keys)."""
    return self._block(kv, jnp.int32(row), jnp.int32(j), block_tokens, keyed)

  # ---- traced code (under jit) -------------------------------------------------------------------
  def _chunk_impl(self, parts, samp: SamplingArrays, state: DecodeState, active, mode: SamplingMode, steps):
    """Up to ``steps`` (at most ``chunk``) decode steps of every slot; returns the state, tokens [N, chunk] (-1:
    none), steps run."""
    return self._decode(parts, samp, state, active, mode, steps)

  def _chunk_rows_impl(self, parts, samp: SamplingArrays, state: DecodeState, rows, active, mode: SamplingMode, steps):
    """:meth:`_chunk_impl` computed on the W slots ``rows`` only (W < N, distinct; ``active`` [W] marks the
    slots in use among them): their caches and settings are gathered, decoded, and written back, so a step costs
    W rows, not N. Returns the state, tokens [N, chunk] (-1 for every other slot) and the steps run."""
    at = self._at(rows)
    sub = DecodeState(
      tuple((k[at], v[at]) for k, v in state.caches),
      state.token[rows],
      state.start[rows],
      state.cursor,
      state.done[rows],
      state.count[rows],
      state.out[rows],
    )
    sub, out, steps = self._decode(parts, jax.tree.map(lambda x: x[rows], samp), sub, active, mode, steps)
    state = DecodeState(
      tuple((k.at[at].set(sk), v.at[at].set(sv)) for (k, v), (sk, sv) in zip(state.caches, sub.caches, strict=True)),
      state.token.at[rows].set(sub.token),
      state.start,
      sub.cursor,
      state.done.at[rows].set(sub.done),
      state.count.at[rows].set(sub.count),
      state.out.at[rows].set(sub.out),
    )
    return state, jnp.full((self.slots, self.steps_per_chunk), -1, jnp.int32).at[rows].set(out), steps

  def _decode(self, parts, samp: SamplingArrays, state: DecodeState, active, mode: SamplingMode, steps):
    """Up to ``steps`` (at most ``chunk``) decode steps of the rows of ``state`` (any number of them, all sharing
    the cursor): the one decode step of every pool (:func:`~thoughtjax.decode.state.decode_chunk`), sampling step
    ``cursor``."""
    embed, head, cfg, run_blocks = self._modules(parts, decode=True)
    S, C = self.cache_len, self.steps_per_chunk

    def run(tokens, positions, caches, write_at, mask):
      x = embed(tokens)
      cos, sin = (None, None) if cfg is None else rope_tables(positions, cfg.head_dim, cfg.rope_theta)
      x, caches = run_blocks(x, cos, sin, caches, write_at, mask)
      return head(x, embed.table[...]), caches

    start = state.count
    steps = jnp.minimum(steps, C)
    state, steps = state_lib.decode_chunk(run, state, samp, active, mode, self.kernels, steps=steps, ring=S)
    # A row runs from the chunk's first step until it stops, so its chunk tokens follow its earlier ones in the
    # history: [N, C], -1 where a row produced none.
    j = jnp.arange(C)[None, :]
    got = jnp.take_along_axis(state.out, jnp.minimum(start[:, None] + j, S - 1), axis=1)
    return state, jnp.where(j < (state.count - start)[:, None], got, -1), steps

  def _scratch_impl(self, rows: int):
    """Zero prefill caches for ``rows`` prompts, in this program's layout (unrolled: per path block (k, v) [rows, K,
    S, E], S: the ring's length); a prompt's key i goes to index i."""
    return self._empty(rows)

  def _put_block_impl(self, scratch, block, row, j):
    """``scratch`` with cached prefix block ``j`` ([L, 2, K, B, E], L: the path's blocks with keys) written into
    row ``row`` at indices [j * B, (j + 1) * B)."""
    B = block.shape[3]
    if self.indexed:  # positions [0, L) of the stacked caches
      at = (jnp.int32(0), row, jnp.int32(0), j * B, jnp.int32(0))
      ((ck, cv),) = scratch
      return (
        tuple(
          jax.lax.dynamic_update_slice(c, block[:, h][:, None].astype(c.dtype), at) for h, c in enumerate((ck, cv))
        ),
      )
    out, i = [], 0
    for layer, (ck, cv) in zip(self.layers, scratch, strict=True):
      if layer < 0:  # a bridge keeps no keys
        out.append((ck, cv))
        continue
      at = (row, jnp.int32(0), j * B, jnp.int32(0))
      out.append(
        tuple(jax.lax.dynamic_update_slice(c, block[i, h][None].astype(c.dtype), at) for h, c in enumerate((ck, cv)))
      )
      i += 1
    return tuple(out)

  def _prefill_chunk_impl(
    self, parts, scratch, tokens, at, n, token, stop, samp: SamplingArrays, mode: SamplingMode, rows: int
  ):
    """One prefill chunk of the first ``rows`` of P prompts: ``tokens`` [rows, C] are each row's prompt tokens at
    indices [at, at + C) of its prefill caches ``scratch`` (donated; keys of [0, at) already there), at RoPE
    positions at, at + 1, ...; each query sees its row's keys up to itself. The other rows (prompts that ended
    before ``at``, padding) are not computed. A row whose prompt (``n`` [P] tokens) ends in this chunk gets its
    first token sampled from its last position and whether it stopped there; the others keep ``token`` and
    ``stop`` [P]. Returns (scratch, token, stop). Keys past a row's end are never read: its queries see only keys
    before them, and an insert copies [0, n)."""
    embed, head, cfg, run_blocks = self._modules(parts)
    R, C = tokens.shape
    whole = R == scratch[0][0].shape[self._axis]
    first = self._at(slice(0, R))
    part = scratch if whole else tuple((ck[first], cv[first]) for ck, cv in scratch)
    n_r, samp_r = (n, samp) if whole else (n[:R], jax.tree.map(lambda x: x[:R], samp))
    slots = jnp.broadcast_to(at + jnp.arange(C, dtype=jnp.int32)[None, :], (R, C))
    positions, mask = layout.steps_at(jnp.zeros(R, jnp.int32), slots, self.cache_len)
    x = embed(tokens)
    cos, sin = (None, None) if cfg is None else rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    x, out = run_blocks(x, cos, sin, part, at, mask)
    last = jnp.clip(n_r - 1 - at, 0, C - 1)
    logits = head(jnp.take_along_axis(x, last[:, None, None], axis=1), embed.table[...])
    new, stopped = sample(logits[:, -1], samp_r, jnp.zeros((), jnp.int32), mode, self.kernels)
    ends = (n_r - 1 >= at) & (n_r - 1 < at + C)
    new = jnp.where(ends, new, token[:R])
    stopped = jnp.where(ends, stopped | (samp_r.max_new <= 1), stop[:R])
    if whole:
      return tuple(out), new, stopped
    zero = jnp.zeros((), jnp.int32)
    out = tuple(
      tuple(jax.lax.dynamic_update_slice(c, u, (zero,) * c.ndim) for c, u in zip(full, new_pair, strict=True))
      for full, new_pair in zip(scratch, out, strict=True)
    )
    return out, token.at[:R].set(new), stop.at[:R].set(stopped)

  def _row_keys_impl(self, kv, row):
    return tuple(tuple(jax.lax.dynamic_slice_in_dim(a, row, 1, self._axis) for a in pair) for pair in kv)

  def _block_impl(self, kv, row, j, block_tokens: int, keyed: int):
    """Keys of prompt positions [j * B, (j + 1) * B) of row ``row`` of a prefill's ``kv`` (B = ``block_tokens``),
    as one prefix-cache block [L, 2, K, B, E] (L = ``keyed``: the path's blocks with keys)."""
    B = block_tokens
    if self.indexed:
      one = [jax.lax.dynamic_index_in_dim(a, row, 1, False)[:keyed] for a in kv[0]]  # [L, K, S, E]
      return jnp.stack([jax.lax.dynamic_slice_in_dim(a, j * B, B, 2) for a in one], axis=1)
    real = [pair for layer, pair in zip(self.layers, kv, strict=True) if layer >= 0]
    return jnp.stack(
      [
        jnp.stack(
          [jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(a, row, 0, False), j * B, B, 1) for a in pair]
        )
        for pair in real
      ]
    )

  def _insert_impl(self, state: DecodeState, kv, slot, row, n, token, done_count) -> DecodeState:
    """Write row ``row`` of a prefill's keys (the prompt of ``n`` tokens) into ``slot``'s ring at absolute
    positions [cursor - n, cursor)."""
    S = self.cache_len
    c = state.cursor
    d = layout.ring_behind(c, S)
    valid = (d >= 1) & (d <= n)
    ax, at = self._axis, self._at(slot)
    caches = []
    for keeps, (ck, cv), (pk, pv) in zip(self._keeps, state.caches, kv, strict=True):
      if not keeps:  # a bridge keeps no keys
        caches.append((ck, cv))
        continue
      T = pk.shape[ax + 2]
      src = jnp.clip(n - d, 0, T - 1)  # the prefill caches hold the prompt at [0, n)
      seen = valid.reshape((1,) * (ax + 1) + (S, 1))
      rows = []
      for pre in (pk, pv):
        one = jax.lax.dynamic_index_in_dim(pre, row, ax, keepdims=False)  # [(L,) K, T, E]
        rows.append(jnp.where(seen, jnp.take(one, src, axis=ax + 1), 0).astype(ck.dtype))
      caches.append((ck.at[at].set(rows[0]), cv.at[at].set(rows[1])))
    done, count = done_count
    first = jnp.where(jnp.arange(S) == 0, token[row], -1)  # the prefill's token is the slot's first
    return DecodeState(
      tuple(caches),
      state.token.at[slot].set(token[row]),
      state.start.at[slot].set(c - n),
      c,
      state.done.at[slot].set(done),
      state.count.at[slot].set(count),
      state.out.at[slot].set(first),
    )

  def _rewind_impl(self, state: DecodeState, slot, keep, token, shift) -> DecodeState:
    """Take back slot ``slot``'s tokens past its first ``keep`` (those its constraint refused, and the ones after):
    its count becomes ``keep``, its last token ``token`` (the last one kept), it runs again, and its keys move
    ``shift`` ring slots forward (the chunk's steps less the tokens it kept), start with them, so that the kept
    keys end at the cursor and the next step writes the key after them. The keys taken back land before the new
    start, where the row sees nothing, and are overwritten as the cursor goes on."""
    S = self.cache_len
    src = (jnp.arange(S, dtype=jnp.int32) - shift) % S
    at = self._at(slot)
    caches = []
    for keeps, pair in zip(self._keeps, state.caches, strict=True):
      if not keeps:  # a bridge keeps no keys
        caches.append(pair)
        continue
      caches.append(tuple(c.at[at].set(jnp.take(c[at], src, axis=self._axis + 1)) for c in pair))
    row = state.out[slot]
    return state._replace(
      caches=tuple(caches),
      token=state.token.at[slot].set(token),
      start=state.start.at[slot].add(shift),
      done=state.done.at[slot].set(False),
      count=state.count.at[slot].set(keep),
      out=state.out.at[slot].set(jnp.where(jnp.arange(row.shape[0]) < keep, row, -1)),
    )


class ChunkedPrefill:
  """The chunked prefill of P prompts (``prompts``: P token-id lists, longest first, each at most the ring's length;
  an empty one is a padding row), one chunk per :meth:`advance`, so a driver can step its decode between chunks.

  Each row's key i goes to index i of its prefill caches, computed ``prefill_tokens`` positions at a time from
  ``start`` on; the keys of [0, start) come from ``prefix`` (per row, its cached blocks, first block first), written
  at the outset. A chunk computes only the rows whose prompts reach into it (the first ones, as the longest come
  first), padded to a power of two (:func:`width`): one program per number of rows, whatever the prompts' lengths. A
  chunk past the ring's end is moved back to end there (it recomputes keys it already has). After each chunk,
  :attr:`ended` lists the rows whose prompts ended in it (their first token and stop flag are then in
  :attr:`result`) and :attr:`computed` the rows it computed; once :attr:`done`, :attr:`result` is (caches [P, K, S, E] per path block, first tokens [P],
  stopped [P]).

  ``scratch``: prefill caches of P rows to compute into (donated), whatever finite values they hold: a row's queries
  weigh only keys it wrote or was given (the others get probability 0), so an earlier prefill's caches serve again
  without being zeroed (None: zeros)."""

  def __init__(self, program: SlotProgram, parts, prompts, samp, mode, *, start: int = 0, prefix=(), scratch=None):
    self.program, self.parts, self.samp, self.mode = program, parts, samp, mode
    P, S = len(prompts), program.cache_len
    self.lengths = np.array([len(ids) for ids in prompts], np.int32)
    if np.any(np.diff(self.lengths) > 0):
      raise ValueError(f"a chunked prefill takes its prompts longest first, got lengths {self.lengths.tolist()}")
    self.tokens = np.zeros((P, S), np.int32)
    for p, ids in enumerate(prompts):
      self.tokens[p, : len(ids)] = ids
    scratch = program._scratch(P) if scratch is None else scratch
    for p, blocks in enumerate(prefix):
      for j, block in enumerate(blocks):
        scratch = program._put_block(scratch, block, jnp.int32(p), jnp.int32(j))
    self.end, self.at, self.chunks, self.computed = int(self.lengths.max()), int(start), 0, 0
    self._n = jnp.asarray(self.lengths)
    self._reported = np.zeros(P, bool)
    self.ended: list[int] = []
    self.result = (scratch, jnp.zeros(P, jnp.int32), jnp.zeros(P, bool))

  @property
  def done(self) -> bool:
    return self.at >= self.end

  def advance(self) -> None:
    """Run the next chunk (the program's :meth:`~SlotProgram._prefill_chunk_impl`) on the rows it reaches."""
    S, C = self.program.cache_len, self.program.prefill_tokens
    a = min(self.at, S - C)
    reach = self.lengths > a
    R = width(int(reach.sum()), len(self.lengths))
    scratch, token, stop = self.result
    tokens = jnp.asarray(self.tokens[:R, a : a + C])
    self.result = self.program._prefill_chunk(
      self.parts, scratch, tokens, jnp.int32(a), self._n, token, stop, self.samp, self.mode, R
    )
    ends = reach & (self.lengths <= a + C) & ~self._reported
    self._reported |= ends
    self.ended = np.flatnonzero(ends).tolist()
    self.at, self.chunks, self.computed = a + C, self.chunks + 1, R


def slot_program(
  defs, cfg, layers, slots, cache_len, chunk, kernels, prefill: int = DEFAULT_PREFILL_CHUNK, layout: str = "unrolled"
) -> SlotProgram:
  """The slot program of this layout from the process's one program cache (:data:`thoughtjax.decode.program.PROGRAMS`):
  a new engine of the same layout compiles nothing.

  Unrolled, it is keyed by the path's shape (:func:`~thoughtjax.transformer.path_shape`) and runs any path of that
  shape on the path's parts :meth:`~thoughtjax.transformer.PathParts.by_position`; indexed, by the positions it
  holds (:func:`~thoughtjax.decode.indexed.max_layers`), and runs any path of at most that many on
  :class:`~thoughtjax.decode.indexed.StackedParts` (see :meth:`thoughtjax.model.Model.program_parts`)."""
  if layout not in indexed.LAYOUTS:
    raise SlotRequestError(f"layout is one of {', '.join(indexed.LAYOUTS)}; got {layout!r}")
  if layout == "indexed":
    if any(i < 0 for i in layers):
      raise SlotRequestError("a path with a bridge has no layer-indexed form; use layout='unrolled'")
    layers = range(indexed.max_layers(len(layers), cfg.num_layers))
  return program_lib.PROGRAMS.get(
    SlotKey(tuple(layers), slots, cache_len, chunk, kernels, prefill, layout), defs, cfg, SlotProgram
  )


def width(live: int, slots: int) -> int:
  """The rows a decode chunk computes for ``live`` slots in use: the next power of two, at most ``slots`` (a few
  compiled widths serve every occupancy). The latency model prices a joining stream by it."""
  return min(1 << max(int(live) - 1, 0).bit_length(), max(int(slots), 1))

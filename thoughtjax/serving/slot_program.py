"""The compiled programs of a slot layout: :class:`SlotProgram` (the decode program interface over N slots whose
requests join and leave between chunks), keyed by :class:`SlotKey` and shared by every engine of that layout
(:func:`slot_program`). :class:`~thoughtjax.serving.slots.SlotEngine` drives them; the cache layout, the prefill
and the decode chunk are described in :mod:`thoughtjax.serving.slots`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.decode import layout
from thoughtjax.decode import program as program_lib
from thoughtjax.decode import state as state_lib
from thoughtjax.decode.interface import DecodeInputs, DecodeKey, DecodeProgram, Tokens
from thoughtjax.decode.state import DecodeState
from thoughtjax.sampling import (
  SamplingArrays,
  SamplingMode,
  sample,
)
from thoughtjax.serving.errors import SlotRequestError
from thoughtjax.transformer import GraphDefs, merge_path, path_config, rope_tables, run_path


@dataclasses.dataclass(frozen=True)
class SlotKey(DecodeKey):
  """A slot program's key: the path, the number of slots, the ring's length, decode steps per chunk, kernels."""

  slots: int
  cache_len: int
  chunk: int
  kernels: str | None


class SlotProgram(DecodeProgram):
  """The compiled functions of one slot layout (shared by every engine of that layout; see :func:`slot_program`).

  It is the decode program interface (:class:`~thoughtjax.decode.interface.DecodeProgram`) over N slots:
  :meth:`prefill` puts N prompts into the N slots, :meth:`advance` runs a decode chunk of every slot in use,
  :meth:`read` gives each slot's tokens; a :class:`~thoughtjax.serving.slots.SlotEngine` uses the same executables piecewise
  (``prefill_rows`` of waiting requests apart, ``insert`` into a free slot, ``chunk`` / ``chunk_rows``) so
  requests join and leave between chunks."""

  def __init__(self, key: SlotKey, defs: GraphDefs, cfg):
    self.key, self.defs, self.cfg, self.layers, self.kernels = key, defs, cfg, key.layers, key.kernels
    self.slots, self.cache_len, self.steps_per_chunk = key.slots, key.cache_len, key.chunk
    self.init = jax.jit(self._init_impl)
    self.chunk = jax.jit(self._chunk_impl, static_argnums=(4,), donate_argnums=(2,))
    self.chunk_rows = jax.jit(self._chunk_rows_impl, static_argnums=(5,), donate_argnums=(2,))
    self.prefill_rows = jax.jit(self._prefill_impl, static_argnums=(4,))
    self.prefill_after = jax.jit(self._prefill_after_impl, static_argnums=(6,))
    self.blocks = jax.jit(self._blocks_impl, static_argnums=(2,))
    self.insert = jax.jit(self._insert_impl, donate_argnums=(0,))

  # ---- traced code (under jit) -------------------------------------------------------------------
  def _init_impl(self) -> DecodeState:
    N = self.slots
    caches = layout.empty_caches(self.cfg, self.layers, N, self.cache_len)
    return state_lib.empty(caches, N, self.cache_len, free=True)

  # ---- the decode program interface (a pool of N slots filled at once) --------------------------
  def init_state(self, parts=None) -> DecodeState:
    return program_lib.on_device_of(self.init(), parts)

  def prefill(self, inputs: DecodeInputs, state: DecodeState) -> DecodeState:
    """The N prompts of ``inputs`` ([N, T], left-padded) prefilled in one call, prompt p into slot p at the
    cursor; ``inputs.mode`` is their sampling mode, ``inputs.samp`` has N rows (a slot's prompt + max_tokens
    must fit the ring). ``state`` is donated."""
    tokens = inputs.prompt
    P, T = tokens.shape
    if P != self.slots or inputs.mode is None:
      raise SlotRequestError(f"a slot program's prefill takes {self.slots} prompts and a sampling mode; got {P}")
    kv, token, done = self.prefill_rows(inputs.parts, tokens, inputs.pad, inputs.samp, inputs.mode)
    lengths = T - np.asarray(jax.device_get(inputs.pad))
    one = jnp.int32(1)
    for p in range(P):
      p_ = jnp.int32(p)
      state = self.insert(state, kv, p_, p_, jnp.int32(lengths[p]), token, (done[p], one))
    return state

  def advance(self, inputs: DecodeInputs, state: DecodeState) -> DecodeState:
    """One decode chunk of every slot still running (``state`` donated)."""
    state, _, _ = self.chunk(inputs.parts, inputs.samp, state, jnp.ones(self.slots, bool), inputs.mode)
    return state

  def read(self, state: DecodeState) -> Tokens:
    return Tokens(state.out, state.count, state.done)

  def _chunk_impl(self, parts, samp: SamplingArrays, state: DecodeState, active, mode: SamplingMode):
    """Up to ``chunk`` decode steps of every slot; returns the state, tokens [N, chunk] (-1: none), steps."""
    return self._decode(parts, samp, state, active, mode)

  def _chunk_rows_impl(self, parts, samp: SamplingArrays, state: DecodeState, rows, active, mode: SamplingMode):
    """:meth:`_chunk_impl` computed on the W slots ``rows`` only (W < N, distinct; ``active`` [W] marks the
    slots in use among them): their caches and settings are gathered, decoded, and written back, so a step costs
    W rows, not N. Returns the state, tokens [N, chunk] (-1 for every other slot) and the steps run."""
    sub = DecodeState(
      tuple((k[rows], v[rows]) for k, v in state.caches),
      state.token[rows],
      state.start[rows],
      state.cursor,
      state.done[rows],
      state.count[rows],
      state.out[rows],
    )
    sub, out, steps = self._decode(parts, jax.tree.map(lambda x: x[rows], samp), sub, active, mode)
    state = DecodeState(
      tuple(
        (k.at[rows].set(sk), v.at[rows].set(sv)) for (k, v), (sk, sv) in zip(state.caches, sub.caches, strict=True)
      ),
      state.token.at[rows].set(sub.token),
      state.start,
      sub.cursor,
      state.done.at[rows].set(sub.done),
      state.count.at[rows].set(sub.count),
      state.out.at[rows].set(sub.out),
    )
    return state, jnp.full((self.slots, self.steps_per_chunk), -1, jnp.int32).at[rows].set(out), steps

  def _decode(self, parts, samp: SamplingArrays, state: DecodeState, active, mode: SamplingMode):
    """Up to ``chunk`` decode steps of the rows of ``state`` (any number of them, all sharing the cursor): the one
    decode step of every pool (:func:`~thoughtjax.decode.state.decode_chunk`), sampling step ``cursor``."""
    embed, blocks, head = merge_path(self.defs, parts, self.layers)
    S, C = self.cache_len, self.steps_per_chunk

    def run(tokens, positions, caches, write_at, mask):
      return run_path(embed, blocks, head, tokens, positions, caches, write_at, mask)

    start = state.count
    state, steps = state_lib.decode_chunk(run, state, samp, active, mode, self.kernels, steps=C, ring=S)
    # A row runs from the chunk's first step until it stops, so its chunk tokens follow its earlier ones in the
    # history: [N, C], -1 where a row produced none.
    j = jnp.arange(C)[None, :]
    got = jnp.take_along_axis(state.out, jnp.minimum(start[:, None] + j, S - 1), axis=1)
    return state, jnp.where(j < (state.count - start)[:, None], got, -1), steps

  def _prefill_impl(self, parts, tokens, pad, samp: SamplingArrays, mode: SamplingMode):
    """The prefill of P left-padded prompts [P, T] (row p's prompt in [pad[p], T)): per path block (k, v)
    [P, K, T, E], each row's first token [P] and whether it stopped there [P]. Positions, mask and sampling are
    those of the alone run's prefill (:class:`~thoughtjax.decode.program.Program`); the head sees only the last
    position, the one the first token comes from."""
    embed, blocks, head = merge_path(self.defs, parts, self.layers)
    P, T = tokens.shape
    positions, mask = layout.prefill(pad, T, T)
    caches = layout.empty_caches(self.cfg, self.layers, P, T)
    zero = jnp.zeros((), jnp.int32)
    logits, out = run_path(embed, blocks, head, tokens, positions, caches, zero, mask, last=True)
    token, stop = sample(logits[:, -1], samp, zero, mode, self.kernels)
    return tuple(out), token, stop | (samp.max_new <= 1)

  def _prefill_after_impl(self, parts, prefix, tokens, pad, have, samp: SamplingArrays, mode: SamplingMode):
    """The prefill of P prompts whose first ``have[p]`` tokens' keys are given: only the rest is computed.

    prefix: P * NB block arrays [L, 2, K, B, E] (L: the path's blocks with keys), row p's NB blocks in a row,
    its cached prefix right-aligned (zero blocks before it); tokens [P, Ts] the rest of each prompt, left-padded
    (row p's in [pad[p], Ts)). The prefix keys sit at [Sp - have, Sp) of a [P, K, Sp + Ts, E] cache (Sp = NB * B)
    and the rest is written at [Sp, Sp + Ts), at RoPE positions have, have + 1, ...; each query sees its row's
    prefix and its own tokens up to itself. Returns what :meth:`_prefill_impl` returns, the keys moved to its
    layout (each row's whole prompt left-padded, ending at Sp + Ts), so :meth:`_insert_impl` takes them as they are.
    """
    embed, blocks, head = merge_path(self.defs, parts, self.layers)
    P, Ts = tokens.shape
    NB = len(prefix) // P
    L, _, K, B, E = prefix[0].shape
    Sp = NB * B
    S = Sp + Ts
    # [P * NB, L, 2, K, B, E] -> [L, 2, P, K, Sp, E]
    pre = jnp.stack(prefix).reshape(P, NB, L, 2, K, B, E).transpose(2, 3, 0, 4, 1, 5, 6).reshape(L, 2, P, K, Sp, E)
    rest = jnp.zeros((P, K, Ts, E), pre.dtype)
    caches, i = [], 0
    for layer in self.layers:
      if layer < 0:  # a bridge keeps no keys
        caches.append((jnp.zeros((P, 1, 1, 1)),) * 2)
        continue
      caches.append((jnp.concatenate([pre[i, 0], rest], axis=2), jnp.concatenate([pre[i, 1], rest], axis=2)))
      i += 1
    positions, mask = layout.after_prefix(pad, have, Sp, Ts)
    s = jnp.arange(S)
    x = embed(tokens)
    cfg = path_config(blocks)
    cos, sin = (None, None) if cfg is None else rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    out = []
    # Cache index t of the prefill layout holds the rest's key t when t >= Sp + pad, else the prefix's key t - pad.
    src = jnp.where(s[None, :] >= (Sp + pad)[:, None], s[None, :], jnp.maximum(s[None, :] - pad[:, None], 0))
    src = src[:, None, :, None]  # [P, 1, S, 1]
    for layer, block, (ck, cv) in zip(self.layers, blocks, caches, strict=True):
      x, ck, cv = block(x, cos, sin, ck, cv, jnp.int32(Sp), mask)
      if layer >= 0:
        ck, cv = jnp.take_along_axis(ck, src, axis=2), jnp.take_along_axis(cv, src, axis=2)
      out.append((ck, cv))
    logits = head(x[:, -1:], embed.table[...])
    token, stop = sample(logits[:, -1], samp, jnp.zeros((), jnp.int32), mode, self.kernels)
    return tuple(out), token, stop | (samp.max_new <= 1)

  def _blocks_impl(self, kv, pad, block_tokens: int):
    """Each row's prompt keys from a prefill's ``kv`` (row p's prompt in [pad[p], T)) cut into blocks:
    [P, T // B, L, 2, K, B, E] (B = ``block_tokens``; L: the path's blocks with keys), block j of row p holding
    prompt positions [j * B, (j + 1) * B) (past the prompt's end: whatever the cache held)."""
    real = [(k, v) for layer, (k, v) in zip(self.layers, kv, strict=True) if layer >= 0]
    P, K, T, E = real[0][0].shape
    B = block_tokens
    NB = T // B
    src = jnp.clip(jnp.arange(NB * B)[None, :] + pad[:, None], 0, T - 1)[:, None, :, None]  # [P, 1, NB * B, 1]
    moved = jnp.stack([jnp.stack([jnp.take_along_axis(a, src, axis=2) for a in pair]) for pair in real])
    # [L, 2, P, K, NB * B, E] -> [P, NB, L, 2, K, B, E]
    return moved.reshape(len(real), 2, P, K, NB, B, E).transpose(2, 4, 0, 1, 3, 5, 6)

  def _insert_impl(self, state: DecodeState, kv, slot, row, n, token, done_count) -> DecodeState:
    """Write row ``row`` of a prefill's keys (the prompt of ``n`` tokens) into ``slot``'s ring at absolute
    positions [cursor - n, cursor)."""
    S = self.cache_len
    c = state.cursor
    d = layout.ring_behind(c, S)
    valid = (d >= 1) & (d <= n)
    caches = []
    for layer, (ck, cv), (pk, pv) in zip(self.layers, state.caches, kv, strict=True):
      if layer < 0:  # a bridge keeps no keys
        caches.append((ck, cv))
        continue
      T = pk.shape[2]
      src = jnp.clip(T - d, 0, T - 1)  # the prefill cache holds the prompt left-padded in [T - n, T)
      rows = []
      for pre in (pk, pv):
        one = jax.lax.dynamic_index_in_dim(pre, row, 0, keepdims=False)  # [K, T, E]
        rows.append(jnp.where(valid[None, :, None], jnp.take(one, src, axis=1), 0).astype(ck.dtype))
      caches.append((ck.at[slot].set(rows[0]), cv.at[slot].set(rows[1])))
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


def slot_program(defs, cfg, layers, slots, cache_len, chunk, kernels) -> SlotProgram:
  """The slot program of this layout from the process's one program cache (:data:`thoughtjax.decode.program.PROGRAMS`):
  a new engine of the same layout compiles nothing.

  Keyed by the path's shape (:func:`~thoughtjax.transformer.path_shape`): it runs any path of that shape on the
  path's parts :meth:`~thoughtjax.transformer.PathParts.by_position`."""
  return program_lib.PROGRAMS.get(SlotKey(tuple(layers), slots, cache_len, chunk, kernels), defs, cfg, SlotProgram)

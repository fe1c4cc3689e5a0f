"""Self-speculative decoding: a short path of the same model drafts, the full path verifies, in one program.

A *draft* is a prefix of the full path: ``embed, blocks[0:k)`` of it, optionally a bridge after them
(``embed, blocks[0:10), bridge.10-30, head``), then the head, optionally over a truncated vocabulary
(the ``vocab`` most frequent token ids). After its shared prefix a draft may also run blocks of other
weights, a weight variant of the full path (``embed, blocks[0:30)@int8, head``, ``embed, blocks[0:10),
blocks[10:30)@int8, head``): those *own* blocks keep a KV cache of their own, filled by the prefill and by
every draft step, since their keys are not the full path's. Each decode iteration of :class:`SpecProgram`,
inside one ``lax.while_loop`` of one compiled program,

1. runs the draft K times, one token at a time, proposing d_1..d_K after the last token d_0; its
   shared blocks write the KV-cache entries the full path would write for the same tokens (its own
   blocks write their own cache, and once more for d_K, so the next iteration finds every accepted token);
2. runs the full path once over the K+1 positions d_0..d_K, giving p_0..p_K (with ``reuse``, the
   verify pass starts at block k from the residuals the draft saved there, since blocks 0..k-1 already
   ran on those tokens);
3. accepts a prefix of the draft and appends one more token of the full path's own:
   greedy rows accept d_{j+1} while it equals argmax p_j, then take argmax p_n, so the tokens are those
   of plain greedy decoding; sampled rows accept d_{j+1} with probability min(1, p_j/q_j) and on the
   first rejection sample from norm(max(0, p_n - q_n)) (after K acceptances: from p_K), so every token
   has the full path's distribution (Leviathan et al. 2023), p and q under the same bias, temperature,
   top-k and top-p transform.

Rows accept different counts, so every row keeps its own cache slot: row b's last token (not yet in the
cache) goes to slot ``T + count[b] - 1``, with left-padded prompts as in :mod:`thoughtjax.decode.program`.
Blocks run per row under ``vmap`` so each row writes its keys at its own slot. Positions written for
rejected tokens are overwritten later (writes are by position) and are masked until then.

An *n-gram draft* (``"ngram:N"`` or ``"ngram:N:M"``, prompt lookup) needs no weights: step 1 becomes a
lookup in the row's own history (the left-padded prompt, then the tokens generated so far, both on device).
It finds the latest earlier position whose last m tokens equal the history's last m, for the largest m <= N
that has one, and proposes the K tokens that followed it (a match whose continuation reaches the end of the
history repeats its period, so ``a b a b`` proposes ``a b a b``). Its proposal is deterministic, a one-hot q:
a sampled row accepts d with probability p(d) and on rejection draws from p with d removed, renormalised,
which is the rule above with that q. The verify pass is the full path's over the K+1 positions from the
embedding (no shared blocks). When no live row has a match of at least M tokens (default 1), the iteration
is a plain one-token step instead (d_0 alone, no draft counted, no verify pass): a pass of K+1 rows costs
more than a step of one, and a short match rarely predicts.

The prefill and the first token are the plain program's. A stop token inside an accepted run ends the
row there; ``max_tokens`` cuts the run; cancellation acts between device calls of ``chunk`` iterations.
The Trace of a speculative call counts tokens drafted, drafts accepted and verify passes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax import exported, quantized
from thoughtjax.decode import layout
from thoughtjax.decode import program as program_lib
from thoughtjax.decode import state as state_lib
from thoughtjax.decode.interface import DecodeInputs, DecodeProgram, Tokens, run_chunks
from thoughtjax.decode.program import ProgramKey
from thoughtjax.decode.request import DecodeRequest
from thoughtjax.decode.state import DecodeState
from thoughtjax.decode.stream import Generation, Rows, Trace
from thoughtjax.defaults import DEFAULT_DRAFT_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import format_path, parse_path
from thoughtjax.sampling import (
  SamplingArrays,
  SamplingMode,
  sample,
  sampling_arrays,
  top_p_mask,
)
from thoughtjax.transformer import GraphDefs, PathParts, merge_path, path_shape, rope_tables, run_path

NGRAM_DEFAULT = 3  # "ngram" alone: look up the last 3 tokens, then 2, then 1
NGRAM_MAX = 16
# "always" and "resample" are deliberately wrong rules, the statistical tests' controls: accept every draft;
# on a rejection draw from p itself rather than from the residual (the rejected draft keeps its mass).
AcceptRule = Literal["speculative", "always", "resample"]


class DraftError(UserError, ValueError):
  """A draft that cannot speculate for this model; the message names the draft, the rule and the fix."""


@dataclasses.dataclass(eq=False)
class Draft:
  """What drafts for a full path.

  ``path``: a path string (``"embed, blocks[0:10), head"``, or with a registry bridge
  ``"embed, blocks[0:10), bridge.10-30, head"``) or layer slots, a prefix of the full path's blocks
  followed only by bridges; ``bridge``: params of a bridge (:mod:`thoughtjax.thoughtlet.bridge`, e.g.
  fresh from training) run after the shared blocks; ``vocab``: a truncated head over that many of the
  most frequent ids (BPE ids follow merge order, so the lowest ids stand in for the most frequent) or
  over the given ids; ``reuse``: the verify pass starts from the residual the draft saved after the
  shared blocks instead of recomputing them. It saves the shared blocks' work on K positions for one
  more single-token pass through them (d_K was never drafted from): the same weight reads, less
  compute. Measured on CPU at batch 1, K=4, interleaved runs: 6% faster at exit 8, 12% at exit 28
  (``thoughtjax bench speculative`` prints the comparison).

  ``path="ngram:N"`` (``"ngram"``: N=3, N in [1, 16]) is the n-gram draft of the module docstring: no
  weights, the continuation of the latest earlier match of the last N (then N-1, ..., 1) tokens;
  ``"ngram:N:M"`` drafts only from a match of at least M <= N tokens (a plain step otherwise). It takes no
  ``vocab`` or ``bridge``. :meth:`ngram` builds one.
  """

  @classmethod
  def ngram(cls, n: int = NGRAM_DEFAULT, min_match: int = 1) -> Draft:
    """The n-gram (prompt lookup) draft matching up to the last ``n`` tokens, drafting from a match of at
    least ``min_match``."""
    return cls(f"ngram:{n}" if min_match == 1 else f"ngram:{n}:{min_match}")

  path: str | Sequence[int]
  vocab: int | Sequence[int] | None = None
  bridge: Mapping | None = None
  reuse: bool = True


@dataclasses.dataclass(frozen=True)
class SpecKey(ProgramKey):
  """A plain program's key (:class:`thoughtjax.decode.program.ProgramKey`: path, batch, prompt and output lengths,
  sampling mode, chunk of verify passes per device call, kernels) and what the draft adds. Speculative programs
  are unrolled and take no template or masks: those fields stay at their defaults."""

  draft: tuple[int, ...] = ()  # draft slots: layers[:shared], then ``own`` slots of its own weights, bridges (< 0)
  shared: int = 0  # leading full-path blocks the draft runs
  draft_tokens: int = 1  # K
  draft_vocab: int | None = None  # size of the truncated draft head (its ids come as data)
  reuse: bool = True
  accept: AcceptRule = "speculative"  # "always", "resample": deliberately wrong rules, the statistical tests' controls
  own: int = 0  # draft blocks after the shared ones with weights (and a KV cache) of their own
  ngram: int = 0  # > 0: an n-gram draft matching up to this many last tokens (no draft blocks)
  ngram_min: int = 1  # the shortest match it drafts from; shorter: a plain step

  def shape(self) -> SpecKey:
    """The path and the draft numbered by position, the draft's slots after the path's."""
    return dataclasses.replace(self, layers=path_shape(self.layers), draft=path_shape(self.draft, len(self.layers)))

  @property
  def cache_len(self) -> int:  # S: a verify pass writes K positions past the last token
    return self.prompt_len + self.max_new + self.draft_tokens + 1


class SpecState(NamedTuple):
  """A pool's rows (:class:`~thoughtjax.decode.state.DecodeState`: the full path's caches, tokens, counts; ``out``
  [B, N + K + 1]) and what the draft adds."""

  rows: DecodeState
  drafted: jax.Array  # [B] i32
  accepted: jax.Array  # [B] i32
  passes: jax.Array  # [B] i32, verify passes
  draft_caches: tuple[tuple[jax.Array, jax.Array], ...] = ()  # per own draft block


def _is_stop(tokens, stop_ids):
  """tokens [B, J] -> [B, J] bool: in the row's stop set (entries < 0 are padding)."""
  hit = (tokens[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0)
  return jnp.any(hit, axis=-1)


def ngram_proposal(hist, start, end, n_max: int, K: int):
  """The n-gram draft's K tokens per row and the length of the match they follow: hist [B, S] i32 (row b's
  history at [start[b], end[b]]), start, end [B] i32 -> ([B, K] i32, [B] i32).

  Scores every earlier end position i < end by how many of the history's last n_max tokens it matches
  backwards (consecutively, within the history), takes the longest match, latest on ties, and proposes
  what followed it, repeating the period ``end - i`` where that reaches past ``end``; no match: hist[end]
  K times, length 0. O(B S n_max) compares, no host round trip."""
  B, S = hist.shape
  i = jnp.arange(S)[None, :]
  run = jnp.ones((B, S), bool)
  length = jnp.zeros((B, S), jnp.int32)
  for j in range(n_max):
    tail = jnp.take_along_axis(hist, jnp.maximum(end - j, 0)[:, None], axis=1)  # [B, 1] the j-th last token
    back = jnp.pad(hist, ((0, 0), (j, 0)), constant_values=-1)[:, :S]  # back[b, i] = hist[b, i - j]
    run = run & (back == tail) & (i - j >= start[:, None]) & (end - j >= start)[:, None]
    length = length + run
  score = jnp.where((i < end[:, None]) & (length > 0), length * S + i, -1)
  best = jnp.argmax(score, axis=1).astype(jnp.int32)
  found = jnp.max(score, axis=1) >= 0
  period = jnp.maximum(end - best, 1)
  idx = best[:, None] + 1 + jnp.arange(K)[None, :] % period[:, None]
  got = jnp.take_along_axis(hist, jnp.clip(idx, 0, S - 1), axis=1)
  last = jnp.take_along_axis(hist, end[:, None], axis=1)
  matched = jnp.where(found, jnp.take_along_axis(length, best[:, None], axis=1)[:, 0], 0)
  return jnp.where(found[:, None], got, last).astype(jnp.int32), matched.astype(jnp.int32)


def transformed_probs(logits, samp: SamplingArrays, mode: SamplingMode, bias=None):
  """logits [B, J, V] -> probabilities [B, J, V] under each row's bias, temperature, top-k and top-p,
  as the fused sampler draws from them (top-k keeps ties at the k-th value). ``bias`` [B, V] overrides
  ``samp.logit_bias`` (a truncated head's columns)."""
  B, J, V = logits.shape
  bias = samp.logit_bias if bias is None else bias
  rep = lambda a: jnp.repeat(a, J, axis=0)  # noqa: E731 - per row -> per (row, position)
  x = logits.reshape(B * J, V).astype(jnp.float32)
  if mode is SamplingMode.SAMPLE_TOP_P:
    flat = samp._replace(
      temperature=rep(samp.temperature),
      top_k=rep(samp.top_k),
      top_p=rep(samp.top_p),
      logit_bias=None if bias is None else rep(bias),
    )
    x = top_p_mask(x, flat)
  if bias is not None:
    x = x + rep(bias)
  x = x / rep(jnp.maximum(samp.temperature, 1e-6))[:, None]
  k = rep(samp.top_k)
  kth = jnp.take_along_axis(jnp.sort(x, axis=-1), (V - jnp.clip(k, 1, V))[:, None], axis=-1)
  x = jnp.where((k[:, None] > 0) & (k[:, None] < V) & (x < kth), -jnp.inf, x)
  return jax.nn.softmax(x, axis=-1).reshape(B, J, V)


class SpecProgram(DecodeProgram):
  """One compiled speculative generation program; see the module docstring.

  The decode program interface (:class:`~thoughtjax.decode.interface.DecodeProgram`) over one executable:
  :meth:`prefill` runs the plain program's prefill and first token, :meth:`advance` up to ``chunk``
  draft-and-verify iterations; both donate the state. Its inputs carry the draft's truncated vocabulary.
  """

  def __init__(self, key: SpecKey, defs: GraphDefs, cfg):
    self.key, self.defs, self.cfg = key, defs, cfg
    # Exported as the plain program is (thoughtjax.exported): a later process loads the lowered program instead of
    # tracing and lowering draft and verify again, which took ~4 s of its compile stage (the state, 5, donated).
    self._advance = exported.wrap(
      jax.jit(self._advance_impl, donate_argnums=(5,)), key=(key, defs, cfg), donate_argnums=(5,), out_like=5
    )
    self._init = jax.jit(self._init_impl)

  def _init_impl(self) -> SpecState:
    k = self.key
    caches = layout.empty_caches(self.cfg, k.layers, k.batch, k.cache_len)
    zeros = jnp.zeros(k.batch, jnp.int32)
    return SpecState(
      state_lib.empty(caches, k.batch, k.max_new + k.draft_tokens + 1, free=False),
      zeros,
      zeros,
      zeros,
      layout.empty_caches(self.cfg, range(k.own), k.batch, k.cache_len),
    )

  def init_state(self, parts: PathParts | None = None) -> SpecState:
    """The empty state, committed to the one device ``parts`` live on (as
    :meth:`thoughtjax.decode.program.Program.init_state`): ``advance`` returns a committed state, and an
    uncommitted first one would make the first decode chunk compile the program a second time."""
    return program_lib.on_device_of(self._init(), parts)

  def prefill(self, inputs: DecodeInputs, state: SpecState) -> SpecState:
    return self._advance(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, inputs.vocab_ids, state)

  def advance(self, inputs: DecodeInputs, state: SpecState) -> SpecState:
    return self._advance(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, inputs.vocab_ids, state)

  def read(self, state: SpecState) -> Tokens:
    return Tokens(state.rows.out, state.rows.count, state.rows.done)

  def lower(self, inputs: DecodeInputs):
    """The lowered program of these inputs' shapes (HLO inspection)."""
    state = jax.eval_shape(self._init_impl)
    return self._advance.trace(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, inputs.vocab_ids, state).lower()

  # ---- traced code -------------------------------------------------------------
  def _prefill(self, parts, prompt, pad, samp, vocab_ids, st):
    del vocab_ids
    k = self.key
    embed, blocks, head = merge_path(self.defs, parts, k.layers)
    positions, mask = layout.prefill(pad, k.prompt_len, k.cache_len)
    zero = jnp.zeros((), jnp.int32)
    logits, caches = run_path(embed, blocks, head, prompt, positions, st.rows.caches, zero, mask, last=True)
    draft_caches = st.draft_caches
    if k.own:  # the draft's own blocks see the prompt too: from the residual after the shared blocks
      _, draft_blocks, _ = merge_path(self.defs, parts, k.draft[: k.shared + k.own])
      cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
      x = embed(prompt)
      for block, (ck, cv) in zip(draft_blocks[: k.shared], caches[: k.shared], strict=True):
        x, _, _ = block(x, cos, sin, ck, cv, zero, mask)  # the same entries the full path wrote: dropped
      new = []
      for block, (ck, cv) in zip(draft_blocks[k.shared :], draft_caches, strict=True):
        x, ck, cv = block(x, cos, sin, ck, cv, zero, mask)
        new.append((ck, cv))
      draft_caches = tuple(new)
    token, stop = sample(logits[:, -1], samp, zero, k.mode, k.kernels)
    rows = state_lib.prefilled(st.rows, caches, pad, k.prompt_len, token, stop, samp)
    return st._replace(rows=rows, draft_caches=draft_caches)

  def _blocks(self, blocks, slots, x, positions, caches, write_at, mask):
    """Run ``blocks`` (path slots ``slots``) over x [B, J, D]; row b writes its J keys at slot write_at[b]."""
    cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
    new = []
    for block, slot, (ck, cv) in zip(blocks, slots, caches, strict=True):
      if slot < 0:  # a bridge: position-wise, no cache
        x, ck, cv = block(x, cos, sin, ck, cv, write_at, mask)
      else:

        def row(x, cos, sin, ck, cv, w, m, block=block):
          y, ck, cv = block(x[None], cos[None], sin[None], ck[None], cv[None], w, m[None])
          return y[0], ck[0], cv[0]

        x, ck, cv = jax.vmap(row)(x, cos, sin, ck, cv, write_at, mask)
      new.append((ck, cv))
    return x, new

  def _draft_logits(self, embed, head, x, vocab_ids):
    """Draft head over x [B, J, D]: logits [B, J, V] or, truncated, [B, J, Vd] over ``vocab_ids``."""
    if vocab_ids is None:
      return head(x, embed.table[...])
    w = embed.table[...] if head.tied else head.unembed[...]
    rows = quantized.take_rows(w, vocab_ids) if quantized.is_packed(w) else jnp.take(w, vocab_ids, axis=0)
    h = head.norm(x)  # btd,vd->btv
    return jax.lax.dot_general(h, rows.astype(h.dtype), (((2,), (1,)), ((), ())), precision=quantized.EXACT).astype(
      jnp.float32
    )

  def _iteration(self, parts, pad, samp, vocab_ids, st: SpecState, proposal=None) -> SpecState:
    """One draft-and-verify iteration; an n-gram draft's ``proposal`` [B, K'] comes looked up (K' = 0: a plain
    step)."""
    k = self.key
    K, S = (k.draft_tokens if proposal is None else proposal.shape[1]), k.cache_len
    greedy_only = k.mode is SamplingMode.GREEDY
    embed, full_blocks, head = merge_path(self.defs, parts, k.layers)
    _, draft_blocks, _ = merge_path(self.defs, parts, k.draft) if k.draft else (None, [], None)
    pool = st.rows
    B = pool.token.shape[0]
    slot0 = pool.cursor + pool.count - 1  # [B] cache slot of d_0 (the cursor stays where the prefill left it)
    live = ~pool.done
    draft_bias = None
    if samp.logit_bias is not None:
      draft_bias = samp.logit_bias if vocab_ids is None else jnp.take(samp.logit_bias, vocab_ids, axis=1)
    keys = None
    if not greedy_only:  # per (seed, tokens so far): a row draws the same whatever its batch
      keys = jax.vmap(lambda sd, c: jax.random.split(jax.random.fold_in(jax.random.key(sd), c), K + 2))(
        samp.seed, pool.count
      )

    def shared_pass(caches, tok, j):
      slot = slot0 + j
      positions, mask = layout.step_at(pad, slot, S)
      x = embed(tok[:, None])
      x, new = self._blocks(draft_blocks[: k.shared], k.draft[: k.shared], x, positions, caches[: k.shared], slot, mask)
      return x, tuple(new) + tuple(caches[k.shared :]), positions, mask

    own_blocks, own_slots = draft_blocks[k.shared : k.shared + k.own], k.draft[k.shared : k.shared + k.own]

    def draft_step(j, c):
      caches, dcaches, toks, resid, qlog = c
      tok = jax.lax.dynamic_index_in_dim(toks, j, axis=1, keepdims=False)
      x, caches, positions, mask = shared_pass(caches, tok, j)
      resid = jax.lax.dynamic_update_slice_in_dim(resid, x, j, axis=1)
      if k.own:
        x, new = self._blocks(own_blocks, own_slots, x, positions, dcaches, slot0 + j, mask)
        dcaches = tuple(new)
      for bridge in draft_blocks[k.shared + k.own :]:  # position-wise: no rope, no cache
        x, _, _ = bridge(x, None, None, None, None, None, None)
      logits = self._draft_logits(embed, head, x, vocab_ids)[:, 0]  # [B, V or Vd]
      biased = logits if draft_bias is None else logits + draft_bias
      nxt = jnp.argmax(biased, axis=-1).astype(jnp.int32)
      if not greedy_only:
        q = transformed_probs(logits[:, None], samp, k.mode, draft_bias)[:, 0]
        drawn = jax.vmap(lambda key, lq: jax.random.categorical(key, lq))(keys[:, j], jnp.log(q)).astype(jnp.int32)
        nxt = jnp.where(samp.temperature > 0, drawn, nxt)
        qlog = jax.lax.dynamic_update_slice_in_dim(qlog, logits[:, None], j, axis=1)
      if vocab_ids is not None:
        nxt = jnp.take(vocab_ids, nxt)
      toks = jax.lax.dynamic_update_slice_in_dim(toks, nxt[:, None], j + 1, axis=1)
      return caches, dcaches, toks, resid, qlog

    if k.ngram:
      toks = jnp.concatenate([pool.token[:, None], proposal], axis=1)
      caches, dcaches, resid, qlog = pool.caches, st.draft_caches, None, None
    else:
      D = self.cfg.d_model
      Vd = self.cfg.vocab_size if vocab_ids is None else k.draft_vocab
      toks = jnp.zeros((B, K + 1), jnp.int32).at[:, 0].set(pool.token)
      resid = jnp.zeros((B, K + 1, D), jnp.float32)
      qlog = jnp.zeros((B, K if not greedy_only else 0, Vd), jnp.float32)  # the draft's raw logits per step
      caches, dcaches, toks, resid, qlog = jax.lax.fori_loop(
        0, K, draft_step, (pool.caches, st.draft_caches, toks, resid, qlog)
      )

    # Verify the K + 1 positions d_0..d_K in one pass.
    slots = slot0[:, None] + jnp.arange(K + 1)[None, :]  # [B, K+1]
    positions, mask = layout.steps_at(pad, slots, S)
    if (k.reuse and k.shared > 0) or k.own:
      # d_K has not been through the shared blocks yet; the draft's residuals stand for d_0..d_{K-1}.
      last, caches, lpos, lmask = shared_pass(caches, toks[:, K], K)
    if k.own:  # the own blocks' cache takes d_K too: after K acceptances the next d_0 follows it
      _, new = self._blocks(own_blocks, own_slots, last, lpos, dcaches, slot0 + K, lmask)
      dcaches = tuple(new)
    if k.reuse and k.shared > 0:
      x = jax.lax.dynamic_update_slice_in_dim(resid, last, K, axis=1)
      x, rest = self._blocks(
        full_blocks[k.shared :], k.layers[k.shared :], x, positions, caches[k.shared :], slot0, mask
      )
      caches = tuple(caches[: k.shared]) + tuple(rest)
    else:
      x, caches = self._blocks(full_blocks, k.layers, embed(toks), positions, caches, slot0, mask)
    logits = head(x, embed.table[...])  # [B, K+1, V]
    biased = logits if samp.logit_bias is None else logits + samp.logit_bias[:, None, :]
    target = jnp.argmax(biased, axis=-1).astype(jnp.int32)  # [B, K+1]
    drafts = toks[:, 1:]  # [B, K]
    ok = drafts == target[:, :K]
    V = self.cfg.vocab_size
    if not greedy_only:
      p = transformed_probs(logits, samp, k.mode)  # [B, K+1, V]
      if k.ngram:  # a deterministic proposal: q_j is one-hot at d_{j+1}
        q = None
        qd = jnp.ones((B, K), jnp.float32)
      else:
        q_small = transformed_probs(qlog, samp, k.mode, draft_bias)  # [B, K, Vd]
        q = q_small if vocab_ids is None else jnp.zeros((B, K, V)).at[:, :, vocab_ids].set(q_small)
        qd = jnp.take_along_axis(q, drafts[:, :, None], axis=-1)[..., 0]
      pd = jnp.take_along_axis(p[:, :K], drafts[:, :, None], axis=-1)[..., 0]
      u = jax.vmap(lambda key: jax.random.uniform(key, (K,)))(keys[:, K])
      sampled_ok = u * qd < pd if k.accept != "always" else jnp.ones_like(ok)
      ok = jnp.where((samp.temperature > 0)[:, None], sampled_ok, ok)
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B] drafts accepted
    bonus = jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]
    if not greedy_only:
      p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
      if q is None and K == 0:  # a plain step: the bonus is drawn from p_0
        q_n = jnp.zeros_like(p_n)
      elif q is None:  # one-hot at the rejected d_{n+1}; 0 at n == K
        d_n = jnp.take_along_axis(drafts, jnp.minimum(n, K - 1)[:, None], axis=1)
        q_n = ((jnp.arange(V)[None, :] == d_n) & (n < K)[:, None]).astype(jnp.float32)
      else:
        q_n = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), n[:, None, None], axis=1)[:, 0]  # 0 at n == K
      r = jnp.maximum(p_n - q_n, 0.0) if k.accept != "resample" else p_n
      r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_n)  # p == q: the residual is p itself
      drawn = jax.vmap(lambda key, lr: jax.random.categorical(key, lr))(keys[:, K + 1], jnp.log(r)).astype(jnp.int32)
      bonus = jnp.where(samp.temperature > 0, drawn, bonus)

    j = jnp.arange(K + 1)[None, :]
    new = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)  # position K: only ever the bonus
    new = jnp.where(j == n[:, None], bonus[:, None], new)
    stop = _is_stop(new, samp.stop_ids) & (j <= n[:, None])
    first_stop = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1), K + 1)
    take = jnp.minimum(jnp.minimum(n + 1, first_stop + 1), jnp.maximum(samp.max_new - pool.count, 0))
    take = jnp.where(live, take, 0)
    idx = pool.count[:, None] + j
    written = jnp.where(j < take[:, None], new, -1)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], idx.shape)
    out = pool.out.at[rows, idx].set(jnp.where(j < take[:, None], written, pool.out[rows, idx]), mode="drop")
    last = jnp.take_along_axis(new, jnp.maximum(take - 1, 0)[:, None], axis=1)[:, 0]
    count = pool.count + take
    done = pool.done | (live & ((first_stop < take) | (count >= samp.max_new)))
    live_i = live.astype(jnp.int32)
    return st._replace(
      rows=pool._replace(
        caches=tuple(caches), token=jnp.where(take > 0, last, pool.token), count=count, done=done, out=out
      ),
      draft_caches=dcaches,
      drafted=st.drafted + live_i * K,
      accepted=st.accepted + live_i * jnp.minimum(n, take),
      passes=st.passes + (live_i if K else 0),
    )

  def _decode_chunk(self, parts, prompt, pad, samp, vocab_ids, st):
    def cond(c):
      i, st = c
      return (i < self.key.chunk) & ~jnp.all(st.rows.done)

    def body(c):
      i, st = c
      if not self.key.ngram:
        return i + 1, self._iteration(parts, pad, samp, vocab_ids, st)
      # History: the left-padded prompt at [pad, T), then the generated tokens at T + [0, count); d_0 is last.
      hist = jnp.concatenate([prompt, st.rows.out], axis=1)  # [B, S]
      k = self.key
      proposal, matched = ngram_proposal(hist, pad, k.prompt_len + st.rows.count - 1, k.ngram, k.draft_tokens)
      draft = jnp.any(~st.rows.done & (matched >= k.ngram_min))
      st = jax.lax.cond(
        draft,
        lambda st: self._iteration(parts, pad, samp, vocab_ids, st, proposal),
        lambda st: self._iteration(parts, pad, samp, vocab_ids, st, proposal[:, :0]),
        st,
      )
      return i + 1, st

    return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), st))[1]

  def _advance_impl(self, parts, prompt, pad, samp, vocab_ids, st):
    started = st.rows.cursor > 0  # the prefill moved the cursor past the prompt
    return jax.lax.cond(started, self._decode_chunk, self._prefill, parts, prompt, pad, samp, vocab_ids, st)


# ---- host side ------------------------------------------------------------------------
class ResolvedDraft(NamedTuple):
  """A draft checked against a full path: its slots, the blocks it shares, the parts both read."""

  slots: tuple[int, ...]
  shared: int
  parts: PathParts  # the full path's parts, plus the draft's own blocks and bridges
  vocab_ids: jax.Array | None  # [Vd] i32
  reuse: bool
  label: str
  own: int = 0  # draft blocks of other weights after the shared ones (a KV cache of their own)
  ngram: int = 0  # > 0: the n-gram draft's longest lookup (no slots, no blocks)
  ngram_min: int = 1  # its shortest match that drafts


def _prefix_error(model, label: str, why: str) -> DraftError:
  n = max(1, len([i for i in model.layers if i >= 0]) // 3)
  return DraftError(
    f"draft {label!r} cannot draft for the path {model.path!r}: {why}. A draft runs embed, the full path's "
    f"first k blocks in the same order (optionally bridges after them), then head, over the same model; "
    f"e.g. draft='embed, blocks[0:{n}), head'"
  )


def _same_leaves(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(x is y or np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def ngram_order(path) -> tuple[int, int] | None:
  """(N, M) of an n-gram draft path (``"ngram"``: (3, 1), ``"ngram:N"``: (N, 1), ``"ngram:N:M"``), None for any
  other path; a malformed or out-of-range N or M is a :class:`DraftError`."""
  if not isinstance(path, str) or path.strip().split(":")[0].strip().lower() != "ngram":
    return None
  fields = [f.strip() for f in path.strip().split(":")[1:]]
  if not fields:
    return NGRAM_DEFAULT, 1
  n = _int_or_none(fields[0])
  if len(fields) > 2 or n is None or not 1 <= n <= NGRAM_MAX:
    raise DraftError(
      f"draft {path!r}: an n-gram draft is 'ngram:N' (or 'ngram:N:M') with N, the most last tokens it looks up, "
      f"an integer in [1, {NGRAM_MAX}]; got {':'.join(fields)!r}. Use e.g. 'ngram:3' (or 'ngram' for "
      f"N={NGRAM_DEFAULT})"
    )
  m = 1 if len(fields) == 1 else _int_or_none(fields[1])
  if m is None or not 1 <= m <= n:
    raise DraftError(
      f"draft {path!r}: in 'ngram:N:M', M, the shortest match it drafts from, is an integer in [1, N] = [1, {n}]; "
      f"got {fields[1]!r}. Use e.g. 'ngram:{n}:{min(2, n)}'"
    )
  return n, m


def _int_or_none(text: str) -> int | None:
  try:
    return int(text)
  except ValueError:
    return None


def resolve_draft(model, draft: str | Sequence[int] | Draft) -> ResolvedDraft:
  """Check ``draft`` against ``model``'s path (a :class:`~thoughtjax.model.Model`); see :class:`Draft`."""
  spec = draft if isinstance(draft, Draft) else Draft(draft)
  label = spec.path if isinstance(spec.path, str) else str(list(spec.path))
  if model.template is not None:
    raise _prefix_error(model, label, "the full path starts with a template; speculate over an embed path")
  order = ngram_order(spec.path)
  if order is not None:
    if spec.vocab is not None or spec.bridge is not None:
      raise DraftError(
        f"draft {label!r} looks its tokens up in the text: it has no head or blocks, so vocab= and bridge= do "
        f"not apply (got vocab={spec.vocab!r}, bridge={'given' if spec.bridge is not None else None}); drop them"
      )
    if any(i < 0 for i in model.layers):
      raise _prefix_error(model, label, "the full path itself holds a bridge; verify with the uncut path")
    n, m = order
    return ResolvedDraft((), 0, model.parts, None, False, f"ngram:{n}" + (f":{m}" if m > 1 else ""), 0, n, m)
  blocks = dict(model.parts.blocks)
  if isinstance(spec.path, str):
    refs = parse_path(spec.path)
    if refs[0].name != "embed" or refs[-1].name != "head":
      raise _prefix_error(model, label, f"it must start with embed and end with head, got {refs[0]} ... {refs[-1]}")
    plain = all(r.version is None and r.variant is None for r in refs)
    if all(r.span is not None for r in refs[1:-1]) and plain and model.links is None:
      slots = [i for r in refs[1:-1] for i in r.layers(model.config.num_layers)]
      other = None
    else:  # registry refs (bridges, versions) or weight variants: composed over the same source
      other = _composed(model, spec.path)
      slots = list(other.layers)
      for part in ("embed", "head"):
        if not _same_leaves(getattr(other.parts, part), getattr(model.parts, part)):
          raise _prefix_error(model, label, f"its {part} holds other weights than the full path's")
  else:
    slots, other = [int(i) for i in spec.path], None
  full = [i for i in model.layers]

  def same(j: int) -> bool:  # the draft's j-th block is the full path's j-th, weights and all
    if j >= len(full) or slots[j] != full[j]:
      return False
    return other is None or _same_leaves(other.parts.blocks[slots[j]], blocks[full[j]])

  shared = 0
  while shared < len(slots) and slots[shared] >= 0 and same(shared):
    shared += 1
  own = shared
  while own < len(slots) and slots[own] >= 0:
    # After the shared prefix only blocks of other weights (a variant: a cache of their own) may run.
    if other is None or _same_leaves(other.parts.blocks[slots[own]], blocks.get(slots[own], {})):
      mine, theirs = format_path(slots[: own + 1]), format_path(full)
      raise _prefix_error(model, label, f"its blocks ({mine}) are not the first blocks of the full path ({theirs})")
    own += 1
  own -= shared
  if any(i >= 0 for i in slots[shared + own :]):
    raise _prefix_error(model, label, f"only bridges may follow its shared blocks, got slots {slots}")
  draft_slots = list(slots[:shared])
  top = max([-1, *blocks]) + 1
  for j, i in enumerate(slots[shared : shared + own]):  # its own blocks, in slots the full path does not use
    blocks[top + j] = other.parts.blocks[i]
    draft_slots.append(top + j)
  free = min([0, *blocks]) - 1
  for i in slots[shared + own :]:  # the draft's registry bridges, in slots the full path does not use
    blocks[free] = other.parts.blocks[i]
    draft_slots.append(free)
    free -= 1
  if spec.bridge is not None:
    blocks[free] = dict(spec.bridge)
    draft_slots.append(free)
  if any(i < 0 for i in full):
    raise _prefix_error(model, label, "the full path itself holds a bridge; verify with the uncut path")
  if own == 0 and len(draft_slots) == len(full) and draft_slots == full and spec.vocab is None:
    raise _prefix_error(model, label, "it is the full path itself, so it saves nothing; cut it or truncate its head")
  V = model.config.vocab_size
  vocab_ids = None
  if spec.vocab is not None:
    ids = np.arange(spec.vocab) if isinstance(spec.vocab, (int, np.integer)) else np.unique(np.asarray(spec.vocab))
    if ids.size < 1 or ids.min() < 0 or ids.max() >= V:
      raise DraftError(
        f"draft vocab {spec.vocab!r}: expected a size in [1, {V}] or token ids in [0, {V}); pick ids the "
        f"draft may propose, e.g. vocab=8192 for the 8192 most frequent"
      )
    vocab_ids = jnp.asarray(ids, jnp.int32)
  parts = PathParts(model.parts.embed, blocks, model.parts.head)
  return ResolvedDraft(tuple(draft_slots), shared, parts, vocab_ids, spec.reuse, label, own)


_COMPOSED: dict = {}  # (id of the full path's parts, draft path) -> (those parts, the composed draft)


def forget_drafts(parts=None) -> int:
  """Drop the drafts composed over ``parts`` (a full path's weights; None: every one); returns how many. A server
  releasing an idle path calls it, so the draft's reference to the full path's weights goes too."""
  keys = [k for k, (p, _) in list(_COMPOSED.items()) if parts is None or p is parts]
  for k in keys:
    _COMPOSED.pop(k, None)
  return len(keys)


def _composed(model, path: str):
  """``model.with_path(path)``, kept for the last few (full parts, path): a variant draft of a loaded model is
  quantized when composed, once, not on every call."""
  key = (id(model.parts), path)
  got = _COMPOSED.get(key)
  if got is not None and got[0] is model.parts:
    return got[1]
  other = model.with_path(path)
  while len(_COMPOSED) >= 4:
    _COMPOSED.pop(next(iter(_COMPOSED)))
  _COMPOSED[key] = (model.parts, other)
  return other


def get_program(key: SpecKey, defs: GraphDefs, cfg) -> SpecProgram:
  """The program of ``key``'s shape: its path and draft numbered by position (:func:`~thoughtjax.transformer.path_shape`,
  the draft after the path), run on parts :meth:`~thoughtjax.transformer.PathParts.by_position` of both. Held in the
  process's one program cache (:data:`thoughtjax.decode.program.PROGRAMS`)."""
  return program_lib.PROGRAMS.get(key, defs, cfg, SpecProgram)


def _count_drafts(trace: Trace, rows: int, state: SpecState | None) -> None:
  """The trace's drafted, accepted and verify-pass counts of the call's ``rows`` rows, from its last state."""
  if state is not None:
    drafted, accepted, passes = jax.device_get((state.drafted, state.accepted, state.passes))
    trace.drafted, trace.accepted = int(drafted[:rows].sum()), int(accepted[:rows].sum())
    trace.verify_passes = int(passes[:rows].sum())


class SpecRequest(NamedTuple):
  """One speculative call's program and inputs, prepared on the host."""

  key: SpecKey  # the call's own key (the program's holds its shape)
  program: SpecProgram
  inputs: DecodeInputs


def prepare(
  model,
  request: DecodeRequest,
  draft,
  draft_tokens: int = DEFAULT_DRAFT_TOKENS,
  accept: AcceptRule = "speculative",
) -> SpecRequest:
  """The program and inputs of a speculative call over a checked request (checks the draft and the sizes)."""
  if not isinstance(draft_tokens, (int, np.integer)) or not 1 <= draft_tokens <= 64:
    raise DraftError(f"draft_tokens is the number of tokens drafted per verify pass, in [1, 64]; got {draft_tokens!r}")
  d = resolve_draft(model, draft)
  longest, max_new = max(len(i) for i in request.ids), max(p.max_tokens for p in request.params)
  if longest + max_new + draft_tokens + 1 > model.config.max_context:
    raise DraftError(
      f"prompt ({longest} tokens) + max_tokens ({max_new}) + draft_tokens + 1 ({draft_tokens + 1}) exceeds the "
      f"model's context of {model.config.max_context}: a verify pass looks draft_tokens past the end; "
      f"shorten the prompt or lower max_tokens"
    )
  key = SpecKey(
    layers=model.layers,
    draft=d.slots,
    shared=d.shared,
    draft_tokens=int(draft_tokens),
    **request.key_fields(),
    chunk=model.chunk,
    kernels=model.kernels,
    draft_vocab=None if d.vocab_ids is None else int(d.vocab_ids.shape[0]),
    reuse=d.reuse,
    accept=accept,
    own=d.own,
    ngram=d.ngram,
    ngram_min=d.ngram_min,
  )
  prog = get_program(key, GraphDefs.from_model(model.module), model.config)
  B, T = key.batch, key.prompt_len
  tokens, pad = request.left_padded(B, T)
  samp = sampling_arrays(request.params, B, model.config.vocab_size, key.stop_width, model.codec.eos_ids, key.has_bias)
  parts = d.parts.by_position(key.layers, key.draft)
  return SpecRequest(key, prog, DecodeInputs(parts, jnp.asarray(tokens), jnp.asarray(pad), samp, d.vocab_ids))


def stream_batch(
  model,
  request: DecodeRequest,
  start: float,
  draft,
  draft_tokens: int = DEFAULT_DRAFT_TOKENS,
  accept: AcceptRule = "speculative",
):
  """A speculative :class:`~thoughtjax.decode.stream.Generation` of a checked request (the engine's ``draft=``
  path)."""

  req = prepare(model, request, draft, draft_tokens, accept)
  trace = Trace(req.key, [list(i) for i in request.ids], start, tokens_out=[0] * len(request.ids))
  cancelled = threading.Event()
  rows = Rows(model.codec, request.params, request.stops)
  n = len(request.ids)
  run = run_chunks(req.program, req.inputs, rows, trace, cancelled, finish=lambda st: _count_drafts(trace, n, st))
  return Generation(run, trace, cancelled)

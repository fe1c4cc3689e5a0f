"""The Llama-family decoder as a tree of small Flax NNX parts.

The parts line up with thoughtlet kinds: :class:`Embed` (tokens -> residual),
:class:`Block` (residual -> residual, one layer), :class:`Head` (residual -> logits), and
:class:`BridgeLayer` (residual -> residual, a bridge thoughtlet standing in a block's place).
:class:`Transformer` holds them and runs any *layer path* (a sequence of layer
indices, repeats allowed) so early exits, skips and repeated spans are the same code.

Numerics follow the reference implementation: RMSNorm in float32 and cast back,
rotate-half RoPE (Hugging Face order; GGUF's permuted Q/K rows are undone at load),
grouped-query attention, SwiGLU. Parameter dtype and compute dtype are separate.

Model code never calls ``jax.jit``; :mod:`thoughtjax.decode.program` owns that boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from thoughtjax import quantized
from thoughtjax.config import ModelConfig

Array = jax.Array


def _zeros(shape, dtype):
  return nnx.Param(jnp.zeros(shape, dtype))


class RMSNorm(nnx.Module):
  """x * w / rms(x), computed in float32 and cast back to x.dtype."""

  def __init__(self, dim: int, eps: float, dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:  # [..., D]
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + self.eps)
    w = self.weight[...].astype(jnp.float32)
    return (y * w.reshape((1,) * (y.ndim - 1) + w.shape)).astype(x.dtype)  # explicit broadcast over [...]


def rope_tables(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """cos, sin of shape [B, T, E/2] for integer positions [B, T]."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotate-half RoPE. x [B, T, N, E]; cos, sin [B, T, E/2]."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
  return out.astype(x.dtype)


def _matmul(x: Array, w: Array | quantized.BlockQuant) -> Array:
  """[B, T, I] x [I, O] -> [B, T, O]. Direct dot_general: einsum's path search and
  nested jit cost start-up time when tracing 30 layers. A native weight is W [O, I] in its
  quantized blocks (:mod:`thoughtjax.quantized`), read packed and computed in float32."""
  if quantized.is_packed(w):
    return quantized.matmul(x, w)
  return jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())), precision=quantized.EXACT)


def _matrix(w: Array | quantized.BlockQuant, rows: int, cols: int):
  """A weight as the [I, O] = [rows, cols] matrix _matmul takes (a native weight already is one)."""
  return w if quantized.is_packed(w) else w.reshape(rows, cols)


def _batched(a: Array, b: Array, b_contract: int) -> Array:
  """[B, K, Q, X] x [B, K, ., .] -> [B, K, Q, .], contracting a's last dim with b's dim
  ``b_contract`` (3: bkqe,bkse->bkqs; 2: bkqs,bkse->bkqe)."""
  return jax.lax.dot_general(a, b, (((3,), (b_contract,)), ((0, 1), (0, 1))), precision=quantized.EXACT)


def kv_cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, int, int, int]:
  """Shape of one layer's K (or V) cache: [B, K, S, E]."""
  return (batch, cfg.num_kv_heads, length, cfg.head_dim)


def _write(cache: Array, new: Array, write_at: Array) -> Array:
  """cache [B, K, S, E] with new [B, K, T, E] at slots write_at.. (clamped into the cache like any DUS)."""
  zero = jnp.zeros((), jnp.int32)
  return jax.lax.dynamic_update_slice(cache, new, (zero, zero, write_at, zero))


def after(at: Array, ctx: Array, last: int) -> Array:
  """``at`` (already in [0, last]) unchanged, as a value computed after ``ctx``.

  An ordering edge for XLA's copy insertion (optimization barriers are gone by then): min(at, last or
  last + 1, chosen by a test on ctx that holds for any value, NaN included) is at; no pass folds it.
  """
  probe = ctx.reshape(-1)[0]
  return jnp.minimum(at, jnp.where(jnp.isnan(probe) | (probe == probe), last, last + 1))


def _before_and_new(cache_k, cache_v, k_new, v_new, write_at, mask):
  """Attention over the cache as it will be after writing T new keys at ``write_at``, as two parts
  that read only the cache as it is now: its slots outside [at, at + T), and the new keys in place of
  those slots (``at`` clamped as dynamic_update_slice clamps). mask [B, T, S] -> masks [B, T, S], [B, T, T]."""
  S, T = cache_k.shape[2], k_new.shape[2]
  at = jnp.clip(write_at, 0, S - T)
  s = jnp.arange(S)
  replaced = (s >= at) & (s < at + T)
  return (cache_k, cache_v, mask & ~replaced[None, None, :]), (
    k_new,
    v_new,
    jax.lax.dynamic_slice_in_dim(mask, at, T, 2),
  )


def _attend(qg: Array, parts, B: int, T: int, G: int, E: int) -> Array:
  """Softmax attention of qg [B, K, T*G, E] over the concatenated key parts (keys [B, K, S_i, E],
  values [B, K, S_i, E], mask [B, T, S_i]): one softmax over all parts. Returns ctx [B, K, T*G, E]."""
  scores = []
  for keys, _, mask in parts:
    sc = _batched(qg, keys, 3).astype(jnp.float32) * (E**-0.5)  # bkqe,bkse->bkqs
    allowed = jnp.broadcast_to(mask[:, None, :, None, :], (B, 1, T, G, mask.shape[-1]))
    scores.append(jnp.where(allowed.reshape(B, 1, T * G, -1), sc, -jnp.inf))
  probs = jax.nn.softmax(scores[0] if len(scores) == 1 else jnp.concatenate(scores, axis=-1), axis=-1)
  ctx, start = None, 0
  for _, values, _ in parts:
    n = values.shape[2]
    term = _batched(probs[..., start : start + n].astype(values.dtype), values, 2)  # bkqs,bkse->bkqe
    ctx, start = term if ctx is None else ctx + term, start + n
  return ctx


class KeyBlocks(NamedTuple):
  """Which blocks of a cache one decode step's queries read (:func:`key_blocks`): ``M`` (row, block) pairs, each
  ``size`` consecutive cache slots of one row. A row's keys outside its pairs are masked for all its queries."""

  rows: Array  # [M] i32, ascending
  blocks: Array  # [M] i32, the block of the cache (slots [block * size, block * size + size))
  allowed: Array  # [M, size] bool, the row's mask over those slots (False for every slot of a padding pair)


def key_blocks(mask: Array, blocks: int, pairs: int) -> KeyBlocks:
  """The (row, block) pairs of a one-query mask [B, 1, S] (S divisible by ``blocks``) that allow any slot, in order,
  padded with pairs that allow none up to ``pairs`` (which must be at least as many as allow any: see
  :func:`blocks_needed`)."""
  by_block, needed = _by_block(mask, blocks)
  rows, index = jnp.nonzero(needed, size=pairs, fill_value=0)
  real = jnp.arange(pairs) < needed.sum()
  return KeyBlocks(rows.astype(jnp.int32), index.astype(jnp.int32), by_block[rows, index] & real[:, None])


def blocks_needed(mask: Array, blocks: int) -> Array:
  """How many (row, block) pairs of a one-query mask [B, 1, S] allow any slot: i32 []."""
  return _by_block(mask, blocks)[1].sum(dtype=jnp.int32)


def _by_block(mask: Array, blocks: int) -> tuple[Array, Array]:
  """A one-query mask [B, 1, S] as [B, blocks, S / blocks], and whether each (row, block) allows any slot."""
  B, _, S = mask.shape
  by_block = mask.reshape(B, blocks, S // blocks)
  return by_block, by_block.any(-1)


def _attend_blocks(qg: Array, before, new, plan: KeyBlocks) -> Array:
  """:func:`_attend` of one query per row (T = 1) over ``before`` (the cache, read only at ``plan``'s pairs) and
  ``new`` (the new keys), one softmax over both: the scores of each row's pairs are gathered, not the whole cache's."""
  keys, values, mask = before
  B, K, S, E = keys.shape
  size = plan.allowed.shape[1]
  take = lambda c: c.reshape(B, K, S // size, size, E)[plan.rows, :, plan.blocks]  # noqa: E731  [M, K, size, E]
  allowed = plan.allowed & mask.reshape(B, S // size, size)[plan.rows, plan.blocks]  # without the slot replaced
  at = dict(num_segments=B, indices_are_sorted=True)
  scores = _batched(qg[plan.rows], take(keys), 3).astype(jnp.float32) * (E**-0.5)  # [M, K, G, size]
  scores = jnp.where(allowed[:, None, None, :], scores, -jnp.inf)
  k_new, v_new, mask_new = new
  fresh = _batched(qg, k_new, 3).astype(jnp.float32) * (E**-0.5)  # [B, K, G, 1]
  fresh = jnp.where(mask_new[:, :, None, :], fresh, -jnp.inf)
  top = jnp.maximum(jax.ops.segment_max(scores.max(-1), plan.rows, **at), fresh.max(-1))  # [B, K, G], finite
  weights, weights_new = jnp.exp(scores - top[plan.rows][..., None]), jnp.exp(fresh - top[..., None])
  total = jax.ops.segment_sum(weights.sum(-1), plan.rows, **at) + weights_new.sum(-1)
  ctx = jax.ops.segment_sum(_batched(weights.astype(values.dtype), take(values), 2), plan.rows, **at)
  ctx = ctx + _batched(weights_new.astype(v_new.dtype), v_new, 2)
  return ctx / total[..., None]


class Attention(nnx.Module):
  """Grouped-query self-attention over a KV cache."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
    D, H, K, E = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.q = _zeros((D, H, E), dtype)
    self.k = _zeros((D, K, E), dtype)
    self.v = _zeros((D, K, E), dtype)
    self.o = _zeros((H, E, D), dtype)
    if cfg.qkv_bias:
      self.q_bias = _zeros((H, E), dtype)
      self.k_bias = _zeros((K, E), dtype)
      self.v_bias = _zeros((K, E), dtype)

  def __call__(
    self,
    x: Array,
    cos: Array,
    sin: Array,
    cache_k: Array,
    cache_v: Array,
    write_at: Array,
    mask: Array,
    *,
    new_only: bool = False,
    blocks: KeyBlocks | None = None,
  ) -> tuple[Array, Array, Array]:
    """One attention step over new tokens.

    x [B, T, D]; cos, sin [B, T, E/2]; cache_k, cache_v [B, K, S, E] (see kv_cache_shape);
    write_at: scalar index where the T new keys go in the cache;
    mask [B, T, S] bool, True where a query may attend a cache slot (of the updated cache).
    Returns the output [B, T, D] and the updated caches (``new_only``: the new keys and values [B, K, T, E] instead,
    which belong at ``clip(write_at, 0, S - T)``, for a caller that keeps the caches elsewhere).

    A short write (2T <= S: decode, verification) attends over the cache as it was plus the new keys in
    one softmax and writes the cache last, so a loop carrying the cache updates it in place. ``blocks`` (one query
    per row, ``new_only``): the cache is read at those (row, block) pairs only, which must hold every slot ``mask``
    allows outside the one written (:func:`key_blocks`).
    """
    cfg = self.cfg
    B, T, D = x.shape
    H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # Contract against the weights viewed as 2-D matrices (a free reshape): XLA:CPU runs
    # these as plain GEMV/GEMM, about 3x faster than the 3-D einsum at batch 1.
    q = _matmul(x, _matrix(self.q[...], D, H * E)).reshape(B, T, H, E)  # btd,df->btf
    k = _matmul(x, _matrix(self.k[...], D, K * E)).reshape(B, T, K, E)
    v = _matmul(x, _matrix(self.v[...], D, K * E)).reshape(B, T, K, E)
    if cfg.qkv_bias:
      q, k, v = q + self.q_bias[...][None, None], k + self.k_bias[...][None, None], v + self.v_bias[...][None, None]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # The cache is [B, K, S, E]: batch dims lead, so both attention contractions are
    # plain batched matmuls with no per-step transpose of the cache.
    k_new = k.transpose(0, 2, 1, 3).astype(cache_k.dtype)  # [B, K, T, E]
    v_new = v.transpose(0, 2, 1, 3).astype(cache_v.dtype)
    G = cfg.group_size  # query heads k*G .. k*G+G-1 share kv head k
    qg = q.reshape(B, T, K, G, E).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, E)
    S = cache_k.shape[2]
    if 2 * T > S:  # a prefill-sized write: attend over the updated cache (the old part is mostly replaced)
      cache_k, cache_v = _write(cache_k, k_new, write_at), _write(cache_v, v_new, write_at)
      ctx = _attend(qg, ((cache_k, cache_v, mask),), B, T, G, E)
    elif new_only and blocks is not None:
      if T != 1:
        raise ValueError(f"attention over key blocks takes one query per row, not {T}")
      ctx = _attend_blocks(qg, *_before_and_new(cache_k, cache_v, k_new, v_new, write_at, mask), blocks)
    elif new_only:
      ctx = _attend(qg, _before_and_new(cache_k, cache_v, k_new, v_new, write_at, mask), B, T, G, E)
    else:
      ctx = _attend(qg, _before_and_new(cache_k, cache_v, k_new, v_new, write_at, mask), B, T, G, E)
      # The write is the cache's last use in the step, and its index depends on ctx so that the reads
      # of the old cache data-precede it: XLA then updates the loop-carried buffer in place. With the
      # order of a read and the write left open, copy insertion copies the cache (every layer, every step).
      at = after(jnp.clip(write_at, 0, S - T), ctx, S - T)
      cache_k, cache_v = _write(cache_k, k_new, at), _write(cache_v, v_new, at)
    ctx = ctx.reshape(B, K, T, G, E).transpose(0, 2, 1, 3, 4).reshape(B, T, H * E)
    out = _matmul(ctx.astype(x.dtype), _matrix(self.o[...], H * E, D))  # btf,fd->btd
    return (out, k_new, v_new) if new_only else (out, cache_k, cache_v)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate x) * up x)."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
    self.gate = _zeros((cfg.d_model, cfg.ffn_dim), dtype)
    self.up = _zeros((cfg.d_model, cfg.ffn_dim), dtype)
    self.down = _zeros((cfg.ffn_dim, cfg.d_model), dtype)

  def __call__(self, x: Array) -> Array:  # [B, T, D] -> [B, T, D]
    g = _matmul(x, self.gate[...])  # btd,df->btf
    u = _matmul(x, self.up[...])
    return _matmul(jax.nn.silu(g) * u, self.down[...])  # btf,fd->btd


class Block(nnx.Module):
  """One decoder layer: residual -> residual."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, dtype)
    self.attn = Attention(cfg, dtype)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, dtype)
    self.mlp = MLP(cfg, dtype)

  def __call__(self, x, cos, sin, cache_k, cache_v, write_at, mask, *, new_only: bool = False, blocks=None):
    """x [B, T, D] -> (x, caches); ``new_only``: (x, the new keys, the new values), ``blocks``: the cache's blocks
    to read, see :class:`Attention`."""
    h, cache_k, cache_v = self.attn(
      self.attn_norm(x), cos, sin, cache_k, cache_v, write_at, mask, new_only=new_only, blocks=blocks
    )
    x = x + h
    x = x + self.mlp(self.mlp_norm(x))
    return x, cache_k, cache_v


class Embed(nnx.Module):
  """Token ids [B, T] -> residual [B, T, D]."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
    self.table = _zeros((cfg.vocab_size, cfg.d_model), dtype)

  def __call__(self, tokens: Array) -> Array:
    table = self.table[...]
    if quantized.is_packed(table):  # gather the quantized rows, dequantize only those
      return quantized.take_rows(table, tokens)
    return jnp.take(table, tokens, axis=0)


class Head(nnx.Module):
  """Residual [B, T, D] -> logits [B, T, V]: final norm and LM head (tied or not)."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
    self.norm = RMSNorm(cfg.d_model, cfg.rms_eps, dtype)
    self.tied = cfg.tie_embeddings
    if not self.tied:
      self.unembed = _zeros((cfg.vocab_size, cfg.d_model), dtype)

  def __call__(self, x: Array, table: Array | None = None) -> Array:
    w = table if self.tied else self.unembed[...]
    if w is None:
      raise ValueError("a tied head needs the embedding table; pass table=embed.table[...]")
    h = self.norm(x)  # btd,vd->btv
    if quantized.is_packed(w):  # [V, D] blocks: the head reads the packed bytes
      return quantized.matmul(h, w)
    return jax.lax.dot_general(h, w, (((2,), (1,)), ((), ())), precision=quantized.EXACT).astype(jnp.float32)


class Transformer(nnx.Module):
  """Embed, L blocks and a head; runs any layer path over a per-position KV cache."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32):
    self.cfg = cfg
    self.embed = Embed(cfg, dtype)
    self.blocks = nnx.List([Block(cfg, dtype) for _ in range(cfg.num_layers)])
    self.head = Head(cfg, dtype)

  def full_path(self) -> tuple[int, ...]:
    return tuple(range(self.cfg.num_layers))

  def forward(
    self,
    tokens: Array,
    positions: Array,
    caches: Sequence[tuple[Array, Array]],
    write_at: Array,
    mask: Array,
    layers: Sequence[int] | None = None,
  ):
    """Run a layer path (default: every layer once); see :func:`run_path`."""
    layers = self.full_path() if layers is None else tuple(layers)
    return run_path(self.embed, [self.blocks[i] for i in layers], self.head, tokens, positions, caches, write_at, mask)


def run_path(
  embed: Embed,
  blocks: Sequence[Block],
  head: Head,
  tokens: Array,
  positions: Array,
  caches: Sequence[tuple[Array, Array]],
  write_at: Array,
  mask: Array,
  embeddings: Array | None = None,
  *,
  last: bool = False,
):
  """Embed, then each block in order (a block may appear more than once), then the head.

  tokens [B, T] i32 (ignored when ``embeddings`` [B, T, D] is given); positions [B, T]
  i32 RoPE positions; caches: one (k, v) pair per block of the path, each
  :func:`kv_cache_shape`;
  write_at: scalar cache slot of the first new token; mask [B, T, S] bool.
  Returns logits [B, T, V] f32 (``last``: [B, 1, V], the last position's only, as a prefill needs) and the new
  caches.
  """
  if len(caches) != len(blocks):
    raise ValueError(f"need one cache per path block: {len(blocks)} blocks, {len(caches)} caches")
  x = embed(tokens) if embeddings is None else embeddings
  new_caches = []
  if blocks:
    cfg = path_config(blocks)
    cos, sin = (None, None) if cfg is None else rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    for block, (ck, cv) in zip(blocks, caches, strict=True):
      x, ck, cv = block(x, cos, sin, ck, cv, write_at, mask)
      new_caches.append((ck, cv))
  return head(x[:, -1:] if last else x, embed.table[...]), new_caches


def path_config(blocks: Sequence) -> ModelConfig | None:
  """The model config of a path's first decoder block (a bridge in the sequence has none)."""
  # Duck-typed: a block may stand behind a wrapper (thoughtlet.isolate's recorders forward .attn).
  return next((b.attn.cfg for b in blocks if getattr(b, "attn", None) is not None), None)


class PathParts(NamedTuple):
  """Parameters a path needs: embed, the distinct blocks it uses, head."""

  embed: nnx.State
  blocks: dict[int, nnx.State]
  head: nnx.State

  @classmethod
  def from_model(cls, model: Transformer, layers: Sequence[int]) -> PathParts:
    return cls(
      nnx.state(model.embed), {i: nnx.state(model.blocks[i]) for i in sorted(set(layers))}, nnx.state(model.head)
    )

  def by_position(self, *sequences: Sequence[int]) -> PathParts:
    """These parts keyed by position along ``sequences`` (see :func:`path_shape`), the form a program takes:
    a layer a path repeats appears once per position, holding the same arrays."""
    blocks, start = {}, 0
    for layers in sequences:
      blocks.update(zip(path_shape(layers, start), (self.blocks[i] for i in layers), strict=True))
      start += len(layers)
    return PathParts(self.embed, blocks, self.head)


def path_shape(layers: Sequence[int], start: int = 0) -> tuple[int, ...]:
  """A path as its program sees it: position p holds block ``start + p``, or bridge ``-(start + p + 1)``.

  Weights are program arguments, so paths of one shape (say the 30 layers in order, and 30 layers that
  repeat a span) run one compiled program: the program is keyed by this shape and its parts are
  :meth:`PathParts.by_position`. ``start`` numbers a second sequence after a first (a draft after its path)."""
  return tuple(start + p if i >= 0 else -(start + p + 1) for p, i in enumerate(layers))


class GraphDefs(NamedTuple):
  """Static structure of a path's modules (one block graph serves every layer)."""

  embed: nnx.GraphDef
  block: nnx.GraphDef
  head: nnx.GraphDef

  @classmethod
  def from_model(cls, model: Transformer) -> GraphDefs:
    return cls(nnx.graphdef(model.embed), nnx.graphdef(model.blocks[0]), nnx.graphdef(model.head))


BRIDGE_EPS = 1e-6  # the bridge's own RMSNorm epsilon (a property of the adapter, not of the model)


def apply_bridge(params: Mapping, x: Array) -> Array:
  """A bridge over residual x [B, T, D] -> [B, T, D] (x.dtype): ``x + up(silu(down(norm(x))))``.

  ``params`` is ``{"norm": {"weight": [D]}, "down": [D, R], "up": [R, D]}`` (R, the rank, is their
  shape); ``norm`` is an RMSNorm in float32 with its own weight. The bridge thoughtlet that holds
  these params (initialised, cut, published) is :mod:`thoughtjax.thoughtlet.bridge`."""
  x32 = x.astype(jnp.float32)
  h = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + BRIDGE_EPS)
  w = params["norm"]["weight"].astype(jnp.float32)
  h = h * w.reshape((1,) * (h.ndim - 1) + w.shape)  # explicit broadcast over [...]
  z = jax.nn.silu(jnp.einsum("btd,dr->btr", h, params["down"].astype(jnp.float32), precision=quantized.EXACT))
  return (x32 + jnp.einsum("btr,rd->btd", z, params["up"].astype(jnp.float32), precision=quantized.EXACT)).astype(
    x.dtype
  )


class BridgeLayer:
  """A bridge in a block's place inside a path: same call, caches passed through untouched."""

  def __init__(self, params: Mapping):
    self.params = params

  def __call__(self, x, cos, sin, cache_k, cache_v, write_at, mask):
    del cos, sin, write_at, mask  # position-wise: no attention, no rope
    return apply_bridge(self.params, x), cache_k, cache_v


def merge_path(defs: GraphDefs, parts: PathParts, layers: Sequence[int]) -> tuple[Embed, list[Block], Head]:
  """Modules of a path from graph definitions and states (inside traced code).

  A negative slot holds a bridge thoughtlet's params, run as a :class:`BridgeLayer`."""
  embed = nnx.merge(defs.embed, parts.embed)
  by_layer = {i: BridgeLayer(s) if i < 0 else nnx.merge(defs.block, s) for i, s in parts.blocks.items()}
  return embed, [by_layer[i] for i in layers], nnx.merge(defs.head, parts.head)


def init_random(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, scale: float = 0.02) -> Transformer:
  """A Transformer with seeded random weights (tiny test models)."""
  model = Transformer(cfg, dtype)
  state = nnx.state(model, nnx.Param)
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  keys = jax.random.split(jax.random.key(seed), len(paths_leaves))
  new = []
  for key, (path, leaf) in zip(keys, paths_leaves, strict=True):
    noise = scale * jax.random.normal(key, leaf.shape, dtype)
    is_norm = any("norm" in str(getattr(p, "key", p)) for p in path)
    new.append(1.0 + noise if is_norm else noise)
  nnx.update(model, jax.tree.unflatten(treedef, new))
  return model


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> Transformer:
  """A Transformer whose parameters are shape/dtype placeholders (no memory)."""
  return nnx.eval_shape(lambda: Transformer(cfg, dtype))

"""Native weights: a GGUF's quantized blocks held so that XLA reads the packed bytes.

A :class:`BlockQuant` is one weight matrix W [O, I] (rows = outputs, the GGUF / PyTorch layout)
quantized in blocks of 32 consecutive inputs, as the GGUF stores it:

- ``Q8_0``: ``W[o, i] = scale[o, i // 32] * q[o, i]``, q int8;
- ``Q4_0``: the same with q in [-8, 7] (the file's 4-bit value minus 8), q int8;
- ``Q4_1``: ``W[o, i] = scale[o, i // 32] * q[o, i] + min[o, i // 32]``, q uint8 in [0, 15].

4-bit values are held one per byte: XLA:CPU fuses a uint8 -> float32 convert into the dot that
reads them, while unpacking two nibbles per byte (``jnp.uint4``) falls to a slow path (measured in
``../shared/experiments/cpu_weight_formats.py``). ``scale`` and ``min`` are the file's float16
values widened to float32, an exact conversion.

Contract: :func:`dequantize` gives, bit for bit, the float32 matrix that ``gguf.quants.dequantize``
gives for the same blocks (the same products and sums in float32, in the same order), so a model
computed from native weights is the f32 model up to the summation order inside each matmul.
:func:`matmul` and :func:`take_rows` compute from the packed form inside the traced program.

A :class:`BlockQuant` is a JAX pytree (arrays are children; ``kind`` is static) and can be the
value of an ``nnx.Param``. Like an array, ``w[...]`` is ``w`` itself (what ``Variable[...]`` calls),
``w[ids]`` gathers and dequantizes rows, and ``jnp.asarray(w)`` dequantizes the whole matrix
(code that needs a float32 table, e.g. a template's rows, keeps working).

A :class:`RowInt8` is the lossy ``int8`` form: W [O, I] as int8 q and one float32 scale per output
row (symmetric, ``W[o, i] ~ scale[o] * q[o, i]``, q in [-127, 127]), quantized from float32 weights by
:func:`quantize_int8`. Its matmul ``(x @ convert(q).T) * scale`` reads one byte per weight. It is not
exact: its quality against the exact path is measured (``thoughtjax bench decode --weights int8``).

A :class:`RowInt8A8` (``int8a8``) holds the same int8 weights and quantizes the activations too: each
row of x to int8 with its own scale (:func:`quantize_rows`), the dot in integers, then both scales.
With more than one row XLA:CPU runs that s8 x s8 -> s32 dot as an integer GEMM (an XNNPACK/YNNPACK
fusion), which beats the float32 GEMM at 8 rows where the convert-inside-the-dot forms lose to it
(``scripts/matmul_forms.py``). Lossy twice; its quality is measured like int8's.

Imports inside functions here are deferred for start-up: importing this module does not load ``gguf``; the functions
that need them do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.errors import UserError

# Every float32 dot of the engine asks for full float32 products. CPUs compute them so anyway; GPUs
# would otherwise round the operands to TF32 (seen on an H200: 1e-3 relative error in a matmul).
EXACT = jax.lax.Precision.HIGHEST

Kind = Literal["Q8_0", "Q4_0", "Q4_1"]
KINDS: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1")
BLOCK = 32  # inputs per block, for every kind here (gguf.GGML_QUANT_SIZES[...][0])
WEIGHT_FORMATS = ("f32", "native", "int8")
ArrayLike = jax.Array | np.ndarray


class WeightFormatError(UserError, ValueError):
  """A weight format, a block type or packed data is not what native weights accept."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQuant:
  """W [O, I] as blocks of 32 inputs: q [O, I] (int8, or uint8 for Q4_1), scale [O, I/32] f32,
  min [O, I/32] f32 (Q4_1 only, else None)."""

  q: ArrayLike
  scale: ArrayLike
  min: ArrayLike | None
  kind: str = dataclasses.field(metadata=dict(static=True), default="Q8_0")

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.q.shape)

  @property
  def ndim(self) -> int:
    return 2

  @property
  def dtype(self):
    return np.dtype(np.float32)  # what it computes as

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(self))

  def __getitem__(self, index):
    if index is Ellipsis:
      return self
    return take_rows(self, index)

  def __jax_array__(self):
    return dequantize_jnp(self)

  def map(self, fn) -> BlockQuant:
    """The same kind with ``fn`` applied to q, scale and min (e.g. a row permutation)."""
    return BlockQuant(fn(self.q), fn(self.scale), None if self.min is None else fn(self.min), self.kind)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowInt8:
  """W [O, I] as int8 q [O, I] and a float32 scale [O] per output row (symmetric, lossy)."""

  q: ArrayLike
  scale: ArrayLike
  # A static field, not a class attribute: jaxlib's PyTreeDef equality compares a dataclass node's static
  # fields but not its class, so without it RowInt8 and RowInt8A8 trees would compare equal and a jit
  # cache lookup could run one form's program on the other's weights.
  kind: str = dataclasses.field(metadata=dict(static=True), default="int8")

  shape = BlockQuant.shape
  ndim = BlockQuant.ndim
  dtype = BlockQuant.dtype
  nbytes = BlockQuant.nbytes
  __getitem__ = BlockQuant.__getitem__

  def __jax_array__(self):
    return dequantize_jnp(self)

  def map(self, fn) -> RowInt8:
    """``fn`` applied to q and scale (e.g. a row permutation; both are indexed by row first)."""
    return RowInt8(fn(self.q), fn(self.scale))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowInt8A8(RowInt8):
  """A :class:`RowInt8` W [O, I] whose matmul also quantizes x per row: ``(xq @ q.T) * xscale * scale``."""

  kind: str = dataclasses.field(metadata=dict(static=True), default="int8a8")

  def map(self, fn) -> RowInt8A8:
    return RowInt8A8(fn(self.q), fn(self.scale))


Packed = BlockQuant | RowInt8


def is_packed(w) -> bool:
  """Whether ``w`` is a weight held in a narrow form ([O, I], computed by :func:`matmul`)."""
  return isinstance(w, (BlockQuant, RowInt8))


def int8_activations(tree):
  """``tree`` (any pytree, e.g. a model's parts) with every :class:`RowInt8` as a :class:`RowInt8A8`:
  the same int8 weights, computed with int8 activations (the ``int8a8`` form of an ``int8`` model)."""

  def one(w):
    return RowInt8A8(w.q, w.scale) if isinstance(w, RowInt8) else w

  return jax.tree.map(one, tree, is_leaf=is_packed)


# Forms computed from a loadable form's weights by a transformation of a model's parts or params
# (``thoughtjax.load(weights=...)``, ``generate --weights``, ``thoughtjax bench decode --weights``).
DERIVED_FORMATS = {"int8a8": ("int8", int8_activations)}


def check_format(weights: str) -> str:
  if weights not in WEIGHT_FORMATS:
    raise WeightFormatError(
      f"weights={weights!r} is not a weight format; expected one of {', '.join(WEIGHT_FORMATS)} "
      f"(native: the GGUF's quantized blocks, computed in float32; f32: dequantized float32; "
      f"int8: per-row int8 quantized from float32, lossy)"
    )
  return weights


def quantize_int8(w: ArrayLike) -> RowInt8:
  """Per-output-row symmetric int8 of a float32 W [O, I] (numpy): scale[o] = max_i |W[o, i]| / 127,
  q = round(W / scale) in [-127, 127]; an all-zero row gets scale 0 and q 0."""
  w = dequantize(w) if is_packed(w) else np.asarray(w, np.float32)
  if w.ndim != 2:
    raise WeightFormatError(f"int8 quantization takes a matrix W [O, I]; got shape {w.shape}")
  scale = (np.max(np.abs(w), axis=1) / np.float32(127)).astype(np.float32)  # [O]
  safe = np.where(scale > 0, scale, np.float32(1))[:, None]
  q = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
  return RowInt8(q, scale)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, I] float32 -> (xq int8 [M, I], scale f32 [M]) in the traced program: per row symmetric,
  scale = max_i |x[m, i]| / 127, xq = round(x / scale) in [-127, 127]; an all-zero row gets scale 0."""
  scale = jnp.max(jnp.abs(x), axis=1) / jnp.float32(127)
  safe = jnp.where(scale > 0, scale, jnp.float32(1))[:, None]
  return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def _type_size(kind: str) -> int:
  import gguf

  block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
  if block != BLOCK:
    raise WeightFormatError(f"block type {kind}: expected blocks of {BLOCK} values, gguf says {block}")
  return size


def from_gguf_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int] | None = None) -> BlockQuant:
  """Packed numpy form of a GGUF tensor's raw blocks.

  raw: uint8 [O, I/32 * type_size] (what ``gguf.GGUFReader`` gives for a quantized tensor), or any
  array of the same bytes when ``shape`` = (O, I) is given.
  """
  if kind not in KINDS:
    raise WeightFormatError(
      f"block type {kind!r} has no native form; supported: {', '.join(KINDS)}. Load it with "
      f"weights='f32' (dequantized)."
    )
  size = _type_size(kind)
  raw = np.ascontiguousarray(raw).view(np.uint8)
  if shape is None:
    if raw.ndim != 2 or raw.shape[1] % size:
      raise WeightFormatError(f"{kind} blocks: expected uint8 [O, I/32 * {size}], got shape {raw.shape}")
    shape = (raw.shape[0], raw.shape[1] // size * BLOCK)
  rows, cols = shape
  if cols % BLOCK or raw.size != rows * cols // BLOCK * size:
    raise WeightFormatError(
      f"{kind} blocks: {raw.size} bytes do not hold a [{rows}, {cols}] matrix "
      f"(needs I divisible by {BLOCK} and {rows * cols // BLOCK * size} bytes)"
    )
  blocks = raw.reshape(rows, cols // BLOCK, size)
  scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [O, I/32]
  if kind == "Q8_0":
    return BlockQuant(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols), scale, None, kind)
  at = 4 if kind == "Q4_1" else 2
  nib = blocks[..., at : at + BLOCK // 2]  # byte j holds value j (low nibble) and value j + 16 (high)
  q = np.concatenate([nib & np.uint8(0x0F), nib >> np.uint8(4)], axis=-1).reshape(rows, cols)
  if kind == "Q4_0":
    return BlockQuant((q.astype(np.int8) - np.int8(8)), scale, None, kind)
  mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
  return BlockQuant(q, scale, mins, kind)


def dequantize(w: Packed) -> np.ndarray:
  """float32 [O, I] in numpy, bit for bit ``gguf.quants.dequantize`` of the same blocks."""
  if isinstance(w, RowInt8):
    return np.asarray(w.scale, np.float32)[:, None] * np.asarray(w.q).astype(np.float32)
  q = np.asarray(w.q)
  rows, cols = q.shape
  d = np.asarray(w.scale, np.float32)[:, :, None]
  out = d * q.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
  if w.min is not None:
    out = out + np.asarray(w.min, np.float32)[:, :, None]
  return out.reshape(rows, cols)


def dequantize_jnp(w: Packed) -> jax.Array:
  """float32 [O, I] computed in the traced program (the same products and sums as :func:`dequantize`)."""
  if isinstance(w, RowInt8):
    return jnp.asarray(w.scale)[:, None] * jnp.asarray(w.q).astype(jnp.float32)
  rows, cols = w.q.shape
  out = jnp.asarray(w.scale)[:, :, None] * jnp.asarray(w.q).reshape(rows, cols // BLOCK, BLOCK).astype(jnp.float32)
  if w.min is not None:
    out = out + jnp.asarray(w.min)[:, :, None]
  return out.reshape(rows, cols)


# Rows of x up to which the dot is fused with the dequantization (XLA:CPU's elemental dot, which reads
# W once per row); above it W is dequantized into a float32 buffer and multiplied as one GEMM. At 8 rows
# (batch-8 decode) both forms measured alike and 1.8-2.6x slower than float32 weights; prefill wants the GEMM.
FUSED_ROWS_MAX = 1


def matmul(x: jax.Array, w: Packed) -> jax.Array:
  """x [..., I] @ W.T -> [..., O] in float32, W read from its packed form.

  Dequantize-then-dot in one expression: XLA fuses the convert and the block scale into the dot's
  operand, so the program reads q's bytes (int8 / uint8) and no float32 W exists in memory.
  """
  if x.shape[-1] != w.shape[1]:
    raise ValueError(f"matmul: x has {x.shape[-1]} inputs, the {w.kind} weight [O, I] = {w.shape} expects {w.shape[1]}")
  # Exactly x2 [M, I] @ W.T [I, O] (measured with HLO dumps, jax 0.10.2): with M = 1 XLA:CPU then emits
  # the dot as one loop fusion that converts and scales q's bytes as it reads them. Contracting W's
  # dim 1 directly, or a [1, 1, I] operand, gets a materialized float32 W instead.
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  if isinstance(w, RowInt8A8):  # quantizes x first, then ties W to the quantized x (as below)
    return _int8a8_dot(x2, w).reshape(*x.shape[:-1], w.shape[0])
  # Tie W to x: inside a decode loop W is loop-invariant and XLA would hoist the dequantization out
  # of the loop, materializing float32 W once and then reading it through the slow elemental dot
  # (measured 6x slower than f32 weights). The barrier makes W's uses depend on this step's x.
  x2, w = jax.lax.optimization_barrier((x2, w))
  if x2.shape[0] <= FUSED_ROWS_MAX:
    x2 = computed_once(x2)
  if isinstance(w, RowInt8):  # (x @ convert(q).T) * scale: the per-row scale moves out of the sum
    y = jax.lax.dot_general(x2, jnp.asarray(w.q).astype(jnp.float32).T, (((1,), (0,)), ((), ())), precision=EXACT)
    y = y * jnp.asarray(w.scale)[None, :]
  elif x2.shape[0] > FUSED_ROWS_MAX:  # prefill: dequantize once, then one GEMM over all rows
    y = jax.lax.dot_general(x2, dequantize_jnp(w), (((1,), (1,)), ((), ())), precision=EXACT)
  else:
    y = jax.lax.dot_general(x2, dequantize_jnp(w).T, (((1,), (0,)), ((), ())), precision=EXACT)
  return y.reshape(*x.shape[:-1], w.shape[0])


def _int8a8_dot(x2: jax.Array, w: RowInt8A8) -> jax.Array:
  """x2 [M, I] f32 -> [M, O]: x2 quantized per row, the dot in integers, both scales applied after."""
  xq, xscale = quantize_rows(x2)
  xq, w = jax.lax.optimization_barrier((xq, w))  # no hoisting of W's uses out of a decode loop (see matmul)
  q = jnp.asarray(w.q)
  if x2.shape[0] > 1:  # XLA:CPU: an integer GEMM (XNNPACK/YNNPACK fusion) that reads q's bytes
    acc = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xscale[:, None] * jnp.asarray(w.scale)[None, :]
  # At one row XLA:CPU gives the s8 x s8 dot a converted s32 copy of W (measured 5-12x slower); the
  # float32 dot of the same integers is the fused decode form that reads q's bytes. Its sums are exact,
  # hence the int32 dot's, while every partial sum stays below 2**24 (always for I <= 1040).
  xqf = computed_once(xq.astype(jnp.float32))
  acc = jax.lax.dot_general(xqf, q.astype(jnp.float32).T, (((1,), (0,)), ((), ())), precision=EXACT)
  return acc * xscale[:, None] * jnp.asarray(w.scale)[None, :]


def computed_once(x: jax.Array) -> jax.Array:
  """``x`` itself, as a buffer of its own: the operand of a fused decode dot.

  XLA:CPU fuses x's producers (an RMSNorm's scaling, SiLU(gate) * up, a quantization) into the loop
  fusion of a one-row dot, which then recomputes them for every output row: the head recomputed its
  norm 49152 times per step (HLO of the decode loop). A conditional is not fused, so x is computed
  once before it; an optimization barrier does not do it (XLA:CPU removes it before fusion). Its
  branches reinterpret the bits (a branch that only returns its operand is simplified away with
  the conditional); the values are unchanged. Other backends get x as it is: a conditional per
  matmul would cost a GPU more than the fusion it prevents.
  """
  if jax.default_backend() != "cpu":
    return x
  bits = jax.lax.cond(jnp.isfinite(x.reshape(-1)[0]), _to_bits, _to_bits, x)
  return jax.lax.bitcast_convert_type(bits, x.dtype)


def _to_bits(a: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(a, jnp.uint32)


def take_rows(w: Packed, ids) -> jax.Array:
  """Rows ``W[ids]`` in float32 (ids of any shape -> [*ids.shape, I]): gathers the packed rows, then
  dequantizes only those (the embedding lookup of a quantized table)."""
  ids = jnp.asarray(ids)
  cols = w.q.shape[1]
  if isinstance(w, RowInt8):
    rows = jnp.take(jnp.asarray(w.q), ids, axis=0).astype(jnp.float32)
    return jnp.take(jnp.asarray(w.scale), ids, axis=0)[..., None] * rows
  q = jnp.take(jnp.asarray(w.q), ids, axis=0).reshape(*ids.shape, cols // BLOCK, BLOCK).astype(jnp.float32)
  out = jnp.take(jnp.asarray(w.scale), ids, axis=0)[..., None] * q
  if w.min is not None:
    out = out + jnp.take(jnp.asarray(w.min), ids, axis=0)[..., None]
  return out.reshape(*ids.shape, cols)


def to_device(w: Packed) -> Packed:
  return w.map(jnp.asarray)


def from_stored(params: Mapping) -> dict:
  """Params restored from a registry with every ``{"int8", "scale"}`` mapping back as a RowInt8."""

  def one(v):
    if isinstance(v, Mapping):
      return RowInt8(v["int8"], v["scale"]) if set(v) == {"int8", "scale"} else from_stored(v)
    return v

  return {k: one(v) for k, v in params.items()}

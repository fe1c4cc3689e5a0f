"""A thoughtlet's weights as arrays only: the form that is hashed, signed and checkpointed.

Weights held packed in memory (:mod:`thoughtjax.quantized`) are stored as small named trees of arrays,
so the versioned hash and the file digests cover the packed bytes themselves:

- :class:`~thoughtjax.quantized.RowInt8` (the lossy ``int8`` variant): ``{"int8": q int8 [O, I], "scale": f32 [O]}``;
- :class:`~thoughtjax.quantized.BlockQuant` (a GGUF's native blocks): ``{<kind>: q, "scale": f16 [O, I/32]}``
  plus ``"min": f16 [O, I/32]`` for Q4_1, where ``<kind>`` is ``Q8_0``, ``Q4_0`` or ``Q4_1`` (so the block
  type is part of every hashed path) and q holds the GGUF's own bytes: Q8_0 int8 [O, I]; Q4_0 / Q4_1 uint8
  [O, I/2], each 32-value block as 16 bytes whose byte j holds value j (low nibble) and value j + 16 (high).
  Scale and minimum are the file's float16 values. A stored block weight is as large as in the GGUF.

In memory a 4-bit value takes a byte and scales are float32 (what XLA reads fast, see ``quantized``);
:func:`block_from_stored` widens them back, exactly. Unquantized weights (norms, biases, F32/F16
matrices) are stored as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from thoughtjax.quantized import BLOCK, KINDS, BlockQuant, RowInt8, WeightFormatError

INT8_KEYS = frozenset({"int8", "scale"})


def _block_keys(kind: str) -> frozenset:
  return frozenset({kind, "scale", "min"} if kind == "Q4_1" else {kind, "scale"})


def stored_kind(node: Any) -> str | None:
  """``"int8"`` or the block type when ``node`` is a stored packed weight, else None."""
  if not isinstance(node, Mapping):
    return None
  keys = frozenset(node)
  if keys == INT8_KEYS:
    return "int8"
  kinds = [k for k in KINDS if k in keys]
  return kinds[0] if len(kinds) == 1 and keys == _block_keys(kinds[0]) else None


def _f16(x, what: str) -> np.ndarray:
  """float32 scales that came from the file's float16 values, narrowed back (checked exact)."""
  a = np.asarray(x, np.float32)
  h = a.astype(np.float16)
  if not np.array_equal(h.astype(np.float32).view(np.uint32), a.view(np.uint32)):
    raise WeightFormatError(
      f"{what}: block scales are not float16 values widened to float32, so the GGUF form cannot hold them; "
      f"native weights come from quantized.from_gguf_blocks"
    )
  return h


def block_to_stored(w: BlockQuant) -> dict:
  """The stored tree of one native weight (numpy; see the module docstring)."""
  q = np.asarray(w.q)
  rows, cols = q.shape
  out = {"scale": _f16(w.scale, w.kind)}
  if w.min is not None:
    out["min"] = _f16(w.min, w.kind)
  if w.kind == "Q8_0":
    out[w.kind] = q.astype(np.int8, copy=False)
    return out
  v = q.astype(np.int16) + (8 if w.kind == "Q4_0" else 0)  # the file's 4-bit values, 0..15
  if v.min(initial=0) < 0 or v.max(initial=0) > 15:
    raise WeightFormatError(f"{w.kind}: 4-bit values outside 0..15 (got {v.min()}..{v.max()}); the blocks are corrupt")
  v = v.astype(np.uint8).reshape(rows, cols // BLOCK, 2, BLOCK // 2)
  out[w.kind] = (v[:, :, 0] | (v[:, :, 1] << np.uint8(4))).reshape(rows, cols // 2)
  return out


def block_from_stored(node: Mapping) -> BlockQuant:
  """The in-memory :class:`BlockQuant` (numpy) of a stored block weight: nibbles one per byte, scales float32."""
  kind = stored_kind(node)
  if kind not in KINDS:
    raise WeightFormatError(
      f"not a stored block weight: keys {sorted(node)}; expected {{Q8_0|Q4_0|Q4_1, scale[, min]}}"
    )
  qs = np.asarray(node[kind])
  scale = np.asarray(node["scale"]).astype(np.float32)
  rows = qs.shape[0]
  cols = qs.shape[1] if kind == "Q8_0" else 2 * qs.shape[1]
  if qs.ndim != 2 or scale.shape != (rows, cols // BLOCK) or cols % BLOCK:
    raise WeightFormatError(
      f"stored {kind} weight: q {qs.shape} and scale {scale.shape} do not describe one [O, I] matrix "
      f"with blocks of {BLOCK}"
    )
  mins = None if kind != "Q4_1" else np.asarray(node["min"]).astype(np.float32)
  if kind == "Q8_0":
    return BlockQuant(qs.astype(np.int8, copy=False), scale, None, kind)
  g = qs.astype(np.uint8, copy=False).reshape(rows, cols // BLOCK, BLOCK // 2)
  q = np.concatenate([g & np.uint8(0x0F), g >> np.uint8(4)], axis=-1).reshape(rows, cols)
  if kind == "Q4_0":
    return BlockQuant(q.astype(np.int8) - np.int8(8), scale, None, kind)
  return BlockQuant(q, scale, mins, kind)


def to_stored(params: Mapping) -> dict:
  """``params`` with every packed weight as its stored tree; arrays and stored trees are kept as they are."""
  out = {}
  for k, v in params.items():
    if isinstance(v, BlockQuant):
      out[k] = block_to_stored(v)
    elif isinstance(v, RowInt8):
      out[k] = {"int8": v.q, "scale": v.scale}
    elif isinstance(v, Mapping):
      out[k] = to_stored(v)
    else:
      out[k] = v
  return out


def has_blocks(params: Mapping) -> bool:
  """Whether a stored tree holds any native block weight."""
  return any(
    stored_kind(v) in KINDS or (isinstance(v, Mapping) and stored_kind(v) is None and has_blocks(v))
    for v in params.values()
  )


# Parameters the model holds as [O, I] already ([V, D]); every other matrix is a projection held as
# [in..., out...] (thoughtjax.weights lays the float32 model out so).
_AS_ROWS = frozenset({"table", "unembed"})


def in_dims(name: str, rows_cols: tuple[int, int], shape: tuple[int, ...]) -> int | None:
  """How many leading dims of parameter ``name`` (model layout ``shape``) are the inputs of its [O, I]
  matrix ``rows_cols``; None when the model holds it as [O, I] already."""
  if name in _AS_ROWS:
    return None
  rows, cols = rows_cols
  for n in range(1, len(shape)):
    if int(np.prod(shape[:n])) == cols and int(np.prod(shape[n:])) == rows:
      return n
  raise WeightFormatError(f"parameter {name}: an [O, I] = {list(rows_cols)} matrix does not fit the model's {shape}")


def model_layout(name: str, dense: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """A dense [O, I] matrix of parameter ``name`` in the model's layout ``shape`` (as the float32 loader
  lays it out: ``W.T.reshape(shape)`` for projections, [V, D] as it is)."""
  return dense.reshape(shape) if in_dims(name, dense.shape, shape) is None else dense.T.reshape(shape)

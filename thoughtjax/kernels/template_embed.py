"""Fused template embedding: chat-template rows and user-token rows in one pass.

The template thoughtlet precomputes the embedding rows of a chat template's
fixed parts. A prompt's embedding is then those rows around the embedding rows
of the user's tokens, which this op writes in one pass instead of a gather, two
concatenations and a pad. Three implementations of one contract live here:

- ``template_embed_reference``: pure ``jnp``, the CPU default and the ground truth;
- the Pallas kernel (``implementation="pallas"``), lowered through Pallas' Triton
  backend on NVIDIA GPUs and interpreted on CPU;
- ``template_embed``: the public entry point that dispatches between them.

Layout of output row ``b`` (``P1 = len(prefix_rows)``, ``P2 = len(suffix_rows)``,
``L = clip(user_lengths[b], 0, U)``, ``T = total_len``)::

    right padding (default)            left padding (left_pad=True)
    [0, P1)          prefix_rows       [0, pad)                 zeros
    [P1, P1+L)       table[ids[:L]]    [pad, pad+P1)            prefix_rows
    [P1+L, P1+L+P2)  suffix_rows       [pad+P1, pad+P1+L)       table[ids[:L]]
    [P1+L+P2, T)     zeros             [pad+P1+L, T)            suffix_rows

with ``pad = T - (P1 + L + P2)``. ``ids = user_ids[b]``; entries past ``L`` are
ignored, and ids outside ``[0, V)`` are clamped into it (nothing can raise inside
``jit``). The output dtype is the promoted dtype of the three row sources.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# The dispatch rule is shared by every kernel of this package.
from thoughtjax.kernels.sample_stop import Implementation, resolve_dispatch

_MAX_BLOCK_D = 512
_BLOCK_ELEMENTS = 8192  # target size of one program's [block_t, block_d] tile


# ------------------------------------------------------------------------ validation
def _check(prefix_rows, suffix_rows, table, user_ids, user_lengths, total_len):
  """Validates shapes and returns them as arrays plus the output dtype."""
  prefix_rows, suffix_rows, table = map(jnp.asarray, (prefix_rows, suffix_rows, table))
  user_ids, user_lengths = jnp.asarray(user_ids), jnp.asarray(user_lengths)
  if table.ndim != 2:
    raise ValueError(f"template_embed: table must be [V, D], got shape {table.shape}; pass the token embedding matrix.")
  dim = table.shape[1]
  for name, rows in (("prefix_rows", prefix_rows), ("suffix_rows", suffix_rows)):
    if rows.ndim != 2 or rows.shape[1] != dim:
      raise ValueError(
        f"template_embed: {name} must be [P, D] with D={dim} like the table, got "
        f"shape {rows.shape}; pass the template thoughtlet's precomputed rows "
        "(shape [0, D] for an empty part)."
      )
  if user_ids.ndim != 2 or not jnp.issubdtype(user_ids.dtype, jnp.integer):
    raise ValueError(
      f"template_embed: user_ids must be [B, U] integers, got shape "
      f"{user_ids.shape} dtype {user_ids.dtype}; pad each row's token ids to U."
    )
  num_rows, max_user = user_ids.shape
  if user_lengths.shape != (num_rows,) or not jnp.issubdtype(user_lengths.dtype, jnp.integer):
    raise ValueError(
      f"template_embed: user_lengths must be [B]=[{num_rows}] integers, got "
      f"shape {user_lengths.shape} dtype {user_lengths.dtype}; pass the number of "
      "real tokens in each row of user_ids."
    )
  needed = prefix_rows.shape[0] + max_user + suffix_rows.shape[0]
  if not isinstance(total_len, (int, np.integer)) or total_len < needed:
    raise ValueError(
      f"template_embed: total_len must be a static int >= P1 + U + P2 = "
      f"{prefix_rows.shape[0]} + {max_user} + {suffix_rows.shape[0]} = {needed}, "
      f"got {total_len!r}; raise total_len or trim user_ids to fewer columns."
    )
  out_dtype = jnp.result_type(prefix_rows.dtype, suffix_rows.dtype, table.dtype)
  lengths = jnp.clip(user_lengths.astype(jnp.int32), 0, max_user)
  return (prefix_rows, suffix_rows, table, user_ids.astype(jnp.int32), lengths, int(total_len), out_dtype)


# ------------------------------------------------------------------------- reference
def template_embed_reference(
  prefix_rows: jax.Array,  # [P1, D]
  suffix_rows: jax.Array,  # [P2, D]
  table: jax.Array,  # [V, D]
  user_ids: jax.Array,  # [B, U] i32
  user_lengths: jax.Array,  # [B] i32
  *,
  total_len: int,
  left_pad: bool = False,
) -> jax.Array:  # [B, T, D]
  """Pure-jnp reference of ``template_embed`` (layout in the module docstring)."""
  (prefix_rows, suffix_rows, table, user_ids, lengths, total_len, out_dtype) = _check(
    prefix_rows, suffix_rows, table, user_ids, user_lengths, total_len
  )
  num_rows, max_user = user_ids.shape
  prefix_len, suffix_len = prefix_rows.shape[0], suffix_rows.shape[0]
  start = total_len - (prefix_len + lengths + suffix_len) if left_pad else jnp.zeros_like(lengths)  # [B]
  p = jnp.arange(total_len, dtype=jnp.int32)[None, :] - start[:, None]  # [B, T]
  q = p - prefix_len  # position inside the user part
  r = q - lengths[:, None]  # position inside the suffix

  out = jnp.zeros((num_rows, total_len, table.shape[1]), out_dtype)
  if suffix_len:
    in_suffix = (r >= 0) & (r < suffix_len)
    rows = suffix_rows[jnp.clip(r, 0, suffix_len - 1)].astype(out_dtype)
    out = jnp.where(in_suffix[..., None], rows, out)
  if max_user:
    in_user = (q >= 0) & (q < lengths[:, None])
    ids = jnp.take_along_axis(user_ids, jnp.clip(q, 0, max_user - 1), axis=1)
    rows = table[jnp.clip(ids, 0, table.shape[0] - 1)].astype(out_dtype)
    out = jnp.where(in_user[..., None], rows, out)
  if prefix_len:
    in_prefix = (p >= 0) & (p < prefix_len)
    rows = prefix_rows[jnp.clip(p, 0, prefix_len - 1)].astype(out_dtype)
    out = jnp.where(in_prefix[..., None], rows, out)
  return out


# ---------------------------------------------------------------------------- kernel
def _template_embed_kernel(
  *refs,
  prefix_len: int,
  suffix_len: int,
  max_user: int,
  vocab: int,
  dim: int,
  total_len: int,
  left_pad: bool,
  block_t: int,
  block_d: int,
):
  """One program per (row, block of positions, block of columns).

  Row indices are integer arrays into the refs (pointer arithmetic on Triton),
  never a gather op; each source is loaded only where its mask is set.
  """
  refs = list(refs)
  prefix_ref = refs.pop(0) if prefix_len else None  # [P1, D]
  suffix_ref = refs.pop(0) if suffix_len else None  # [P2, D]
  table_ref = refs.pop(0) if max_user else None  # [V, D]
  ids_ref = refs.pop(0) if max_user else None  # [B, U]
  lengths_ref, out_ref = refs  # [B], [B, T, D]

  row, t_block, d_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t = t_block * block_t + jnp.arange(block_t, dtype=jnp.int32)  # [bt]
  d = (d_block * block_d + jnp.arange(block_d, dtype=jnp.int32))[None, :]  # [1, bd]
  d_ok = d < dim
  length = lengths_ref[row]
  start = total_len - (prefix_len + length + suffix_len) if left_pad else 0
  p = t - start
  q = p - prefix_len
  r = q - length

  out = jnp.zeros((block_t, block_d), out_ref.dtype)

  def rows_from(ref, index, inside, out):
    rows = pltriton.load(ref.at[index[:, None], d], mask=inside[:, None] & d_ok, other=0)
    return jnp.where(inside[:, None], rows.astype(out_ref.dtype), out)

  if suffix_ref is not None:
    inside = (r >= 0) & (r < suffix_len)
    out = rows_from(suffix_ref, jnp.clip(r, 0, suffix_len - 1), inside, out)
  if table_ref is not None:
    inside = (q >= 0) & (q < length)
    ids = pltriton.load(ids_ref.at[row, jnp.clip(q, 0, max_user - 1)], mask=inside, other=0)
    out = rows_from(table_ref, jnp.clip(ids, 0, vocab - 1), inside, out)
  if prefix_ref is not None:
    inside = (p >= 0) & (p < prefix_len)
    out = rows_from(prefix_ref, jnp.clip(p, 0, prefix_len - 1), inside, out)

  pltriton.store(out_ref.at[row, t[:, None], d], out, mask=(t < total_len)[:, None] & d_ok)


def default_blocks(total_len: int, dim: int) -> tuple[int, int]:
  """(block_t, block_d): powers of two; block_d divides D when it can."""
  block_d = min(pl.next_power_of_2(dim), _MAX_BLOCK_D)
  while block_d > 64 and dim % block_d:
    block_d //= 2
  if dim % block_d:  # no power of two >= 64 divides D: mask the tail instead
    block_d = min(pl.next_power_of_2(dim), _MAX_BLOCK_D)
  block_t = min(pl.next_power_of_2(total_len), max(1, _BLOCK_ELEMENTS // block_d), 64)
  return block_t, block_d


def _template_embed_pallas(
  prefix_rows, suffix_rows, table, user_ids, lengths, total_len, out_dtype, *, left_pad, interpret, block_t, block_d
):
  num_rows, max_user = user_ids.shape
  vocab, dim = table.shape
  default_t, default_d = default_blocks(total_len, dim)
  block_t, block_d = block_t or default_t, block_d or default_d
  kernel = functools.partial(
    _template_embed_kernel,
    prefix_len=prefix_rows.shape[0],
    suffix_len=suffix_rows.shape[0],
    max_user=max_user,
    vocab=vocab,
    dim=dim,
    total_len=total_len,
    left_pad=left_pad,
    block_t=block_t,
    block_d=block_d,
  )
  inputs = [x for x in (prefix_rows, suffix_rows) if x.shape[0]]
  if max_user:
    inputs += [table, user_ids]
  inputs.append(lengths)
  return pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((num_rows, total_len, dim), out_dtype),
    grid=(num_rows, pl.cdiv(total_len, block_t), pl.cdiv(dim, block_d)),
    # Explicit Triton params: without them current JAX lowers Pallas to
    # Mosaic GPU on NVIDIA.
    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="template_embed",
  )(*inputs)


# -------------------------------------------------------------------------- dispatch
def template_embed(
  prefix_rows: jax.Array,  # [P1, D]
  suffix_rows: jax.Array,  # [P2, D]
  table: jax.Array,  # [V, D]
  user_ids: jax.Array,  # [B, U] i32
  user_lengths: jax.Array,  # [B] i32
  *,
  total_len: int,
  left_pad: bool = False,
  implementation: Implementation | None = None,
  interpret: bool | None = None,
  block_t: int | None = None,
  block_d: int | None = None,
) -> jax.Array:  # [B, T, D]
  """Embeds ``prefix + user tokens + suffix`` per row, padded to ``total_len``.

  See the module docstring for the layout. Traceable under ``jax.jit``.

  Args:
    prefix_rows: [P1, D] template rows before the user text (P1 may be 0).
    suffix_rows: [P2, D] template rows after it, e.g. the rows of
      ``<|im_end|>\\n<|im_start|>assistant\\n`` (P2 may be 0).
    table: [V, D] token embedding table.
    user_ids: [B, U] int32 user token ids, padded to U.
    user_lengths: [B] int32 real lengths, clamped into [0, U].
    total_len: static T >= P1 + U + P2.
    left_pad: right-align each row's content behind zeros.
    implementation: "pallas", "xla" or None (the default of kernels/dispatch.py).
    interpret: run the Pallas kernel interpreted; None means "unless on GPU".
    block_t, block_d: kernel tile, powers of two (defaults from
      ``default_blocks``); tuning knobs, the result never depends on them.

  Returns:
    [B, total_len, D] in the promoted dtype of the row sources.
  """
  implementation, interpret = resolve_dispatch(implementation, interpret)
  if implementation == "xla":
    return template_embed_reference(
      prefix_rows, suffix_rows, table, user_ids, user_lengths, total_len=total_len, left_pad=left_pad
    )
  for name, block in (("block_t", block_t), ("block_d", block_d)):
    if block is not None and (block < 1 or block & (block - 1)):
      raise ValueError(
        f"template_embed: {name} must be a power of two (Triton block shapes "
        f"are), got {block}; pass e.g. {pl.next_power_of_2(max(block, 1))} or None."
      )
  checked = _check(prefix_rows, suffix_rows, table, user_ids, user_lengths, total_len)
  return _template_embed_pallas(*checked, left_pad=left_pad, interpret=interpret, block_t=block_t, block_d=block_d)

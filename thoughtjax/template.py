"""Chat templates as path inputs: the fixed token ids and embedding rows around one user message.

One builder serves every template: a loaded model's chat template (``chat=True``), a composed
path's leading template thoughtlet and the template thoughtlet cut from a model all come from
:meth:`Template.build` (codec + embedding table) or :meth:`Template.from_params` (restored
thoughtlet params). A prompt through a template is ``prefix_ids + user ids + suffix_ids``; the
program embeds it with the fused template kernel (prefix and suffix rows precomputed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Template:
  """A chat template's fixed parts for one system message."""

  system: str | None
  prefix_ids: tuple[int, ...]  # [P1]
  suffix_ids: tuple[int, ...]  # [P2]
  prefix_rows: jax.Array  # [P1, D], embedding rows of prefix_ids
  suffix_rows: jax.Array  # [P2, D]

  @classmethod
  def build(cls, codec, table: jax.Array, system: str | None = None) -> Template:
    """Cut the template of ``codec``'s chat template; rows gathered from ``table`` [V, D]."""
    prefix, suffix = codec.chat_template_parts(system)
    return cls(system, tuple(prefix), tuple(suffix), _rows(table, prefix), _rows(table, suffix))

  @classmethod
  def from_params(cls, params: Mapping, system: str | None = None) -> Template:
    """From a template thoughtlet's params (``prefix_ids``, ``suffix_ids``, ``*_rows``)."""
    ids = lambda x: tuple(int(t) for t in np.asarray(x).reshape(-1))
    return cls(
      system, ids(params["prefix_ids"]), ids(params["suffix_ids"]), params["prefix_rows"], params["suffix_rows"]
    )

  def params(self) -> dict:
    """The template thoughtlet's params: ids as i32 vectors, rows as given."""
    ids = lambda x: jnp.asarray(np.asarray(x, np.int32).reshape(-1))
    return {
      "prefix_ids": ids(self.prefix_ids),
      "suffix_ids": ids(self.suffix_ids),
      "prefix_rows": self.prefix_rows,
      "suffix_rows": self.suffix_rows,
    }

  @property
  def widths(self) -> tuple[int, int]:  # (P1, P2), part of a program's key
    return len(self.prefix_ids), len(self.suffix_ids)

  @property
  def nbytes(self) -> int:
    return int(np.asarray(self.prefix_rows).nbytes + np.asarray(self.suffix_rows).nbytes)

  def wrap(self, user_ids: Sequence[int]) -> list[int]:
    """Token ids of one whole prompt: prefix + user + suffix."""
    return [*self.prefix_ids, *(int(t) for t in user_ids), *self.suffix_ids]


def _rows(table: jax.Array, ids: Sequence[int]) -> jax.Array:
  """Rows ``table[ids]`` [P, D]. A table in host memory is gathered by numpy (a view, no copy): an eager
  ``jnp.take`` compiles or fetches a small program in every new process, on the start-up path of chat."""
  idx = np.asarray(ids, np.int32).reshape(-1)
  if isinstance(table, np.ndarray):
    return jax.device_put(table[idx])
  if isinstance(table, jax.Array) and {d.platform for d in table.sharding.device_set} == {"cpu"}:
    if len(table.sharding.device_set) == 1:
      return jax.device_put(np.asarray(table)[idx], next(iter(table.sharding.device_set)))
  return jnp.take(table, jnp.asarray(idx), axis=0)

"""Per-row allowed-token masks for constrained decoding, kept in step with each row's grammar matcher.

A batch's rows each carry a :class:`~thoughtjax.constraint.Constraint` or none. Before every
program call the host writes each constrained row's bitmask of allowed next tokens (one bit per vocabulary
id, uint32 words, the layout :func:`~thoughtjax.kernels.sample_stop.pack_allowed` makes); unconstrained and
padding rows allow everything. The fused sampler applies the mask before bias, temperature, top-k and top-p,
so the sampled token is always one the grammar allows. After the call each row's new tokens advance its
matcher. A masked program therefore decodes one step per call: the next mask depends on the token just
sampled.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from thoughtjax.constraint import Constraint, Grammars, Matcher

ALL = np.uint32(0xFFFFFFFF)


@functools.lru_cache(maxsize=8)
def grammars_for(codec, vocab_size: int) -> Grammars:
  """The compiled-grammar cache of one tokenizer and vocabulary width (shared by every path of a model)."""
  return Grammars(codec, vocab_size)


class RowMasks:
  """The allowed-token bitmasks [B, W] of one batch, refreshed from the rows' matchers before each step."""

  def __init__(self, grammars: Grammars, constraints: Sequence[Constraint | None], batch: int):
    self.matchers: list[Matcher | None] = [None if c is None else grammars.matcher(c) for c in constraints]
    self.words = np.full((batch, grammars.words), ALL, np.uint32)
    self._ended = [m is None for m in self.matchers]

  @staticmethod
  def needed(constraints: Sequence[Constraint | None]) -> bool:
    return any(c is not None for c in constraints)

  def device(self) -> jax.Array:
    """Every live constrained row's mask for its next token, on the device."""
    for r, m in enumerate(self.matchers):
      if m is not None and not self._ended[r]:
        m.fill(self.words[r])
    return jax.device_put(self.words)

  def advance(self, out: np.ndarray, done: np.ndarray, seen: Sequence[int], count: np.ndarray) -> None:
    """Feed each constrained row r the tokens it produced since the last call: ``out[r, seen[r]:count[r]]``."""
    for r, m in enumerate(self.matchers):
      if m is None or self._ended[r]:
        continue
      for tok in out[r, seen[r] : int(count[r])]:
        if tok >= 0:
          m.consume(int(tok))
      if done[r]:
        self._ended[r] = True

"""The state of the machine a latency prediction is made under: what is warm and what slot engines decode now.

Contract: :class:`Residency` is the thoughtlet refs already restored, the program keys already compiled and those the
persistent compilation cache holds with their load price (:data:`COLD`: none); :class:`Load` is a server's slot engines with the streams each decodes now
(:class:`EngineLoad` each; :data:`IDLE`: none), validated on construction
(:class:`~thoughtjax.synthesis.latency_params.LatencyModelError`). Both are plain frozen values: how they change a
prediction is :mod:`thoughtjax.synthesis.latency`'s.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping

from thoughtjax.serving.pool import choose_engine
from thoughtjax.synthesis.latency_params import LatencyModelError


@dataclasses.dataclass(frozen=True)
class Residency:
  """What is warm right now: resident thoughtlet refs (``name@version``), the program keys this process has
  compiled, and ``cached``: program key -> the ms this process would pay to load it from the persistent
  compilation cache (:mod:`thoughtjax.synthesis.program_ledger`; a program neither compiled nor cached is priced
  as a full compile)."""

  resident: frozenset[str] = frozenset()
  compiled: frozenset[str] = frozenset()
  cached: Mapping[str, float] = dataclasses.field(default_factory=dict, hash=False)

  def __post_init__(self):
    object.__setattr__(self, "resident", frozenset(self.resident))
    object.__setattr__(self, "compiled", frozenset(self.compiled))
    object.__setattr__(self, "cached", types.MappingProxyType(dict(self.cached)))


COLD = Residency()


@dataclasses.dataclass(frozen=True)
class EngineLoad:
  """One slot engine now: its path, the streams in its slots or waiting for them (``rows``), its ring length
  (``cache_len``, the cache every step attends over) and, once it has stepped, the wall ms of one of its latest
  steps (``step_ms``, a median) at the width it then computed (``width``)."""

  path_hash: str
  rows: int
  cache_len: int
  width: int = 0
  step_ms: float | None = None

  def __post_init__(self):
    for name, least in (("rows", 0), ("cache_len", 1), ("width", 0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise LatencyModelError(f"engine load {name}: expected an integer >= {least}, got {v!r}")
    if self.step_ms is not None and (
      isinstance(self.step_ms, bool)
      or not isinstance(self.step_ms, (int, float))
      or not math.isfinite(self.step_ms)
      or self.step_ms <= 0
      or self.width < 1
    ):
      raise LatencyModelError(
        f"engine load step_ms: expected None or ms > 0 measured at a width >= 1, got {self.step_ms!r} at "
        f"width {self.width!r}"
      )


@dataclasses.dataclass(frozen=True)
class Load:
  """What a server's slot engines (``slots`` slots each) decode now (:class:`EngineLoad` each, idle ones
  dropped); ``Load()`` is an idle machine without slot engines."""

  engines: tuple[EngineLoad, ...] = ()
  slots: int = 1

  def __post_init__(self):
    if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
      raise LatencyModelError(f"load slots: expected an integer >= 1, got {self.slots!r}")
    object.__setattr__(self, "engines", tuple(e for e in self.engines if e.rows > 0))

  @classmethod
  def of_pool(cls, pool) -> Load:
    """The load of an engine pool now (:meth:`EnginePool.occupancy <thoughtjax.serving.pool.EnginePool.occupancy>`)."""
    engines = (EngineLoad(h, rows, ring, *(recent or (0, None))) for h, rows, ring, recent in pool.occupancy())
    return cls(tuple(engines), pool.slots)

  @property
  def rows(self) -> int:
    return sum(e.rows for e in self.engines)

  def of(self, path_hash: str, cache_len: int = 1) -> EngineLoad | None:
    """The engine of ``path_hash`` a request attending over ``cache_len`` slots joins (the path's longest ring, when
    it holds the request, as an engine pool picks), or None."""
    return choose_engine(((e, e.cache_len) for e in self.engines if e.path_hash == path_hash), cache_len)

  def describe(self) -> str:
    if not self.engines:
      return "idle"
    n = len(self.engines)
    return f"{self.rows} stream{'s' * (self.rows != 1)} decoding in {n} engine{'s' * (n != 1)}"


IDLE = Load()

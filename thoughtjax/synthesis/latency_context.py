"""Where a learned latency correction belongs, and what one execution context has learned.

Contract: a correction belongs to the :class:`LatencyContext` that taught it (engine, weight form, batch width,
kernels; named by its ``key``, ``engine|weights|b<batch>|kernels``) and moves predictions in that context only.
:class:`Learned` is one context's record (its machine-wide and per-path factors, the observations behind each and
when it last learned), replaced whole on every update; its ``to_json``/``from_json`` are the corrections file's
form, validated field by field (:class:`~thoughtjax.synthesis.latency_params.LatencyModelError`). A context's
factors relax halfway back to the calibration's every :data:`HALF_LIFE_S` of silence and are dropped after
:data:`MAX_AGE_S`. How factors are learned and applied: :mod:`thoughtjax.synthesis.latency`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from thoughtjax.synthesis.latency_params import STAGES, LatencyModelError, factor_json

ENGINES = ("plain", "speculative", "slots", "masked")
# A context's learned factors relax halfway back to the calibration's every this many seconds without a new
# observation there (the machine, its load and its software change; an old correction is a guess).
HALF_LIFE_S = 6 * 3600.0
# Past this age a context's corrections weigh under 1/256 of what they did: dropped, not kept around.
MAX_AGE_S = 8 * HALF_LIFE_S


@dataclasses.dataclass(frozen=True)
class LatencyContext:
  """Where a program runs, which is what a learned correction belongs to (a correction learned in one context
  never moves a prediction in another).

  ``engine``: ``plain`` (one request's own program), ``speculative`` (draft and verify in one program) or
  ``slots`` (a slot engine's shared decode program: a server's continuous batching) or ``masked`` (one
  request's own program stepping once per call under an output constraint); ``weights``: the form
  restores give (f32, native); ``batch``: the program's batch width (1 alone; a slot engine's slot count,
  which it decodes whole every chunk whatever the rows in use); ``kernels``: the kernel implementation.
  """

  engine: str = "plain"
  weights: str = "f32"
  batch: int = 1
  kernels: str = "xla"

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise LatencyModelError(f"latency context engine: expected one of {list(ENGINES)}, got {self.engine!r}")
    if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
      raise LatencyModelError(f"latency context batch: expected an integer >= 1, got {self.batch!r}")
    for name in ("weights", "kernels"):
      v = getattr(self, name)
      if not isinstance(v, str) or not v or "|" in v:
        raise LatencyModelError(f"latency context {name}: expected a non-empty name without '|', got {v!r}")

  @property
  def key(self) -> str:
    """``engine|weights|b<batch>|kernels``: the context's name in the corrections file and in plans."""
    return f"{self.engine}|{self.weights}|b{self.batch}|{self.kernels}"

  @classmethod
  def from_key(cls, key: Any) -> LatencyContext:
    parts = key.split("|") if isinstance(key, str) else []
    if len(parts) != 4 or not parts[2].startswith("b") or not parts[2][1:].isdigit():
      raise LatencyModelError(f"latency context {key!r}: expected 'engine|weights|b<batch>|kernels'")
    return cls(parts[0], parts[1], int(parts[2][1:]), parts[3])

  def label(self) -> str:
    """The context in words (what ``plan --explain`` prints)."""
    engine = {
      "plain": "plain program",
      "speculative": "speculative program",
      "slots": f"slot engine of {self.batch} slots",
      "masked": "constrained program (one step per call)",
    }[self.engine]
    batch = "" if self.engine == "slots" else f", batch {self.batch}"
    return f"{engine}, {self.weights} weights{batch}, {self.kernels} kernels"


def _count_json(v: Any, where: str) -> int:
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise LatencyModelError(f"{where}: expected a count >= 0, got {v!r}")
  return v


def _learned_stages(d: Any, where: str) -> tuple[dict[str, float], dict[str, int]]:
  """``{stage: {"factor": f, "observations": n}}`` -> (factors, counts)."""
  if not isinstance(d, Mapping) or set(d) - set(STAGES):
    raise LatencyModelError(f"{where}: expected an object of stage -> {{factor, observations}}, got {d!r}")
  factors, counts = {}, {}
  for s, v in d.items():
    if not isinstance(v, Mapping) or set(v) != {"factor", "observations"}:
      raise LatencyModelError(f"{where}.{s}: expected {{\"factor\": f, \"observations\": n}}, got {v!r}")
    factors[s] = factor_json(v["factor"], f"{where}.{s}.factor")
    counts[s] = _count_json(v["observations"], f"{where}.{s}.observations")
  return factors, counts


@dataclasses.dataclass(frozen=True)
class Learned:
  """What one context learned: the machine-wide factor per stage (``glob``), each path's factor relative to
  it (``paths``), how many observations taught each (``n_glob``, ``n_paths``), how many runs in all
  (``observations``) and when it last learned (``updated``, unix seconds). Replaced whole on every update."""

  glob: Mapping[str, float] = dataclasses.field(default_factory=dict)
  paths: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
  n_glob: Mapping[str, int] = dataclasses.field(default_factory=dict)
  n_paths: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
  observations: int = 0
  updated: float = 0.0

  def to_json(self) -> dict:
    def stages(f, n):
      return {s: {"factor": float(f[s]), "observations": int(n.get(s, 0))} for s in f}

    out: dict = {"updated": float(self.updated), "observations": int(self.observations)}
    if self.glob:
      out["global"] = stages(self.glob, self.n_glob)
    if self.paths:
      out["paths"] = {h: stages(f, self.n_paths.get(h, {})) for h, f in self.paths.items() if f}
    return out

  @classmethod
  def from_json(cls, d: Any, where: str) -> Learned:
    if not isinstance(d, Mapping) or set(d) - {"updated", "observations", "global", "paths"}:
      raise LatencyModelError(
        f"{where}: expected {{updated, observations, global: {{stage: {{factor, observations}}}}, paths: "
        f"{{path_hash: {{stage: ...}}}}}}, got {d!r}"
      )
    updated = d.get("updated")
    if isinstance(updated, bool) or not isinstance(updated, (int, float)) or not math.isfinite(updated):
      raise LatencyModelError(f"{where}.updated: expected unix seconds, got {updated!r}")
    glob, n_glob = _learned_stages(d.get("global", {}), f"{where}.global")
    paths = d.get("paths", {})
    if not isinstance(paths, Mapping):
      raise LatencyModelError(f"{where}.paths: expected an object, got {paths!r}")
    pf, pn = {}, {}
    for h, v in paths.items():
      pf[str(h)], pn[str(h)] = _learned_stages(v, f"{where}.paths[{h}]")
    return cls(glob, pf, n_glob, pn, _count_json(d.get("observations", 0), f"{where}.observations"), float(updated))

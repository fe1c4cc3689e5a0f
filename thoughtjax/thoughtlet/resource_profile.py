"""What one thoughtlet costs, as measured: the record :func:`~thoughtjax.thoughtlet.profile.measure_profile` fills.

A :class:`ResourceProfile` is plain data (sizes, FLOPs, latencies and the hardware ``fingerprint`` they were
measured on), so a :class:`~thoughtjax.thoughtlet.types.Thoughtlet` and a registry manifest can hold one
without the measuring code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ResourceProfile:
  param_bytes: int
  flops_per_token: float
  peak_memory_bytes: int
  latency_mean_s: float
  latency_std_s: float
  latency_p99_s: float
  samples: int
  batch: int
  context: int
  fingerprint: Mapping[str, Any]

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["fingerprint"] = dict(self.fingerprint)
    return d

  @classmethod
  def from_json(cls, d: Mapping) -> ResourceProfile:
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})

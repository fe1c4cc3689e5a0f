"""Restored thoughtlets kept in memory (an LRU under a byte budget) and the registry's counters."""

from __future__ import annotations

import collections
import dataclasses

from thoughtjax.registry.errors import MemoryBudgetError


@dataclasses.dataclass
class RegistryStats:
  hits: int = 0
  misses: int = 0
  evictions: int = 0
  restores: int = 0
  restored_bytes: int = 0
  resident_bytes: int = 0
  budget_bytes: int | None = None
  integrity_failures: int = 0  # a file does not match its digest
  signature_failures: int = 0  # a signature missing, malformed, untrusted or wrong (downgrades included)
  downgrade_refusals: int = 0  # a signed registry presented an unsigned file, or a keyless publish into it
  rollback_refusals: int = 0  # an index sequence lower than one seen
  restore_failures: int = 0  # Orbax failed on files that passed their checks (memory, sharding, I/O)
  mapped_restores: int = 0  # restores served by mapping a version's verified mapped form (registry/mapped.py)
  mapped_refusals: int = 0  # a mapped form changed after its verification: refused, restored from the checkpoint
  writer_refusals: int = 0  # a publish refused to build on an index or version that failed verification
  # The last FAILURE_DETAILS refusals, {"kind", "thoughtlet", "file", "reason"}; the counters above count all,
  # failures_dropped those whose details were dropped (a client repeating a refused request cannot grow it).
  failures: list = dataclasses.field(default_factory=list)
  failures_dropped: int = 0
  restore_seconds: dict = dataclasses.field(default_factory=dict)  # "name@version" -> s
  resident: list = dataclasses.field(default_factory=list)  # "name@version", LRU first

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def count(self, kind: str, thoughtlet: str, file: str, reason: str) -> None:
    """Count one refusal of ``kind`` (see :data:`FAILURE_COUNTERS`)."""
    for name in FAILURE_COUNTERS[kind]:
      setattr(self, name, getattr(self, name) + 1)
    self.failures.append({"kind": kind, "thoughtlet": thoughtlet[:200], "file": file[:1000], "reason": reason[:2000]})
    if len(self.failures) > FAILURE_DETAILS:
      drop = len(self.failures) - FAILURE_DETAILS
      del self.failures[:drop]
      self.failures_dropped += drop


# Refusals whose details RegistryStats keeps (the most recent); counters count every one.
FAILURE_DETAILS = 100

# Failure kind -> the counters it increments.
FAILURE_COUNTERS = {
  "integrity": ("integrity_failures",),
  "signature": ("signature_failures",),
  "downgrade": ("signature_failures", "downgrade_refusals"),
  "rollback": ("rollback_refusals",),
  "restore": ("restore_failures",),
  "writer": ("writer_refusals",),
  "mapped": ("mapped_refusals",),
}


@dataclasses.dataclass
class ResidentEntry:
  params: dict
  nbytes: int
  ref: str


class ResidentSet:
  """Restored thoughtlets kept in memory: an LRU under an optional byte budget."""

  def __init__(self, budget_bytes: int | None = None):
    self.budget = budget_bytes
    self._entries: collections.OrderedDict[tuple, ResidentEntry] = collections.OrderedDict()

  @property
  def nbytes(self) -> int:
    return sum(e.nbytes for e in self._entries.values())

  def get(self, key: tuple) -> ResidentEntry | None:
    entry = self._entries.get(key)
    if entry is not None:
      self._entries.move_to_end(key)
    return entry

  def make_room(self, need: int, pinned: set, what: str) -> list[ResidentEntry]:
    """Evict least recently used unpinned entries until ``need`` more bytes fit."""
    if self.budget is None:
      return []
    pinned_bytes = sum(e.nbytes for k, e in self._entries.items() if k in pinned)
    if need + pinned_bytes > self.budget:
      raise MemoryBudgetError(
        f"{what} needs {need + pinned_bytes} bytes of weights resident at once but the registry's "
        f"memory budget is {self.budget} bytes; raise memory_budget or use a shorter path"
      )
    evicted = []
    for key in list(self._entries):
      if self.nbytes + need <= self.budget:
        break
      if key not in pinned:
        evicted.append(self._entries.pop(key))
    return evicted

  def put(self, key: tuple, entry: ResidentEntry) -> None:
    self._entries[key] = entry
    self._entries.move_to_end(key)

  def drop_except(self, keep: set[str]) -> int:
    """Drop every entry whose ref (``name@version``) is not in ``keep``; returns how many."""
    drop = [k for k, e in self._entries.items() if e.ref not in keep]
    for k in drop:
      del self._entries[k]
    return len(drop)

  def clear(self) -> int:
    n = len(self._entries)
    self._entries.clear()
    return n

  def refs(self) -> list[str]:
    return [e.ref for e in self._entries.values()]

  def params(self) -> list[dict]:
    """Every entry's restored params, least recently used first."""
    return [e.params for e in self._entries.values()]

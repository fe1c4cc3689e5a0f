"""The programs this machine's persistent compilation cache holds, and what loading each one costs.

A process that has not run a program yet pays its compile stage: a full XLA compile the first time on this machine
(6-12 s on the default model), a load from the persistent caches afterwards (the exported program and JAX's
compiled executable: ~1.2 s for the float32 unrolled full path, ~2.2 s for its n-gram drafted program, ~0.1 s for
the layer-indexed form). The latency model's compile fit cannot tell the two apart from the program alone: a cold
process would price a program it has not run itself as a fitted compile whichever it is, and a drafted program,
whose compile the fit (of plain programs) prices at a fifth of what it is, as cheaper than it ever is.

The ledger records, per latency-model program key (:meth:`~thoughtjax.synthesis.latency.LatencyModel.program_key`),
what its compile stage measured when a run of this registry and calibration (one ledger entry, the synthesizer's
corrections key) paid it in a process that had not run it: ``compile_ms`` when JAX compiled it (a persistent-cache
miss; it is in the cache from then on), ``load_ms`` when JAX found it there (the latest such run).
:meth:`ProgramLedger.prices` gives what a cold process pays per program: ``load_ms`` when measured, else
``compile_ms`` times :data:`LOAD_SHARE`. A cache cleared meanwhile shows up as a compile again, which puts it back.

The file lives inside the compilation cache's own folder (``thoughtjax-programs.json``; JAX reads only its
``*-cache`` files there): removing that folder removes the ledger with the programs it describes. Writes are atomic
under an advisory lock; a file that cannot be read is ignored (prices then fall back to full compiles) and
rewritten by the next record."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from thoughtjax import durable

FILE_NAME = "thoughtjax-programs.json"
FORMAT = "thoughtjax-program-ledger"
FORMAT_VERSION = 1
# A load from the persistent caches over the full compile it replaces, for a program never loaded yet on this
# machine: measured on the default model (float32, unrolled, prompt bucket 16, 64 new tokens), the plain full path
# 1.2 s against 6.0 s, the n-gram drafted one 2.2-2.4 s against 10-12 s.
LOAD_SHARE = 0.2
MAX_ENTRIES = 16  # registries x calibrations kept, the most recently recorded
MAX_PROGRAMS = 256  # programs per entry, the most recently recorded


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
  fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def _finite_ms(v) -> float | None:
  return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 else None


class ProgramLedger:
  """One registry-and-calibration entry (``key``) of the ledger file ``path`` (None: a ledger kept in memory only,
  e.g. a synthesizer told to keep no state between processes). Thread-safe."""

  def __init__(self, key: str, path: Path | None):
    self.key, self.path = key, path
    self._lock = threading.Lock()
    self._programs: dict[str, dict] = self._read_entry()

  def _read_all(self) -> dict:
    if self.path is None:
      return {}
    try:
      doc = json.loads(self.path.read_text())
    except (OSError, ValueError):
      return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != FORMAT_VERSION:
      return {}
    entries = doc.get("entries")
    if not isinstance(entries, dict):
      return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict) and isinstance(v.get("programs"), dict)}

  def _read_entry(self) -> dict[str, dict]:
    programs = self._read_all().get(self.key, {}).get("programs", {})
    out = {}
    for k, v in programs.items():
      if not (isinstance(k, str) and isinstance(v, dict)):
        continue
      entry = {"compile_ms": _finite_ms(v.get("compile_ms")), "load_ms": _finite_ms(v.get("load_ms"))}
      if entry["compile_ms"] is not None or entry["load_ms"] is not None:
        out[k] = {**entry, "at": _finite_ms(v.get("at")) or 0.0}
    return out

  def prices(self) -> dict[str, float]:
    """Program key -> the ms a process that has not run it pays for its compile stage (a load from the cache)."""
    with self._lock:
      return {
        k: v["load_ms"] if v["load_ms"] is not None else v["compile_ms"] * LOAD_SHARE for k, v in self._programs.items()
      }

  def record(self, program_key: str, ms: float, *, loaded: bool) -> None:
    """A run of ``program_key`` paid ``ms`` for its compile stage in a process that had not run it: JAX loaded the
    program from the persistent compilation cache (``loaded``) or compiled it into that cache."""
    ms = _finite_ms(ms)
    if ms is None:
      return
    with self._lock:
      got = dict(self._programs.get(program_key) or {"compile_ms": None, "load_ms": None})
      got["load_ms" if loaded else "compile_ms"] = ms
      got["at"] = time.time()
      self._programs[program_key] = got
    if self.path is None:
      return
    try:
      with _locked(self.path):
        entries = self._read_all()
        programs = {**entries.get(self.key, {}).get("programs", {}), program_key: got}
        keep = sorted(programs, key=lambda k: _finite_ms(programs[k].get("at")) or 0.0)[-MAX_PROGRAMS:]
        entries[self.key] = {"updated": time.time(), "programs": {k: programs[k] for k in keep}}
        live = sorted(entries, key=lambda k: _finite_ms(entries[k].get("updated")) or 0.0)[-MAX_ENTRIES:]
        doc = {"format": FORMAT, "version": FORMAT_VERSION, "entries": {k: entries[k] for k in live}}
        durable.write_atomic(self.path, json.dumps(doc, sort_keys=True).encode())
    except OSError:  # kept in memory: a later process prices a full compile, as without a ledger
      pass

  def __len__(self) -> int:
    with self._lock:
      return len(self._programs)


def ledger_path(compile_cache: str | os.PathLike) -> Path:
  """The ledger file of the persistent compilation cache in ``compile_cache``."""
  return Path(compile_cache) / FILE_NAME


def ledger_for(key: str, compile_cache: str | os.PathLike | None) -> ProgramLedger:
  """The ledger entry ``key`` of the cache folder ``compile_cache`` (None: in memory only)."""
  return ProgramLedger(key, None if compile_cache is None else ledger_path(compile_cache))

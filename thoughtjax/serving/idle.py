"""Idle release (scale to zero): which served paths have been idle long enough to drop, and a gate that keeps
a release from overlapping any request's start.

A path is identified by its composed model's ``path_hash``. A request *holds* its path from the moment its run
is made (plan, restore, compose) until its stream ended; a path nobody holds is *due* once ``idle_s`` seconds
passed since the last holder let go (or since it was first seen resident, e.g. warmed at start-up).
Compiled programs are not a path's: :func:`drop_compiled_programs` drops them all, for a server scaled to zero.

The gate: a request's start phase (between its turn and the moment it holds its path, where the path it will
run is not yet known) runs inside :meth:`IdleTracker.starting`; a release drops references only inside
:meth:`IdleTracker.releasing`, which is entered only while no start is in flight, and starts that arrive
meanwhile wait for it to end (a release drops references, it does not compute: milliseconds). So a request
never composes from a model or resident weights a release is dropping at that moment; it restores them again.

:func:`trim_memory` runs the cycle collector and hands glibc's freed heap back to the OS (``malloc_trim``), so a
release shows in the process's RSS rather than only in the allocator's free lists.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator

import jax

from thoughtjax import heap
from thoughtjax.decode import program


class IdleTracker:
  """Holds and last use per path (see the module docstring). ``idle_s`` None: nothing is ever due.
  ``clock``: seconds, monotonic (tests inject a fake one). Thread-safe."""

  def __init__(self, idle_s: float | None, clock: Callable[[], float] = time.monotonic):
    self.idle_s, self.clock = idle_s, clock
    self._cond = threading.Condition()
    self._holds: dict[Hashable, int] = {}
    self._last: dict[Hashable, float] = {}  # path -> when its last holder let go (or it was first seen)
    self._starting = 0
    self._releasing = False
    self.released = 0  # paths released over the tracker's life

  # ---- requests -----------------------------------------------------------------------------
  @contextlib.contextmanager
  def starting(self) -> Iterator[None]:
    """A request's start phase: waits while a release drops references, and keeps the next one out."""
    with self._cond:
      self._cond.wait_for(lambda: not self._releasing)
      self._starting += 1
    try:
      yield
    finally:
      with self._cond:
        self._starting -= 1
        self._cond.notify_all()

  def hold(self, path: Hashable) -> None:
    """A request runs ``path`` (called inside its start phase, so no release slips in between)."""
    with self._cond:
      self._holds[path] = self._holds.get(path, 0) + 1
      self._last.setdefault(path, self.clock())

  def let_go(self, path: Hashable) -> None:
    """A request on ``path`` ended: its idle time starts now when it was the last one."""
    with self._cond:
      n = self._holds.get(path, 0) - 1
      if n > 0:
        self._holds[path] = n
      else:
        self._holds.pop(path, None)
        self._last[path] = self.clock()

  # ---- release ------------------------------------------------------------------------------
  def seen(self, paths: Iterable[Hashable]) -> None:
    """Paths found resident: their idle time starts now unless it has already started; a path no longer
    resident (dropped by an LRU, say) and nobody holds is forgotten."""
    paths = set(paths)
    with self._cond:
      now = self.clock()
      for p in paths:
        self._last.setdefault(p, now)
      for p in [p for p in self._last if p not in paths and p not in self._holds]:
        del self._last[p]

  def due(self, now: float | None = None) -> list[Hashable]:
    """Paths nobody holds, idle for at least ``idle_s`` at ``now`` (default: the clock), longest idle first."""
    if self.idle_s is None:
      return []
    with self._cond:
      now = self.clock() if now is None else now
      idle = [(t, p) for p, t in self._last.items() if p not in self._holds and now - t >= self.idle_s]
    return [p for _, p in sorted(idle, key=lambda x: x[0])]

  def held(self, path: Hashable) -> bool:
    with self._cond:
      return path in self._holds

  @contextlib.contextmanager
  def releasing(self) -> Iterator[bool]:
    """Yields True with every request start kept out until the block ends, or False (at once, nothing kept
    out) when a start is in flight: the caller tries again later."""
    with self._cond:
      if self._starting or self._releasing:
        clear = False
      else:
        clear = self._releasing = True
    try:
      yield clear
    finally:
      if clear:
        with self._cond:
          self._releasing = False
          self._cond.notify_all()

  def forget(self, path: Hashable) -> None:
    """``path`` was released: it is no longer resident (a later request makes it resident again)."""
    with self._cond:
      if self._last.pop(path, None) is not None:
        self.released += 1

  def resident(self) -> list[Hashable]:
    """Paths held or not yet released."""
    with self._cond:
      return list(dict.fromkeys([*self._holds, *self._last]))

  def next_due_in(self, now: float | None = None) -> float | None:
    """Seconds until the next path nobody holds becomes due (0: one is due now); None: none can be."""
    if self.idle_s is None:
      return None
    with self._cond:
      now = self.clock() if now is None else now
      times = [t for p, t in self._last.items() if p not in self._holds]
    return None if not times else max(0.0, min(times) + self.idle_s - now)


def drop_compiled_programs() -> None:
  """Forget every compiled program of this process: the program cache's (plain, slot and speculative programs)
  and jax's own executables. Each program's next call compiles again (from the persistent compilation cache
  when it holds the program). Call it only while nothing runs or starts."""

  program.PROGRAMS.clear()
  jax.clear_caches()


def trim_memory() -> dict:
  """Collect cycles, then give glibc's free heap pages back to the OS. Returns ``{"collected": objects found
  unreachable, "trimmed": whether malloc_trim ran}``. Call it after dropping the last references to large
  buffers (jax frees a CPU buffer when its last array is deleted; glibc keeps the pages until trimmed)."""
  collected = gc.collect()
  return {"collected": collected, "trimmed": heap.trim()}

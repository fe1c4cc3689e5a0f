"""The engine pool: slot engines per path and ring length, shared by every request, with leases and eviction.

A server (any transport) asks the pool for the engine of a request (:meth:`EnginePool.lease`) and gets its
:class:`~thoughtjax.serving.driver.SlotDriver` with a lease on it; the lease is given back
(:meth:`EnginePool.give_back`) once the request's slot is free, or when it never took one.

* Engines are made lazily per path and ring length (the request's prompt + max_tokens bucket, at least
  ``cache_len``), at most ``max_engines``. A path decodes in one engine: a request joins the path's engine with the
  longest ring when it fits there (:func:`choose_engine`), so requests of any length share one batch instead of
  several engines stepping in turn on the same cores; one that does not fit makes an engine of its own, longer
  ring, which from then on takes the path's requests: the shorter engine finishes what it holds and is closed once
  nothing holds it.
* Past ``max_engines`` an unused engine is evicted for the new one; when every engine is in use,
  :class:`PoolFull`. An engine is in use while a request holds a lease on it (handed out, not yet submitted) or it
  has work queued, prefilling, being placed or in a slot: such an engine is never evicted or released
  (:meth:`release_path`, a server's idle release).
* Closing an engine (eviction, release) stops its driver thread, outside the pool's lock: the pool's other
  callers (a metrics scrape, another request) never wait for it. Every method may block on the engines' work and
  belongs on a worker thread, not on an event loop; :meth:`stats` and :meth:`drivers` only read.
* A request planned onto a path and not yet submitted to its engine can be counted in :meth:`occupancy` from the
  moment it was planned (:meth:`reserve`, :meth:`Reservation.release`), so requests planned one after another (a
  burst) each see the rows planned before them.
* Each engine keeps a prefix cache (:class:`~thoughtjax.serving.prefix.PrefixCache`) of ``prefix_cache_bytes``
  (0: none) in blocks of ``prefix_block_tokens``; it goes with its engine. :meth:`stats` adds up their counters.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from typing import TypeVar

from thoughtjax.decode.program import bucket
from thoughtjax.defaults import MIN_POOL_RING
from thoughtjax.errors import UserError
from thoughtjax.sampling import SamplingMode
from thoughtjax.serving.driver import SlotDriver
from thoughtjax.serving.prefix import PrefixCache
from thoughtjax.serving.slots import SlotEngine

T = TypeVar("T")


def choose_engine(engines: Iterable[tuple[T, int]], ring: int) -> T | None:
  """The engine a request whose prompt and new tokens need a ring of ``ring`` slots joins, of a path's ``engines``
  (engine, ring length): the one with the longest ring, when it holds the request; None when it does not (then
  none does, and a longer one is made). So a path decodes in one engine: the longest ring it has needed, where every
  new request goes; a shorter one only finishes what it holds. The pool leases by it and the latency model predicts
  by it (:meth:`Load.of <thoughtjax.synthesis.latency_load.Load.of>`)."""
  best = None
  for engine, length in engines:
    if best is None or length > best[0]:
      best = (length, engine)
  return best[1] if best is not None and best[0] >= ring else None


class PoolFull(UserError, RuntimeError):
  """Every engine the pool may hold is in use and the request's path needs another one."""


class Reservation:
  """A request counted in its pool's occupancy from its plan on (:meth:`EnginePool.reserve`)."""

  def __init__(self, pool: EnginePool, key: tuple[str, int]):
    self._pool, self.key, self.released = pool, key, False

  def release(self) -> None:
    """Stop counting it (it is in its engine now, or gave up); once, from any thread: later calls do nothing."""
    self._pool._unreserve(self)


class EnginePool:
  """Slot engines by (path, ring length), at most ``max_engines``, each with ``slots`` slots; see the module
  docstring. Thread-safe."""

  def __init__(
    self,
    slots: int,
    *,
    max_engines: int = 4,
    cache_len: int = MIN_POOL_RING,
    prefix_cache_bytes: int = 0,
    prefix_block_tokens: int = 16,
    layout: str | None = None,
  ):
    if slots < 1 or max_engines < 1:
      raise ValueError(f"an engine pool needs slots >= 1 and max_engines >= 1, got {slots} and {max_engines}")
    self.slots, self.max_engines, self.cache_len = slots, max_engines, cache_len
    self.prefix_cache_bytes, self.prefix_block_tokens = prefix_cache_bytes, prefix_block_tokens
    self.layout = layout  # the engines' layer layout (SlotEngine's layout=; None: each model's)
    self._engines: collections.OrderedDict[tuple, SlotDriver] = collections.OrderedDict()  # least recent first
    self._leases: collections.Counter[SlotDriver] = collections.Counter()
    self._reserved: collections.Counter[tuple[str, int]] = collections.Counter()  # (path hash, ring length)
    self._lock = threading.Lock()
    self._freed_by_closed = 0  # slots freed by engines since closed, so the count survives them
    self.evictions = 0
    self._closed = False

  def _layout(self, model) -> str | None:
    """The pool's layout for ``model``'s engine; a path with a bridge runs unrolled whatever the pool's."""
    return None if any(i < 0 for i in model.layers) else self.layout

  # ---- leases ----------------------------------------------------------------------------------------------
  def lease(self, model, tokens: int) -> SlotDriver:
    """The driver of ``model``'s path for a request of ``tokens`` prompt + new tokens (made on first use), with a
    lease on it; :class:`PoolFull` when it needs a new engine and every engine is in use."""
    cache_len = min(bucket(tokens, self.cache_len), model.config.max_context)
    path = (model.path_hash, tuple(model.layers), model.kernels, model.chunk)
    evicted, superseded = None, []
    with self._lock:
      if self._closed:
        raise PoolFull("the engine pool is closed (the server is stopping); retry on another replica")
      mine = [(k, k[-1]) for k in self._engines if k[:-1] == path]
      key = choose_engine(mine, cache_len)
      if key is not None:
        self._engines.move_to_end(key)
        driver = self._engines[key]
      else:
        if len(self._engines) >= self.max_engines:
          idle = next((k for k, d in self._engines.items() if self._unused(d)), None)
          if idle is None:
            raise PoolFull(
              f"{len(self._engines)} paths are decoding at once (max_engines {self.max_engines}) and none is idle; "
              f"retry with backoff, or serve fewer distinct paths"
            )
          evicted = self._engines.pop(idle)
          self._freed_by_closed += evicted.engine.freed_total
          self.evictions += 1
        prefix = PrefixCache(self.prefix_block_tokens, self.prefix_cache_bytes) if self.prefix_cache_bytes else None
        engine = SlotEngine(model, self.slots, cache_len=cache_len, prefix_cache=prefix, layout=self._layout(model))
        driver = self._engines[(*path, cache_len)] = SlotDriver(engine)
        superseded = self._drop_superseded(path)
      self._leases[driver] += 1
    for d in ([evicted] if evicted is not None else []) + superseded:
      d.close()  # unused: only its thread stops, and nobody waits on the lock meanwhile
    return driver

  def _drop_superseded(self, path: tuple) -> list[SlotDriver]:
    """Take out the engines of ``path`` that a longer ring superseded and that hold nothing any more (under
    ``_lock``); the caller closes them outside it."""
    mine = [(k, k[-1]) for k in self._engines if k[:-1] == path]
    current = choose_engine(mine, 0)
    gone = [k for k, _ in mine if k != current and self._unused(self._engines[k])]
    drivers = [self._engines.pop(k) for k in gone]
    for d in drivers:
      self._freed_by_closed += d.engine.freed_total
    return drivers

  def reserve(self, path_hash: str, tokens: int) -> Reservation:
    """Count a request planned onto the path ``path_hash`` (``tokens`` prompt + new tokens) in :meth:`occupancy`
    until :meth:`Reservation.release` (once it was submitted to its engine, or gave up). Its ring is the bucket of
    ``tokens``: a model whose context is shorter caps the engine's ring, and the reservation then counts as an
    engine of its own (a prediction's input only)."""
    key = (path_hash, bucket(tokens, self.cache_len))
    with self._lock:
      self._reserved[key] += 1
    return Reservation(self, key)

  def _unreserve(self, r: Reservation) -> None:
    with self._lock:
      if r.released:
        return
      r.released = True
      self._reserved[r.key] -= 1
      if self._reserved[r.key] <= 0:
        del self._reserved[r.key]

  def give_back(self, driver: SlotDriver) -> None:
    """End one lease on ``driver`` (its request's slot is free, or it never took one); an engine a longer ring of
    its path superseded is closed once nothing holds it."""
    with self._lock:
      self._leases[driver] -= 1
      if self._leases[driver] <= 0:
        del self._leases[driver]
      key = next((k for k, d in self._engines.items() if d is driver), None)
      superseded = self._drop_superseded(key[:-1]) if key is not None else []
    for d in superseded:  # its thread ends; never joined from itself
      threading.Thread(target=d.close, daemon=True).start() if d.on_driver_thread() else d.close()

  def warm(
    self, model, prompt_tokens: int, max_tokens: int, modes: Sequence[SamplingMode] = (SamplingMode.GREEDY,)
  ) -> SlotDriver:
    """Make (if need be) the engine a request of ``prompt_tokens`` prompt and ``max_tokens`` new tokens on
    ``model``'s path joins, and compile what its requests run in each sampling mode of ``modes``
    (:meth:`SlotEngine.warm <thoughtjax.serving.slots.SlotEngine.warm>`: the chunked prefill of every number of rows,
    every decode width, the prefix cache's cut and reuse), holding a lease meanwhile so it is not evicted. Returns
    its driver. Blocks for the compiles (seconds per program); belongs on a worker thread."""
    driver = self.lease(model, prompt_tokens + max_tokens)
    try:
      driver.engine.warm(modes)
    finally:
      self.give_back(driver)
    return driver

  def leases(self, driver: SlotDriver) -> int:
    """Requests holding a lease on ``driver`` now."""
    with self._lock:
      return self._leases[driver]

  def _unused(self, driver: SlotDriver) -> bool:
    """No lease on ``driver`` and nothing queued, prefilling or in a slot (under ``_lock``: leases change under it)."""
    return self._leases[driver] == 0 and not driver.busy

  # ---- release ---------------------------------------------------------------------------------------------
  def release_path(self, path_hash: str) -> bool:
    """Close every engine of the path ``path_hash`` (its KV caches and its reference to the model go); False,
    closing none, when one of them is in use."""
    with self._lock:
      keys = [k for k in self._engines if k[0] == path_hash]
      if any(not self._unused(self._engines[k]) for k in keys):
        return False
      drivers = [self._engines.pop(k) for k in keys]
      for d in drivers:
        self._freed_by_closed += d.engine.freed_total
    for d in drivers:
      d.close()
    return True

  def close(self) -> None:
    """Close every engine (runs still in a slot end with an error); later leases are refused."""
    with self._lock:
      self._closed = True
      drivers, self._engines = list(self._engines.values()), collections.OrderedDict()
      self._leases.clear()
    for d in drivers:
      d.close()

  # ---- reading -------------------------------------------------------------------------------------------------
  def drivers(self) -> list[SlotDriver]:
    """The engines' drivers now, least recently leased first."""
    with self._lock:
      return list(self._engines.values())

  def resident_models(self) -> list:
    """The models the engines hold (what an idle release must not evict the weights of)."""
    return [d.engine.model for d in self.drivers()]

  def resident_paths(self) -> set[str]:
    """The path hashes of the engines."""
    with self._lock:
      return {k[0] for k in self._engines}

  def occupancy(self) -> list[tuple[str, int, int, tuple[int, float] | None]]:
    """(path hash, rows, ring length, recent step) of every engine now: the streams it decodes or will (queued,
    prefilling, in a slot, or reserved: planned onto it and not yet submitted), the cache its steps attend over,
    and (width, ms) of its latest steps or None (:meth:`SlotEngine.recent_step
    <thoughtjax.serving.slots.SlotEngine.recent_step>`). Reserved requests whose path has no engine with a ring
    that holds them are one entry per (path, ring), as the engine they will make, not stepped yet."""
    with self._lock:
      drivers, reserved = list(self._engines.values()), dict(self._reserved)
    out = [[d.engine.model.path_hash, d.rows, d.engine.cache_len, d.engine.recent_step()] for d in drivers]
    made: list[list] = []  # the engines reserved requests will make, longest ring first
    for (h, ring), n in sorted(reserved.items(), key=lambda kv: -kv[0][1]):
      # The engine a lease would join: of the engines now and those longer reservations will make.
      joins = choose_engine(((e, e[2]) for e in out + made if e[0] == h), ring)
      if joins is not None:
        joins[1] += n
      else:
        made.append([h, n, ring, None])
    return [tuple(e) for e in out + made]

  def stats(self) -> dict:
    """engines, slots_in_use, slots_freed (engines closed since included), engine_evictions, and the prefix caches'
    counters added up."""
    with self._lock:
      drivers, freed_before = list(self._engines.values()), self._freed_by_closed
    totals: collections.Counter = collections.Counter()
    for d in drivers:
      if d.engine.prefix_cache is not None:
        totals.update(d.engine.prefix_cache.stats())
    return {
      "engines": len(drivers),
      "slots_in_use": sum(d.engine.active for d in drivers),
      "slots_freed": freed_before + sum(d.engine.freed_total for d in drivers),
      "engine_evictions": self.evictions,
      **totals,
    }

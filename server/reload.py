"""ReloadRegistry's work: the next :class:`~thoughtjax.server.validation.Serving` prepared off the event loop, the old one
retired, and the counts of both kept for the server's life.

Everything one registry sequence serves with (registry, synthesizer, composed explicit paths) is one
:class:`~thoughtjax.server.validation.Serving`; a request takes the current one when it arrives and keeps it to its end.
:meth:`Reloader.prepare` builds the next one on a worker thread (open under the serving trust policy, verify
every current thoughtlet's signature and digests, a calibration valid for the new sequence
(:func:`calibration_for`), warm the configured hints) and the servicer swaps the reference. Streams in flight
finish on the version they started with; a failure leaves the old version serving, is answered
FAILED_PRECONDITION naming it and is counted (RegistryStats, metrics).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import grpc

from thoughtjax.registry import Registry
from thoughtjax.sampling import SamplingMode
from thoughtjax.server.config import ServerConfig, WarmConfig
from thoughtjax.server.messages import failure_field, public_message, status_of
from thoughtjax.server.metrics import ServerMetrics, failure_totals
from thoughtjax.server.validation import Refused, Serving
from thoughtjax.serving.pool import EnginePool
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.calibration_store import MissingCalibrationError, read_calibration
from thoughtjax.synthesis.router_store import forget_router, stored_router
from thoughtjax.synthesis.synthesize import Synthesizer

log = logging.getLogger("thoughtjax.server")


def warm_set(syn: Synthesizer, warm: WarmConfig, pool: EnginePool | None) -> list[str]:
  """Restore and compile ``syn``'s warm set (config ``warm``) where requests run: with ``pool`` (the continuous
  scheduler's), in the slot engine of each hint's plan, in each of ``warm.modes``; with every hint
  (:data:`~thoughtjax.server.config.WARM_ALL`), also the stored router's programs, which route a request without
  hints. Returns the paths warmed (none when no hint is set). Blocks for the compiles; a worker thread's."""
  if not warm.hints:
    return []
  if warm.every_hint:
    router, _ = stored_router(syn.registry)
    if router is not None:
      router.warm()
  return syn.warm(
    None if warm.every_hint else warm.hints,
    prompt_tokens=warm.prompt_tokens,
    max_tokens=warm.max_tokens,
    pool=pool,
    budgets=warm.budgets_ms,
    modes=[SamplingMode(m) for m in warm.modes],
  )


@dataclasses.dataclass
class Reload:
  """What one ReloadRegistry prepared (``serving`` None: nothing to switch to)."""

  serving: Serving | None
  published: int
  calibration: str = ""
  dropped: tuple[str, ...] = ()
  warmed: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()


class Reloader:
  """A server's reloads: the rate limit (:meth:`limit`), one at a time (``lock``), the next version
  (:meth:`prepare`), the old one retired (:meth:`retire`). ``counts``: switched, unchanged and refused reloads
  and the last refusal's message; ``retired``: the versions replaced (their registry counters stay in the
  server's totals, as do the refused sequences', :meth:`refused_failures`)."""

  def __init__(self, config: ServerConfig, metrics: ServerMetrics, pool: EnginePool | None = None):
    self.config = config
    self.metrics = metrics
    self.pool = pool  # the continuous scheduler's engines, where the warm set is compiled (None: simple scheduler)
    self.counts: dict[str, Any] = {"switched": 0, "unchanged": 0, "refused": 0, "last_refusal": None}
    self.retired: list[Serving] = []
    self.lock = asyncio.Lock()  # one reload at a time; requests keep flowing meanwhile
    self._refused_failures: collections.Counter[str] = collections.Counter()
    self._count_lock = threading.Lock()
    self._last: float | None = None  # time.monotonic() of the last reload taken

  def refused_failures(self) -> dict[str, int]:
    """Registry failure counters of the new sequences a reload refused."""
    with self._count_lock:
      return dict(self._refused_failures)

  def limit(self) -> None:
    """RESOURCE_EXHAUSTED within ``admin.reload_interval_s`` of the last reload (each re-hashes the registry)."""
    now, interval = time.monotonic(), self.config.admin.reload_interval_s
    if self._last is not None and now - self._last < interval:
      raise Refused(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"ReloadRegistry: the last reload was {now - self._last:.1f} s ago and the server takes one per "
        f"{interval:g} s (admin.reload_interval_s); retry in {interval - (now - self._last):.1f} s",
      )
    self._last = now

  def prepare(self, old: Serving) -> Reload:
    """On a worker thread: the next :class:`~thoughtjax.server.validation.Serving`, opened, verified, calibrated and
    warmed; or nothing when the published sequence is the one served. A failure is counted and refused,
    ``old`` untouched."""
    fresh = None
    try:
      # The index: its signature under the serving trust policy, and never a sequence lower than one seen.
      fresh = Registry.open(old.registry.root, trust=old.registry.trust)
      if fresh.sequence == old.sequence:
        fresh.close()
        return Reload(None, old.sequence)
      # Every current thoughtlet's manifest signature and file digests, before anything is switched.
      fresh.verify(deep=False)
      calibration, how, dropped, notes = calibration_for(fresh, old.syn.calibration)
      syn = Synthesizer(
        fresh,
        calibration,
        old.syn.dictionary,
        kernels=old.syn.kernels,
        keep_paths=old.syn.keep_paths,
        learn=old.syn.learn,
      )
      warmed = warm_set(syn, self.config.warm, self.pool)
      return Reload(Serving.of(syn, owned=True), fresh.sequence, how, tuple(dropped), tuple(warmed), tuple(notes))
    except Exception as e:
      seq = "" if fresh is None else f" sequence {fresh.sequence}"
      message = (
        e.args[0]
        if isinstance(e, Refused)
        else (
          f"ReloadRegistry: the registry{seq} was refused: {e}. "
          f"Still serving sequence {old.sequence}; republish the failed thoughtlet (or restore the registry "
          f"from a backup), check it with thoughtjax registry verify, then call ReloadRegistry again"
        )
      )
      with self._count_lock:
        if fresh is not None:
          for field, n in failure_totals(fresh.stats()).items():
            self._refused_failures[field] += n
        elif (field := failure_field(e)) is not None:  # refused while opening: its counters went with it
          self._refused_failures[field] += 1
        self.counts["refused"] += 1
        self.counts["last_refusal"] = public_message(message)
      self.metrics.reloads.labels("refused").inc()
      log.error("ReloadRegistry of %s refused (%s): %s", old.registry.root, type(e).__name__, message)
      if fresh is not None:
        fresh.close()
      if status_of(e) is None:
        raise
      raise Refused(grpc.StatusCode.FAILED_PRECONDITION, message) from None

  def retire(self, old: Serving) -> None:
    """``old`` stops taking requests; streams in flight hold their own models. Its counters stay in the
    totals; its resident weights are dropped now (when the server opened it) and its lease at stop."""
    self.retired.append(old)
    if old.owned:
      old.registry.evict_all()
    old.paths.clear()
    old.syn.drop_models()  # its composed models: the new sequence composes its own
    forget_router(old.registry)

  def taken(self, switched: bool) -> None:
    """Count a reload that was answered OK: it switched to a new sequence or found the served one current."""
    outcome = "switched" if switched else "unchanged"
    self.counts[outcome] += 1
    self.metrics.reloads.labels(outcome).inc()


def calibration_for(registry, previous) -> tuple[Any, str, list[str], list[str]]:
  """A calibration valid for ``registry``'s sequence: its stored one (``"stored"``), else ``previous`` (of an
  older sequence) restricted to the paths whose thoughtlet versions are all still current (``"derived"``,
  with the dropped paths and a note saying so). Refused (FAILED_PRECONDITION naming ``thoughtjax registry
  calibrate``) when the full path changed: then no path's quality or latency is known at the new sequence."""
  try:
    return read_calibration(registry), "stored", [], []
  except MissingCalibrationError:
    pass
  current = registry.current
  changed = lambda c: sorted({u.ref for u in c.units if current.get(u.name) != u.version})
  fix = f"calibrate it (thoughtjax registry calibrate {registry.root}) and call ReloadRegistry again"
  full = changed(previous.full)
  if full:
    now = ", ".join(f"{ref.split('@')[0]}@{current.get(ref.split('@')[0], '(removed)')}" for ref in full)
    raise Refused(
      grpc.StatusCode.FAILED_PRECONDITION,
      f"ReloadRegistry: registry {registry.root} sequence {registry.sequence} has no calibration, and the one of "
      f"sequence {previous.sequence} cannot serve it: the full path's thoughtlets {full} are no longer current "
      f"(now {now}), so no path's quality or latency is known. Still serving sequence {previous.sequence}; {fix}",
    )
  kept = [c for c in previous.candidates if not changed(c)]
  dropped = [c.path for c in previous.candidates if changed(c)]
  hashes = {c.path_hash for c in kept}
  calibration = Calibration(
    registry.sequence,
    previous.fingerprint,
    kept,
    {h: q for h, q in previous.quality.items() if h in hashes},
    previous.latency,
    dict(current),
  )
  note = (
    f"registry sequence {registry.sequence} has no calibration: serving with the quality and latency recorded "
    f"at sequence {previous.sequence} for the {len(kept)} paths whose thoughtlet versions are unchanged"
    + (f"; {len(dropped)} paths whose thoughtlets changed are not offered until you {fix}" if dropped else "")
  )
  return calibration, "derived", dropped, [note]

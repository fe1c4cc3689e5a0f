"""Learned latency corrections kept across processes: one small JSON file per user, beside the cache.

A :class:`~thoughtjax.synthesis.latency.LatencyModel` learns multiplicative corrections from every finished
request (``latency`` module docstring). They describe this machine as it really runs, so they outlive the
process: a :class:`~thoughtjax.synthesis.synthesize.Synthesizer` loads them when it opens and saves them as it
learns. They are not part of the signed registry (they are per machine and change with every request).

Layout (``<cache dir>/latency-corrections.json``; ``THOUGHTJAX_LATENCY_CORRECTIONS`` names another file, or
``off`` to keep corrections in process only)::

    {"format": "thoughtjax.latency-corrections", "version": 3,
     "entries": {"<registry id>|<machine fingerprint>|<latency digest>":
                   {"updated": unix seconds, "updates": n,
                    "contexts": {"<engine>|<weights>|b<batch>|<kernels>":
                                   {"updated": unix seconds, "observations": n,
                                    "global": {stage: {"factor": f, "observations": n}},
                                    "paths": {path_hash: {stage: {"factor": f, "observations": n}}}}}}}}

An entry is keyed by the registry, the machine fingerprint and a digest of the fitted latency parameters the
factors correct, so a re-measured latency model (``calibrate --latency-only``) starts from fresh factors. Inside
an entry, corrections are kept per execution context (:class:`~thoughtjax.synthesis.latency_context.LatencyContext`):
what a server's slot engine learned is never applied to a plain program's prediction. The file is bounded: at
most :data:`MAX_ENTRIES` entries (the least recently updated go first), :data:`MAX_CONTEXTS` contexts per entry
and :data:`MAX_PATHS` per-path factor sets per context; a context silent for
:data:`~thoughtjax.synthesis.latency_context.MAX_AGE_S` is dropped (its factors have decayed to nothing). Writes are
atomic (a temporary file in the same folder, fsynced, then one ``os.replace``) under an advisory lock, merging
with what other processes wrote: a writer replaces only the contexts it learned in. A file that cannot be read
or does not follow this format is named in a :class:`LatencyCorrectionsWarning` and ignored (and replaced at
the next save), never an error: corrections only refine predictions. :func:`forget_corrections` (``thoughtjax
corrections --reset``, and ``registry calibrate``) removes a registry's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from thoughtjax import settings
from thoughtjax.errors import UserError
from thoughtjax.fetch import cache_dir
from thoughtjax.synthesis.latency_context import MAX_AGE_S, LatencyContext, Learned
from thoughtjax.synthesis.latency_params import LatencyModelError, LatencyParams

FORMAT = "thoughtjax.latency-corrections"
# 2: a path's factor is relative to the global one (latency module docstring); 3: corrections per execution
# context, with observation counts. A file of an older version is not damaged, only incomparable (version 2 mixed
# every context's corrections): it is ignored without a warning and replaced at the next save.
FORMAT_VERSION = 3
MAX_ENTRIES = 16
MAX_CONTEXTS = 16
MAX_PATHS = 128
ENV = settings.LATENCY_CORRECTIONS


class LatencyCorrectionsWarning(UserWarning):
  """The learned-corrections file could not be read or written; predictions use the calibration alone."""


def corrections_path() -> Path | None:
  """The corrections file of this user (``None`` when ``THOUGHTJAX_LATENCY_CORRECTIONS=off``)."""

  s = settings.current()
  if s.corrections_off:
    return None
  return s.latency_corrections or cache_dir() / "latency-corrections.json"


def corrections_key(registry_id: str | None, fingerprint: str, params: LatencyParams) -> str:
  """The entry of one registry on one machine for one fitted latency model (corrections left out)."""
  body = {k: v for k, v in params.to_json().items() if k != "corrections"}
  digest = hashlib.sha3_256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
  return f"{registry_id or 'unnamed'}|{fingerprint}|{digest}"


def _warn(path: Path, what: str) -> None:
  warnings.warn(
    f"latency corrections file {path}: {what}; ignored (predictions use the calibration alone until "
    f"requests teach them again; delete the file to silence this)",
    LatencyCorrectionsWarning,
    stacklevel=3,
  )


def _read(path: Path) -> dict:
  """The file's entries, validated; ``{}`` when absent, unreadable or malformed (warned)."""
  try:
    raw = path.read_bytes()
  except FileNotFoundError:
    return {}
  except OSError as e:
    _warn(path, f"cannot be read ({e.strerror or e})")
    return {}
  try:
    doc = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    _warn(path, f"is not JSON ({e})")
    return {}
  version = doc.get("version") if isinstance(doc, dict) else None
  if isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(version, int) and version < FORMAT_VERSION:
    return {}
  if not isinstance(doc, dict) or doc.get("format") != FORMAT or version != FORMAT_VERSION:
    got = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else type(doc).__name__
    _warn(path, f"expected format {FORMAT!r} version {FORMAT_VERSION}, got {got!r}")
    return {}
  entries = doc.get("entries")
  if not isinstance(entries, dict):
    _warn(path, f"'entries': expected an object, got {type(entries).__name__}")
    return {}
  out = {}
  for key, e in entries.items():
    try:
      if not isinstance(e, dict):
        raise LatencyModelError(f"expected an object, got {type(e).__name__}")
      updated, updates = e.get("updated"), e.get("updates", 0)
      if isinstance(updated, bool) or not isinstance(updated, (int, float)):
        raise LatencyModelError(f"'updated': expected unix seconds, got {updated!r}")
      if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
        raise LatencyModelError(f"'updates': expected a count >= 0, got {updates!r}")
      contexts = e.get("contexts", {})
      if not isinstance(contexts, dict):
        raise LatencyModelError(f"'contexts': expected an object, got {type(contexts).__name__}")
      learned = {}
      for ctx, doc in contexts.items():
        LatencyContext.from_key(ctx)
        learned[ctx] = Learned.from_json(doc, f"contexts[{ctx}]")
    except LatencyModelError as err:
      _warn(path, f"entry {key!r}: {err}")
      continue
    out[str(key)] = {"updated": float(updated), "updates": updates, "contexts": learned}
  return out


def read_entries(path: Path | None = None) -> dict:
  """Every entry of the file: key -> ``{"updated", "updates", "contexts": {context key: Learned}}``."""
  path = corrections_path() if path is None else path
  return {} if path is None else _read(path)


def load_corrections(key: str, path: Path | None = None) -> dict[str, Learned]:
  """The learned corrections of entry ``key``, context key -> :class:`~thoughtjax.synthesis.latency_context.Learned`
  (``{}`` when none; a bad file is warned about and ignored; contexts past their age are left out)."""
  path = corrections_path() if path is None else path
  if path is None:
    return {}
  now = time.time()
  contexts = _read(path).get(key, {}).get("contexts", {})
  return {k: v for k, v in contexts.items() if now - v.updated <= MAX_AGE_S}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
  """An advisory lock beside ``path`` (writers only; readers see whole files thanks to the rename)."""
  lock = path.with_name(path.name + ".lock")
  fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
    except ImportError:  # pragma: no cover - no flock (Windows): the rename still keeps the file whole
      pass
    yield
  finally:
    os.close(fd)


def _bounded(contexts: Mapping[str, Learned], now: float) -> dict[str, Learned]:
  """At most MAX_CONTEXTS contexts (the most recently updated), none past its age, MAX_PATHS paths each."""
  live = sorted((k for k, v in contexts.items() if now - v.updated <= MAX_AGE_S), key=lambda k: contexts[k].updated)
  out = {}
  for k in live[-MAX_CONTEXTS:]:
    rec = contexts[k]
    keep = list(rec.paths)[-MAX_PATHS:]  # the most recently added kept
    out[k] = dataclasses.replace(
      rec, paths={h: rec.paths[h] for h in keep}, n_paths={h: rec.n_paths.get(h, {}) for h in keep}
    )
  return out


def _write(path: Path, entries: dict) -> None:
  keep = sorted(entries, key=lambda k: entries[k]["updated"])[-MAX_ENTRIES:]
  doc = {
    "format": FORMAT,
    "version": FORMAT_VERSION,
    "entries": {
      k: {
        "updated": entries[k]["updated"],
        "updates": entries[k]["updates"],
        "contexts": {c: rec.to_json() for c, rec in entries[k]["contexts"].items()},
      }
      for k in keep
    },
  }
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(doc, f, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def save_corrections(key: str, contexts: Mapping[str, Learned], updates: int, path: Path | None = None) -> Path | None:
  """Store the ``contexts`` (context key -> :class:`~thoughtjax.synthesis.latency_context.Learned`) this process
  learned in under entry ``key``, keeping the entry's other contexts and the other entries (bounded, atomic).
  Returns the file written, or ``None`` when disabled or the write failed (warned)."""
  path = corrections_path() if path is None else path
  if path is None:
    return None
  if not path.parent.is_dir():  # a folder since removed (a test's scratch dir at exit): nothing to keep
    return None
  now = time.time()
  try:
    with _locked(path):
      entries = _read(path)
      before = entries.get(key, {}).get("contexts", {})
      entries[key] = {"updated": now, "updates": int(updates), "contexts": _bounded({**before, **contexts}, now)}
      _write(path, entries)
  except OSError as e:
    _warn(path, f"cannot be written ({e.strerror or e})")
    return None
  return path


EVERY_REGISTRY = "*"


class CorrectionsFileError(UserError, OSError):
  """The learned-corrections file could not be rewritten (e.g. it or its folder is read-only)."""


def forget_corrections(registry_id: str | None, path: Path | None = None) -> dict[str, int]:
  """Remove the learned corrections of ``registry_id`` (every machine and latency model it was learned with;
  ``None``: an unnamed registry's; :data:`EVERY_REGISTRY`: all). Returns entry key -> contexts removed
  (``{}``: nothing was learned)."""
  path = corrections_path() if path is None else path
  if path is None or not path.exists():
    return {}
  every = registry_id == EVERY_REGISTRY
  prefix = f"{registry_id or 'unnamed'}|"
  try:
    with _locked(path):
      entries = _read(path)
      gone = {k: len(e["contexts"]) for k, e in entries.items() if every or k.startswith(prefix)}
      if gone:
        _write(path, {k: e for k, e in entries.items() if k not in gone})
  except OSError as e:
    raise CorrectionsFileError(
      f"latency corrections file {path}: cannot be rewritten ({e.strerror or e}); make it and its folder "
      f"writable, or delete the file to forget every correction"
    ) from None
  return gone


class CorrectionsStore:
  """Saves one :class:`~thoughtjax.synthesis.latency.LatencyModel`'s corrections under ``key``, at most once
  every ``interval_s`` seconds (a request's learning costs no fsync of its own); :meth:`flush` writes what is
  pending (also run at exit)."""

  def __init__(self, key: str, model, path: Path | None, *, interval_s: float = 1.0):
    self.key, self.model, self.path, self.interval_s = key, model, path, interval_s
    self._saved_at = float("-inf")
    self._saved_updates = model.updates
    self._lock = threading.Lock()
    self.saves = 0

  def learned(self) -> None:
    """Call after the model learned from a request."""
    if time.monotonic() - self._saved_at >= self.interval_s:
      self.flush()

  def flush(self) -> None:
    with self._lock:
      updates = self.model.updates
      if self.path is None or updates == self._saved_updates:
        return
      changed = self.model.take_changed()
      self._saved_at, self._saved_updates = time.monotonic(), updates
    if changed and save_corrections(self.key, changed, updates, self.path) is not None:
      self.saves += 1

"""Learned latency corrections kept across processes: one small JSON file per user, beside the cache.

A :class:`~thoughtjax.synthesis.latency.LatencyModel` learns multiplicative corrections from every finished
request (``latency`` module docstring). They describe this machine as it really runs, so they outlive the
process: a :class:`~thoughtjax.synthesis.synthesize.Synthesizer` loads them when it opens and saves them as it
learns. They are not part of the signed registry (they are per machine and change with every request).

Layout (``<cache dir>/latency-corrections.json``; ``THOUGHTJAX_LATENCY_CORRECTIONS`` names another file, or
``off`` to keep corrections in process only)::

    {"format": "thoughtjax.latency-corrections", "version": 2,
     "entries": {"<registry id>|<machine fingerprint>|<latency digest>":
                   {"updated": unix seconds, "updates": n,
                    "corrections": {"global": {stage: f}, "paths": {path_hash: {stage: f}}}}}}

An entry is keyed by the registry, the machine fingerprint and a digest of the fitted latency parameters the
factors correct, so a re-measured latency model (``calibrate --latency-only``) starts from fresh factors. The
file is bounded: at most :data:`MAX_ENTRIES` entries (the least recently updated go first) and
:data:`MAX_PATHS` per-path factor sets per entry. Writes are atomic (a temporary file in the same folder,
fsynced, then one ``os.replace``) under an advisory lock, merging with what other processes wrote. A file that
cannot be read or does not follow this format is named in a :class:`LatencyCorrectionsWarning` and ignored
(and replaced at the next save), never an error: corrections only refine predictions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from thoughtjax.synthesis.latency import LatencyModelError, LatencyParams, _corrections_json

FORMAT = "thoughtjax.latency-corrections"
# 2: a path's factor is relative to the global one (latency module docstring). A file of an older version
# is not damaged, only incomparable: it is ignored without a warning and replaced at the next save.
FORMAT_VERSION = 2
MAX_ENTRIES = 16
MAX_PATHS = 128
ENV = "THOUGHTJAX_LATENCY_CORRECTIONS"


class LatencyCorrectionsWarning(UserWarning):
  """The learned-corrections file could not be read or written; predictions use the calibration alone."""


def corrections_path() -> Path | None:
  """The corrections file of this user (``None`` when ``THOUGHTJAX_LATENCY_CORRECTIONS=off``)."""
  from thoughtjax.fetch import cache_dir

  env = os.environ.get(ENV, "").strip()
  if env.lower() == "off":
    return None
  return Path(env) if env else cache_dir() / "latency-corrections.json"


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
      corr = _corrections_json(e.get("corrections", {}), f"entries[{key}].corrections")
    except LatencyModelError as err:
      _warn(path, f"entry {key!r}: {err}")
      continue
    out[str(key)] = {"updated": float(updated), "updates": updates, "corrections": corr}
  return out


def load_corrections(key: str, path: Path | None = None) -> dict:
  """The learned corrections of entry ``key`` (``{}`` when none; a bad file is warned about and ignored)."""
  path = corrections_path() if path is None else path
  if path is None:
    return {}
  return _read(path).get(key, {}).get("corrections", {})


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
  """An advisory lock beside ``path`` (writers only; readers see whole files thanks to the rename)."""
  lock = path.with_name(path.name + ".lock")
  fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
  try:
    try:
      import fcntl

      fcntl.flock(fd, fcntl.LOCK_EX)
    except ImportError:  # pragma: no cover - no flock (Windows): the rename still keeps the file whole
      pass
    yield
  finally:
    os.close(fd)


def _bounded(corrections: Mapping) -> dict:
  out = {}
  if corrections.get("global"):
    out["global"] = dict(corrections["global"])
  paths = list(corrections.get("paths", {}).items())[-MAX_PATHS:]  # the most recently added kept
  if paths:
    out["paths"] = {h: dict(f) for h, f in paths}
  return out


def save_corrections(key: str, corrections: Mapping, updates: int, path: Path | None = None) -> Path | None:
  """Store ``corrections`` as entry ``key`` (merged with the other entries, bounded, atomic). Returns the
  file written, or ``None`` when disabled or the write failed (warned)."""
  path = corrections_path() if path is None else path
  if path is None:
    return None
  corr = _bounded(_corrections_json(corrections, "corrections"))
  if not path.parent.is_dir():  # a folder since removed (a test's scratch dir at exit): nothing to keep
    return None
  try:
    with _locked(path):
      entries = _read(path)
      entries[key] = {"updated": time.time(), "updates": int(updates), "corrections": corr}
      keep = sorted(entries, key=lambda k: entries[k]["updated"])[-MAX_ENTRIES:]
      doc = {"format": FORMAT, "version": FORMAT_VERSION, "entries": {k: entries[k] for k in keep}}
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
  except OSError as e:
    _warn(path, f"cannot be written ({e.strerror or e})")
    return None
  return path


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
      corrections = self.model.to_params().corrections
      self._saved_at, self._saved_updates = time.monotonic(), updates
    if save_corrections(self.key, corrections, updates, self.path) is not None:
      self.saves += 1

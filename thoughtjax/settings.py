"""The ``THOUGHTJAX_*`` environment settings, read in one place into one documented object.

:func:`current` reads the environment each time it is called, so a process (or a test) that changes a variable
sees the change at the next use; no other module of the package reads a ``THOUGHTJAX_*`` variable.

==================================  ==========================  ==================================================
variable                            field                       meaning (unset: the default)
==================================  ==========================  ==================================================
``THOUGHTJAX_CACHE``                ``cache``                   the cache directory (``$XDG_CACHE_HOME/thoughtjax``,
                                                                else ``~/.cache/thoughtjax``)
``THOUGHTJAX_COMPILE_CACHE``        ``compile_cache``           XLA's persistent compilation cache (``<cache>/xla``);
                                                                a folder: ``off`` is refused, not made a folder
``THOUGHTJAX_EXPORT_CACHE``         ``export_cache``,           exported programs (``<cache>/exported``); ``off``
                                    ``export_off``              (or ``0``, ``none``, empty) turns exporting off
``THOUGHTJAX_TRUST_STATE``          ``trust_state``             the registry rollback state
                                                                (``<cache>/trust-state.json``)
``THOUGHTJAX_LATENCY_CORRECTIONS``  ``latency_corrections``,    what synthesis learns about this machine's latency
                                    ``corrections_off``         (``<cache>/latency-corrections.json``); ``off``
                                                                keeps it in the process only
``THOUGHTJAX_PROGRAM_CACHE``        ``program_cache``           compiled programs held per process (32)
``THOUGHTJAX_PROGRAM_LEDGER``       ``program_ledger_off``      ``off``: plans price a program an earlier process
                                                                compiled as a full compile, not as the load it is
                                                                (the ledger beside the compilation cache is kept
                                                                in the process only)
``THOUGHTJAX_VERIFY_CACHE``         ``verify_cache_full``       ``full``: re-hash every converted weight on load
==================================  ==========================  ==================================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from thoughtjax.errors import UserError

CACHE = "THOUGHTJAX_CACHE"
COMPILE_CACHE = "THOUGHTJAX_COMPILE_CACHE"
EXPORT_CACHE = "THOUGHTJAX_EXPORT_CACHE"
TRUST_STATE = "THOUGHTJAX_TRUST_STATE"
LATENCY_CORRECTIONS = "THOUGHTJAX_LATENCY_CORRECTIONS"
PROGRAM_CACHE = "THOUGHTJAX_PROGRAM_CACHE"
PROGRAM_LEDGER = "THOUGHTJAX_PROGRAM_LEDGER"
VERIFY_CACHE = "THOUGHTJAX_VERIFY_CACHE"
_OFF = ("off", "0", "none", "")


class SettingsError(UserError, ValueError):
  """A ``THOUGHTJAX_*`` variable holds a value it cannot take; the message names the variable and the fix."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the ``THOUGHTJAX_*`` variables say (see the module's table); ``None``: the variable is unset."""

  cache: Path | None = None
  compile_cache: Path | None = None
  export_cache: Path | None = None
  export_off: bool = False
  trust_state: Path | None = None
  latency_corrections: Path | None = None
  corrections_off: bool = False
  program_cache: int = 32
  program_ledger_off: bool = False
  verify_cache_full: bool = False


def _path(value: str | None) -> Path | None:
  return Path(value).expanduser() if value else None


def current(environ: Mapping[str, str] = os.environ) -> Settings:
  """The settings the environment gives now; a bad value raises :class:`SettingsError`."""
  export = environ.get(EXPORT_CACHE)
  export_off = export is not None and export.strip().lower() in _OFF
  corrections = environ.get(LATENCY_CORRECTIONS, "").strip()
  corrections_off = corrections.lower() == "off"
  programs = environ.get(PROGRAM_CACHE, "32").strip()
  try:
    program_cache = int(programs)
  except ValueError:
    program_cache = 0
  if program_cache < 1:
    raise SettingsError(f"{PROGRAM_CACHE} must be a positive number of programs, got {programs!r}")
  compile_cache = environ.get(COMPILE_CACHE)
  if compile_cache is not None and compile_cache.strip().lower() in _OFF[:3]:
    raise SettingsError(
      f"{COMPILE_CACHE} names the folder of XLA's compilation cache, which cannot be turned off; got"
      f" {compile_cache!r} (unset it for <cache>/xla)"
    )
  return Settings(
    cache=_path(environ.get(CACHE)),
    compile_cache=_path(compile_cache),
    export_cache=None if export_off else _path(export),
    export_off=export_off,
    trust_state=_path(environ.get(TRUST_STATE)),
    latency_corrections=None if corrections_off else _path(corrections),
    corrections_off=corrections_off,
    program_cache=program_cache,
    program_ledger_off=environ.get(PROGRAM_LEDGER, "").strip().lower() == "off",
    verify_cache_full=environ.get(VERIFY_CACHE) == "full",
  )

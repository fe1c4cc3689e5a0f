"""The process's C heap (glibc's malloc), held near what the process uses.

Two policies, both for long-lived or peak-sensitive processes and installed by the commands, not by the library:

* :func:`trim` hands freed heap pages back to the OS (``malloc_trim``): glibc keeps them otherwise, so a process
  that freed a large buffer (a compile's temporaries, a released path's weights) keeps its RSS.
* :func:`cap_arenas` bounds glibc's per-thread arenas (``mallopt(M_ARENA_MAX)``, what the ``MALLOC_ARENA_MAX``
  variable sets). glibc gives each new thread that allocates a heap of its own, up to eight per core; a server's
  gRPC, event-loop and worker threads each fragment theirs, and freed pages scattered over many heaps are neither
  reused by the others nor trimmed. Measured with ``thoughtjax bench soak`` (BENCHMARKS.md): under 300 hostile
  clients the server's RSS kept climbing with glibc's default and levelled off with two arenas. Call it first
  thing, before threads allocate: a thread keeps the arena it got.

Where libc is not glibc both are no-ops that return False.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_ARENA_MAX = -8  # glibc's malloc.h
SERVER_ARENAS = 2


@functools.cache
def _glibc() -> ctypes.CDLL | None:
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim, libc.mallopt  # noqa: B018 (both exist in glibc only)
  except (OSError, AttributeError):
    return None
  return libc


def trim() -> bool:
  """Give glibc's free heap pages back to the OS (~10 ms). False where libc is not glibc."""
  libc = _glibc()
  if libc is None:
    return False
  libc.malloc_trim(0)
  return True


def cap_arenas(arenas: int = SERVER_ARENAS) -> bool:
  """Let glibc make at most ``arenas`` heaps from now on, unless ``MALLOC_ARENA_MAX`` is set (the operator's
  choice, already applied by glibc). True when the cap was set."""
  if arenas < 1:
    raise ValueError(f"arenas must be at least 1; got {arenas}")
  libc = _glibc()
  if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
    return False
  return bool(libc.mallopt(M_ARENA_MAX, arenas))

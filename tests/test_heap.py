"""The C heap policies (thoughtjax.heap), measured in fresh processes through glibc's own report."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from thoughtjax import heap

try:
  ctypes.CDLL("libc.so.6").malloc_info  # noqa: B018
  GLIBC = True
except (OSError, AttributeError):
  GLIBC = False

# Six threads each hold a malloc'd buffer at once; then glibc reports its heaps (one <heap> per arena).
HEAPS_AFTER_THREADS = """
import ctypes, os, sys, threading
from thoughtjax import heap
print(heap.cap_arenas(int(sys.argv[1])) if sys.argv[1] != "none" else None)
held, done = threading.Barrier(7), threading.Event()
def hold():
  buffer = bytearray(64 * 1024)  # from this thread's arena
  held.wait()
  done.wait()
threads = [threading.Thread(target=hold) for _ in range(6)]
for t in threads:
  t.start()
held.wait()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
out = sys.argv[2]
fp = ctypes.c_void_p(libc.fopen(out.encode(), b"w"))
libc.malloc_info(0, fp)
libc.fclose(fp)
done.set()
print(open(out).read().count("<heap nr="))
"""


def _heaps(tmp_path, arenas: str, **env) -> tuple[str, int]:
  environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
  out = subprocess.run(
    [sys.executable, "-c", HEAPS_AFTER_THREADS, arenas, str(tmp_path / "malloc_info.xml")],
    capture_output=True,
    text=True,
    env=environ,
    timeout=60,
    check=True,
  ).stdout.split()
  return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's arenas")
def test_capped_arenas_hold_the_threads_heaps_to_the_cap(tmp_path):
  said, uncapped = _heaps(tmp_path, "none")
  assert uncapped >= 4, "the threads should have made heaps of their own (the check would prove nothing)"
  said, capped = _heaps(tmp_path, "2")
  assert said == "True" and capped <= 2


@pytest.mark.skipif(not GLIBC, reason="glibc's arenas")
def test_the_operators_malloc_arena_max_stands(tmp_path):
  said, heaps = _heaps(tmp_path, "2", MALLOC_ARENA_MAX="3")
  assert said == "False" and 2 < heaps <= 3


def test_a_cap_below_one_is_refused():
  with pytest.raises(ValueError, match="at least 1"):
    heap.cap_arenas(0)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim")
def test_trim_runs_on_glibc():
  assert heap.trim() is True

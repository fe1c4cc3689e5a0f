"""Helpers every benchmark shares: timing, time to first byte, one bandwidth probe, tables, JSON.

Each benchmark (``decode``, ``registry``, ``kernels``) measures its own things; how it times a
call, spawns a process and waits for its first output byte, probes the memory bandwidth it compares
against, prints a table and writes its JSON lives here, once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np


# ------------------------------------------------------------------------------ timing
def median(xs: Sequence[float]) -> float:
  """The median, or NaN for no samples (a row that could not be measured)."""
  return statistics.median(xs) if len(xs) else float("nan")


def time_calls(fn: Callable, args: tuple, repeats: int) -> tuple[float, float, Any]:
  """(median s, min s, output) of hot-cache calls of a JAX function; the first call compiles.

  Each round runs ``inner`` back-to-back calls (enough for >= ~2 ms), then one sync, and
  counts the round's time divided by ``inner``.
  """
  import jax

  out = jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  single = time.perf_counter() - start
  inner = int(np.clip(2e-3 / max(single, 1e-7), 1, 200))  # rounds of >= ~2 ms
  rounds = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    rounds.append((time.perf_counter() - start) / inner)
  return statistics.median(rounds), min(rounds), out


# ------------------------------------------------------------------------ first byte
@dataclasses.dataclass(frozen=True)
class FirstByte:
  """A process run to completion: seconds from spawn to its first stdout byte, and its peak RSS."""

  seconds: float
  peak_rss_mib: float


def first_byte(cmd: list[str], env: dict | None = None) -> FirstByte:
  """Spawn ``cmd``, time it to the first byte on its stdout, then let it finish; it must succeed.

  stderr goes to a temporary file (a pipe nobody reads could fill and stall the child) and its
  tail is quoted when the process fails.
  """
  with tempfile.TemporaryFile() as err:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - start
    proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not first:
      err.seek(0)
      tail = err.read()[-2000:].decode(errors="replace")
      raise RuntimeError(f"{' '.join(cmd)} failed with exit {proc.returncode}: {tail}")
  return FirstByte(elapsed, usage.ru_maxrss / 1024)  # ru_maxrss is in KiB on Linux


# ---------------------------------------------------------------------------- bandwidth
def copy_bandwidth_gbps(num_bytes: int, repeats: int = 5, *, on: Literal["host", "device"] = "host") -> float:
  """Measured copy bandwidth in GB/s, counting bytes read plus bytes written (STREAM's convention).

  ``on="host"``: ``numpy.copyto`` between two preallocated host arrays, what a CPU decode step
  streams its weights against. ``on="device"``: ``x + 1`` in place on the default JAX device; the
  input is donated so every call reuses one buffer (a fresh output would also time the OS faulting
  in new pages, about 10x slower on CPU).
  """
  rounds = []
  if on == "host":
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    for _ in range(repeats):
      start = time.perf_counter()
      np.copyto(dst, src)
      rounds.append(time.perf_counter() - start)
  elif on == "device":
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    x = jax.block_until_ready(step(jnp.ones((num_bytes // 4,), jnp.float32)))
    for _ in range(repeats):
      start = time.perf_counter()
      x = jax.block_until_ready(step(x))
      rounds.append(time.perf_counter() - start)
  else:
    raise ValueError(f"copy_bandwidth_gbps: on must be 'host' or 'device', got {on!r}")
  return 2 * num_bytes / statistics.median(rounds) / 1e9


# ------------------------------------------------------------------------------- output
def print_table(
  title: str,
  columns: Sequence[str],
  rows: Sequence[Sequence[Any]],
  *,
  width: int | None = None,
  right: Sequence[str] = (),
  no_wrap: bool = False,
) -> None:
  """A rich table on stdout; ``right`` names the right-justified (numeric) columns."""
  from rich.console import Console
  from rich.table import Table

  table = Table(title=title)
  for name in columns:
    table.add_column(name, justify="right" if name in right else "left", no_wrap=no_wrap)
  for row in rows:
    table.add_row(*[str(x) for x in row])
  Console(width=width).print(table)


def fmt(value: float | None, spec: str) -> str:
  """``value`` formatted with ``spec``; ``-`` for a figure that was not measured."""
  return "-" if value is None else format(value, spec)


def json_path(text: str) -> str:
  """argparse ``type=`` of ``--json FILE``: refuse a file that cannot be written before the run, not after it."""
  import argparse

  path = Path(text).expanduser()
  if path.is_dir() or not path.parent.is_dir():
    raise argparse.ArgumentTypeError(
      f"{text}: expected a file in an existing directory; create {path.parent} first or pick another path"
    )
  return text


def write_json(path: str | os.PathLike, report: Any, *, indent: int = 2) -> None:
  """Write a benchmark's report (plain JSON types) to ``path``."""
  Path(path).write_text(json.dumps(report, indent=indent))

"""A running local ``thoughtjax serve``, found by the command line: warm weights and programs instead of a cold
start (the way ``ollama run`` talks to its daemon).

A ``thoughtjax serve`` announces itself once it is SERVING: one file ``<cache dir>/servers/<pid>.json`` (mode
0600, in the cache directory only this user may write, :mod:`thoughtjax.cachedir`) that names its gRPC address,
the registry it serves and that registry's full path, and whether calls need a client token. It removes the
file when it stops. :func:`find` returns the announcement of a live server of a given registry and removes
those of servers that are gone (a killed server cannot remove its own; a process id reused since is told
apart by its start time, where ``/proc`` has it).

``thoughtjax generate`` and ``synthesize`` use such a server when the request is one it serves as the
in-process run would (the same registry and model, no flag the server does not take: a weight form, kernels,
a draft, trust keys), and start in-process otherwise. ``--no-server`` (or ``THOUGHTJAX_NO_SERVER=1``) always
starts in-process. A server that needs a client token is used with ``THOUGHTJAX_API_KEY``; one that speaks
TLS is not used (its certificate authority is not known here; ``thoughtjax client --tls-ca`` reaches it).

Importing this module imports neither JAX nor gRPC.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from thoughtjax import durable
from thoughtjax.cachedir import cache_subdir

NO_SERVER_ENV = "THOUGHTJAX_NO_SERVER"  # 1 / true / yes: the command line never uses a running server
TOKEN_ENV = "THOUGHTJAX_API_KEY"
SUBDIR = "servers"


@dataclasses.dataclass(frozen=True)
class Announcement:
  """What a serving ``thoughtjax serve`` wrote: ``target`` (its gRPC address, as a local client dials it),
  ``registry`` (the directory it serves, resolved) and ``full_path`` (that registry's whole model as a path)."""

  pid: int
  target: str
  registry: str
  full_path: str
  token: bool  # calls need a client token
  tls: bool
  started: str | None  # the process's start time in clock ticks since boot (/proc/PID/stat), None elsewhere
  file: Path

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.pop("file")
    return d


def disabled() -> bool:
  """True when ``THOUGHTJAX_NO_SERVER`` asks the command line to start in-process always."""
  return os.environ.get(NO_SERVER_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def dial_address(bind: str, port: int) -> str:
  """The address a client on this machine dials for a server bound to ``bind``: a wildcard bind is reached on
  loopback."""
  host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}.get(bind, bind)
  if ":" in host and not host.startswith("["):
    host = f"[{host}]"
  return f"{host}:{port}"


def announce(target: str, registry: str | os.PathLike, full_path: str, *, token: bool, tls: bool) -> Path:
  """Write this process's announcement (atomically, mode 0600); returns its file, for :func:`withdraw`."""
  pid = os.getpid()
  file = cache_subdir(SUBDIR) / f"{pid}.json"
  a = Announcement(pid, target, str(Path(registry).resolve()), full_path, token, tls, _start_time(pid), file)
  durable.write_atomic(file, json.dumps(a.to_json()).encode())
  return file


def withdraw(file: Path) -> None:
  """Remove an announcement (a missing one is fine)."""
  file.unlink(missing_ok=True)


def find(registry: str | os.PathLike) -> Announcement | None:
  """The newest announcement of a live server of ``registry`` that this command line can call (plaintext, and a
  token at hand when it needs one); None when there is none. Announcements of servers that are gone are
  removed; an unreadable one is skipped."""
  want = str(Path(registry).expanduser().resolve())
  found = []
  for a in announcements():
    if not _alive(a):
      withdraw(a.file)
    elif a.registry == want and not a.tls and (not a.token or os.environ.get(TOKEN_ENV)):
      found.append(a)
  return max(found, key=lambda a: a.file.stat().st_mtime_ns, default=None)


def announcements() -> list[Announcement]:
  """Every readable announcement in the cache directory, live or not."""
  directory = cache_subdir(SUBDIR)
  out = []
  for file in directory.glob("*.json"):
    try:
      d = json.loads(file.read_text())
      out.append(
        Announcement(
          int(d["pid"]),
          str(d["target"]),
          str(d["registry"]),
          str(d["full_path"]),
          bool(d["token"]),
          bool(d["tls"]),
          d.get("started"),
          file,
        )
      )
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return out


def _alive(a: Announcement) -> bool:
  try:
    os.kill(a.pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # a process of another user holds the id now
    return False
  return a.started is None or _start_time(a.pid) in (None, a.started)


def _start_time(pid: int) -> str | None:
  """Field 22 of ``/proc/PID/stat`` (start time after boot, in clock ticks); None without ``/proc``."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return stat.rsplit(")", 1)[1].split()[19]  # the fields after the command name, which may hold spaces

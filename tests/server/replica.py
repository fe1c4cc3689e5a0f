"""A replica for the failover test: the server of ``thoughtjax serve`` (``server.app.serve``) over a registry, in
its own process, printing ``serving on 127.0.0.1:PORT`` like the command.

With ``--hold``, a Synthesize stream whose ``seed`` is :data:`HOLD_SEED` stops after its first delta and waits
for good: the test can then kill the process with those streams truly in flight (a tiny model finishes a
stream in milliseconds, so without it "in flight at the kill" would be a race). Other requests run normally.

    python -m tests.server.replica --registry DIR [--hold]
"""

from __future__ import annotations

import argparse
import asyncio
import threading

HOLD_SEED = 4242


class _Holding:
  """The synthesizer, except that runs asked with ``seed=HOLD_SEED`` never get past their first delta."""

  def __init__(self, syn):
    self._syn = syn
    self._never = threading.Event()

  def __getattr__(self, name):
    return getattr(self._syn, name)

  def synthesize(self, *a, **kw):
    r = self._syn.synthesize(*a, **kw)
    return _Held(r, self._never) if kw.get("seed") == HOLD_SEED else r


class _Held:
  def __init__(self, result, never: threading.Event):
    self._r, self._never, self._n = result, never, 0

  def __getattr__(self, name):
    return getattr(self._r, name)

  def __iter__(self):
    return self

  def __next__(self):
    if self._n == 1:
      self._never.wait()  # until the process is killed
    self._n += 1
    return next(self._r)


def main() -> None:
  from server.app import serve
  from server.config import ServerConfig
  from thoughtjax.registry import Registry
  from thoughtjax.synthesis.synthesize import Synthesizer

  p = argparse.ArgumentParser()
  p.add_argument("--registry", required=True)
  p.add_argument("--hold", action="store_true")
  args = p.parse_args()
  registry = Registry.open(args.registry)
  syn = Synthesizer.open(registry)
  config = ServerConfig(port=0)
  asyncio.run(
    serve(
      _Holding(syn) if args.hold else syn,
      config,
      on_port=lambda port: print(f"serving on {config.bind}:{port}", flush=True),
    )
  )


if __name__ == "__main__":
  main()

"""A replica for the failover test: the server of ``thoughtjax serve`` (``thoughtjax.server.app.serve``) over a registry, in
its own process, printing ``serving on 127.0.0.1:PORT`` like the command.

With ``--hold``, a Synthesize request whose ``seed`` is :data:`HOLD_SEED` is admitted, then waits at its start
for good and prints ``held`` on stdout: the test can then kill the process with those calls truly in flight (a
tiny model finishes a stream in milliseconds, so without it "in flight at the kill" would be a race). The wait
is on the scheduler's worker thread, so the server itself keeps answering (RegistryStats counts them in flight).
Other requests run normally.

    python -m tests.server.replica --registry DIR [--hold]
"""

from __future__ import annotations

import argparse
import asyncio
import threading

HOLD_SEED = 4242
ADMIN_TOKEN = "failover-test-admin-token"  # RegistryStats is an admin call


class _Holding:
  """The synthesizer, except that runs asked with ``seed=HOLD_SEED`` never start."""

  def __init__(self, syn):
    self._syn = syn
    self._never = threading.Event()
    self._print = threading.Lock()

  def __getattr__(self, name):
    return getattr(self._syn, name)

  def synthesize(self, *a, **kw):
    if kw.get("seed") == HOLD_SEED:
      with self._print:
        print("held", flush=True)
      self._never.wait()  # until the process is killed
    return self._syn.synthesize(*a, **kw)


def main() -> None:
  from thoughtjax.registry import Registry
  from thoughtjax.server.app import serve
  from thoughtjax.server.config import AdminConfig, ServerConfig
  from thoughtjax.synthesis.synthesize import Synthesizer

  p = argparse.ArgumentParser()
  p.add_argument("--registry", required=True)
  p.add_argument("--hold", action="store_true")
  args = p.parse_args()
  registry = Registry.open(args.registry)
  syn = Synthesizer.open(registry)
  config = ServerConfig(port=0, admin=AdminConfig(token=ADMIN_TOKEN))
  asyncio.run(
    serve(
      _Holding(syn) if args.hold else syn,
      config,
      on_port=lambda port: print(f"serving on {config.bind}:{port}", flush=True),
    )
  )


if __name__ == "__main__":
  main()

"""``thoughtjax bench startup``: how long a command takes from process start to exit, in-process and through a
running local ``thoughtjax serve``.

Each row is one command line run as a fresh process ``--repeats`` times after one untimed run (which fills the
caches the later ones find warm: the page cache, XLA's compilation cache, the registry's restore caches):

- ``import thoughtjax``, and ``thoughtjax --help`` (the command line with no command run);
- ``thoughtjax generate --chat --prompt P --max-tokens 1`` and the README's ``synthesize`` (``--max-tokens 1``
  unless ``--max-tokens`` says otherwise), with ``--no-server`` (in-process: JAX, restore, compile-cache load,
  prefill);
- the same two commands through a ``thoughtjax serve`` this benchmark starts (on loopback, any free port, gRPC
  only) once it has announced itself; each answer is checked to have come from that server (``--json``'s
  ``server``), and the in-process ones to have not.

Reported: median and spread of the wall time, peak RSS of the command's process (``ru_maxrss``). Targets
(issue 38): generate <= 1.5 s in-process and <= 0.3 s through a server, synthesize <= 2.0 s in-process,
generate's peak RSS <= 0.6 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from thoughtjax.bench import common

PROMPT = "What is the capital of France?"
TARGETS_S = {"generate (in-process)": 1.5, "generate (server)": 0.3, "synthesize (in-process)": 2.0}
GENERATE_RSS_TARGET_MIB = 0.6e9 / 2**20


def timed(cmd: list[str], env: dict) -> tuple[float, float, str]:
  """Run ``cmd`` to its end: (seconds from spawn to exit, peak RSS MiB, stdout). It must succeed."""
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    out.seek(0)
    err.seek(0)
    if code != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed with exit {code}: {err.read()[-2000:].decode(errors='replace')}")
    return seconds, usage.ru_maxrss / 1024, out.read().decode()


def measure(name: str, cmd: list[str], env: dict, repeats: int, served_by: str | None | bool) -> dict:
  """One untimed run, then ``repeats`` timed ones. ``served_by``: the server every ``--json`` answer must name
  (None: none may name one; False: the command prints no JSON)."""
  runs = []
  for i in range(repeats + 1):
    seconds, rss, stdout = timed(cmd, env)
    if served_by is not False:
      got = json.loads(stdout.strip().splitlines()[-1]).get("server")
      if got != served_by:
        raise RuntimeError(f"{name}: answered by {got or 'this process'}, expected {served_by or 'this process'}")
    if i:
      runs.append({"s": seconds, "peak_rss_mib": rss})
    print(f"  {name}: {seconds:.3f} s, peak RSS {rss:.0f} MiB{'' if i else ' (untimed)'}", file=sys.stderr)
  times = [r["s"] for r in runs]
  return {
    "name": name,
    "command": " ".join(cmd),
    "median_s": statistics.median(times),
    "min_s": min(times),
    "max_s": max(times),
    "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
    "runs": runs,
    "target_s": TARGETS_S.get(name),
  }


class _Server:
  """``thoughtjax serve`` on loopback (any free gRPC port, no HTTP) until :meth:`close`; ``target`` once it has
  announced itself."""

  def __init__(self, registry: str | None, env: dict, timeout: float):
    from thoughtjax import local_server

    cmd = [sys.executable, "-m", "thoughtjax.cli", "serve", "--port", "0", "--no-http"]
    if registry:
      cmd += ["--registry", registry]
    self.log = tempfile.TemporaryFile()
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
    line = self.proc.stdout.readline()
    if not line.startswith("serving on "):
      self.close()
      raise RuntimeError(f"thoughtjax serve did not start: {line!r}")
    self.target = line.split()[-1].replace("0.0.0.0", "127.0.0.1")
    deadline = time.monotonic() + timeout
    while not [a for a in local_server.announcements() if a.pid == self.proc.pid]:
      if self.proc.poll() is not None or time.monotonic() > deadline:
        self.log.seek(0)
        tail = self.log.read()[-2000:].decode(errors="replace")
        self.close()
        raise RuntimeError(f"thoughtjax serve never announced itself: {tail}")
      time.sleep(0.1)

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.proc.stdout.close()
    self.log.close()


def run(*, repeats: int, prompt: str, max_tokens: int, registry: str | None, server: bool, timeout: float) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "THOUGHTJAX_NO_SERVER"}
  tj = [sys.executable, "-m", "thoughtjax.cli"]
  where = ["--registry", registry] if registry else []
  gen = [*tj, "generate", *where, "--chat", "--prompt", prompt, "--max-tokens", str(max_tokens), "--json"]
  syn = [*tj, "synthesize", *where, "--hint", "general_purpose", "--max-latency-ms", "60000", "--chat"]
  syn += ["--prompt", prompt, "--max-tokens", str(max_tokens), "--json"]
  rows = [
    measure("import thoughtjax", [sys.executable, "-c", "import thoughtjax"], env, repeats, False),
    measure("thoughtjax --help", [*tj, "--help"], env, repeats, False),
    measure("generate (in-process)", [*gen, "--no-server"], env, repeats, None),
    measure("synthesize (in-process)", [*syn, "--no-server"], env, repeats, None),
  ]
  target = None
  if server:
    srv = _Server(registry, env, timeout)
    target = srv.target
    try:
      rows.append(measure("generate (server)", gen, env, repeats, srv.target))
      rows.append(measure("synthesize (server)", syn, env, repeats, srv.target))
    finally:
      srv.close()
  by = {r["name"]: r for r in rows}
  gen_rss = by["generate (in-process)"]["peak_rss_mib"]
  return {
    "repeats": repeats,
    "prompt": prompt,
    "max_tokens": max_tokens,
    "rows": rows,
    "server": target,
    "targets_met": {
      **{name: by[name]["median_s"] <= t for name, t in TARGETS_S.items() if name in by},
      "generate peak RSS <= 0.6 GB": gen_rss <= GENERATE_RSS_TARGET_MIB,
    },
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench startup", description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=5, help="timed runs per command, after one untimed (default 5)")
  p.add_argument("--prompt", default=PROMPT, help=f"the chat prompt (default {PROMPT!r})")
  p.add_argument("--max-tokens", type=int, default=1, help="tokens each command generates (default 1)")
  p.add_argument("--registry", default=None, help="registry of every command and the server (default: the default)")
  p.add_argument("--no-server", action="store_true", help="only the in-process rows: start no server")
  p.add_argument("--timeout", type=float, default=900.0, help="seconds the server may take to announce itself")
  p.add_argument("--json", default=None, type=common.json_path, help="write the results here")
  args = p.parse_args(argv)
  if args.repeats < 1 or args.max_tokens < 1:
    p.error("--repeats and --max-tokens must be >= 1")
  out = run(
    repeats=args.repeats,
    prompt=args.prompt,
    max_tokens=args.max_tokens,
    registry=args.registry,
    server=not args.no_server,
    timeout=args.timeout,
  )
  out["command"] = "thoughtjax bench startup " + " ".join(argv or [])
  common.print_table(
    f"process start to exit, median of {args.repeats} after one untimed run ({args.max_tokens} token(s))",
    ["command", "median s", "min s", "max s", "peak RSS MiB", "target s"],
    [
      [
        r["name"],
        f"{r['median_s']:.3f}",
        f"{r['min_s']:.3f}",
        f"{r['max_s']:.3f}",
        f"{r['peak_rss_mib']:.0f}",
        "-" if r["target_s"] is None else f"{r['target_s']:g}",
      ]
      for r in out["rows"]
    ],
    right=("median s", "min s", "max s", "peak RSS MiB", "target s"),
  )
  for name, met in out["targets_met"].items():
    print(f"target {name}: {'met' if met else 'missed'}")
  if args.json:
    common.write_json(args.json, out)
  return 0

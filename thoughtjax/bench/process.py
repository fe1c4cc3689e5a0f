"""A real ``thoughtjax serve`` process for the benchmarks that measure one (``bench idle``, ``bench soak``): started
with a config of the benchmark's, its pid, ports and output, its RSS and its Prometheus series."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def rss_mib(pid: int) -> float:
  """Resident set size of process ``pid`` now (MiB), from /proc (Linux); NaN elsewhere."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")


def metric(url: str, name: str) -> float:
  """The value of the unlabelled series ``name`` on a Prometheus text endpoint (0 when absent)."""
  with urllib.request.urlopen(url, timeout=10) as r:
    for line in r.read().decode().splitlines():
      if line.startswith(name + " "):
        return float(line.split()[1])
  return 0.0


class Server:
  """``thoughtjax serve --config`` (the YAML ``config``) in a subprocess, on free ports, with its metrics port and,
  with ``http``, its OpenAI HTTP port: ``pid``, ``target`` (gRPC), ``metrics`` and ``http`` (URLs), read from its
  first lines; ``lines``: everything it printed."""

  def __init__(self, registry: str | None, config: str, timeout: float, *, http: bool = False, prefix: str = "serve"):
    self.dir = tempfile.TemporaryDirectory(prefix=f"thoughtjax-bench-{prefix}-")
    cfg = Path(self.dir.name) / "server.yaml"
    cfg.write_text(config)
    cmd = [sys.executable, "-m", "thoughtjax.cli", "serve", "--config", str(cfg), "--port", "0", "--metrics-port", "0"]
    cmd += ["--http-port", "0"] if http else ["--no-http"]  # HTTP's default port may be taken
    if registry:
      cmd += ["--registry", registry]
    root = str(Path(__file__).resolve().parents[2])  # the checkout this module runs from (server/ lives there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    self.lines: list[str] = []
    self.target = self.metrics = self.http = None
    got = threading.Event()

    def started() -> bool:
      return bool(self.target and self.metrics and (self.http or not http))

    def read():
      try:
        for line in self.proc.stdout:
          self.lines.append(line.rstrip())
          if line.startswith("serving on "):
            self.target = line.split()[-1]
          elif line.startswith("metrics on "):
            self.metrics = line.split()[-1]
          elif line.startswith("openai http on "):
            self.http = line.split()[-1].removesuffix("/v1")
          if started():
            got.set()
      except (OSError, ValueError):  # closed by close() while reading
        pass
      got.set()

    threading.Thread(target=read, daemon=True).start()
    if not got.wait(timeout) or not started():
      self.close()
      raise RuntimeError("the server did not start:\n" + "\n".join(self.lines[-20:]))

  @property
  def pid(self) -> int:
    return self.proc.pid

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    if self.proc.stdout is not None:
      self.proc.stdout.close()
    self.dir.cleanup()


def until(cond, timeout: float, what: str, server: Server, every: float = 0.05) -> None:
  """Poll ``cond`` until true; RuntimeError when ``server`` exits meanwhile or ``timeout`` seconds pass."""
  t_end = time.monotonic() + timeout
  while not cond():
    if server.proc.poll() is not None:
      raise RuntimeError(f"the server exited while waiting for {what}:\n" + "\n".join(server.lines[-20:]))
    if time.monotonic() > t_end:
      raise RuntimeError(f"{what} did not happen within {timeout:.0f} s")
    time.sleep(every)

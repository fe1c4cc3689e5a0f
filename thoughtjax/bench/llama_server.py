"""llama.cpp's own ``llama-server`` as a benchmark peer: started on a GGUF on a free loopback port, asked through
its OpenAI-compatible HTTP API, stopped afterwards.

The binary is not part of thoughtjax: build it from the llama.cpp tree vendored in the ``llama-cpp-python``
source distribution (README, "Benchmarks") or name one with ``--llama-server BIN``. Requests are plain HTTP with
the standard library, so the peer needs no extra Python package.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from thoughtjax.errors import UserError

START_TIMEOUT_S = 300.0


class LlamaServerError(UserError, RuntimeError):
  """llama-server could not be found, started or asked; the message says which and how to fix it."""


def find_binary(given: str | None) -> Path:
  """``given`` (a path or a name on PATH), else ``llama-server`` on PATH; a named error when there is none."""
  name = given or "llama-server"
  found = shutil.which(name) if os.sep not in name else (name if Path(name).is_file() else None)
  if found is None:
    raise LlamaServerError(
      f"llama-server binary {name!r} not found; build it from llama.cpp (cmake --build build --target "
      f"llama-server) and pass --llama-server PATH"
    )
  return Path(found)


def one_line_tail(output: bytes, lines: int = 4) -> str:
  """The last ``lines`` non-empty lines of a process's output joined into one line (at most 600 characters), for
  an error message that stays one line."""
  kept = [x.strip() for x in output.decode(errors="replace").splitlines() if x.strip()][-lines:]
  return (" | ".join(kept) or "(nothing)")[-600:]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LlamaServer:
  """A running ``llama-server`` on ``gguf`` (a context manager). ``parallel`` slots, ``threads`` CPU threads,
  ``context`` tokens per slot (``-c parallel * context``: llama.cpp splits it across the slots); its output goes
  to ``log``."""

  def __init__(
    self,
    binary: str | Path,
    gguf: str | Path,
    *,
    parallel: int = 1,
    threads: int | None = None,
    context: int = 4096,
    log: str | Path | None = None,
  ):
    self.binary, self.gguf = Path(binary), Path(gguf)
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    argv = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port)]
    argv += ["--parallel", str(parallel), "-c", str(context * parallel), "--jinja", "--no-webui"]
    argv += ["-t", str(threads or os.cpu_count() or 1)]
    self.argv = argv
    self._log_path = Path(log) if log else None  # None: a temporary file
    self._proc: subprocess.Popen | None = None
    self._out = None

  def __enter__(self) -> LlamaServer:
    # Its output goes to a file (a full pipe would stall it); on a failed start the error quotes the end of it.
    out = open(self._log_path, "wb") if self._log_path else tempfile.TemporaryFile()  # noqa: SIM115 (closed in __exit__)
    self._out = out
    try:
      self._proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
    except OSError as e:
      self.__exit__()
      raise LlamaServerError(f"could not start {self.binary}: {e}") from None
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:  # /health answers 503 while the model loads, 200 once it serves
      if self._proc.poll() is not None:
        tail = self._tail()
        self.__exit__()
        raise LlamaServerError(
          f"{self.binary} exited with {self._proc.returncode} while starting; its last output: {tail}"
        )
      try:
        with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
          if r.status == 200:
            return self
      except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
      if time.monotonic() > deadline:
        self.__exit__()
        raise LlamaServerError(f"{self.binary} did not become healthy within {START_TIMEOUT_S:.0f} s")
      time.sleep(0.25)  # polling a process we started

  def __exit__(self, *exc) -> None:
    if self._proc is not None and self._proc.poll() is None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
    if self._out is not None:
      self._out.close()

  def _tail(self) -> str:
    self._out.flush()
    self._out.seek(0)
    return one_line_tail(self._out.read())

  @property
  def pid(self) -> int | None:
    return None if self._proc is None else self._proc.pid

  def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
    """POST ``body`` as JSON to ``path``; the decoded JSON answer, or a named error with the server's message."""
    req = urllib.request.Request(
      self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
      with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())
    except urllib.error.HTTPError as e:
      raise LlamaServerError(f"llama-server {path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None

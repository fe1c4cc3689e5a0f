"""``thoughtjax bench serve --peer llama-server``: ``thoughtjax serve`` against llama.cpp's ``llama-server`` on
the same GGUF, one server at a time on this machine, both driven by the same OpenAI-compatible streaming client.

Servers. ``thoughtjax serve`` runs as its own process with its default config: only the gRPC and the HTTP port
are set (free ones), so what is measured is what a user gets without tuning; it is started when ``GET /health``
answers 200 (its warm set compiled; the time to then is reported as ``ready_s``). ``llama-server`` (``--llama-server
BIN``, default: on PATH) runs on the same GGUF (``--gguf FILE``; default: the default model's) with ``--parallel``
equal to the highest level and a per-slot context that holds the longest prompt of the set plus the largest
``--max-tokens``. llama-server is measured first: a peer that cannot start fails the run within seconds, not
after the thoughtjax half. Each server is stopped before the other starts.

Client. ``POST /v1/chat/completions`` over aiohttp (a new connection per request), ``stream: true`` with
``stream_options.include_usage``, temperature 0 (greedy), and the served model's end-of-sequence ids biased by
-100 (``logit_bias``) so every request decodes exactly its max tokens on both servers. Time to first token (TTFT)
is the time to the first chunk with non-empty content; completion tokens are the ``usage`` of the stream's last
chunk, on both servers (a stream without usage counts as an error, ``no_usage``).

Load. For each ``--max-tokens`` value and each level of ``--levels``: that many closed-loop users; each sends a
request, reads its stream to the end and sends the next, until the level has run ``--seconds`` and the user has
finished ``--requests-per-user`` requests (requests in flight then finish; the wall time includes them). Prompts:
one chat message each, mixed 30 % short (about 20 prompt tokens of SmolLM2's tokenizer), 50 % medium (about 100)
and 20 % long (about 300), drawn by a seeded generator, so the k-th request of a level is the same on both servers;
each opens with its own request number, so only the chat template's system part is a shared prefix. Before the
levels each server is warmed: one request of each length class per max tokens, one by one, then per max tokens one
request per user at the highest level (compiles are not measured; the warm-up's wall time is reported).

Reported per server, max tokens and level: requests, aggregate tokens/s (completion tokens of the requests that
succeeded / the level's wall time), TTFT p50 and p95, end-to-end p95, the share of requests with TTFT <= 1 s (a
failed request counts as not), errors by kind, and the server process's peak RSS during the level (VmRSS sampled
every 100 ms; its VmHWM over the whole run too); and the ratios thoughtjax / llama-server of tokens/s and TTFT
p95. A table on stdout, ``--json FILE`` with every field (and every request), ``--plot FILE`` (matplotlib).
``--quick`` shrinks the prompts to a few words (a tiny test registry and a stub peer).

The defaults (levels 1, 4, 8, 16; max tokens 32 and 128; 25 s per level and at least one request per user) take
about 15 minutes on a quiet 2-core machine: 16 levels of 25 s plus each level's last requests, two warm-ups and
two starts, most of it in thoughtjax's half. A noisy machine (other processes on the cores) stretches it and
hurts llama-server most: its threads wait for each other at every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from thoughtjax.bench import common
from thoughtjax.bench.llama_server import one_line_tail
from thoughtjax.errors import UserError

SEED = 19
MIX = (("short", 0.3), ("medium", 0.5), ("long", 0.2))
# Words of filler per class: with the instruction and the request number, about 20 / 100 / 300 prompt tokens of
# SmolLM2's tokenizer; --quick: a few, for a tiny model's 256-token context and byte-level tokenizer.
WORDS = {"short": 0, "medium": 70, "long": 225}
QUICK_WORDS = {"short": 0, "medium": 4, "long": 9}
TTFT_GOOD_S = 1.0
RSS_PERIOD_S = 0.1
START_TIMEOUT_S = 1800.0  # the default registry is built and calibrated on a first start: minutes
TABLE_WIDTH = 140  # wide enough for every column, also when stdout is not a terminal
PLOT_EXTRA = "pip install 'thoughtjax[plot]'"

QUESTIONS = (
  "Explain in one sentence why the sky looks blue at noon and red at sunset.",
  "Give two tips for keeping a small vegetable garden healthy in a dry summer.",
  "What is the difference between weather and climate, in one short sentence?",
  "Suggest a name for a friendly robot that helps children learn to read.",
  "Why do people recommend drinking water before a long walk in the hills?",
  "Describe the taste of a ripe mango to someone who has never eaten one.",
  "List three things a new programmer should learn in their first month.",
  "How does a bicycle stay upright while it is moving forward on a road?",
  "Write one polite sentence declining an invitation to a birthday party.",
  "What makes a good breakfast for a busy student before a morning exam?",
)
SENTENCES = (
  "The town council met on Tuesday to discuss the new bus routes and the cost of repairing the old bridge.",
  "Most residents asked for more frequent buses in the evening, when shops and clinics close late.",
  "The library will extend its opening hours during the exam season and add twenty quiet study desks.",
  "A local bakery started selling bread made with flour from farms less than fifty kilometres away.",
  "Volunteers planted three hundred trees along the river, where the bank had been washed away by floods.",
  "The school reported that attendance rose after it began serving a free warm breakfast to every pupil.",
  "Engineers warned that the water pipes under the market square are more than eighty years old.",
  "A survey found that most cyclists would ride more often if the main road had a protected lane.",
  "The museum opened a small exhibition about the history of the harbour and the ships built there.",
  "Farmers expect a good harvest this year because the spring rain came early and the summer was mild.",
  "The football club is raising money to replace the floodlights, which use far too much electricity.",
  "Several shops on the high street now accept returns of glass jars and refill them with honey and oil.",
  "The hospital hired four new nurses and plans to open a weekend clinic for minor injuries next month.",
  "A storm last week closed the coastal path for two days, and the council is still clearing fallen trees.",
  "Teenagers from the youth club painted a mural about the town's history on the wall of the old station.",
  "The price of heating oil rose again, and a charity is offering advice on insulating older houses.",
)
INSTRUCTIONS = {
  "medium": "Summarize these notes in two sentences. Notes: ",
  "long": "Read this report and list its three main points, one line each. Report: ",
}


class PeerBenchError(UserError, RuntimeError):
  """The peer benchmark cannot run as asked (a server that does not start, a missing file, matplotlib absent);
  the message says which and how to fix it."""


# ------------------------------------------------------------------------------------ prompts
@dataclasses.dataclass(frozen=True)
class PromptSet:
  """The chat prompts of the benchmark: ``prompt(cell, k)`` is the k-th request of a level (``cell``), the same
  on every server; the length class is drawn 30/50/20 from a generator seeded by (seed, cell, k)."""

  seed: int = SEED
  quick: bool = False

  def prompt(self, cell: int, k: int) -> tuple[str, str]:
    """(length class, text) of the k-th request of ``cell`` (a negative cell: the warm-up's)."""
    rng = np.random.default_rng([self.seed, cell + 1000, k])
    u, acc = rng.random(), 0.0
    kind = MIX[-1][0]
    for name, share in MIX:
      acc += share
      if u < acc:
        kind = name
        break
    return kind, self.text(kind, rng, f"{'Warm-up' if cell < 0 else 'Request'} {abs(cell)}-{k}")

  def text(self, kind: str, rng: np.random.Generator, tag: str, question: str | None = None) -> str:
    """A prompt of the class ``kind``, opening with ``tag`` (unique per request)."""
    words = (QUICK_WORDS if self.quick else WORDS)[kind]
    if self.quick:
      filler = " ".join(" ".join(SENTENCES[int(i)] for i in rng.permutation(len(SENTENCES))).split()[:words])
      return f"{tag}: {filler}".strip()
    drawn = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
    question = question or drawn
    if kind == "short":
      return f"{tag}: {question}"
    pool = " ".join(SENTENCES[int(i)] for i in rng.permutation(len(SENTENCES))).split()
    while len(pool) < words:
      pool += pool
    return f"{tag}: {INSTRUCTIONS[kind]}{' '.join(pool[:words])} Then answer: {question}"

  def longest(self) -> str:
    """The longest prompt text the set can produce (to size a server's context)."""
    return self.text("long", np.random.default_rng(0), "Request 999-99999", max(QUESTIONS, key=len))


# ------------------------------------------------------------------------------------ servers
class ThoughtjaxServe:
  """``thoughtjax serve`` as its own process (a context manager): free gRPC and HTTP ports, ``registry`` (None: the
  default one), ``config`` (a server config file; None: the built-in config). Ready once ``GET /health`` answers 200
  (503 while the registry loads and the warm set compiles); :attr:`ready_s` is the time from the start to then. A
  server that logs it will stay unready (its warm-up failed) is stopped and its error raised at once.
  Output goes to a temporary file, whose tail a failed start quotes. Stopped with SIGTERM (it drains)."""

  def __init__(self, registry: str | None = None, config: str | Path | None = None):
    argv = [sys.executable, "-m", "thoughtjax.cli", "serve", "--port", "0", "--http-port", "0"]
    argv += ["--registry", str(registry)] if registry else []
    self.argv = argv + (["--config", str(config)] if config else [])
    self.url: str | None = None
    self.ready_s: float | None = None
    self._proc: subprocess.Popen | None = None
    self._out = None

  def __enter__(self) -> ThoughtjaxServe:
    self._out = tempfile.TemporaryFile()  # a full pipe would stall the server
    started = time.monotonic()
    self._proc = subprocess.Popen(self.argv, stdout=self._out, stderr=subprocess.STDOUT)
    deadline = started + START_TIMEOUT_S
    while True:
      if self._proc.poll() is not None:
        tail = self._tail()
        self.__exit__()
        raise PeerBenchError(
          f"thoughtjax serve exited with {self._proc.returncode} while starting; its last output: {tail}"
        )
      out = self._read()
      if self.url is None:
        m = re.search(rb"openai http on (http://\S+)/v1", out)
        self.url = m.group(1).decode() if m else None
      if b"health stays NOT_SERVING" in out:  # its warm-up failed: it would answer 503 until the deadline
        tail = self._tail()
        self.__exit__()
        raise PeerBenchError(f"thoughtjax serve will not become ready; its last output: {tail}")
      if self.url is not None and _ready(self.url + "/health"):
        self.ready_s = time.monotonic() - started
        return self
      if time.monotonic() > deadline:
        self.__exit__()
        raise PeerBenchError(f"thoughtjax serve did not become ready within {START_TIMEOUT_S:.0f} s")
      time.sleep(0.25)  # polling a process we started

  def __exit__(self, *exc) -> None:
    if self._proc is not None and self._proc.poll() is None:
      self._proc.send_signal(signal.SIGTERM)
      try:
        self._proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
    if self._out is not None:
      self._out.close()
      self._out = None

  def _read(self) -> bytes:
    self._out.flush()
    self._out.seek(0)
    return self._out.read()

  def _tail(self) -> str:
    return one_line_tail(self._read())

  @property
  def pid(self) -> int | None:
    return None if self._proc is None else self._proc.pid


def _ready(url: str) -> bool:
  try:
    with urllib.request.urlopen(url, timeout=5) as r:
      return r.status == 200
  except (urllib.error.URLError, ConnectionError, TimeoutError):
    return False


def rss_mib(pid: int, field: str = "VmRSS") -> float:
  """``field`` (VmRSS now, VmHWM the peak) of process ``pid`` in MiB, from /proc (Linux); NaN if unreadable."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")


# ------------------------------------------------------------------------------------ client
@dataclasses.dataclass
class Outcome:
  """One streamed request, as the client saw it."""

  kind: str  # length class of the prompt
  start_s: float  # from the level's start
  ttft_s: float | None = None  # to the first chunk with content
  e2e_s: float | None = None  # to the end of the stream
  prompt_tokens: int | None = None
  completion_tokens: int | None = None
  chunks: int = 0  # chunks with content
  error: str | None = None


async def stream_chat(session, url: str, body: dict, timeout: float, outcome: Outcome) -> Outcome:
  """POST ``body`` (``stream: true``) to ``url`` and read its server-sent events into ``outcome``."""
  import aiohttp

  t0 = time.perf_counter()
  try:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
      if r.status != 200:
        await r.read()
        outcome.error = f"HTTP_{r.status}"
        return outcome
      async for raw in r.content:  # one line at a time
        line = raw.strip()
        if not line.startswith(b"data:"):
          continue
        data = line[5:].strip()
        if data == b"[DONE]":
          break
        event = json.loads(data)
        if "error" in event:
          outcome.error = "stream_error"
          break
        for choice in event.get("choices") or ():
          if (choice.get("delta") or {}).get("content"):
            outcome.chunks += 1
            if outcome.ttft_s is None:
              outcome.ttft_s = time.perf_counter() - t0
        usage = event.get("usage")
        if usage:
          outcome.prompt_tokens = usage.get("prompt_tokens")
          outcome.completion_tokens = usage.get("completion_tokens")
  except TimeoutError:
    outcome.error = "timeout"
  except (aiohttp.ClientError, ValueError) as e:  # ValueError: a malformed event or an overlong line
    outcome.error = type(e).__name__
  outcome.e2e_s = time.perf_counter() - t0
  if outcome.error is None and outcome.completion_tokens is None:
    outcome.error = "no_usage"
  return outcome


async def closed_loop(
  url: str,
  users: int,
  request: Callable[[int], tuple[str, dict]],
  *,
  seconds: float,
  per_user: int,
  timeout: float,
  pid: int | None = None,
) -> tuple[list[Outcome], float, float]:
  """``users`` users, each sending ``request(k)`` (k counts the level's requests) back to back until ``seconds``
  have passed and it finished ``per_user``: (outcomes, wall seconds, peak RSS MiB of ``pid`` meanwhile)."""
  import aiohttp

  counter = itertools.count()
  outcomes: list[Outcome] = []
  peak = [float("nan")]
  t0 = time.perf_counter()

  async def user(session):
    done = 0
    while done < per_user or time.perf_counter() - t0 < seconds:
      kind, body = request(next(counter))
      o = Outcome(kind, time.perf_counter() - t0)
      outcomes.append(await stream_chat(session, url, body, timeout, o))
      done += 1

  async def sample(stop: asyncio.Event):
    while not stop.is_set():
      now = rss_mib(pid)
      if not math.isnan(now) and not now <= peak[0]:  # NaN: unreadable (the process has gone)
        peak[0] = now
      try:
        await asyncio.wait_for(stop.wait(), RSS_PERIOD_S)
      except TimeoutError:
        pass

  stop = asyncio.Event()
  sampler = asyncio.create_task(sample(stop)) if pid is not None else None
  # A connection per request (force_close): llama-server's HTTP library closes kept-alive connections on its own
  # schedule, and a request sent on one it just closed fails at once; both servers get the same fresh connections.
  async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
    await asyncio.gather(*(user(session) for _ in range(users)))
  wall = time.perf_counter() - t0
  stop.set()
  if sampler is not None:
    await sampler
  return outcomes, wall, float(peak[0])


def _pct(xs: Sequence[float], q: float) -> float:
  return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(outcomes: Sequence[Outcome], wall: float) -> dict:
  """A level's figures from its requests (times in ms)."""
  ok = [o for o in outcomes if o.error is None]
  ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
  e2e = [o.e2e_s * 1e3 for o in ok]
  tokens = sum(o.completion_tokens for o in ok)
  errors: dict[str, int] = {}
  for o in outcomes:
    if o.error is not None:
      errors[o.error] = errors.get(o.error, 0) + 1
  by_kind = {kind: [o.prompt_tokens for o in ok if o.kind == kind and o.prompt_tokens is not None] for kind, _ in MIX}
  return {
    "requests": len(outcomes),
    "ok": len(ok),
    "completion_tokens": tokens,
    "tokens_per_request": tokens / len(ok) if ok else float("nan"),
    "wall_s": wall,
    "tok_s": tokens / wall if wall > 0 else float("nan"),
    "ttft_p50_ms": _pct(ttft, 50),
    "ttft_p95_ms": _pct(ttft, 95),
    "e2e_p50_ms": _pct(e2e, 50),
    "e2e_p95_ms": _pct(e2e, 95),
    "ttft_le_1s_share": (
      sum(o.ttft_s is not None and o.ttft_s <= TTFT_GOOD_S for o in ok) / len(outcomes) if outcomes else float("nan")
    ),
    "errors": sum(errors.values()),
    "error_kinds": errors,
    "mix": {kind: sum(o.kind == kind for o in outcomes) for kind, _ in MIX},
    "prompt_tokens_mean": {k: (sum(v) / len(v) if v else None) for k, v in by_kind.items()},
  }


# ------------------------------------------------------------------------------------ the run
@dataclasses.dataclass(frozen=True)
class Load:
  """What every server is asked: the levels, the max tokens, how long, and the request bodies."""

  levels: tuple[int, ...]
  max_tokens: tuple[int, ...]
  seconds: float
  per_user: int
  timeout: float
  prompts: PromptSet
  eos_ids: tuple[int, ...]

  def body(self, text: str, max_tokens: int) -> dict:
    return {
      "messages": [{"role": "user", "content": text}],
      "max_tokens": max_tokens,
      "temperature": 0.0,
      "stream": True,
      "stream_options": {"include_usage": True},
      "logit_bias": {str(e): -100.0 for e in self.eos_ids},  # every request decodes exactly max_tokens
    }

  def request(self, cell: int, max_tokens: int) -> Callable[[int], tuple[str, dict]]:
    def make(k: int) -> tuple[str, dict]:
      kind, text = self.prompts.prompt(cell, k)
      return kind, self.body(text, max_tokens)

    return make


def drive(name: str, base_url: str, pid: int | None, load: Load, log: Callable[[str], None]) -> dict:
  """Warm one running server, then run every (max tokens, level) cell on it: its report."""
  url = base_url + "/v1/chat/completions"
  t = time.perf_counter()
  warm: list[Outcome] = []
  for i, m in enumerate(load.max_tokens):  # each length class once per max tokens, one at a time
    rng = np.random.default_rng(i)
    bodies = [(kind, load.body(load.prompts.text(kind, rng, f"Warm-up {i}-{kind}"), m)) for kind, _ in MIX]
    done, _, _ = asyncio.run(
      closed_loop(url, 1, bodies.__getitem__, seconds=0, per_user=len(bodies), timeout=load.timeout)
    )
    warm += done
  for m in load.max_tokens:  # then all users at once: the batched shapes of each max tokens
    done, _, _ = asyncio.run(
      closed_loop(url, max(load.levels), load.request(-1 - m, m), seconds=0, per_user=1, timeout=load.timeout)
    )
    warm += done
  report: dict = {
    "name": name,
    "url": base_url,
    "pid": pid,
    "warmup_s": time.perf_counter() - t,
    "warmup_requests": len(warm),
    "warmup_errors": sum(o.error is not None for o in warm),
    "warmup_error_kinds": summarize(warm, 1.0)["error_kinds"],
    "cells": [],
  }
  log(f"{name}: warmed in {report['warmup_s']:.1f} s ({report['warmup_errors']} errors)")
  for mi, m in enumerate(load.max_tokens):
    for li, users in enumerate(load.levels):
      cell = mi * len(load.levels) + li
      outcomes, wall, peak = asyncio.run(
        closed_loop(
          url,
          users,
          load.request(cell, m),
          seconds=load.seconds,
          per_user=load.per_user,
          timeout=load.timeout,
          pid=pid,
        )
      )
      row = {"max_tokens": m, "users": users, **summarize(outcomes, wall), "peak_rss_mib": peak}
      row["outcomes"] = [dataclasses.asdict(o) for o in outcomes]
      report["cells"].append(row)
      log(
        f"{name}: {m} tokens, {users} users: {row['requests']} requests, {row['tok_s']:.1f} tok/s, "
        f"TTFT p95 {row['ttft_p95_ms']:.0f} ms, {row['errors']} errors"
      )
  report["peak_rss_hwm_mib"] = rss_mib(pid, "VmHWM") if pid is not None else float("nan")
  return report


def ratios(ours: dict, peer: dict) -> list[dict]:
  """thoughtjax / llama-server per (max tokens, users): tokens/s and TTFT p95."""
  theirs = {(c["max_tokens"], c["users"]): c for c in peer["cells"]}
  out = []
  for c in ours["cells"]:
    p = theirs.get((c["max_tokens"], c["users"]))
    if p is None:
      continue
    out.append(
      {
        "max_tokens": c["max_tokens"],
        "users": c["users"],
        "tok_s": _div(c["tok_s"], p["tok_s"]),
        "ttft_p95": _div(c["ttft_p95_ms"], p["ttft_p95_ms"]),
      }
    )
  return out


def _div(a: float, b: float) -> float:
  return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def _f(x, spec: str) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_report(report: dict) -> None:
  cols = ["server", "max tokens", "users", "requests", "tok/s", "TTFT p50 ms", "TTFT p95 ms", "e2e p95 ms"]
  cols += ["TTFT <= 1 s", "errors", "peak RSS MiB"]
  rows = []
  for name in ("thoughtjax", "llama-server"):
    server = report["servers"].get(name)
    for c in server["cells"] if server else ():
      rows.append(
        [name, c["max_tokens"], c["users"], c["requests"], _f(c["tok_s"], ".1f"), _f(c["ttft_p50_ms"], ".0f")]
        + [_f(c["ttft_p95_ms"], ".0f"), _f(c["e2e_p95_ms"], ".0f"), _f(c["ttft_le_1s_share"], ".0%")]
        + [c["errors"], _f(c["peak_rss_mib"], ".0f")]
      )
  common.print_table(
    f"OpenAI-compatible streaming, closed-loop users, greedy, same GGUF ({report['gguf_name']}); "
    f"prompts {report['mix_text']}",
    cols,
    rows,
    right=cols[1:],
    width=TABLE_WIDTH,
  )
  if report.get("ratios"):
    common.print_table(
      "thoughtjax / llama-server",
      ["max tokens", "users", "tok/s ratio", "TTFT p95 ratio"],
      [[r["max_tokens"], r["users"], _f(r["tok_s"], ".2f"), _f(r["ttft_p95"], ".2f")] for r in report["ratios"]],
      right=["max tokens", "users", "tok/s ratio", "TTFT p95 ratio"],
      width=TABLE_WIDTH,
    )


def require_matplotlib() -> None:
  """``--plot`` needs the plot extra: refused before anything runs, by name."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise PeerBenchError(
      f"--plot needs matplotlib, which is not installed; install the plot extra ({PLOT_EXTRA}) or drop --plot"
    ) from None


def plot(report: dict, out: str) -> None:
  """Tokens/s and TTFT p95 against users, a line per server and max tokens."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for si, name in enumerate(("thoughtjax", "llama-server")):
    server = report["servers"].get(name)
    if not server:
      continue
    for mi, m in enumerate(sorted({c["max_tokens"] for c in server["cells"]})):
      cells = sorted((c for c in server["cells"] if c["max_tokens"] == m), key=lambda c: c["users"])
      users = [c["users"] for c in cells]
      style = dict(color=f"C{si}", ls="-" if mi == 0 else "--", marker="o", label=f"{name}, {m} tokens")
      left.plot(users, [c["tok_s"] for c in cells], **style)
      right.plot(users, [c["ttft_p95_ms"] / 1e3 for c in cells], **style)
  for ax, ylabel in ((left, "aggregate tokens/s"), (right, "TTFT p95 (s)")):
    ax.set_xlabel("closed-loop users")
    ax.set_ylabel(ylabel)
    ax.set_xticks(sorted({c["users"] for s in report["servers"].values() for c in s["cells"]}))
    ax.grid(alpha=0.3)
  left.legend(fontsize=8)
  fig.suptitle(f"thoughtjax serve vs llama-server, same GGUF ({report['gguf_name']})")
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


def run(args, argv: Sequence[str]) -> int:
  """``thoughtjax bench serve --peer llama-server`` with the parsed ``args`` of ``bench serve``."""
  from thoughtjax.bench.llama_server import LlamaServer, find_binary
  from thoughtjax.thoughtlet import fingerprint

  if args.plot:
    require_matplotlib()
  binary = find_binary(args.llama_server)  # before anything long runs
  if args.server_config and not Path(args.server_config).expanduser().is_file():
    raise PeerBenchError(f"--server-config {args.server_config}: no such file; give a thoughtjax serve config file")
  if args.gguf:
    gguf = Path(args.gguf).expanduser()
    if not gguf.is_file():
      raise PeerBenchError(f"--gguf {args.gguf}: no such file; give the GGUF the registry was built from")
  elif args.registry:
    raise PeerBenchError(
      "--registry needs --gguf FILE: llama-server loads a GGUF; give the one the registry was built from"
    )
  else:
    from thoughtjax.fetch import DEFAULT_MODEL, fetch

    gguf = fetch(DEFAULT_MODEL)
  reg = _open(args.registry)
  try:
    codec = reg.codec
    eos = tuple(int(e) for e in codec.eos_ids)
    prompts = PromptSet(quick=args.quick)
    longest = len(codec.encode(codec.render_chat([{"role": "user", "content": prompts.longest()}])))
  finally:
    reg.close()
  load = Load(
    levels=tuple(args.levels),
    max_tokens=tuple(args.max_tokens),
    seconds=args.seconds,
    per_user=args.requests_per_user,
    timeout=args.timeout,
    prompts=prompts,
    eos_ids=eos,
  )
  parallel = max(load.levels)
  per_slot = -(-int((longest + max(load.max_tokens)) * 1.25 + 16) // 256) * 256  # rounded up to 256
  report: dict = {
    "command": "thoughtjax bench serve " + " ".join(argv),
    "fingerprint": fingerprint(),
    "registry": args.registry or "default",
    "gguf": str(gguf),
    "gguf_name": gguf.name,
    "levels": list(load.levels),
    "max_tokens": list(load.max_tokens),
    "seconds": load.seconds,
    "requests_per_user": load.per_user,
    "timeout_s": load.timeout,
    "quick": args.quick,
    "seed": prompts.seed,
    "mix": dict(MIX),
    "mix_text": ", ".join(f"{int(share * 100)} % {kind}" for kind, share in MIX),
    "longest_prompt_tokens": longest,
    "eos_ids_biased": list(eos),
    "client": "aiohttp, POST /v1/chat/completions, stream with include_usage, temperature 0",
    "servers": {},
  }

  def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

  def save() -> None:
    if args.json:  # after each server: a later failure loses nothing measured
      common.write_json(args.json, report, indent=1)

  peer = LlamaServer(binary, gguf, parallel=parallel, threads=os.cpu_count(), context=per_slot)
  log(f"llama-server: starting {' '.join(peer.argv)}")
  with peer:
    theirs = drive("llama-server", peer.url, peer.pid, load, log)
  theirs |= {"binary": str(binary), "argv": peer.argv, "parallel": parallel, "context_per_slot": per_slot}
  report["servers"]["llama-server"] = theirs
  save()

  config = str(Path(args.server_config).expanduser()) if args.server_config else None
  server = ThoughtjaxServe(args.registry, config)
  log(f"thoughtjax serve: starting {' '.join(server.argv)}{'' if config else ' (default config)'}")
  with server:
    ours = drive("thoughtjax", server.url, server.pid, load, log)
  report["servers"]["thoughtjax"] = ours | {
    "argv": server.argv,
    "ready_s": server.ready_s,
    "config": config or "default (server/config.yaml), ports only",
  }
  report["ratios"] = ratios(ours, theirs)
  save()
  print_report(report)
  if args.plot:
    plot(report, args.plot)
    log(f"plot written to {args.plot}")
  return 0


def _open(registry: str | None):
  from thoughtjax.registry import Registry

  if registry:
    return Registry.open(registry)
  from thoughtjax.synthesis.default_registry import ensure_default

  return ensure_default(lambda stage, done, total, item: print(f"{stage} {done}/{total} {item}", flush=True))

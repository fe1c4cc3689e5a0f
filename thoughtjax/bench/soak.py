"""``thoughtjax bench soak``: a real ``thoughtjax serve`` under hostile load, and whether its users notice.

For ``--seconds``, all at once:

- ``--streams`` gRPC clients, each streaming one request after another (the users; a try refused
  RESOURCE_EXHAUSTED, a full server, is made again after a backoff, as a client with a retry policy does);
- ``--sockets`` connections to the HTTP port, each sending half a request head and then nothing, held open (the
  server answers 503 past its ``http_max_connections`` and closes the silent ones after ``http_idle_timeout_s``);
- ``--hostile`` gRPC clients, each sending one request after another constrained by a hostile regular expression
  (nested counted repeats, an alternation of thousands of words, patterns that backtrack or blow up a DFA);
- a gRPC health check every half second.

Measured: each group's answers by status code, the users' streams that finished, the health checks answered, and the
server's RSS every half second (before, during and after the attack). The acceptance: every user stream finishes,
gRPC keeps answering, RSS stays flat, no INTERNAL or UNKNOWN answer.
"""

from __future__ import annotations

import argparse
import collections
import socket
import statistics
import threading
import time

from thoughtjax.bench import common
from thoughtjax.bench.process import Server, rss_mib, until

PROMPT = "Write two sentences about the sea."
HOSTILE = (
  r"((((a{1,100}){1,100}){1,100}){1,100})",
  r"(.*a){40}",
  r"(a+)+$",
  r"[\s\S]{0,4000}x[\s\S]{0,4000}y",
  r"(" + "|".join(f"w{i}x{i * 7}" for i in range(3000)) + ")+",
  r"((a|b)*a(a|b){24})+",
)
BROKEN = frozenset({"INTERNAL", "UNKNOWN"})


class _Tally:
  """Answers by status code, from many threads."""

  def __init__(self):
    self.codes: collections.Counter[str] = collections.Counter()
    self.seconds: list[float] = []  # of the calls answered OK (users: from the first try, retries included)
    self.retries = 0  # users: tries refused RESOURCE_EXHAUSTED and made again
    self.messages: dict[str, list[str]] = {}  # code -> the first few distinct messages (not OK)
    self._lock = threading.Lock()

  def add(self, code: str, seconds: float | None = None, message: str | None = None) -> None:
    with self._lock:
      self.codes[code] += 1
      if seconds is not None:
        self.seconds.append(seconds)
      if message is not None and len(self.messages.setdefault(code, [])) < 3 and message not in self.messages[code]:
        self.messages[code].append(message)


def _code(e: BaseException) -> str:
  code = getattr(e, "code", None)
  return getattr(code, "name", None) or type(e).__name__


def _user(target: str, hints: list[str], max_tokens: int, stop: threading.Event, tally: _Tally, timeout: float):
  from thoughtjax.client import Client

  with Client(target, timeout=timeout) as c:
    while not stop.is_set():
      t, wait = time.perf_counter(), 0.05
      while True:  # as a client with a retry policy: a full server (RESOURCE_EXHAUSTED) is tried again, backing off
        try:
          c.generate(PROMPT, hints, max_tokens=max_tokens)
          tally.add("OK", time.perf_counter() - t)
          break
        except Exception as e:
          code = _code(e)
          if code != "RESOURCE_EXHAUSTED":
            tally.add(code, message=str(e)[:300])
            break
          tally.retries += 1
          if stop.wait(wait):
            break
          wait = min(2 * wait, 1.0)


def _attacker(target: str, i: int, stop: threading.Event, tally: _Tally, timeout: float):
  from thoughtjax.client import Client

  with Client(target, timeout=timeout) as c:
    k = i
    while not stop.is_set():
      try:
        c.generate("a" * 64, ["general_purpose"], max_tokens=24, regex=HOSTILE[k % len(HOSTILE)])
        tally.add("OK")
      except Exception as e:
        tally.add(_code(e), message=str(e)[:300])
      k += 1


def _health(target: str, stop: threading.Event, tally: _Tally, timeout: float):
  from thoughtjax.client import Client

  with Client(target, timeout=timeout) as c:
    while not stop.is_set():
      try:
        tally.add("SERVING" if c.health() == "SERVING" else "NOT_SERVING")
      except Exception as e:
        tally.add(_code(e))
      stop.wait(0.5)


def _half_open(url: str, n: int, out: list[socket.socket], stop: threading.Event) -> None:
  """Open ``n`` connections to the HTTP front into ``out``, each with half a request head sent (until ``stop``)."""
  host, port = url.removeprefix("http://").removeprefix("https://").rsplit(":", 1)
  head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: the head never ends
  for _ in range(n):
    if stop.is_set():
      return
    try:
      s = socket.create_connection((host, int(port)), timeout=10)
      s.sendall(head)
      s.setblocking(False)
      out.append(s)
    except OSError:
      return  # the machine's own limit (file descriptors, ports): report how many were open


def _sockets_state(socks: list[socket.socket]) -> dict:
  """How the server treated the held sockets: answered 503, closed silently, or still open."""
  refused = closed = open_ = 0
  for s in socks:
    try:
      got = s.recv(4096)
    except BlockingIOError:
      open_ += 1
      continue
    except OSError:
      closed += 1
      continue
    if got.startswith(b"HTTP/1.1 503"):
      refused += 1
    else:
      closed += 1
  return {"refused_503": refused, "closed": closed, "open_at_end": open_}


def run(
  registry: str | None,
  *,
  seconds: float,
  streams: int,
  sockets: int,
  hostile: int,
  slots: int,
  max_tokens: int,
  hints: list[str],
  timeout: float,
) -> dict:
  """Measure one server process (see the module docstring); a dict of plain JSON values."""
  from thoughtjax.client import Client

  config = f"max_concurrent: {slots}\nmax_queue: {2 * slots}\n"
  server = Server(registry, config, timeout, http=True, prefix="soak")
  threads: list[threading.Thread] = []
  socks: list[socket.socket] = []
  stop = threading.Event()
  try:
    with Client(server.target, timeout=timeout) as c:

      def serving():
        try:
          return c.health() == "SERVING"
        except Exception:
          return False

      until(serving, timeout, "SERVING", server, every=0.2)
      for _ in range(2):  # restored and compiled before the baseline
        c.generate(PROMPT, hints, max_tokens=max_tokens)
      c.generate("a" * 64, hints, max_tokens=8, regex="a+")
      t = time.perf_counter()
      c.generate(PROMPT, hints, max_tokens=max_tokens)
      alone_s = time.perf_counter() - t  # a user's stream with nobody else on the server
    time.sleep(1.0)
    rss = {"before": rss_mib(server.pid)}
    users, attackers, health = _Tally(), _Tally(), _Tally()
    series: list[tuple[float, float]] = []
    threads = [
      threading.Thread(target=_half_open, args=(server.http, sockets, socks, stop)),
      *(
        threading.Thread(target=_user, args=(server.target, hints, max_tokens, stop, users, timeout))
        for _ in range(streams)
      ),
      *(threading.Thread(target=_attacker, args=(server.target, i, stop, attackers, timeout)) for i in range(hostile)),
      threading.Thread(target=_health, args=(server.target, stop, health, timeout)),
    ]
    t0 = time.monotonic()
    for t in threads:
      t.daemon = True
      t.start()
    while time.monotonic() - t0 < seconds:
      series.append((round(time.monotonic() - t0, 2), rss_mib(server.pid)))
      time.sleep(0.5)
      if server.proc.poll() is not None:
        raise RuntimeError("the server exited under the attack:\n" + "\n".join(server.lines[-20:]))
    stop.set()
    for t in threads:
      t.join(timeout)
    stuck = sum(t.is_alive() for t in threads)
    sockets_seen = _sockets_state(list(socks))
    for s in socks:
      s.close()
    socks = []
    time.sleep(2.0)
    with Client(server.target, timeout=timeout) as c:  # served as before, once the attack is over
      after = c.generate(PROMPT, hints, max_tokens=max_tokens)
    rss["max_during"] = max(r for _, r in series)
    rss["after"] = rss_mib(server.pid)
    broken = sum(n for g in (users, attackers, health) for code, n in g.codes.items() if code in BROKEN)
    out = {
      "seconds": seconds,
      "streams": streams,
      "sockets": sockets,
      "hostile": hostile,
      "slots": slots,
      "max_tokens": max_tokens,
      "hints": hints,
      "users": dict(users.codes),
      "user_messages": users.messages,
      "attackers": dict(attackers.codes),
      "attacker_messages": attackers.messages,
      "health": dict(health.codes),
      "sockets_opened": sum(sockets_seen.values()),
      **{f"sockets_{k}": v for k, v in sockets_seen.items()},
      "clients_stuck": stuck,
      "rss_mib": rss,
      "rss_series": series,
      "after_finish_reason": after.finish_reason,
    }
    health_calls = sum(health.codes.values())
    out["summary"] = {
      "user_streams_ok": users.codes["OK"],
      "user_streams_failed": sum(n for code, n in users.codes.items() if code != "OK"),
      "user_retries": users.retries,
      "user_stream_s_p50": statistics.median(users.seconds) if users.seconds else None,
      "user_stream_s_max": max(users.seconds) if users.seconds else None,
      "user_stream_s_alone": alone_s,
      "health_serving_share": health.codes["SERVING"] / health_calls if health_calls else 0.0,
      "internal_or_unknown": broken,
      "rss_growth_mib": rss["after"] - rss["before"],
      "rss_growth_during_mib": rss["max_during"] - rss["before"],
      "rss_median_during_mib": statistics.median(r for _, r in series),
      # Steady state: the first half of the attack also warms what a full server runs (wider batches, more
      # engines); a process that keeps growing after it is what leaks or fragments.
      "rss_growth_second_half_mib": series[-1][1] - next((r for t, r in series if t >= seconds / 2), series[-1][1]),
    }
    return out
  finally:
    stop.set()
    for s in socks:
      s.close()
    server.close()


def _f(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench soak", description=__doc__.splitlines()[0])
  p.add_argument("--registry", default=None, help="registry to serve (default: the default registry)")
  p.add_argument("--seconds", type=float, default=60.0, help="how long the attack lasts (default 60)")
  p.add_argument(
    "--streams", type=int, default=16, help="user clients streaming one request after another (default 16)"
  )
  p.add_argument("--sockets", type=int, default=4000, help="half-open HTTP connections held (default 4000)")
  p.add_argument("--hostile", type=int, default=300, help="clients sending hostile regex requests (default 300)")
  p.add_argument(
    "--slots", type=int, default=16, help="the server's max_concurrent; its max_queue is twice it (default 16)"
  )
  p.add_argument("--max-tokens", type=int, default=32, help="tokens per user request (default 32)")
  p.add_argument("--hint", action="append", default=None, help="user request hint (default general_purpose)")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for start-up or one call")
  p.add_argument("--json", default=None, type=common.json_path, help="write the results here")
  args = p.parse_args(argv)
  if args.seconds <= 0 or min(args.streams, args.slots, args.max_tokens) < 1 or min(args.sockets, args.hostile) < 0:
    p.error("--seconds must be > 0, --streams, --slots and --max-tokens >= 1, --sockets and --hostile >= 0")
  out = run(
    args.registry,
    seconds=args.seconds,
    streams=args.streams,
    sockets=args.sockets,
    hostile=args.hostile,
    slots=args.slots,
    max_tokens=args.max_tokens,
    hints=args.hint or ["general_purpose"],
    timeout=args.timeout,
  )
  out["command"] = "thoughtjax bench soak " + " ".join(argv or [])
  s, r = out["summary"], out["rss_mib"]
  codes = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"
  common.print_table(
    f"soak: {args.streams} users, {out['sockets_opened']} half-open sockets, {args.hostile} hostile clients, "
    f"{args.seconds:g} s",
    ["measure", "value"],
    [
      [
        "user streams finished / failed (tries refused and retried)",
        f"{s['user_streams_ok']} / {s['user_streams_failed']} ({s['user_retries']})",
      ],
      ["user answers by code", codes(out["users"])],
      [
        "user stream s: alone / p50 / max under attack",
        f"{s['user_stream_s_alone']:.2f} / {_f(s['user_stream_s_p50'])} / {_f(s['user_stream_s_max'])}",
      ],
      ["hostile answers by code", codes(out["attackers"])],
      ["gRPC health checks by answer", codes(out["health"])],
      [
        "half-open sockets: 503 / closed / still open",
        f"{out['sockets_refused_503']} / {out['sockets_closed']} / {out['sockets_open_at_end']}",
      ],
      ["INTERNAL or UNKNOWN answers", s["internal_or_unknown"]],
      [
        "RSS MiB before / max during / after (growth over the attack's second half)",
        f"{r['before']:.0f} / {r['max_during']:.0f} / {r['after']:.0f} ({s['rss_growth_second_half_mib']:+.0f})",
      ],
      ["clients still waiting at the end", out["clients_stuck"]],
    ],
    right=("value",),
  )
  if args.json:
    common.write_json(args.json, out)
  return 0

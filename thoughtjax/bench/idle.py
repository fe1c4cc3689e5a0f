"""``thoughtjax bench idle``: scale to zero and back, measured on a real ``thoughtjax serve`` process.

Starts the server as a subprocess with a short ``idle_release_s`` (and its metrics endpoint), then measures:

1. the process's RSS once it is SERVING, before any request (the baseline);
2. a cold first request (restore and compile), then ``--warm`` warm requests: their time to first token and the
   RSS after them;
3. ``--cycles`` times (``--programs``: with ``idle_release_programs``): wait until the server released the idle path (its ``thoughtjax_idle_releases_total``
   grows), the RSS then, and one request after idle: its time to first token and the restore (and compile) its
   trace reports.

Targets: RSS after release within 50 MiB of the baseline; first token after idle at most a warm request's TTFT +
100 ms. Times are wall clock on the client's side of a loopback channel.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from thoughtjax.bench import common
from thoughtjax.bench.process import Server, metric, rss_mib, until

PROMPT = "Write two sentences about the sea."
RSS_TARGET_MIB = 50.0
TTFT_SLACK_MS = 100.0  # first token after idle: at most the warm one's + this


def _request(client, hints: list[str], max_tokens: int, timeout: float) -> dict:
  """One stream: time to first token (ms), tokens, and the stages its trace reports (ms)."""
  t0 = time.perf_counter()
  ttft, tokens = None, 0
  messages = [{"role": "user", "content": PROMPT}]
  for r in client.synthesize(None, hints, messages=messages, max_tokens=max_tokens, timeout=timeout):
    if r.WhichOneof("kind") == "delta" and r.delta.token_ids:
      if ttft is None:
        ttft = (time.perf_counter() - t0) * 1e3
      tokens += len(r.delta.token_ids)
  t = client.last_final.trace
  return {
    "ttft_ms": ttft,
    "tokens": tokens,
    "path": t.path,
    **{f"{k}_ms": float(t.actual_ms.get(k, 0.0)) for k in ("restore", "compile", "prefill", "total")},
  }


def run(
  registry: str | None,
  *,
  idle_s: float,
  warm: int,
  cycles: int,
  hints: list[str],
  max_tokens: int,
  slots: int,
  timeout: float,
  programs: bool = False,
) -> dict:
  """Measure one server process (see the module docstring); a dict of plain JSON values."""
  from thoughtjax.client import Client

  config = f"idle_release_s: {idle_s}\nidle_release_programs: {str(programs).lower()}\nmax_concurrent: {slots}\n"
  server = Server(registry, config, timeout, prefix="idle")
  try:
    with Client(server.target, timeout=timeout) as c:

      def serving():
        try:
          return c.health() == "SERVING"
        except Exception:
          return False

      until(serving, timeout, "SERVING", server, every=0.2)
      time.sleep(1.0)  # let start-up's freed pages settle before the baseline
      out: dict = {
        "idle_release_s": idle_s,
        "idle_release_programs": programs,
        "hints": hints,
        "max_tokens": max_tokens,
        "pid": server.pid,
      }
      out["rss_baseline_mib"] = rss_mib(server.pid)
      out["cold"] = _request(c, hints, max_tokens, timeout)
      warms = [_request(c, hints, max_tokens, timeout) for _ in range(warm)]
      out["warm"] = warms
      out["warm_ttft_ms"] = statistics.median(w["ttft_ms"] for w in warms)
      out["warm_prefill_ms"] = statistics.median(w["prefill_ms"] for w in warms)
      out["rss_warm_mib"] = rss_mib(server.pid)
      out["cycles"] = []
      for _ in range(cycles):
        before = metric(server.metrics, "thoughtjax_idle_releases_total")
        t_idle = time.monotonic()
        until(
          lambda b=before: metric(server.metrics, "thoughtjax_idle_releases_total") > b,
          idle_s * 4 + timeout,
          "the idle release",
          server,
        )
        cycle = {
          "released_after_s": time.monotonic() - t_idle,
          "resident_paths": metric(server.metrics, "thoughtjax_resident_paths"),
          "rss_released_mib": rss_mib(server.pid),
        }
        cycle["after_idle"] = _request(c, hints, max_tokens, timeout)
        cycle["rss_back_mib"] = rss_mib(server.pid)
        out["cycles"].append(cycle)
  finally:
    server.close()
  base, warm_ttft = out["rss_baseline_mib"], out["warm_ttft_ms"]
  released = [cy["rss_released_mib"] for cy in out["cycles"]]
  after = [cy["after_idle"]["ttft_ms"] for cy in out["cycles"]]
  restores = [cy["after_idle"]["restore_ms"] for cy in out["cycles"]]
  prefills = [cy["after_idle"]["prefill_ms"] for cy in out["cycles"]]
  out["summary"] = {
    "rss_baseline_mib": base,
    "rss_warm_mib": out["rss_warm_mib"],
    "rss_released_mib_max": max(released) if released else None,
    "rss_released_over_baseline_mib": (max(released) - base) if released else None,
    "warm_ttft_ms": warm_ttft,
    "cold_ttft_ms": out["cold"]["ttft_ms"],
    "after_idle_ttft_ms_max": max(after) if after else None,
    "after_idle_restore_ms_max": max(restores) if restores else None,
    "after_idle_compile_ms_max": max(cy["after_idle"]["compile_ms"] for cy in out["cycles"]) if after else None,
    "after_idle_prefill_ms_max": max(prefills) if prefills else None,
    "warm_prefill_ms": out["warm_prefill_ms"],
    "ttft_target_ms": warm_ttft + TTFT_SLACK_MS,
    "rss_target_met": bool(released) and max(released) - base <= RSS_TARGET_MIB,
    "ttft_target_met": bool(after) and max(after) <= warm_ttft + TTFT_SLACK_MS,
  }
  return out


def _f(x, spec: str) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench idle", description=__doc__.splitlines()[0])
  p.add_argument("--registry", default=None, help="registry to serve (default: the default registry)")
  p.add_argument("--idle", type=float, default=5.0, help="the server's idle_release_s (default 5)")
  p.add_argument("--warm", type=int, default=5, help="warm requests timed before the first release (default 5)")
  p.add_argument("--cycles", type=int, default=2, help="release-and-return cycles (default 2)")
  p.add_argument("--hint", action="append", default=None, help="request hint (default general_purpose)")
  p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
  p.add_argument("--slots", type=int, default=4, help="the server's max_concurrent (default 4)")
  p.add_argument("--programs", action="store_true", help="the server's idle_release_programs: compiled programs go too")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for start-up, a release, a call")
  p.add_argument("--json", default=None, type=common.json_path, help="write the results here")
  args = p.parse_args(argv)
  if args.idle <= 0 or args.warm < 1 or args.cycles < 1:
    p.error("--idle must be > 0, --warm and --cycles >= 1")
  out = run(
    args.registry,
    idle_s=args.idle,
    warm=args.warm,
    cycles=args.cycles,
    hints=args.hint or ["general_purpose"],
    max_tokens=args.max_tokens,
    slots=args.slots,
    timeout=args.timeout,
    programs=args.programs,
  )
  out["command"] = "thoughtjax bench idle " + " ".join(argv or [])
  s = out["summary"]
  common.print_table(
    f"scale to zero and back (idle_release_s {args.idle}{', programs too' if args.programs else ''}, "
    f"{args.max_tokens} tokens, path {out['cold']['path']})",
    ["measure", "value"],
    [
      ["RSS baseline (SERVING, no request) MiB", _f(s["rss_baseline_mib"], ".0f")],
      ["RSS warm MiB", _f(s["rss_warm_mib"], ".0f")],
      ["RSS after release MiB (max)", _f(s["rss_released_mib_max"], ".0f")],
      [f"  over baseline MiB (target <= {RSS_TARGET_MIB:.0f})", _f(s["rss_released_over_baseline_mib"], ".0f")],
      ["TTFT cold (restore + compile) ms", _f(s["cold_ttft_ms"], ".0f")],
      ["TTFT warm (median) ms", _f(s["warm_ttft_ms"], ".0f")],
      ["TTFT after idle ms (max)", _f(s["after_idle_ttft_ms_max"], ".0f")],
      [f"  target ms (warm + {TTFT_SLACK_MS:.0f})", _f(s["ttft_target_ms"], ".0f")],
      ["restore after idle ms (max, from the trace)", _f(s["after_idle_restore_ms_max"], ".0f")],
      ["compile after idle ms (max, from the trace)", _f(s["after_idle_compile_ms_max"], ".0f")],
      ["prefill after idle ms (max, from the trace)", _f(s["after_idle_prefill_ms_max"], ".0f")],
      ["prefill warm ms (median, from the trace)", _f(s["warm_prefill_ms"], ".0f")],
      ["RSS target met", s["rss_target_met"]],
      ["TTFT target met", s["ttft_target_met"]],
    ],
    right=("value",),
  )
  if args.json:
    common.write_json(args.json, out)
  return 0

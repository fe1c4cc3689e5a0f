"""``thoughtjax bench serve``: the gRPC server with continuous batching on loopback, against the library's static batch.

Measured in one run, in one process (the server on its own event-loop thread, the clients on threads), on one
path of a registry (default: the default registry's full path), every stream decoding exactly ``--max-tokens``
(end-of-sequence suppressed with a logit bias, the same bias in the static batch):

1. **concurrency**: at 1, 4, 8 and 16 concurrent streams (closed loop: each client starts its next stream when
   one ends; ``--rounds`` streams per client, bounded by ``--level-seconds``): p50/p99 time to first token
   (call -> first token on the client) and aggregate tokens/s (tokens / wall time of the level), with the slot
   engines' prefill calls and the requests they prefilled (waiting requests are prefilled together);
2. **static batch 8**: ``Model.generate_batch`` of 8 prompts on the same path, warm: tokens/s; the ratios
   (aims: 8 streams >= 0.9x static batch 8; p50 TTFT at 8 streams <= 2x single-stream p50);
3. **cancellation**: streams cancelled after their first delta: time from the slot's cancel to its release
   and the decode chunks in between, beside the median decode chunk time;
4. ``--soak SECONDS``: 16 streams closed loop for that long: requests, errors, RSS after warm-up and at the end.

Prints tables; ``--json FILE`` writes every number. ``--quick`` shrinks everything (short prompts and decodes,
one round) so a test can run it on a tiny registry.

``--peer llama-server`` runs the other benchmark of this command instead: ``thoughtjax serve`` (its own process,
default config) against llama.cpp's ``llama-server`` on the same GGUF through one OpenAI-compatible streaming
client; :mod:`thoughtjax.bench.serve_peer` states what it measures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import threading
import time

import numpy as np

from thoughtjax.bench import common
from thoughtjax.cli.args import CommandLineError, add_trust_args, trust_policy


def _rss_mib() -> float:
  """Resident set size of this process now (MiB), from /proc (Linux)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def _pct(xs, q: float) -> float:
  return float(np.percentile(xs, q)) if len(xs) else float("nan")


class _Load:
  """Requests over one channel: each stream's time to first token, tokens and errors."""

  def __init__(self, port: int, request):
    import grpc

    from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc

    self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    self.stub = rpc.SynthesizerStub(self.channel)
    self.request = request

  def one(self, timeout: float) -> tuple[float | None, int, str | None]:
    """(seconds to first token, tokens, error status name or None) of one stream."""
    import grpc

    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
      for r in self.stub.Synthesize(self.request, timeout=timeout):
        if r.WhichOneof("kind") == "delta" and r.delta.token_ids:
          if ttft is None:
            ttft = time.perf_counter() - t0
          tokens += len(r.delta.token_ids)
    except grpc.RpcError as e:
      return ttft, tokens, e.code().name
    return ttft, tokens, None

  def closed_loop(self, streams: int, per_client: int, seconds: float, timeout: float) -> dict:
    """``streams`` clients, each running up to ``per_client`` streams back to back for at most ``seconds``."""
    stop_at = time.perf_counter() + seconds
    rows: list[tuple] = []
    lock = threading.Lock()

    def client():
      for _ in range(per_client):
        if time.perf_counter() >= stop_at:
          return
        row = self.one(timeout)
        with lock:
          rows.append(row)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
      for f in [pool.submit(client) for _ in range(streams)]:
        f.result()
    wall = time.perf_counter() - t0
    ttfts = [r[0] * 1e3 for r in rows if r[0] is not None and r[2] is None]
    tokens = sum(r[1] for r in rows)
    errors = [r[2] for r in rows if r[2] is not None]
    return {
      "streams": streams,
      "requests": len(rows),
      "tokens": tokens,
      "wall_s": wall,
      "tok_s": tokens / wall if wall > 0 else float("nan"),
      "ttft_p50_ms": _pct(ttfts, 50),
      "ttft_p99_ms": _pct(ttfts, 99),
      "errors": len(errors),
      "error_codes": sorted(set(errors)),
    }

  def close(self) -> None:
    self.channel.close()


def _engine_counts(scheduler) -> tuple[int, int, int]:
  """(prefill calls, requests prefilled, decode chunks) over the scheduler's slot engines so far."""
  engines = [d.engine for d in scheduler.pool.drivers()]
  return (
    sum(e.prefill_calls for e in engines),
    sum(e.prefill_rows for e in engines),
    sum(e.chunks for e in engines),
  )


def bench_static(model, ids: list[int], params, reps: int) -> dict:
  """Warm ``Model.generate_batch`` of 8 copies of the prompt: tokens/s over ``reps`` calls (prefill included)."""
  model.generate_batch([ids] * 8, params)  # compile
  walls, tokens = [], 0
  for _ in range(reps):
    t = time.perf_counter()
    out = model.generate_batch([ids] * 8, params)
    walls.append(time.perf_counter() - t)
    tokens = sum(len(c.token_ids) for c in out)
  wall = common.median(walls)
  return {"batch": 8, "reps": reps, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def bench_cancel(load: _Load, scheduler, count: int, timeout: float) -> dict:
  """Streams cancelled after their first delta: the slot's cancel -> release time and chunks in between."""
  from thoughtjax.proto.v1 import synthesis_pb2 as pb

  ids = []
  for i in range(count):
    req = pb.SynthesizeRequest()
    req.CopyFrom(load.request)
    req.request_id = f"bench-cancel-{i}-{time.monotonic_ns()}"
    call = load.stub.Synthesize(req, timeout=timeout)
    for r in call:
      if r.WhichOneof("kind") == "delta":
        break
    call.cancel()
    ids.append(req.request_id)
  deadline = time.monotonic() + timeout
  records = {}
  # A record is listed when its request starts; the release thread completes it (times, chunks) and then
  # marks it closed: wait for that, not for the listing.
  while time.monotonic() < deadline:
    records = {r.request_id: r for r in list(scheduler.records) if r.request_id in ids}
    if len(records) == len(ids) and all(r.closed for r in records.values()):
      break
    time.sleep(0.01)
  free_ms = [r.cancel_to_free_s * 1e3 for r in records.values() if r.cancel_to_free_s is not None]
  chunks = [
    r.decode_chunks_end - r.decode_chunks_at_cancel
    for r in records.values()
    if r.decode_chunks_end is not None and r.decode_chunks_at_cancel is not None
  ]
  chunk_s = [s for d in scheduler.pool.drivers() for s in d.engine.chunk_seconds]
  return {
    "cancelled": len(ids),
    "recorded": len(records),
    "cancel_to_free_ms_p50": _pct(free_ms, 50),
    "cancel_to_free_ms_max": max(free_ms) if free_ms else float("nan"),
    "chunks_between_max": max(chunks) if chunks else None,
    "decode_chunk_ms_p50": _pct([s * 1e3 for s in chunk_s], 50),
  }


def bench_soak(load: _Load, seconds: float, timeout: float) -> dict:
  """16 streams closed loop for ``seconds``; RSS after a warm-up tenth and at the end."""
  warm = load.closed_loop(16, 10**9, max(seconds * 0.1, 0.5), timeout)
  rss_warm = _rss_mib()
  main = load.closed_loop(16, 10**9, seconds, timeout)
  rss_end = _rss_mib()
  return {
    "seconds": seconds,
    "requests": warm["requests"] + main["requests"],
    "errors": warm["errors"] + main["errors"],
    "error_codes": sorted(set(warm["error_codes"]) | set(main["error_codes"])),
    "tok_s": main["tok_s"],
    "rss_warm_mib": rss_warm,
    "rss_end_mib": rss_end,
    "rss_growth": (rss_end - rss_warm) / rss_warm,
  }


def _open(args):
  from thoughtjax.registry import Registry

  if args.registry:
    return Registry.open(args.registry, trust=trust_policy(args))
  if args.public_key or args.require_signatures:
    raise CommandLineError("--public-key and --require-signatures check a registry you name: add --registry DIR")
  from thoughtjax.synthesis.default_registry import ensure_default

  return ensure_default(lambda stage, done, total, item: print(f"{stage} {done}/{total} {item}", flush=True))


def _f(x, spec: str) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


PEER_ONLY = ("llama_server", "gguf", "seconds", "requests_per_user", "plot", "server_config")
GRPC_ONLY = ("path", "slots", "rounds", "level_seconds", "prompt_tokens", "static_reps", "cancels", "soak")


def _positive_list(text: str) -> list[int]:
  """argparse ``type=`` of a comma list of positive integers (``1,4,8,16``)."""
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected a comma list of positive integers such as 1,4,8,16, got {text!r}")
  return values


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench serve", description=__doc__.splitlines()[0])
  p.add_argument(
    "--registry",
    default=None,
    metavar="DIR",
    help="registry to serve (default: the default registry); with --peer, also needs --gguf",
  )
  add_trust_args(p, keys_help="with --registry, without --peer: trusted Ed25519 public key (repeatable)")
  p.add_argument("--path", default=None, help="the path every request runs (default: the registry's full path)")
  p.add_argument(
    "--quick",
    action="store_true",
    help="small sizes everywhere (CI); with --peer: prompts of a few words, 8 tokens, --seconds 0",
  )
  p.add_argument(
    "--concurrency",
    "--levels",
    dest="levels",
    type=_positive_list,
    default=[1, 4, 8, 16],
    help="comma-separated stream counts; with --peer, closed-loop users per level (default 1,4,8,16)",
  )
  p.add_argument(
    "--slots", type=int, default=None, help="slots per path engine (the server's max_concurrent; default 8)"
  )
  p.add_argument("--rounds", type=int, default=None, help="streams per client per level (default 4; quick 1)")
  p.add_argument("--level-seconds", type=float, default=None, help="at most this long per level (default 120)")
  p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length in tokens (default 32; quick 8)")
  p.add_argument(
    "--max-tokens",
    type=_positive_list,
    default=None,
    help="tokens per stream (default 64; quick 8); with --peer a comma list, each run at every level "
    "(default 32,128; quick 8)",
  )
  p.add_argument("--static-reps", type=int, default=None, help="static batch-8 calls timed (default 5; quick 1)")
  p.add_argument("--cancels", type=int, default=None, help="streams cancelled after a delta (default 8; quick 2)")
  p.add_argument("--soak", type=float, default=None, metavar="SECONDS", help="also soak 16 streams this long")
  p.add_argument("--timeout", type=float, default=600.0, help="deadline of each call in seconds")
  p.add_argument("--json", default=None, type=common.json_path, help="write the results here")
  peer = p.add_argument_group(
    "peer benchmark (--peer llama-server)",
    "thoughtjax serve (its own process; its built-in config unless --server-config) against llama.cpp's "
    "llama-server on the same GGUF, one at a time, both through the same OpenAI-compatible streaming client "
    "(thoughtjax/bench/serve_peer.py). The default run takes about 15 minutes on a 2-core machine.",
  )
  peer.add_argument(
    "--peer",
    choices=("llama-server",),
    default=None,
    help="compare thoughtjax serve's OpenAI-compatible HTTP endpoint with this server instead of the gRPC benchmark",
  )
  peer.add_argument("--llama-server", default=None, metavar="BIN", help="the llama-server binary (default: on PATH)")
  peer.add_argument(
    "--gguf",
    default=None,
    metavar="FILE",
    help="the GGUF llama-server loads (default: the default model's; required with --registry)",
  )
  peer.add_argument(
    "--seconds",
    type=float,
    default=None,
    help="each level runs at least this long; requests in flight then finish (default 25; quick 0)",
  )
  peer.add_argument(
    "--requests-per-user",
    type=int,
    default=None,
    help="and until every user finished this many requests (default 1)",
  )
  peer.add_argument(
    "--plot", default=None, metavar="FILE", help="plot tokens/s and TTFT p95 against users (matplotlib)"
  )
  peer.add_argument(
    "--server-config",
    default=None,
    metavar="FILE",
    help="a config file for the thoughtjax serve it starts (e.g. a warm set; default: its built-in config)",
  )
  args = p.parse_args(argv)
  given = lambda names: [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]
  if args.peer is None:
    if given(PEER_ONLY):
      p.error(f"{', '.join(given(PEER_ONLY))}: only with --peer llama-server")
    if args.max_tokens is not None and len(args.max_tokens) != 1:
      p.error(f"--max-tokens: one number without --peer, got {args.max_tokens}")
  else:
    if given(GRPC_ONLY):
      p.error(f"{', '.join(given(GRPC_ONLY))}: not with --peer (thoughtjax serve runs its default config)")
    if args.public_key or args.require_signatures:  # the serve subprocess opens the registry; it is not given them
      p.error("--public-key/--require-signatures: not with --peer (its thoughtjax serve process opens the registry)")
    args.requests_per_user = 1 if args.requests_per_user is None else args.requests_per_user
    if args.requests_per_user < 1:
      p.error(f"--requests-per-user: expected at least 1, got {args.requests_per_user}")
    from thoughtjax.bench import serve_peer

    args.max_tokens = args.max_tokens or ([8] if args.quick else [32, 128])
    args.seconds = args.seconds if args.seconds is not None else (0.0 if args.quick else 25.0)
    return serve_peer.run(args, list(argv or []))
  args.slots = 8 if args.slots is None else args.slots
  args.level_seconds = 120.0 if args.level_seconds is None else args.level_seconds

  from thoughtjax.assembly import full_path
  from thoughtjax.bench.synthesis import synthetic_prompt_ids
  from thoughtjax.compose import compose
  from thoughtjax.proto.v1 import synthesis_pb2 as pb
  from thoughtjax.sampling import SamplingParams
  from thoughtjax.server.app import BackgroundServer
  from thoughtjax.server.config import ServerConfig
  from thoughtjax.synthesis.synthesize import Synthesizer
  from thoughtjax.thoughtlet import fingerprint

  quick = args.quick
  levels = args.levels
  rounds = args.rounds or (1 if quick else 4)
  T = args.prompt_tokens or (8 if quick else 32)
  n = args.max_tokens[0] if args.max_tokens else (8 if quick else 64)
  reg = _open(args)
  syn = Synthesizer.open(reg)
  path = args.path or full_path(reg)
  codec = reg.codec
  ids = synthetic_prompt_ids(codec, T)
  eos = [int(e) for e in codec.eos_ids]
  bias = {e: -100.0 for e in eos}  # every stream decodes max_tokens
  text = codec.decode(ids)
  request = pb.SynthesizeRequest(prompt=text, path=path, max_tokens=n, logit_bias=bias)
  prompt_len = len(codec.encode(text))
  result: dict = {
    "registry": str(reg.root),
    "sequence": reg.sequence,
    "path": path,
    "quick": quick,
    "fingerprint": fingerprint(),
    "prompt_tokens": prompt_len,
    "max_tokens": n,
    "slots": args.slots,
    "command": "thoughtjax bench serve " + " ".join(argv or []),
  }

  model = compose(path, reg)
  result["static_batch8"] = static = bench_static(
    model, codec.encode(text), SamplingParams(max_tokens=n, logit_bias=bias), args.static_reps or (1 if quick else 5)
  )
  config = ServerConfig(port=0, scheduler="continuous", max_concurrent=args.slots, max_queue=max(levels + [16]) * 2)
  with BackgroundServer(syn, config) as srv:
    if not srv.call(srv.app.wait_ready):
      raise RuntimeError(f"the server did not become ready: {srv.app.warm_error}")
    load = _Load(srv.port, request)
    try:
      load.closed_loop(min(args.slots, 2), 1, args.level_seconds, args.timeout)  # compile prefill, insert, chunk
      sched = srv.app.service.scheduler
      for d in sched.pool.drivers():  # every prefill batch size the levels may meet
        d.engine.warm()
      rows = []
      for c in levels:
        before = _engine_counts(sched)
        row = load.closed_loop(c, rounds, args.level_seconds, args.timeout)
        after = _engine_counts(sched)
        row["prefill_calls"], row["prefilled"], row["decode_chunks"] = (a - b for a, b in zip(after, before))
        rows.append(row)
      result["levels"] = rows
      by = {r["streams"]: r for r in rows}
      if 8 in by:
        result["ratio_8_streams_to_static_batch8"] = by[8]["tok_s"] / static["tok_s"]
      if 8 in by and 1 in by:
        result["ttft_p50_8_over_1"] = by[8]["ttft_p50_ms"] / by[1]["ttft_p50_ms"]
      result["cancellation"] = bench_cancel(load, sched, args.cancels or (2 if quick else 8), args.timeout)
      if args.soak:
        result["soak"] = bench_soak(load, args.soak, args.timeout)
      result["scheduler"] = sched.snapshot()
    finally:
      load.close()

  common.print_table(
    f"gRPC streams on loopback, path {path} ({prompt_len} prompt tokens, {n} tokens per stream, {args.slots} slots)",
    ["streams", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "errors", "prefill calls", "decode chunks"],
    [
      [r["streams"], r["requests"], _f(r["tok_s"], ".1f"), _f(r["ttft_p50_ms"], ".1f"), _f(r["ttft_p99_ms"], ".1f")]
      + [r["errors"], r["prefill_calls"], r["decode_chunks"]]
      for r in result["levels"]
    ],
    right=("streams", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "errors", "prefill calls", "decode chunks"),
  )
  common.print_table(
    "static batch 8 (Model.generate_batch, same path and sizes) and the ratios",
    ["static tok/s", "8 streams / static (aim >= 0.9)", "TTFT p50 8 / 1 (aim <= 2)"],
    [
      [
        _f(static["tok_s"], ".1f"),
        _f(result.get("ratio_8_streams_to_static_batch8"), ".2f"),
        _f(result.get("ttft_p50_8_over_1"), ".2f"),
      ]
    ],
  )
  cz = result["cancellation"]
  common.print_table(
    "cancellation (after the first delta)",
    ["cancelled", "cancel -> free p50 ms", "max ms", "chunks between (max)", "decode chunk p50 ms"],
    [
      [
        cz["cancelled"],
        _f(cz["cancel_to_free_ms_p50"], ".2f"),
        _f(cz["cancel_to_free_ms_max"], ".2f"),
        _f(cz["chunks_between_max"], "d"),
        _f(cz["decode_chunk_ms_p50"], ".2f"),
      ]
    ],
  )
  if "soak" in result:
    s = result["soak"]
    common.print_table(
      f"soak: 16 streams for {s['seconds']:.0f} s",
      ["requests", "errors", "tok/s", "RSS warm MiB", "RSS end MiB", "growth"],
      [
        [
          s["requests"],
          s["errors"],
          _f(s["tok_s"], ".1f"),
          _f(s["rss_warm_mib"], ".0f"),
          _f(s["rss_end_mib"], ".0f"),
          _f(s["rss_growth"], ".1%"),
        ]
      ],
    )
  if args.json:
    common.write_json(args.json, result, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

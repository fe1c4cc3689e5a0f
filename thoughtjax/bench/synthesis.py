"""``thoughtjax bench synthesis``: what synthesis costs, how well it predicts, what it buys, and the router.

Measured in one run, on one calibrated registry (default: the default registry in the cache dir):

1. **overhead**: ``Synthesizer.plan`` (hint normalization + GetOptimalPath) warm, in process, on
   pre-tokenized prompts: p50 and p99 over many calls;
2. **prediction**: warm requests mixing hints, prompt lengths and max_tokens (each request runs first
   without a budget, to restore and compile; its warm prediction p gives a budget p * U(0.7, 2.5); the
   budget's plan is warmed too if it chose another path; then the request runs measured; EOS ignored so
   every request decodes its max_tokens):
   median and p90 of |predicted - actual| / actual on the total, and of the plans that said they fit,
   the share that finished within their budget;
3. **per hint**: the path chosen under a generous and a tight budget (half the generous plan's
   prediction) against the full path: held-out quality (top-1 agreement, mean KL) and greedy decode tok/s;
4. **router**: held-out accuracy, per-hint precision/recall and time per prompt of the router stored in
   the registry (or, if none is stored, of one trained here and not stored);
5. **load**: plans under a server's load, through the gRPC server on loopback (continuous batching, 8 slots):
   per hint, a request at one budget (``--load-budget-ms``; default 1.15x the first hint's idle plan) planned and
   run on the idle server, then with ``--load-streams`` streams decoding in the full path's slot engine (its
   plan's path, kind, reason, predicted and wall ms); and, under the same load, the full path and each weight
   variant forced (explicit path): predicted against wall ms, beside their wall ms on the idle server;
6. **streams**: ``--streams`` concurrent requests of ``--streams-hint`` (default fast_draft) at
   ``--streams-budget-ms`` through the same kind of server, sent ``--streams-stagger-ms`` apart so each is planned
   under the load of those before it, against the same streams forced onto the full path and onto each weight
   variant's full path: aggregate tok/s (medians of interleaved rounds) and the plans chosen; ``--weights native``
   restores the full path in the GGUF's packed blocks;
7. ``--calibrate``: wall time of ``registry calibrate`` on the registry (measured, not stored).

Prints tables; ``--json FILE`` writes every number. ``--quick`` shrinks every section (few requests, short
prompts and decodes, a short router training) so a test can run it on a tiny registry.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from typing import Any

import numpy as np

from thoughtjax.bench import common
from thoughtjax.cli.args import CommandLineError, add_trust_args, trust_policy

FILLER = (
  "The history of the city spans many centuries, from its founding as a small settlement on the river "
  "to the busy port it became. "
)


def _percentile(xs, q: float) -> float:
  return float(np.percentile(xs, q)) if len(xs) else float("nan")


def synthetic_prompt_ids(codec, tokens: int) -> list[int]:
  """``tokens`` token ids of ordinary text (the filler repeated as needed)."""
  base = codec.encode(FILLER)
  return (base * (tokens // len(base) + 1))[:tokens]


# ------------------------------------------------------------------------------ 1. overhead
def bench_overhead(syn, ids: list[int], hints: list[str], calls: int) -> dict:
  """Warm plan() wall time in ms (the first calls warm the planner's per-hint caches)."""
  for _ in range(5):
    syn.plan(ids, hints, max_latency_ms=math.inf, max_tokens=32)
  times = []
  for i in range(calls):
    budget = math.inf if i % 2 else 1e6
    t = time.perf_counter()
    syn.plan(ids, hints, max_latency_ms=budget, max_tokens=32)
    times.append((time.perf_counter() - t) * 1e3)
  return {
    "calls": calls,
    "hints": hints,
    "prompt_tokens": len(ids),
    "p50_ms": _percentile(times, 50),
    "p99_ms": _percentile(times, 99),
    "mean_ms": float(np.mean(times)),
  }


# ------------------------------------------------------------------------------ 2. prediction
def bench_prediction(
  syn, codec, requests: int, prompt_range: tuple[int, int], tokens_range: tuple[int, int], seed: int
) -> dict:
  """Warm requests under budgets around their own prediction (module docstring): the measured run's
  prediction against what it measured."""
  rng = np.random.default_rng(seed)
  hints_all = list(syn.calibration.hints)
  rows = []
  for i in range(requests):
    k = int(rng.integers(1, min(3, len(hints_all)) + 1))
    hints = [str(h) for h in rng.choice(hints_all, k, replace=False)]
    T = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
    n = int(rng.integers(tokens_range[0], tokens_range[1] + 1))
    ids = synthetic_prompt_ids(codec, T)
    syn.synthesize(ids, hints, max_latency_ms=math.inf, max_tokens=n, ignore_eos=True).finish()
    p = syn.plan(ids, hints, max_latency_ms=math.inf, max_tokens=n).predicted.total  # warm
    budget = float(p * rng.uniform(0.7, 2.5))
    cold = syn.plan(ids, hints, max_latency_ms=budget, max_tokens=n).predicted
    if cold.restore or cold.compile:  # the budget chose another path: warm it too
      syn.synthesize(ids, hints, max_latency_ms=budget, max_tokens=n, ignore_eos=True).finish()
    r = syn.synthesize(ids, hints, max_latency_ms=budget, max_tokens=n, ignore_eos=True).finish()
    predicted, actual = r.plan.predicted.total, r.trace.actual_ms["total"]
    rows.append(
      {
        "hints": hints,
        "prompt_tokens": T,
        "max_tokens": n,
        "budget_ms": budget,
        "path": r.plan.path,
        "degraded": r.plan.degraded,
        "predicted_ms": predicted,
        "actual_ms": actual,
        "rel_error": abs(predicted - actual) / actual,
        "within_budget": actual <= budget,
        "tokens_out": r.trace.tokens_out,
      }
    )
    print(
      f"prediction request {i + 1}/{requests}: {T} prompt tokens, {n} max tokens, predicted "
      f"{predicted:.0f} ms, actual {actual:.0f} ms",
      file=sys.stderr,
      flush=True,
    )
  errors = [row["rel_error"] for row in rows]
  fits = [row for row in rows if not row["degraded"]]
  return {
    "requests": len(rows),
    "median_rel_error": common.median(errors),
    "p90_rel_error": _percentile(errors, 90),
    "fits": len(fits),
    "fits_within_budget": (sum(r["within_budget"] for r in fits) / len(fits)) if fits else float("nan"),
    "rows": rows,
  }


# ------------------------------------------------------------------------------ 3. per hint
def _tok_s(syn, candidate, ids: list[int], tokens: int) -> float:
  """Greedy decode tok/s of one candidate path (second run: compiled)."""
  from thoughtjax.sampling import SamplingParams

  model = syn.model_of(candidate)
  params = SamplingParams(max_tokens=tokens, ignore_eos=True)
  for _ in range(2):
    g = model.stream_batch([ids], params)
    for _ in g:
      pass
  out = g.trace.tokens_out[0] if g.trace.tokens_out else 0
  return out / g.trace.decode_s if g.trace.decode_s else float("nan")


def bench_per_hint(syn, codec, prompt_tokens: int, tokens: int) -> list[dict]:
  cal = syn.calibration
  ids = synthetic_prompt_ids(codec, prompt_tokens)
  full = cal.full
  speed: dict[str, float] = {}

  def speed_of(c) -> float:
    if c.path_hash not in speed:
      speed[c.path_hash] = _tok_s(syn, c, ids, tokens)
    return speed[c.path_hash]

  rows = []
  for hint in cal.hints:
    generous = syn.plan(ids, [hint], max_latency_ms=math.inf, max_tokens=tokens)
    tight_ms = generous.predicted.total / 2
    tight = syn.plan(ids, [hint], max_latency_ms=tight_ms, max_tokens=tokens)
    for label, plan, budget in (("full", None, None), ("generous", generous, None), ("tight", tight, tight_ms)):
      c = full if plan is None else next(x for x in cal.candidates if x.path_hash == plan.path_hash)
      q = cal.hint_quality(c.path_hash, hint)
      rows.append(
        {
          "hint": hint,
          "budget": label,
          "budget_ms": budget,
          "path": c.path,
          "degraded": False if plan is None else plan.degraded,
          "top1_heldout": None if q is None else q.heldout.top1_agreement,
          "kl_heldout": None if q is None else q.heldout.mean_kl,
          "predicted_ms": None if plan is None else plan.predicted.total,
          "tok_s": speed_of(c),
        }
      )
  return rows


# ------------------------------------------------------------------------------ a server on loopback
@contextlib.contextmanager
def _serving(syn, config):
  """A ready server of ``syn`` on loopback under ``config``: (its scheduler, a Synthesizer stub); closed after."""
  import grpc

  from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
  from thoughtjax.server.app import BackgroundServer

  with BackgroundServer(syn, config) as srv:
    if not srv.call(srv.app.wait_ready):
      raise RuntimeError(f"the server did not become ready: {srv.app.warm_error}")
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
      yield srv.app.service.scheduler, rpc.SynthesizerStub(channel)


# ------------------------------------------------------------------------------ 5. load
def bench_load(syn, codec, *, streams: int, budget_ms: float | None, prompt_tokens: int, tokens: int) -> dict:
  """Plans and runs on an idle server and beside ``streams`` streams in the full path's engine (module docstring)."""
  import threading

  import grpc

  from thoughtjax.proto.v1 import synthesis_pb2 as pb
  from thoughtjax.server.config import ServerConfig

  cal = syn.calibration
  prompt = codec.decode(synthetic_prompt_ids(codec, prompt_tokens))
  T = len(syn.prompt_ids(prompt))
  forced = [cal.full, *(c for c in cal.candidates if c.kind.value == "variant")]
  if budget_ms is None:
    idle_plan = syn.plan(
      prompt,
      [cal.hints[0]],
      max_latency_ms=math.inf,
      max_tokens=tokens,
      residency=syn.latency.warm_residency(cal.candidates, T, tokens),
    )
    budget_ms = round(1.15 * idle_plan.predicted.total)
  config = ServerConfig(port=0, scheduler="continuous", max_concurrent=8, max_queue=32)
  out: dict = {"streams": streams, "budget_ms": budget_ms, "prompt_tokens": T, "tokens": tokens, "plans": []}
  with _serving(syn, config) as (sched, stub):
    # End-of-sequence suppressed: every request decodes its tokens (the bias changes no step's cost).
    bias = {i: -100.0 for i in codec.eos_ids}

    def run(**kw) -> tuple[Any, float]:
      t0 = time.perf_counter()
      responses = list(stub.Synthesize(pb.SynthesizeRequest(prompt=prompt, logit_bias=bias, **kw), timeout=600))
      return responses[0].plan, (time.perf_counter() - t0) * 1e3

    # Warm: every plan a warm process chooses at these budgets, in its engine; every forced path once.
    syn.warm(
      list(cal.hints),
      prompt_tokens=(T,),
      max_tokens=(tokens,),
      pool=sched.pool,
      budgets=(math.inf, budget_ms, budget_ms / 2),
    )
    for c in forced:
      run(path=c.path, max_tokens=tokens)
    idle_ms = {
      c.path_hash: float(np.median([run(path=c.path, max_tokens=tokens)[1] for _ in range(3)])) for c in forced
    }

    def plans(when: str) -> None:
      for hint in cal.hints:
        plan, ms = run(hints=[hint], max_latency_ms=budget_ms, max_tokens=tokens)
        out["plans"].append(
          {
            "when": when,
            "hint": hint,
            "path": plan.path,
            "kind": plan.kind,
            "degraded": plan.degraded,
            "reason": plan.reason,
            "predicted_ms": plan.predicted_ms["total"],
            "wall_ms": ms,
          }
        )

    plans("warm-up")  # the programs with the bias compile here (the warm-up above ran without it)
    del out["plans"][:]
    plans("idle")
    # Long enough to outlast what is measured under it, within the model's context.
    load_tokens = min(1200, syn.model_of(cal.full).config.max_context - T - 1)
    request = pb.SynthesizeRequest(prompt=prompt, path=cal.full.path, max_tokens=load_tokens, logit_bias=bias)
    loaders = [stub.Synthesize(request, timeout=3600) for _ in range(streams)]
    done = threading.Event()
    threads = []

    def drain(call) -> None:
      try:
        for _ in call:
          if done.is_set():
            return
      except grpc.RpcError:
        return

    for call in loaders:
      threads.append(threading.Thread(target=drain, args=(call,), daemon=True))
      threads[-1].start()
    deadline = time.monotonic() + 300
    # Every stream in its slot and the engine stepped (or, on a small model, the streams already over).
    while not (sched.load().rows >= streams and any(e.step_ms for e in sched.load().engines)):
      if not any(t.is_alive() for t in threads):
        break
      if time.monotonic() > deadline:
        raise RuntimeError(f"the load did not start within 300 s: {sched.load().describe()}")
      time.sleep(0.01)
    out["load"] = sched.load().describe()
    plans("load")
    out["forced"] = []
    for c in forced:
      for _ in range(2):
        load = sched.load()
        res = syn.latency.warm_residency([c], T, tokens)
        pred = syn.latency.predict(c, T, tokens, res, syn.context_under(load), load=load)
        plan, ms = run(path=c.path, max_tokens=tokens)
        out["forced"].append(
          {
            "path": c.path,
            "kind": c.kind.value,
            "predicted_ms": pred.total,
            "wall_ms": ms,
            "idle_wall_ms": idle_ms[c.path_hash],
          }
        )
    out["moved_by_load"] = sum(
      a["path"] != b["path"] or a["kind"] != b["kind"]
      for a, b in zip(out["plans"][: len(cal.hints)], out["plans"][len(cal.hints) :], strict=True)
    )
    done.set()
    for call in loaders:
      call.cancel()
  return out


# ------------------------------------------------------------------------------ 6. streams
def bench_streams(
  syn,
  codec,
  *,
  streams: int,
  hint: str,
  budget_ms: float | None,
  prompt_tokens: int,
  tokens: int,
  rounds: int,
  untimed: int,
  stagger_ms: float,
) -> dict:
  """``streams`` concurrent requests of ``hint`` at ``budget_ms`` through the server, sent ``stagger_ms`` apart so
  each is planned under the load of those sent before it, against the same streams forced onto the full path and
  onto each weight variant's full path (explicit paths): aggregate tok/s (every stream's tokens over the wall time
  from the first send to the last token), ``rounds`` interleaved rounds of each after ``untimed`` ones (which
  compile each engine's widths), medians."""
  import collections
  import threading

  from thoughtjax.path_syntax import split_variant
  from thoughtjax.proto.v1 import synthesis_pb2 as pb
  from thoughtjax.server.config import ServerConfig

  cal = syn.calibration
  prompt = codec.decode(synthetic_prompt_ids(codec, prompt_tokens))
  T = len(syn.prompt_ids(prompt))
  if budget_ms is None:
    everything = syn.latency.warm_residency(cal.candidates, T, tokens)
    budget_ms = round(syn.latency.predict(cal.full, T, tokens, everything, syn.context_under(None)).total)
  config = ServerConfig(port=0, scheduler="continuous", max_concurrent=max(8, streams), max_queue=4 * streams)
  # End-of-sequence suppressed: every request decodes its tokens.
  bias = {i: -100.0 for i in codec.eos_ids}
  # Synthesized, then forced (explicit path) onto the full path and onto each weight variant's full path.
  modes = {"synthesized": dict(hints=[hint], max_latency_ms=budget_ms), "full": dict(path=cal.full.path)}
  for c in cal.candidates:
    if c.kind.value == "variant":
      modes["+".join(sorted({split_variant(u.name)[1] for u in c.units} - {None}))] = dict(path=c.path)
  out: dict = {
    "streams": streams,
    "hint": hint,
    "budget_ms": budget_ms,
    "prompt_tokens": T,
    "tokens": tokens,
    "weights": getattr(syn.registry, "weights", None) or "f32",
    "full_path": cal.full.path,
    "stagger_ms": stagger_ms,
    "rounds": {m: [] for m in modes},
  }
  with _serving(syn, config) as (sched, stub):
    syn.warm([hint], prompt_tokens=(T,), max_tokens=(tokens,), pool=sched.pool, budgets=(math.inf, budget_ms))

    def one_round(mode: str) -> dict:
      got: list = [None] * streams
      t0 = time.perf_counter()

      def client(i: int) -> None:
        request = pb.SynthesizeRequest(prompt=prompt, logit_bias=bias, max_tokens=tokens, **modes[mode])
        plan, n = None, 0
        for r in stub.Synthesize(request, timeout=600):
          if r.HasField("plan"):
            plan = r.plan
          elif r.HasField("delta"):
            n += len(r.delta.token_ids)
        got[i] = (plan, n, time.perf_counter() - t0)

      threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
      for i, t in enumerate(threads):
        time.sleep(max(0.0, t0 + i * stagger_ms / 1e3 - time.perf_counter()))
        t.start()
      for t in threads:
        t.join()
      wall = max(g[2] for g in got)
      chosen = collections.Counter(f"{g[0].kind}: {g[0].path}" for g in got)
      return {
        "wall_s": wall,
        "tokens": sum(g[1] for g in got),
        "tok_s": sum(g[1] for g in got) / wall,
        "plans": dict(chosen),
        "reasons": sorted({g[0].reason for g in got}),
      }

    for _ in range(untimed):  # each width of each engine compiles here
      for mode in modes:
        one_round(mode)
    for _ in range(rounds):
      for mode in modes:
        out["rounds"][mode].append(one_round(mode))
  med = {m: float(np.median([r["tok_s"] for r in rs])) for m, rs in out["rounds"].items()}
  out["tok_s"] = med
  out["ratio"] = {m: x / med["full"] for m, x in med.items() if m != "full"}
  return out


# ------------------------------------------------------------------------------ 4. router
def bench_router(reg, quick: bool) -> dict:
  """The stored router's held-out numbers, or those of one trained here (not stored) if none is."""
  from thoughtjax.synthesis.router import RouterError, confusion_metrics, predict_times
  from thoughtjax.synthesis.router_data import load_router_prompts
  from thoughtjax.synthesis.router_store import ROUTER_NAME, load_router, train_registry_router

  heldout = load_router_prompts("heldout")
  if ROUTER_NAME in reg.names:
    router, source = load_router(reg), f"stored {ROUTER_NAME}@{reg.resolve(ROUTER_NAME)[:8]}"
  else:
    train = load_router_prompts("train")
    if quick:  # a few prompts of each hint: the numbers show the section works, not the router's quality
      train = [r for i, r in enumerate(train) if i % 8 == 0]
    router, _, _ = train_registry_router(reg, train, heldout, steps=60 if quick else 300, publish=False)
    source = "trained here (none stored)"
  rows = [r for r in heldout if r.hint in router.labels]
  if not rows:
    raise RouterError(f"no held-out prompt is labeled with one of the router's hints {list(router.labels)}")
  probs = router.probabilities([r.prompt for r in rows])
  index = {h: i for i, h in enumerate(router.labels)}
  confusion = np.zeros((len(router.labels),) * 2, np.int64)
  np.add.at(confusion, ([index[r.hint] for r in rows], np.argmax(probs, axis=-1)), 1)
  accuracy, precision, recall = confusion_metrics(confusion)
  times = predict_times(router, [r.prompt for r in (rows[:40] if quick else rows)])
  return {
    "source": source,
    "labels": list(router.labels),
    "n_heldout": len(rows),
    "accuracy": accuracy,
    "precision": precision.tolist(),
    "recall": recall.tolist(),
    "confusion": confusion.tolist(),
    "predict_ms_p50": common.median(times),
    "predict_ms_p90": _percentile(times, 90),
  }


# ------------------------------------------------------------------------------ 5. calibrate
def bench_calibrate(reg, quick: bool) -> dict:
  from thoughtjax.synthesis.calibrate import calibrate
  from thoughtjax.synthesis.calibrate_settings import CalibrateSettings, LatencySettings
  from thoughtjax.synthesis.candidates import CandidateSettings

  settings = CalibrateSettings()
  if quick:
    settings = CalibrateSettings(
      candidates=CandidateSettings(exits=[2], single_skips=1, greedy_removals=0, repeats=[]),
      window=32,
      max_windows=1,
      hints=tuple(sorted(_calibrated(reg)))[:1],
      latency=LatencySettings(prompt_tokens=(4, 12), max_tokens=(4, 9), reps=1, plan_reps=5),
    )
  t = time.perf_counter()
  cal = calibrate(reg, settings=settings)
  return {
    "wall_s": time.perf_counter() - t,
    "candidates": len(cal.candidates),
    "hints": list(cal.hints),
    "quick_settings": quick,
  }


def _calibrated(reg) -> tuple[str, ...]:
  from thoughtjax.synthesis.calibration_store import read_calibration

  return read_calibration(reg).hints


# ------------------------------------------------------------------------------ main
def _open(args):
  from thoughtjax.registry import Registry

  if args.registry:
    return Registry.open(args.registry, weights=args.weights, trust=trust_policy(args))
  if args.public_key or args.require_signatures:
    raise CommandLineError("--public-key and --require-signatures check a registry you name: add --registry DIR")
  from thoughtjax.synthesis.default_registry import ensure_default

  return ensure_default(
    lambda stage, done, total, item: print(f"{stage} {done}/{total} {item}", flush=True), weights=args.weights
  )


def _f(x: Any, spec: str) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench synthesis", description=__doc__.splitlines()[0])
  p.add_argument("--registry", default=None, metavar="DIR", help="calibrated registry (default: the default registry)")
  add_trust_args(p, keys_help="with --registry: trusted Ed25519 public key (repeatable)")
  p.add_argument("--quick", action="store_true", help="small sizes everywhere (CI)")
  p.add_argument("--requests", type=int, default=None, help="prediction requests (default 60; quick 6)")
  p.add_argument("--plan-calls", type=int, default=None, help="plan() calls timed (default 2000; quick 200)")
  p.add_argument("--calibrate", action="store_true", help="also time `registry calibrate` (not stored)")
  p.add_argument(
    "--skip", action="append", default=[], choices=("overhead", "prediction", "hints", "router", "load", "streams")
  )
  p.add_argument("--load-streams", type=int, default=None, help="streams of the load (default 7; quick 2)")
  p.add_argument(
    "--load-budget-ms",
    type=float,
    default=None,
    help="budget of the requests planned under load (default: 1.15x the first hint's warm idle plan)",
  )
  p.add_argument("--streams", type=int, default=None, help="concurrent streams of the streams section (default 8)")
  p.add_argument("--streams-hint", default="fast_draft", help="hint of those streams (default fast_draft)")
  p.add_argument(
    "--streams-budget-ms",
    type=float,
    default=None,
    help="budget of those streams (default: the warm full path's idle prediction for one request)",
  )
  p.add_argument(
    "--streams-stagger-ms",
    type=float,
    default=100.0,
    help="time between the sends of those streams (default 100; 0: all at once, planned before any is placed)",
  )
  p.add_argument(
    "--weights",
    choices=("f32", "native"),
    default="f32",
    help="the form the registry's restores take (the full path's weights; variants are paths of their own)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, type=common.json_path, help="write the results here")
  args = p.parse_args(argv)

  from thoughtjax.synthesis.synthesize import Synthesizer
  from thoughtjax.thoughtlet import fingerprint

  quick = args.quick
  reg = _open(args)
  syn = Synthesizer.open(reg)
  codec = reg.codec
  hints = list(syn.calibration.hints)
  result: dict = {
    "registry": str(reg.root),
    "sequence": reg.sequence,
    "quick": quick,
    "fingerprint": fingerprint(),
    "hints": hints,
  }

  if "overhead" not in args.skip:
    calls = args.plan_calls or (200 if quick else 2000)
    result["overhead"] = o = bench_overhead(syn, synthetic_prompt_ids(codec, 64), hints[:3], calls)
    common.print_table(
      "GetOptimalPath overhead, warm, in process (plan(): hints + GetOptimalPath)",
      ["calls", "hints", "p50 ms", "p99 ms", "mean ms"],
      [[o["calls"], ", ".join(o["hints"]), _f(o["p50_ms"], ".4f"), _f(o["p99_ms"], ".4f"), _f(o["mean_ms"], ".4f")]],
      right=("calls", "p50 ms", "p99 ms", "mean ms"),
    )
  if "prediction" not in args.skip:
    n = args.requests or (6 if quick else 60)
    prompts, tokens = ((10, 40), (8, 12)) if quick else ((10, 400), (8, 128))
    result["prediction"] = r = bench_prediction(syn, codec, n, prompts, tokens, args.seed)
    common.print_table(
      f"prediction over {r['requests']} warm requests (prompts {prompts[0]}-{prompts[1]} tokens, "
      f"max_tokens {tokens[0]}-{tokens[1]})",
      ["median |p-a|/a", "p90 |p-a|/a", "plans that fit", "of those within budget"],
      [
        [_f(r["median_rel_error"], ".1%"), _f(r["p90_rel_error"], ".1%"), r["fits"], _f(r["fits_within_budget"], ".1%")]
      ],
    )
  if "hints" not in args.skip:
    rows = bench_per_hint(syn, codec, 16 if quick else 64, 8 if quick else 64)
    result["per_hint"] = rows
    common.print_table(
      "per hint: chosen path under a generous and a tight budget vs the full path",
      ["hint", "budget", "path", "degraded", "top-1 held-out", "KL held-out", "predicted ms", "tok/s"],
      [
        [
          r["hint"],
          r["budget"] + ("" if r["budget_ms"] is None else f" {r['budget_ms']:.0f} ms"),
          r["path"],
          "yes" if r["degraded"] else "",
          _f(r["top1_heldout"], ".3f"),
          _f(r["kl_heldout"], ".3f"),
          _f(r["predicted_ms"], ".1f"),
          _f(r["tok_s"], ".1f"),
        ]
        for r in rows
      ],
      right=("top-1 held-out", "KL held-out", "predicted ms", "tok/s"),
    )
  if "router" not in args.skip:
    result["router"] = r = bench_router(reg, quick)
    common.print_table(
      f"router ({r['source']}), held-out",
      ["prompts", "accuracy", "predict ms p50", "p90"],
      [[r["n_heldout"], _f(r["accuracy"], ".3f"), _f(r["predict_ms_p50"], ".3f"), _f(r["predict_ms_p90"], ".3f")]],
    )
    common.print_table(
      "router per hint",
      ["hint", "precision", "recall", "confusion row"],
      [
        [h, _f(r["precision"][i], ".3f"), _f(r["recall"][i], ".3f"), " ".join(map(str, r["confusion"][i]))]
        for i, h in enumerate(r["labels"])
      ],
    )
  if "load" not in args.skip:
    streams = args.load_streams or (2 if quick else 7)
    if streams < 1 or (args.load_budget_ms is not None and not args.load_budget_ms > 0):
      p.error("--load-streams must be >= 1 and --load-budget-ms > 0")
    result["load"] = r = bench_load(
      syn,
      codec,
      streams=streams,
      budget_ms=args.load_budget_ms,
      prompt_tokens=16 if quick else 32,
      tokens=8 if quick else 64,
    )
    common.print_table(
      f"plans at {r['budget_ms']:.0f} ms, idle and under load ({r['load']}; {r['prompt_tokens']} prompt + "
      f"{r['tokens']} new tokens, through the server)",
      ["when", "hint", "kind", "path", "reason", "predicted ms", "wall ms"],
      [
        [
          x["when"],
          x["hint"],
          x["kind"] + (" (degraded)" if x["degraded"] else ""),
          x["path"],
          x["reason"],
          _f(x["predicted_ms"], ".0f"),
          _f(x["wall_ms"], ".0f"),
        ]
        for x in r["plans"]
      ],
      right=("predicted ms", "wall ms"),
    )
    common.print_table(
      f"each path forced under the same load (the full path joins the busy engine; {r['moved_by_load']} of "
      f"{len(r['plans']) // 2} hints moved)",
      ["kind", "path", "predicted ms", "wall ms", "idle wall ms"],
      [
        [x["kind"], x["path"], _f(x["predicted_ms"], ".0f"), _f(x["wall_ms"], ".0f"), _f(x["idle_wall_ms"], ".0f")]
        for x in r["forced"]
      ],
      right=("predicted ms", "wall ms", "idle wall ms"),
    )
  if "streams" not in args.skip:
    n = args.streams or (2 if quick else 8)
    if n < 1 or (args.streams_budget_ms is not None and not args.streams_budget_ms > 0) or args.streams_stagger_ms < 0:
      p.error("--streams must be >= 1, --streams-budget-ms > 0 and --streams-stagger-ms >= 0")
    hint = args.streams_hint if args.streams_hint in hints else hints[0]
    result["streams"] = r = bench_streams(
      syn,
      codec,
      streams=n,
      hint=hint,
      budget_ms=args.streams_budget_ms,
      prompt_tokens=16 if quick else 32,
      tokens=8 if quick else 128,
      rounds=1 if quick else 5,
      untimed=1 if quick else 2,
      stagger_ms=args.streams_stagger_ms,
    )
    common.print_table(
      f"{r['streams']} concurrent {r['hint']} streams through the server at {r['budget_ms']:.0f} ms, sent "
      f"{r['stagger_ms']:.0f} ms apart "
      f"({r['prompt_tokens']} prompt + {r['tokens']} new tokens each; {r['weights']} weights), against the same "
      f"streams forced onto the full path and each weight variant",
      ["streams", "aggregate tok/s (median)", "/ full path", "rounds tok/s", "plans"],
      [
        [
          m,
          _f(r["tok_s"][m], ".1f"),
          _f(r["ratio"].get(m), ".2f"),
          " ".join(_f(x["tok_s"], ".0f") for x in rs),
          "; ".join(f"{k} x{v}" for k, v in rs[-1]["plans"].items()),
        ]
        for m, rs in r["rounds"].items()
      ],
      right=("aggregate tok/s (median)", "/ full path", "rounds tok/s"),
    )
  if args.calibrate:
    result["calibrate"] = c = bench_calibrate(reg, quick)
    common.print_table(
      "registry calibrate (measured, not stored)",
      ["wall s", "candidates", "hints"],
      [[_f(c["wall_s"], ".1f"), c["candidates"], ", ".join(c["hints"])]],
    )
  if args.json:
    common.write_json(args.json, result, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

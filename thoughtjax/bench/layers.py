"""``thoughtjax bench layers``: the unrolled program against the layer-indexed one, in the same run.

For each layout (``unrolled``: every block traced into the program; ``indexed``: one loop over the stacked blocks,
:mod:`thoughtjax.decode.indexed`), on the default model (or ``--model``) and ``--weights``:

* compile: seconds the first request of each shape spends tracing, lowering and compiling (the trace's
  ``compile_s``), with a compilation cache of its own, empty at the start, and exported programs off, so both
  compile from nothing;
* executable size: bytes the compilation cache holds for that layout once every measured shape has run;
* decode tok/s at batch 1 and batch 8 (``--new-tokens`` greedy tokens per row, EOS ignored; tokens after the first
  over the time after the first), and prefill tok/s of a ``--prompt-tokens`` prompt at batch 1 (prompt tokens
  over the time from the device call to the first token): medians of ``--repeats``, the layouts alternating;
* start-up: a new process (``python -c``) that loads the model, runs one request and prints the seconds from its
  start to the first token, with that layout's compilation cache warm (an untimed process ran the same request
  first): median of ``--startup-runs``; and in that process the executable load: the seconds JAX spends reading
  and loading the request's compiled programs from the persistent cache (its ``cache_retrieval_time_sec`` events;
  tracing and lowering not included);
* slot engine (``--slots N``, 0: skipped): in a new process per layout with an empty compilation cache, a
  :class:`~thoughtjax.serving.slots.SlotEngine` of N slots over a ring of ``--ring`` tokens in that layout: the
  seconds its greedy warm takes (every prefill row count and decode width compiled), the process's resident memory
  before and after it and its peak, the decode step with every slot in use (ms per step, the median of
  ``--repeats`` rounds of 3 chunks), and the prefill of one prompt that fills one prefill chunk (ms, the median of
  ``--repeats``, after the engine's first prefill);

``--json FILE`` writes the report. The layout with the higher batch-1 and batch-8 decode is the one to default to.
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
from pathlib import Path

from thoughtjax.bench import common

LAYOUTS = ("unrolled", "indexed")
TEXT = (
  "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had taught him, "
  "and at the top he trimmed the wick, polished the great lens and watched the ships pass along the dark coast. "
)

# A new process, with the compilation cache argv[1]: "compile" runs each shape's first request and prints the
# compile seconds of each; "startup" prints the seconds from its start to the first token of one request and the
# seconds its programs took to load from the cache.
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
import thoughtjax
loads = []
jax.monitoring.register_event_duration_secs_listener(
  lambda e, s, **_: loads.append(s) if e == "/jax/compilation_cache/cache_retrieval_time_sec" else None
)
from thoughtjax.decode import program
from thoughtjax.bench import layers
program.configure_compilation_cache(sys.argv[1])
model = thoughtjax.load(sys.argv[2] or None, weights=sys.argv[3], compile_cache=False).with_layout(sys.argv[4])
if sys.argv[5] == "slots":
  print(json.dumps(layers.slot_engine(model, int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]))))
elif sys.argv[5] == "startup":
  g = model.stream([1, 2, 3, 4], max_tokens=2, ignore_eos=True)
  next(iter(g))
  print(json.dumps({"first_token_s": time.perf_counter() - t0, "executable_load_s": sum(loads), "loads": len(loads)}))
else:
  short, batch8, ids = layers.prompts(model, int(sys.argv[6]))
  new = int(sys.argv[7])
  print(json.dumps({
    "batch1": layers.decode_rate(model, short, new)[1],
    "batch8": layers.decode_rate(model, batch8, new)[1],
    "prefill": layers.prefill_rate(model, ids)[1],
  }))
"""


def _child(cache: str, model_name: str | None, weights: str, layout: str, *args: str):
  env = {**os.environ, "THOUGHTJAX_EXPORT_CACHE": "off"}  # every program traces and lowers from nothing
  argv = [sys.executable, "-c", _CHILD, cache, model_name or "", weights, layout, *args]
  out = subprocess.run(argv, capture_output=True, text=True, env=env)
  if out.returncode:
    raise SystemExit(f"bench layers: a {layout} child process failed:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def prompts(model, prompt_tokens: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
  """The batch-1 and batch-8 decode prompts (16 tokens each) and the prefill prompt."""
  enc = model.codec.encode
  ids = enc(TEXT * (1 + prompt_tokens // 40))[:prompt_tokens]
  return [enc(TEXT)[:16]], [enc(TEXT)[i : i + 16] for i in range(8)], ids


def _dir_bytes(path: str) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def decode_rate(model, ids: list[list[int]], new_tokens: int) -> tuple[float, float]:
  """(decode tok/s over the rows after their first token, compile seconds) of one greedy batch."""
  from thoughtjax.sampling import SamplingParams

  g = model.stream_batch(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
  g.completions()
  t = g.trace
  return (sum(t.tokens_out) - len(ids)) / (t.end - t.first_token), t.compile_s


def prefill_rate(model, ids: list[int]) -> tuple[float, float]:
  """(prompt tokens per second from the device call to the first token, compile seconds)."""
  g = model.stream(ids, max_tokens=1, ignore_eos=True)
  g.completions()
  t = g.trace
  return len(ids) / (t.first_token - t.device_start), t.compile_s


def slot_engine(model, slots: int, ring: int, repeats: int) -> dict:
  """A slot engine of ``slots`` slots over ``ring`` tokens in ``model``'s layout: warm seconds (greedy), resident
  MiB before and after, peak MiB, ms per decode step with every slot in use (3 chunks per round), and ms per
  prefill of one prompt that fills one prefill chunk, before any slot (one per round)."""
  import resource

  import jax

  from thoughtjax.bench.process import rss_mib
  from thoughtjax.sampling import SamplingParams
  from thoughtjax.serving import SlotEngine

  before = rss_mib(os.getpid())
  t = time.perf_counter()
  engine = SlotEngine(model, slots, cache_len=ring)
  engine.warm()
  warm_s = time.perf_counter() - t
  after = rss_mib(os.getpid())
  chunk = model.codec.encode(TEXT * (1 + engine.prefill_chunk // 16))[: min(engine.prefill_chunk, ring - 1)]
  prefill_ms = []
  for k in range(repeats + 1):  # the first: the engine's first prefill, not measured
    t = time.perf_counter()
    (pre,) = engine.prefiller.run([engine.request(chunk, SamplingParams(max_tokens=1))])
    jax.block_until_ready(pre.kv)
    if k:
      prefill_ms.append((time.perf_counter() - t) * 1e3)
  ids = model.codec.encode(TEXT)[:16]
  engine.insert_batch([(ids, SamplingParams(max_tokens=ring - len(ids), ignore_eos=True))] * slots)
  engine.step()
  step_ms = []
  for _ in range(repeats):
    steps, t = engine.steps, time.perf_counter()
    for _ in range(3):
      engine.step()
    step_ms.append((time.perf_counter() - t) * 1e3 / max(engine.steps - steps, 1))
  return {
    "layout": engine.layout,
    "warm_s": warm_s,
    "rss_before_mib": before,
    "rss_after_warm_mib": after,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "step_ms": step_ms,
    "prefill_chunk_tokens": len(chunk),
    "prefill_chunk_ms": prefill_ms,
  }


def run(
  model_name: str | None,
  *,
  weights: str,
  new_tokens: int,
  prompt_tokens: int,
  repeats: int,
  startup_runs: int,
  workdir: str,
  slots: int = 0,
  ring: int = 512,
) -> dict:
  import thoughtjax

  base = thoughtjax.load(model_name, weights=weights)
  short, batch8, ids = prompts(base, prompt_tokens)
  caches = {name: os.path.join(workdir, f"xla-{name}") for name in LAYOUTS}
  # Each layout's first requests in a process of its own, compiling into an empty cache.
  compile_s = {name: _child(caches[name], model_name, weights, name, "compile", str(prompt_tokens), str(new_tokens))
               for name in LAYOUTS}  # fmt: skip
  sizes = {name: _dir_bytes(caches[name]) for name in LAYOUTS}
  models = {name: base.with_layout(name) for name in LAYOUTS}
  rates: dict[str, dict[str, list[float]]] = {name: {"batch1": [], "batch8": [], "prefill": []} for name in LAYOUTS}
  for m in models.values():  # this process's own first requests (compiled or loaded): not measured
    decode_rate(m, short, new_tokens), decode_rate(m, batch8, new_tokens), prefill_rate(m, ids)
  for _ in range(repeats):
    for name in LAYOUTS:
      m = models[name]
      rates[name]["batch1"].append(decode_rate(m, short, new_tokens)[0])
      rates[name]["batch8"].append(decode_rate(m, batch8, new_tokens)[0])
      rates[name]["prefill"].append(prefill_rate(m, ids)[0])
  startup: dict[str, list[float]] = {name: [] for name in LAYOUTS}
  load_s: dict[str, list[float]] = {name: [] for name in LAYOUTS}
  for name in LAYOUTS if startup_runs else ():  # the start-up request's own shapes into the cache, not timed
    _child(caches[name], model_name, weights, name, "startup")
  for _ in range(startup_runs):
    for name in LAYOUTS:
      got = _child(caches[name], model_name, weights, name, "startup")
      startup[name].append(got["first_token_s"])
      load_s[name].append(got["executable_load_s"])
  engines = {
    name: _child(os.path.join(workdir, f"xla-slots-{name}"), model_name, weights, name, "slots", str(slots),
                 str(ring), str(repeats))
    for name in (LAYOUTS if slots else ())
  }  # fmt: skip
  med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
  return {
    "slots": slots,
    "ring": ring,
    "slot_engine": engines,
    "model": base.loaded.name,
    "weights": weights,
    "new_tokens": new_tokens,
    "prompt_tokens": len(ids),
    "repeats": repeats,
    "compile_s": compile_s,
    "executable_cache_bytes": sizes,
    "rates": rates,
    "median": {name: {k: med(v) for k, v in rates[name].items()} for name in LAYOUTS},
    "startup_first_token_s": startup,
    "startup_median_s": {name: med(startup[name]) for name in LAYOUTS},
    "startup_executable_load_s": load_s,
    "startup_executable_load_median_s": {name: med(load_s[name]) for name in LAYOUTS},
  }


def _ms(seconds: float | None) -> float | None:
  return None if seconds is None else seconds * 1e3


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench layers", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="model name or path (default: the default model)")
  p.add_argument("--weights", default="f32", help="weight form: f32 (default), native, int8 or int8a8")
  p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per row in the decode runs (default 64)")
  p.add_argument("--prompt-tokens", type=int, default=250, help="prompt of the prefill run (default 250)")
  p.add_argument("--repeats", type=int, default=3, help="measured rounds, layouts alternating (default 3)")
  p.add_argument("--startup-runs", type=int, default=3, help="new processes per layout (default 3; 0: none)")
  p.add_argument("--slots", type=int, default=16, help="slots of the slot-engine run (default 16; 0: skip it)")
  p.add_argument("--ring", type=int, default=512, help="ring length of the slot-engine run in tokens (default 512)")
  p.add_argument("--json", default=None, type=common.json_path, help="write the report to this JSON file")
  args = p.parse_args(argv)
  if args.repeats < 1 or args.new_tokens < 2 or args.prompt_tokens < 1 or args.startup_runs < 0:
    p.error("--repeats >= 1, --new-tokens >= 2, --prompt-tokens >= 1 and --startup-runs >= 0")
  if args.slots < 0 or (args.slots and args.ring < 32):
    p.error("--slots >= 0 and --ring >= 32")
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="thoughtjax-bench-layers-") as work:
    res = run(
      args.model,
      weights=args.weights,
      new_tokens=args.new_tokens,
      prompt_tokens=args.prompt_tokens,
      repeats=args.repeats,
      startup_runs=args.startup_runs,
      workdir=work,
      slots=args.slots,
      ring=args.ring,
    )
  med, comp = res["median"], res["compile_s"]
  rows = []
  for name in LAYOUTS:
    rows.append(
      (
        name,
        common.fmt(med[name]["batch1"], ".1f"),
        common.fmt(med[name]["batch8"], ".1f"),
        common.fmt(med[name]["prefill"], ".0f"),
        common.fmt(sum(comp[name].values()), ".2f"),
        common.fmt(res["executable_cache_bytes"][name] / 2**20, ".2f"),
        common.fmt(res["startup_median_s"][name], ".2f"),
        common.fmt(_ms(res["startup_executable_load_median_s"][name]), ".0f"),
      )
    )
  cols = ["layout", "decode b1 tok/s", "decode b8 tok/s", "prefill tok/s", "compile s", "cache MiB", "start-up s"]
  cols += ["executable load ms"]
  common.print_table(
    f"thoughtjax bench layers: {res['model']} ({args.weights}), {args.new_tokens} new tokens, prefill of "
    f"{res['prompt_tokens']} tokens, medians of {args.repeats}",
    cols,
    rows,
    right=cols[1:],
  )
  u, i = med["unrolled"], med["indexed"]
  print(
    f"indexed / unrolled: decode b1 {i['batch1'] / u['batch1']:.2f}x, b8 {i['batch8'] / u['batch8']:.2f}x, "
    f"prefill {i['prefill'] / u['prefill']:.2f}x; ran {time.perf_counter() - t0:.0f} s"
  )
  if res["slot_engine"]:
    eng = res["slot_engine"]
    step = f"step ms ({args.slots} rows)"
    columns = ["warm s", "RSS before MiB", "RSS after warm MiB", "peak RSS MiB", step, "prefill chunk ms (1 row)"]
    common.print_table(
      f"slot engine: {args.slots} slots, ring {args.ring}, greedy warm from an empty compilation cache",
      ["layout", *columns],
      [
        (
          name,
          common.fmt(e["warm_s"], ".1f"),
          common.fmt(e["rss_before_mib"], ".0f"),
          common.fmt(e["rss_after_warm_mib"], ".0f"),
          common.fmt(e["peak_rss_mib"], ".0f"),
          common.fmt(statistics.median(e["step_ms"]), ".1f"),
          common.fmt(statistics.median(e["prefill_chunk_ms"]), ".0f"),
        )
        for name, e in eng.items()
      ],
      right=columns,
    )
    ui, ii = eng["unrolled"], eng["indexed"]
    print(
      f"slot engine, indexed / unrolled: warm {ii['warm_s'] / ui['warm_s']:.2f}x, decode step "
      f"{statistics.median(ii['step_ms']) / statistics.median(ui['step_ms']):.2f}x"
    )
  if args.json:
    common.write_json(args.json, res)
  return 0

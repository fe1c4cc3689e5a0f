"""Where the start-up time of ``thoughtjax generate`` goes, phase by phase, in fresh processes.

  .venv/bin/python scripts/startup_profile.py                  # 3 fresh processes, the user's compile cache
  .venv/bin/python scripts/startup_profile.py --empty-cache    # each process with a new, empty compile cache
  .venv/bin/python scripts/startup_profile.py --exported       # + the program from a jax.export artifact
  .venv/bin/python scripts/startup_profile.py --json out.json

Each run is a new interpreter (``--child``) that does what ``thoughtjax generate --chat --max-tokens 8``
does, timing every phase to the millisecond: interpreter start, imports, JAX backend start, source
lookup, weight-cache read (config, tokenizer, mapped weights), Model construction, chat template,
then the first generation call split by JAX's own monitoring spans into tracing, lowering, compiling
(or the persistent-cache fetch) and the prefill itself, and finally the first answer byte.
``--exported`` runs the first call through :mod:`thoughtjax.exported` (a serialized program:
no tracing or lowering when the artifact is there). The table shows medians over ``--runs``.
Other processes share the machine: run it on a quiet one and print ``uptime`` beside the figures.
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

PROMPT = "What is the capital of France?"
HEAVY = ("jax", "flax", "orbax", "transformers", "torch", "grpc", "rich", "tokenizers", "gguf", "optax", "yaml")
JAX_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}


def _union(spans: list[tuple[float, float]]) -> float:
  """Seconds covered by possibly nested spans (a jitted kernel traced inside the program overlaps it)."""
  total, end = 0.0, float("-inf")
  for a, b in sorted(spans):
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def _vm_mib() -> tuple[float, float]:
  """(VmRSS, VmHWM) of this process in MiB: resident now and the peak so far (XLA's buffers included,
  which tracemalloc does not see)."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(("VmRSS:", "VmHWM:")):
        out[line.split(":")[0]] = int(line.split()[1]) / 1024
  return out.get("VmRSS", 0.0), out.get("VmHWM", 0.0)


def child(opts: argparse.Namespace) -> dict:
  """One start-up, timed: the dict of phase -> seconds (and the heavy modules imported)."""
  wall0 = time.time()
  marks: dict[str, float] = {}
  clock = time.perf_counter
  t = clock()

  rss: dict[str, tuple[float, float]] = {}

  def mark(name: str) -> None:
    nonlocal t
    now = clock()
    marks[name] = marks.get(name, 0.0) + now - t
    rss[name] = _vm_mib()
    t = now

  import thoughtjax  # noqa: F401 (the import is what is measured)

  mark("import thoughtjax")
  import jax

  from thoughtjax import loading
  from thoughtjax import model as engine
  from thoughtjax.decode import program

  mark("import engine/program")
  spans: dict[str, list] = {k: [] for k in JAX_EVENTS.values()}
  cache = {"hits": 0, "fetch_s": 0.0}

  def on_span(event, start, end, **_):
    if event in JAX_EVENTS:
      spans[JAX_EVENTS[event]].append((start, end))

  def on_duration(event, secs, **_):
    if event == "/jax/compilation_cache/cache_retrieval_time_sec":
      cache["fetch_s"] += secs

  def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      cache["hits"] += 1

  jax.monitoring.register_event_time_span_listener(on_span)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)
  jax.devices()
  try:  # as `thoughtjax generate` does (absent from older trees this script may measure)
    from thoughtjax.cli.model_commands import trim_heap_after_compiles
  except ImportError:
    pass
  else:
    trim_heap_after_compiles()
  mark("JAX backend start")
  program.configure_compilation_cache()
  from thoughtjax.fetch import DEFAULT_MODEL

  source = loading.resolve_source(opts.model or DEFAULT_MODEL)
  mark("source lookup")
  # Split the weight-cache read into its parts by timing the functions it calls.
  timed: dict[str, float] = {}

  def timing(mod, name, label):
    fn = getattr(mod, name)

    def wrapper(*a, **k):
      s = clock()
      try:
        return fn(*a, **k)
      finally:
        timed[label] = timed.get(label, 0.0) + clock() - s
        rss[f"  {label}"] = _vm_mib()

    setattr(mod, name, wrapper)

  timing(loading, "_codec_from_entry", "tokenizer load")
  timing(loading, "_params_from_entry", "weights map")
  timing(loading, "_check_entry", "cache integrity check")
  timing(loading, "build_model", "NNX module build")
  loaded = loading.load(str(source), weights=opts.weights)
  mark("load (total)")
  model = engine.Model(loaded, kernels=opts.kernels)
  if opts.path:
    from thoughtjax.path_syntax import layers_of_path

    model = model.with_path(layers_of_path(opts.path, model.config.num_layers))
  mark("Model construction")
  model.chat_template(None)
  mark("chat template rows")
  for v in spans.values():
    v.clear()
  cache.update(hits=0, fetch_s=0.0)
  if not opts.exported:  # Program loads exported programs unless the export cache is off
    os.environ["THOUGHTJAX_EXPORT_CACHE"] = "off"
  mark("exported hook")
  g = model.stream_batch([PROMPT], engine.SamplingParams(max_tokens=8), chat=True)
  mark("request preparation")
  text = ""
  for d in g:
    text += d.text
    if text:
      break
  first = clock()
  mark("first delta")
  tr = g.trace
  device = tr.first_token - tr.device_start
  out = dict(marks)
  del out["first delta"]
  for k, v in timed.items():
    out[f"  {k}"] = v
  compile_total = tr.compile_s
  out["first call: trace"] = _union(spans["trace"])
  out["first call: lower"] = _union(spans["lower"])
  out["first call: compile or cache fetch"] = _union(spans["compile"])
  out["first call: prefill + first token (device)"] = device - compile_total
  out["first call: host (detokenize, other)"] = marks["first delta"] - device
  out["cache hits"] = cache["hits"]
  out["cache fetch s"] = cache["fetch_s"]
  out["process -> first answer byte"] = (first - t0_perf) + (wall0 - opts.spawn_wall)
  out["interpreter start"] = wall0 - opts.spawn_wall
  out["heavy modules imported"] = sorted(m for m in HEAVY if m in sys.modules)
  out["text"] = text
  out["rss"] = {k: v for k, v in rss.items()}
  g.close()
  return out


t0_perf = time.perf_counter()


def _run_child(opts, cache_dir: str | None) -> dict:
  env = dict(os.environ)
  if cache_dir:
    env["THOUGHTJAX_COMPILE_CACHE"] = cache_dir
  cmd = [sys.executable, __file__, "--child"]
  for flag in ("model", "weights", "kernels", "path"):
    if getattr(opts, flag):
      cmd += [f"--{flag}", getattr(opts, flag)]
  if opts.exported:
    cmd.append("--exported")
  cmd += ["--spawn-wall", repr(time.time())]
  r = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if r.returncode != 0:
    raise RuntimeError(f"profile child failed ({r.returncode}):\n{r.stderr[-3000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default=None)
  p.add_argument("--weights", default="f32")
  p.add_argument("--kernels", default=None)
  p.add_argument("--path", default=None, help='e.g. "embed, blocks[0:12), head"')
  p.add_argument("--runs", type=int, default=3)
  p.add_argument("--empty-cache", action="store_true", help="a new empty compile cache for every run")
  p.add_argument("--exported", action="store_true", help="run the first call from a jax.export artifact")
  p.add_argument("--compare-exported", action="store_true", help="interleave runs with and without --exported")
  p.add_argument("--json", default=None)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--spawn-wall", type=float, default=None, help=argparse.SUPPRESS)
  opts = p.parse_args()
  if opts.child:
    print(json.dumps(child(opts)))
    return 0
  variants = [("plain", False), ("exported", True)] if opts.compare_exported else [("", opts.exported)]
  runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
  warm_dirs = {}
  for _, exp in variants:  # one unmeasured run per variant fills its caches
    if not opts.empty_cache:
      opts.exported = exp
      _run_child(opts, None)
  for _ in range(opts.runs):
    for name, exp in variants:
      opts.exported = exp
      if opts.empty_cache:
        with tempfile.TemporaryDirectory() as d:
          warm_dirs[name] = d
          env_export = os.environ.get("THOUGHTJAX_EXPORT_CACHE")
          os.environ["THOUGHTJAX_EXPORT_CACHE"] = os.path.join(d, "exported")
          try:
            runs[name].append(_run_child(opts, d))
          finally:
            if env_export is None:
              os.environ.pop("THOUGHTJAX_EXPORT_CACHE", None)
            else:
              os.environ["THOUGHTJAX_EXPORT_CACHE"] = env_export
      else:
        runs[name].append(_run_child(opts, None))
  load = os.getloadavg()
  keys = [k for k in runs[variants[0][0]][0] if isinstance(runs[variants[0][0]][0][k], float | int)]
  width = max(len(k) for k in keys) + 2
  header = "".join(f"{(n or 'median'):>12s}" for n, _ in variants)
  print(f"{'phase (ms, median of ' + str(opts.runs) + ')':{width}s}{header}")
  for k in keys:
    cells = []
    for name, _ in variants:
      v = statistics.median(r[k] for r in runs[name])
      cells.append(f"{v:12.0f}" if k == "cache hits" else f"{v * 1000:12.0f}")
    print(f"{k:{width}s}{''.join(cells)}")
  first = runs[variants[0][0]][0]
  print(f"\n{'memory after phase (MiB, median)':{width}s}" + "".join(f"{(n or ''):>12s}{'':>12s}" for n, _ in variants))
  print(f"{'':{width}s}" + "".join(f"{'VmRSS':>12s}{'VmHWM':>12s}" for _ in variants))
  for k in first["rss"]:
    cells = []
    for name, _ in variants:
      for j in (0, 1):
        cells.append(f"{statistics.median(r['rss'][k][j] for r in runs[name] if k in r['rss']):12.0f}")
    print(f"{k:{width}s}{''.join(cells)}")
  print(f"heavy modules imported: {', '.join(first['heavy modules imported'])}")
  print(f"answer starts: {first['text']!r}   load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({"runs": runs, "loadavg": load, "empty_cache": opts.empty_cache}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

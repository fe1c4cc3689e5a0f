"""This machine's latency model for calibration: per-layer and fixed stage costs fitted from the real program.

:func:`measure_latency` runs the real program (prefill + decode loop, as synthesis runs it) of the full path and of
the shortest candidate, at two prompt buckets and two decode lengths, ``ignore_eos`` so every step runs; per-layer
and fixed (embed + head + loop) costs are fitted by non-negative least squares to the same stage times a synthesis
trace reports, so predictions and traces compare like with like. Warm runs only: the first run of each program
(which compiles it) gives the compile cost alone. Restore cost: every unit restored as a later process restores
it, from its mapped form (bytes, ms). Compile cost: the first run of each program (layers run, ms) per prompt
bucket. :func:`planning_ms`: the synthesis overhead, planning time on a calibration.

Costs are keyed by unit shape (:func:`cost_key`: embed, head, ``blocks:<layers>``, ``bridge:<bytes>``), and a
calibration is valid for the :func:`machine_fingerprint` it was measured on.

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``,
``scipy.optimize``, ``synthesis.planner``; the functions that need them do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence

import numpy as np

from thoughtjax.decode.program import bucket
from thoughtjax.synthesis.calibrate_settings import CalibrateProgress, CalibrateReport, LatencySettings, no_progress
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.candidate import Candidate, CandidateKind, Unit
from thoughtjax.synthesis.candidates import is_bridge
from thoughtjax.synthesis.latency import LatencyModel
from thoughtjax.synthesis.latency_params import LatencyParams, LinearCost, fit_linear
from thoughtjax.thoughtlet import canonical_json, fingerprint

# The form of the latency model's fits (latency module docstring); part of the fingerprint, so latency
# measured for another form is re-measured (the default registry does so on first use).
LATENCY_MODEL = 3


# XLA flags a latency calibration holds across: the scheduler choice the command line and the server make
# (thoughtjax.use_memory_scheduler; a library user, a notebook, does not) and the host device count the tests fake
# (one device's program runs on the same cores either way). Counted, every switch between the command line and
# Python would measure the machine again (20 s and more for the default registry) and undo the other's calibration.
LATENCY_NEUTRAL_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler", "--xla_force_host_platform_device_count")


def machine_fingerprint() -> str:
  """This machine and software, as a short string: ``platform/device kind/cpus/jax version/<hash>/lm<form>``.
  The hash leaves out what latency does not depend on: :data:`LATENCY_NEUTRAL_FLAGS`, and on the CPU the number
  of host devices those flags make."""

  fp = dict(fingerprint())
  fp["xla_flags"] = " ".join(f for f in fp.get("xla_flags", "").split() if not f.startswith(LATENCY_NEUTRAL_FLAGS))
  if fp.get("platform") == "cpu":
    fp.pop("device_count", None)
  digest = hashlib.sha3_256(canonical_json(fp)).hexdigest()[:12]
  return f"{fp['platform']}/{fp['device_kind']}/{fp['cpu_count']}cpu/jax{fp['jax']}/{digest}/lm{LATENCY_MODEL}"


EMBED_KEY, HEAD_KEY = "embed", "head"


def cost_key(unit: Unit) -> str:
  """Units of equal shape share one measured cost: embed, head, ``blocks:<layers>`` and ``bridge:<bytes>``."""
  if unit.layers:
    return f"blocks:{unit.layers}"
  if is_bridge(unit.name):
    return f"bridge:{unit.nbytes}"
  return HEAD_KEY if unit.name == "head" else EMBED_KEY


def with_cost_keys(c: Candidate) -> Candidate:
  """``c`` with every unit's :func:`cost_key` set (the keys are part of the path hash)."""
  return Candidate.build(c.path, c.kind, [dataclasses.replace(u, cost_key=cost_key(u)) for u in c.units], c.draft)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
  from scipy.optimize import nnls

  return nnls(A, y)[0]


def planning_ms(cal: Calibration, reps: int) -> float:
  """Median time of one warm GetOptimalPath on ``cal`` (ms), floors that every candidate meets."""
  from thoughtjax.synthesis.planner import Floor, Planner, PlanRequest

  hints = cal.hints or ("_",)
  planner = Planner(cal, {h: Floor() for h in hints})
  model = LatencyModel(cal.latency)
  req = PlanRequest(hints[:1], 32, 32, 1e9)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    planner.plan(req, model)
    times.append((time.perf_counter() - t) * 1e3)
  return float(np.median(times))


def _run(model, prompt_tokens: int, max_tokens: int) -> dict:
  """One generation of the real program with every step run; its trace's stage times (ms)."""
  vocab = model.config.vocab_size
  rng = np.random.default_rng(prompt_tokens * 1000 + max_tokens)
  ids = [int(t) for t in rng.integers(3, vocab, prompt_tokens)]
  g = model.stream(ids, max_tokens=max_tokens, ignore_eos=True)
  for _ in g:
    pass
  t = g.trace
  return {
    "prompt_tokens": prompt_tokens,
    "max_tokens": max_tokens,
    "tokens_out": t.tokens_out[0],
    "compile_ms": t.compile_s * 1e3,
    "prefill_ms": t.prefill_s * 1e3,
    "decode_ms": t.decode_s * 1e3,
  }


def _prompt_lengths(settings: LatencySettings, max_context: int) -> list[int]:
  """The distinct prompt lengths measured: each within the context left by the longest decode."""
  cap = max_context - max(settings.max_tokens)
  return sorted({max(1, min(T, cap)) for T in settings.prompt_tokens})


def measure_latency(
  registry,
  candidates: Sequence[Candidate],
  settings: LatencySettings = LatencySettings(),
  *,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
) -> LatencyParams:
  """Fitted :class:`LatencyParams` of this machine for ``candidates`` (see the module docstring)."""
  from thoughtjax.compose import compose

  progress = progress or no_progress
  units = {u.ref: u for c in candidates for u in c.units}
  by_layers = sorted(candidates, key=lambda c: (sum(u.layers for u in c.units), c.path_hash))
  full = next(c for c in candidates if c.kind is CandidateKind.FULL)
  timed = [full] + (
    [by_layers[0]] if sum(u.layers for u in by_layers[0].units) < sum(u.layers for u in full.units) else []
  )
  total = len(units) + len(timed) * len(settings.prompt_tokens) * (1 + len(settings.max_tokens) * settings.reps)
  done = 0

  # Restore: every unit as a later process restores it (evicted first), bytes against ms. A unit's first verified
  # restore keeps its mapped form (registry docs, "Restores"), which later processes map instead of reading the
  # checkpoint: that first restore is not the one timed.
  registry.evict_all()
  restore_pts = []
  for ref, u in units.items():
    registry.restore(u.name, u.version)
    registry.evict_all()
    t = time.perf_counter()
    registry.restore(u.name, u.version)
    restore_pts.append((float(u.nbytes), (time.perf_counter() - t) * 1e3))
    registry.evict_all()
    done += 1
    progress("latency", done, total, f"restore {ref}")

  rows, compile_pts = [], {}

  for c in timed:
    layers = sum(u.layers for u in c.units)
    model = compose(", ".join(u.ref for u in c.units), registry, kernels=kernels)
    prompts = _prompt_lengths(settings, model.config.max_context)
    # Fewer runs when the context clamps prompt lengths together.
    total -= (len(settings.prompt_tokens) - len(prompts)) * (1 + len(settings.max_tokens) * settings.reps)
    for T in prompts:
      # The first run of a program key compiles it; later runs are the warm measurements.
      first = _run(model, T, max(settings.max_tokens))
      compile_pts.setdefault(bucket(T), []).append((float(layers), first["compile_ms"]))
      done += 1
      progress("latency", done, total, f"compile {c.path} T={T}")
      for n in settings.max_tokens:
        for _ in range(settings.reps):
          r = _run(model, T, n)
          r["layers"] = layers
          rows.append(r)
          done += 1
          progress("latency", done, total, f"run {c.path} T={T} n={n}")
    del model
  if report is not None:
    report.latency_runs = rows

  # The shapes the program runs (latency module docstring): the prompt padded to P = bucket(T), n - 1
  # decode steps each over the whole cache of S = bucket(T) + bucket(max_tokens) slots.
  # prefill = (P0 + L Pl) + (Q0 + L Ql) P;  decode = (n - 1) ((A0 + L Al) + (B0 + L Bl) S).
  L = np.array([r["layers"] for r in rows], float)
  T = np.array([bucket(r["prompt_tokens"]) for r in rows], float)
  S = T + np.array([bucket(r["max_tokens"]) for r in rows], float)
  n = np.maximum(np.array([r["tokens_out"] for r in rows], float) - 1, 0)
  ctx = n * S
  prefill_ms = np.array([r["prefill_ms"] for r in rows])
  decode_ms = np.array([r["decode_ms"] for r in rows])

  def per_layer_only():  # every cost per layer (the fixed part spread over the layers)
    p, d = _nnls(np.stack([L, L * T], 1), prefill_ms), _nnls(np.stack([n * L, ctx * L], 1), decode_ms)
    return (0.0, 0.0, p[0], p[1]), (0.0, 0.0, d[0], d[1])

  if len(set(L.tolist())) < 2:  # one depth measured: fixed and per-layer costs cannot be told apart
    (P0, Q0, Pl, Ql), (A0, B0, Al, Bl) = per_layer_only()
  else:
    P0, Q0, Pl, Ql = _nnls(np.stack([np.ones_like(L), T, L, L * T], 1), prefill_ms)
    A0, B0, Al, Bl = _nnls(np.stack([n, ctx, n * L, ctx * L], 1), decode_ms)
    # On a noisy machine the depth difference can drown: a fit with no per-layer cost at all would
    # predict every path equally fast. Then spread the cost over the layers; traces correct the rest.
    if Pl + Ql == 0 or Al + Bl == 0:
      (P0, Q0, Pl, Ql), (A0, B0, Al, Bl) = per_layer_only()
  prefill = {EMBED_KEY: LinearCost(0.0), HEAD_KEY: LinearCost(float(P0), float(Q0))}
  decode = {EMBED_KEY: LinearCost(0.0), HEAD_KEY: LinearCost(float(A0), float(B0))}
  for k in sorted({u.layers for u in units.values() if u.layers}):
    prefill[f"blocks:{k}"] = LinearCost(float(k * Pl), float(k * Ql))
    decode[f"blocks:{k}"] = LinearCost(float(k * Al), float(k * Bl))
  # A bridge (a position-wise adapter) is too small to time apart from its path: it costs the per-layer
  # cost scaled by the weights it reads per token against a layer's. It attends to nothing: no cache term.
  blocks = [u for u in units.values() if u.layers]
  layer_bytes = sum(u.nbytes for u in blocks) / max(1, sum(u.layers for u in blocks))
  for u in units.values():
    if is_bridge(u.name):
      frac = u.nbytes / layer_bytes if layer_bytes else 0.0
      prefill[cost_key(u)] = LinearCost(float(frac * Pl), float(frac * Ql))
      decode[cost_key(u)] = LinearCost(float(frac * Al), 0.0)

  return LatencyParams(
    prefill=prefill,
    decode=decode,
    restore=fit_linear(restore_pts, "restore"),
    compile={b: fit_linear(pts, f"compile[{b}]") for b, pts in compile_pts.items()},
  )

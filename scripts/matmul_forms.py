"""Measure the weight forms' matmuls on XLA:CPU: one matmul per shape and a whole decode step.

    .venv/bin/python scripts/matmul_forms.py                       # every section, default model shapes
    .venv/bin/python scripts/matmul_forms.py --sections split,a8   # matmuls only (no model load)
    .venv/bin/python scripts/matmul_forms.py --sections step --batches 1,8 --repeats 7 --json out.json

Sections (every comparison runs its forms interleaved in this one process; figures are medians, and the
load average is printed beside them because the machine is shared):

* ``split`` (M = 1): each decode-shaped matmul as one dot against the same dot split over W's output rows
  into ``--parts`` independent dots (concatenated). Also prints what XLA:CPU made of the dot: the fusion
  and its ``outer_dimension_partitions`` (XLA's own split of a loop fusion into parallel tasks), and
  the process CPU time per wall time (about 2 when both cores work, 1 when one does).
* ``a8`` (M = 1, 8, 250): float32 weights (one GEMM), int8 weights (convert inside the dot) and int8a8
  (activations quantized per row, s8 x s8 -> s32 dot), with the HLO op that carries the dot.
* ``step``: a decode step of the default model (profile_step's program: prompt 8, 64 new tokens) per form
  and batch; at batch 1 each packed form also as it was before ``quantized.computed_once`` (``x fused``:
  the dot's operand recomputed inside its fusion) and, with ``--step-split``, with the split matmul.

Shapes are the default model's (SmolLM2-135M): q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536,
the tied head 49152x576; the block weights are Q4_1 and the head Q8_0, as in its GGUF.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax import quantized

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536), "head": (49152, 576)}


def _blocks(w: np.ndarray, kind: str) -> quantized.BlockQuant:
  import gguf

  return quantized.from_gguf_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]), kind)


def weights_for(name: str, rng) -> dict:
  """Every form of one random matrix of the default model's shape ``name`` (on the device)."""
  rows, cols = SHAPES[name]
  w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
  native = _blocks(w, "Q8_0" if name == "head" else "Q4_1")
  i8 = quantized.quantize_int8(w)
  return {
    "f32": jnp.asarray(quantized.dequantize(native)),
    "native": quantized.to_device(native),
    "int8": quantized.to_device(i8),
    "int8a8": quantized.to_device(quantized.int8_activations(i8)),
  }


def f32_matmul(x, w):
  """The engine's float32 form: x [..., I] @ W [O, I].T."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=quantized.EXACT)


def split_matmul(x, w, parts: int = 2, matmul=None):
  """quantized.matmul with W's output rows split into ``parts`` independent dots, concatenated."""
  matmul = matmul or quantized.matmul
  step = -(-w.shape[0] // parts)
  return jnp.concatenate([matmul(x, w.map(lambda a, i=i: a[i : i + step])) for i in range(0, w.shape[0], step)], -1)


def timed(fns: dict, args: dict, repeats: int, inner: int) -> dict:
  """{name: (median ms per call, median process-CPU ms per call)}; the fns run interleaved."""
  for name, f in fns.items():
    jax.block_until_ready(f(*args[name]))
  wall, cpu = {n: [] for n in fns}, {n: [] for n in fns}
  for _ in range(repeats):
    for name, f in fns.items():
      c, t = time.process_time(), time.perf_counter()
      for _ in range(inner):
        out = f(*args[name])
      jax.block_until_ready(out)
      wall[name].append((time.perf_counter() - t) * 1e3 / inner)
      cpu[name].append((time.process_time() - c) * 1e3 / inner)
  return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in fns}


def dot_ops(f, *args) -> list[str]:
  """The compiled entry's instructions that carry the dot: 'kind dtype[shape] partitions=...'."""
  hlo = jax.jit(f).lower(*args).compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  entry = entry[: entry.index("\n}")]
  out = []
  for line in entry.splitlines():
    m = re.search(r"= (\S+) (fusion|dot|custom-call)\(", line)
    if not m or "dot_general" not in line:
      continue
    ynn = "__ynn_fusion" in line or "__xnn_fusion" in line
    kind = "ynn/xnn fusion" if ynn else re.search(r"kind=(\w+)", line).group(1) if "kind=" in line else m.group(2)
    parts = re.search(r'"outer_dimension_partitions":\[([^\]]*)\]', line)
    out.append(f"{kind} {m.group(1).split('{')[0]} partitions=[{parts.group(1) if parts else ''}]")
  return out


def section_split(args, rng) -> list[dict]:
  rows = []
  for name in SHAPES:
    ws = weights_for(name, rng)
    x = jnp.asarray(rng.standard_normal((1, 1, SHAPES[name][1])).astype(np.float32))
    fns, fargs = {}, {}
    for form in ("native", "int8"):
      fns[form] = jax.jit(quantized.matmul)
      fns[f"{form} split{args.parts}"] = jax.jit(lambda x, w: split_matmul(x, w, args.parts))
      fargs[form] = fargs[f"{form} split{args.parts}"] = (x, ws[form])
    fns["f32"], fargs["f32"] = jax.jit(f32_matmul), (x, ws["f32"])
    res = timed(fns, fargs, args.repeats, 20 if name != "head" else 3)
    for form, (ms, cpu) in res.items():
      base = form.split()[0]
      fn = f32_matmul if base == "f32" else quantized.matmul if form == base else split_matmul
      row = dict(shape=name, form=form, ms=ms, cpu_per_wall=cpu / ms, hlo=dot_ops(fn, *fargs[form]))
      rows.append(row)
      print(f"split  {name:8s} {form:14s} {ms:8.3f} ms  cpu/wall {cpu / ms:4.2f}  {'; '.join(row['hlo'])}", flush=True)
  return rows


def section_a8(args, rng) -> list[dict]:
  rows = []
  for name in SHAPES:
    ws = weights_for(name, rng)
    for m in args.rows:
      x = jnp.asarray(rng.standard_normal((1, m, SHAPES[name][1])).astype(np.float32))
      fns = {"f32": jax.jit(f32_matmul), "int8": jax.jit(quantized.matmul), "int8a8": jax.jit(quantized.matmul)}
      fargs = {k: (x, ws[k]) for k in fns}
      inner = max(1, int(20 / max(1, m / 8) / (30 if name == "head" else 1)))
      res = timed(fns, fargs, args.repeats, inner)
      for form, (ms, cpu) in res.items():
        hlo = dot_ops(f32_matmul if form == "f32" else quantized.matmul, *fargs[form])
        rows.append(dict(shape=name, M=m, form=form, ms=ms, cpu_per_wall=cpu / ms, hlo=hlo))
      print(
        f"a8     {name:8s} M={m:<4d} "
        + "  ".join(f"{f} {ms:8.3f} ms" for f, (ms, _) in res.items())
        + f"   int8a8 dot: {'; '.join(rows[-1]['hlo'])}",
        flush=True,
      )
  return rows


@contextlib.contextmanager
def _split_matmuls(parts: int):
  """Trace programs with every packed matmul split over ``parts`` dots (model.py looks quantized.matmul up
  at call time)."""
  saved = quantized.matmul
  quantized.matmul = lambda x, w: split_matmul(x, w, parts, saved)
  try:
    yield
  finally:
    quantized.matmul = saved


@contextlib.contextmanager
def _x_fused():
  """Trace programs as before ``quantized.computed_once``: a one-row dot's operand fused into it."""
  saved = quantized.computed_once
  quantized.computed_once = lambda x: x
  try:
    yield
  finally:
    quantized.computed_once = saved


def build_step(engine, batch: int, prompt: int = 8, new: int = 64):
  """profile_step's decode program of ``engine``'s path; returns a function timing one chunk:
  (wall ms per step, process CPU ms per step). CPU time is less disturbed by other processes' load."""
  from thoughtjax.decode import program as program_lib
  from thoughtjax.sampling import SamplingMode, SamplingParams, sampling_arrays

  T = program_lib.bucket(prompt)
  key = program_lib.ProgramKey(engine.layers, batch, T, new, 4, SamplingMode.GREEDY, False, kernels=engine.kernels)
  prog = program_lib.Program(key, engine._defs, engine.config)
  samp = sampling_arrays(
    [SamplingParams(max_tokens=new, ignore_eos=True)] * batch, batch, engine.config.vocab_size, 4, None, False
  )
  tokens = jnp.zeros((batch, T), jnp.int32)
  pad = jnp.full((batch,), T - prompt, jnp.int32)
  compiled = prog._advance.trace(engine.parts, tokens, pad, samp, jax.eval_shape(prog._init_impl)).lower().compile()

  def chunk() -> tuple[float, float]:
    state = prog.init_state(engine.parts)
    state = state._replace(cursor=jnp.int32(T), start=pad, token=jnp.ones((batch,), jnp.int32))  # as after a prefill
    state = jax.block_until_ready(compiled(engine.parts, tokens, pad, samp, state))  # first chunk: warm
    before = int(state.cursor)  # the state is donated to the next call
    c, t = time.process_time(), time.perf_counter()
    after = jax.block_until_ready(compiled(engine.parts, tokens, pad, samp, state))
    wall, cpu = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
    steps = int(after.cursor) - before
    return wall / steps, cpu / steps

  return chunk


def section_step(args) -> list[dict]:
  import thoughtjax

  engines = {w: thoughtjax.load(args.model, weights=w) for w in ("native", "f32", "int8")}
  i8 = engines["int8"]
  engines["int8a8"] = i8.with_path(i8.layers, parts=quantized.int8_activations(i8.parts))
  rows = []
  for batch in args.batches:
    runs = {}
    for form, eng in engines.items():
      runs[form] = build_step(eng, batch)
      if form != "f32" and batch == 1:
        with _x_fused():
          runs[f"{form} x fused"] = build_step(eng, batch)
        if args.step_split and form in ("native", "int8"):
          with _split_matmuls(args.parts):
            runs[f"{form} split{args.parts}"] = build_step(eng, batch)
    times = {f: [] for f in runs}
    for _ in range(args.repeats):
      for f, chunk in runs.items():
        times[f].append(chunk())
    for f, ts in times.items():
      wall, cpu = [t[0] for t in ts], [t[1] for t in ts]
      row = dict(
        batch=batch,
        form=f,
        ms_per_step=statistics.median(wall),
        min_ms_per_step=min(wall),
        cpu_ms_per_step=statistics.median(cpu),
        runs=wall,
      )
      rows.append(row)
      print(
        f"step   B={batch:<2d} {f:16s} median {row['ms_per_step']:7.2f}  min {row['min_ms_per_step']:7.2f} ms/step  "
        f"CPU {row['cpu_ms_per_step']:7.2f} ms/step  (runs {', '.join(f'{t:.1f}' for t in wall)})",
        flush=True,
      )
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sections", default="split,a8,step", help="comma-separated: split, a8, step")
  ap.add_argument("--parts", type=int, default=2, help="dots per matmul in the split form")
  ap.add_argument("--rows", default="1,8,250", help="activation rows M for the a8 section")
  ap.add_argument("--batches", default="1,8", help="decode batches for the step section")
  ap.add_argument("--model", default=None, help="model for the step section (default: the default model)")
  ap.add_argument("--step-split", action="store_true", help="step section: also the split matmul (native, int8)")
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  args.rows = [int(m) for m in args.rows.split(",")]
  args.batches = [int(b) for b in args.batches.split(",")]
  rng = np.random.default_rng(0)
  sections = args.sections.split(",")
  out = {"load_average_start": os.getloadavg(), "jax": jax.__version__, "cpu_count": os.cpu_count()}
  if "split" in sections:
    out["split"] = section_split(args, rng)
  if "a8" in sections:
    out["a8"] = section_a8(args, rng)
  if "step" in sections:
    out["step"] = section_step(args)
  out["load_average_end"] = os.getloadavg()
  print(
    f"load average {out['load_average_start'][0]:.2f} at start, {out['load_average_end'][0]:.2f} at end; jax {jax.__version__}"
  )
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()

"""Where a decode step's time goes: a profiler trace of greedy decoding, summed per kind of operation.

    .venv/bin/python scripts/step_breakdown.py                          # default model, default load, batch 1
    .venv/bin/python scripts/step_breakdown.py --weights native --batch 8 --json out.json

The script compiles the model's generation program in this process (compilation and export caches off, the
optimized HLO dumped to a temporary folder), times ``--repeats`` greedy runs of ``--tokens`` tokens without the
profiler (the step's wall time: first token to last, per step), then runs once more under ``jax.profiler`` and
adds up XLA:CPU's per-operation events of the decode steps. Each event's HLO instruction says what it is:

* ``matmul  <width>``   a dot of a layer's weights, by output width (q/o/down, k/v, gate/up at the default model)
* ``head``              the dot over the vocabulary, ``sampler`` the reduction that picks the token from it
* ``attention``         the score and value contractions over the KV cache
* ``cache write``, ``slices``  dynamic-update-slices into the caches, dynamic slices (stacked weights, caches)
* ``elementwise``       every other fusion: norms, RoPE, residual adds, the activation, the loop's bookkeeping
* ``executor``          the step's wall time that no operation accounts for: dispatch between operations and the
                        loops' control flow

The profiler adds a little to every event, so the categories are shares of the profiled step; the table also
gives the unprofiled step for scale.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\(")


def instructions(hlo_dir: str) -> dict[str, tuple[str, str, str]]:
  """name -> (shape, opcode, op_name metadata) of every instruction in the dump's optimized modules."""
  table = {}
  for path in glob.glob(os.path.join(hlo_dir, "*after_optimizations.txt")):
    with open(path) as f:
      for line in f:
        m = _INSTRUCTION.match(line)
        if m:
          op = re.search(r'op_name="([^"]*)"', line)
          table.setdefault(m.group(1), (m.group(2), m.group(3), op.group(1) if op else ""))
  return table


def category(name: str, info: tuple[str, str, str] | None, vocab: int, widths: set[int]) -> str | None:
  """The kind of operation an event is (module docstring), or None for an event that is not one operation.

  ``widths``: the output widths of the layers' matmuls; a library (YNNPACK) fusion with a [rows, width] output is
  one of them, any other is one of attention's contractions."""
  if name.startswith(("while", "conditional", "call", "ThunkExecutor", "$", "PjitFunction")) or info is None:
    return None
  shape, opcode, op_name = info
  dims = [int(d) for d in shape.split("[")[1].split("]")[0].split(",") if d] if "[" in shape else []
  if "ynn_fusion" in name and dims and dims[-1] == vocab:
    return "head"
  if "ynn_fusion" in name:
    return f"matmul {dims[-1]}" if len(dims) == 2 and dims[-1] in widths else "attention"
  if opcode == "dot" or op_name.endswith("dot_general"):
    return "head" if dims and dims[-1] == vocab else f"matmul {dims[-1] if dims else 1}"
  if op_name.endswith(("reduce", "argmax", "reduce_max")) and "while/body/while" not in op_name:
    return "sampler"
  if "dynamic-update-slice" in name:
    return "cache write"
  if "dynamic-slice" in name:
    return "slices"
  return "elementwise"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--weights", default="f32", choices=("f32", "native", "int8", "int8a8"))
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--prompt", type=int, default=250, help="prompt tokens")
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)

  work = tempfile.mkdtemp(prefix="thoughtjax-profile-")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={work}/hlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
  )
  os.environ["THOUGHTJAX_COMPILE_CACHE"] = os.path.join(work, "xla")  # empty: this process compiles
  os.environ["THOUGHTJAX_EXPORT_CACHE"] = "off"

  import jax

  import thoughtjax
  from thoughtjax.sampling import SamplingParams

  model = thoughtjax.load(weights=args.weights)
  cfg = model.config
  vocab, widths = (
    cfg.vocab_size,
    {cfg.d_model, cfg.ffn_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim},
  )
  prompts = [list(range(1000, 1000 + args.prompt))] * args.batch  # token ids: exactly --prompt tokens
  params = [SamplingParams(max_tokens=args.tokens, ignore_eos=True)] * args.batch
  model.generate_batch(prompts, params)  # compiles
  step_ms, prefill_ms = [], []
  for _ in range(args.repeats):
    trace = model.stream_batch(prompts, params).completions()[0].trace
    step_ms.append((trace.end - trace.first_token) * 1e3 / (args.tokens - 1))
    prefill_ms.append((trace.first_token - trace.device_start) * 1e3)
  jax.profiler.start_trace(os.path.join(work, "trace"), create_perfetto_trace=True)
  trace = model.stream_batch(prompts, params).completions()[0].trace
  jax.profiler.stop_trace()
  profiled = {"prefill": (trace.first_token - trace.device_start) * 1e3, "step": (trace.end - trace.first_token) * 1e3}

  table = instructions(os.path.join(work, "hlo"))
  (trace_file,) = glob.glob(os.path.join(work, "trace", "**", "perfetto_trace.json.gz"), recursive=True)
  events = json.load(gzip.open(trace_file))
  events = events["traceEvents"] if isinstance(events, dict) else events
  ops = sorted(
    (
      (e["ts"], e["dur"] / 1e3, category(e["name"], table.get(e["name"]), vocab, widths))
      for e in events
      if e.get("ph") == "X"
    ),
    key=lambda e: e[0],
  )
  ops = [(ms, kind) for _, ms, kind in ops if kind is not None]
  heads = [i for i, (_, kind) in enumerate(ops) if kind == "head"]
  steps = len(heads) - 1  # the first head ends the prefill; each later one ends a decode step
  report = {
    "weights": args.weights,
    "batch": args.batch,
    "prompt_tokens": args.prompt,
    "step_ms": statistics.median(step_ms),
    "prefill_ms": statistics.median(prefill_ms),
    "steps": steps,
    "loadavg": os.getloadavg(),
  }
  for phase, part, count in (("prefill", ops[: heads[0] + 2], 1), ("step", ops[heads[0] + 2 :], steps)):
    totals: dict[str, float] = collections.Counter()
    for ms, kind in part:  # the prefill's part ends with its sampler, right after its head
      totals[kind] += ms / count
    wall = profiled[phase] / (1 if phase == "prefill" else args.tokens - 1)
    totals["executor"] = max(wall - sum(totals.values()), 0.0)
    report[f"profiled_{phase}_ms"] = wall
    report[f"ms_per_{phase}"] = dict(totals)
  print(
    f"{args.weights} weights, batch {args.batch}, {args.prompt}-token prompt: prefill {report['prefill_ms']:.1f} ms, "
    f"step {report['step_ms']:.2f} ms unprofiled (medians of {args.repeats}); load average {os.getloadavg()[0]:.2f}"
  )
  for phase in ("prefill", "step"):
    wall = report[f"profiled_{phase}_ms"]
    print(f"\n{phase} ({wall:.2f} ms profiled{f', {steps} steps' if phase == 'step' else ''})")
    print(f"{'operation':<16}{'ms':>10}{'share':>9}")
    for kind, ms in sorted(report[f"ms_per_{phase}"].items(), key=lambda kv: -kv[1]):
      print(f"{kind:<16}{ms:>10.3f}{ms / wall:>9.1%}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())

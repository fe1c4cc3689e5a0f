"""``thoughtjax bench kernels``: XLA reference vs Pallas kernel vs a CUDA C kernel.

For each op and shape it times every implementation that can run here, side by
side in one run, and reports the median time per call, the bandwidth achieved
(unique bytes the op must move / time) against the device's peak, and whether
the outputs agree with the XLA reference.

- GPU: XLA reference, native Pallas (Triton) kernel, and CUDA C kernels compiled
  at run time with CuPy's ``RawKernel`` when ``cupy`` is importable (skipped with
  the reason otherwise). Peak bandwidth comes from a datasheet table by device
  name; a measured copy bandwidth is reported beside it.
- CPU: the XLA reference and a measured copy bandwidth. Pallas only runs
  interpreted on CPU (an XLA loop over the grid, not a kernel), so it is timed on
  the B = 1 shapes only and labelled ``pallas (interpret)``.

``sample_stop`` also runs under an allowed-token mask (constrained decoding's bitmask, a
random ``mask=P%`` of the vocabulary allowed) at B = 1 and 8, in rows beside the unmasked ones
of the same shape; the CUDA C kernel takes no mask and is skipped there.

Times are hot-cache throughput: ``inner`` back-to-back calls on the same inputs,
then one sync, divided by ``inner``; the median over ``--repeats`` such rounds.
Small cases can therefore run from the GPU's L2 and exceed HBM bandwidth.

Usage: ``thoughtjax bench kernels [--json PATH] [--repeats N] [--quick]``
(or ``python -m thoughtjax.bench.kernels``). The CUDA C kernels are the ``.cu`` files in ``cuda/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.bench import common
from thoughtjax.kernels.sample_stop import pack_allowed, prepare_inputs, sample_stop
from thoughtjax.kernels.template_embed import template_embed

BATCHES = (1, 8, 64)
VOCAB = 49152
DIMS = (576, 4096)
# A chat template's fixed parts: system + user header before, assistant header after.
PREFIX_LEN, SUFFIX_LEN, MAX_USER, TOTAL_LEN = 24, 5, 200, 256
NUM_STOP, TOP_K = 4, 50
# Allowed-token masks: the batches and the fractions of the vocabulary allowed (a JSON value's
# next token is often one of a few structural tokens; free text inside a string allows about half).
MASK_BATCHES = (1, 8)
MASK_FRACTIONS = (0.05, 0.5)

# Datasheet HBM bandwidth, GB/s, matched as substrings of jax's device_kind in
# this order (GH200 before H200, H100 variants before H100).
PEAK_GBPS = (
  ("GH200", 4000.0),
  ("H200", 4800.0),
  ("H100 NVL", 3900.0),
  ("H100 PCIe", 2000.0),
  ("H100", 3350.0),
  ("A100-SXM4-80GB", 2039.0),
  ("A100 80GB PCIe", 1935.0),
  ("A100", 1555.0),
  ("L40S", 864.0),
  ("L4", 300.0),
  ("A10", 600.0),
  ("V100", 900.0),
  ("RTX 4090", 1008.0),
)


@dataclasses.dataclass
class Result:
  """One (op, shape, implementation) row of the report."""

  op: str
  shape: str
  implementation: str
  median_ms: float | None = None
  min_ms: float | None = None
  bytes: int = 0
  gbps: float | None = None
  fraction_of_peak: float | None = None
  agrees_with_reference: bool | None = None
  note: str = ""


@dataclasses.dataclass
class Case:
  """One op at one shape: its inputs, byte count and implementations."""

  op: str
  shape: str
  bytes: int
  args: tuple
  implementations: dict[str, Callable[..., Any]]
  compare: Callable[[Any, Any], bool]
  cuda: Callable[[], tuple[Callable, Callable]]  # -> (run, fetch); built on GPU only


# ------------------------------------------------------------------------------ timing
time_calls = common.time_calls


def copy_bandwidth_gbps(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
  """Measured read+write bandwidth of ``x + 1`` in place on the default device (see ``common``)."""
  return common.copy_bandwidth_gbps(num_bytes, repeats, on="device")


def table_peak_gbps(device_kind: str) -> float | None:
  for name, gbps in PEAK_GBPS:
    if name.lower() in device_kind.lower():
      return gbps
  return None


# ------------------------------------------------------------------------------- cases
def sample_stop_case(
  num_rows: int, vocab: int, *, top_k: int, with_bias: bool, allowed_fraction: float | None = None
) -> Case:
  """One sample_stop shape; ``allowed_fraction`` adds a random allowed-token mask with that share allowed."""
  keys = jax.random.split(jax.random.key(num_rows * 7 + top_k), 3)
  logits = jax.random.normal(keys[0], (num_rows, vocab), jnp.float32) * 3
  bias = jax.random.normal(keys[1], (num_rows, vocab), jnp.float32) if with_bias else None
  temperature = jnp.full((num_rows,), 0.8, jnp.float32)
  top_k_arr = jnp.full((num_rows,), top_k, jnp.int32)
  seed = jnp.arange(num_rows, dtype=jnp.uint32) * jnp.uint32(2654435761)
  stop_ids = jax.random.randint(keys[2], (num_rows, NUM_STOP), 0, vocab, jnp.int32)
  args = (logits, temperature, top_k_arr, seed, 3, stop_ids, bias)
  allowed_bytes = 0
  if allowed_fraction is not None:
    mask_rng = np.random.default_rng(num_rows * 7 + top_k + int(allowed_fraction * 1000))
    allowed = jnp.asarray(pack_allowed(mask_rng.random((num_rows, vocab)) < allowed_fraction))
    args += (allowed,)  # unmasked cases keep their 7 arguments and their program
    allowed_bytes = allowed.nbytes

  def make(implementation):
    def run(logits, temperature, top_k, seed, step, stop_ids, bias, allowed=None):
      return sample_stop(
        logits,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        step=step,
        stop_ids=stop_ids,
        logit_bias=bias,
        allowed=allowed,
        implementation=implementation,
      )

    return jax.jit(run)

  num_bytes = (
    logits.nbytes
    + (bias.nbytes if with_bias else 0)
    + allowed_bytes
    + stop_ids.nbytes
    + 4 * 4 * num_rows
    + 8 * num_rows
  )
  label = f"B={num_rows} V={vocab} " + (f"top_k={top_k}" if top_k else "no top-k") + (" +bias" if with_bias else "")
  if allowed_fraction is not None:
    label += f" mask={allowed_fraction:.0%}"
  compare = lambda a, b: bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
  return Case(
    "sample_stop",
    label,
    num_bytes,
    args,
    {"xla": make("xla"), "pallas": make("pallas")},
    compare,
    cuda=functools.partial(_cuda_sample_stop, args),
  )


def template_embed_case(num_rows: int, vocab: int, dim: int) -> Case:
  dtype = jnp.float32 if dim <= 1024 else jnp.bfloat16  # SmolLM2 f32, 4096-wide models bf16
  keys = jax.random.split(jax.random.key(dim + num_rows), 5)
  prefix = jax.random.normal(keys[0], (PREFIX_LEN, dim), dtype)
  suffix = jax.random.normal(keys[1], (SUFFIX_LEN, dim), dtype)
  table = jax.random.normal(keys[2], (vocab, dim), dtype)
  ids = jax.random.randint(keys[3], (num_rows, MAX_USER), 0, vocab, jnp.int32)
  lengths = jax.random.randint(keys[4], (num_rows,), MAX_USER // 2, MAX_USER + 1, jnp.int32)
  args = (prefix, suffix, table, ids, lengths)

  def make(implementation):
    return jax.jit(functools.partial(template_embed, total_len=TOTAL_LEN, left_pad=True, implementation=implementation))

  itemsize = jnp.dtype(dtype).itemsize
  rows_read = int(np.sum(np.asarray(lengths))) + num_rows * (PREFIX_LEN + SUFFIX_LEN)
  num_bytes = (rows_read * dim + num_rows * TOTAL_LEN * dim) * itemsize + ids.nbytes
  label = f"B={num_rows} T={TOTAL_LEN} D={dim} {jnp.dtype(dtype).name}"
  compare = lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b)))
  return Case(
    "template_embed",
    label,
    num_bytes,
    args,
    {"xla": make("xla"), "pallas": make("pallas")},
    compare,
    cuda=functools.partial(_cuda_template_embed, args),
  )


def build_cases(quick: bool) -> list[Case]:
  batches, vocab, dims = ((1, 8), 4096, (64,)) if quick else (BATCHES, VOCAB, DIMS)
  cases = []
  for num_rows in batches:
    for top_k, with_bias in ((0, False), (TOP_K, True)):
      cases.append(sample_stop_case(num_rows, vocab, top_k=top_k, with_bias=with_bias))
      if num_rows in MASK_BATCHES:  # the masked rows right after the unmasked one of their shape
        for fraction in MASK_FRACTIONS:
          cases.append(sample_stop_case(num_rows, vocab, top_k=top_k, with_bias=with_bias, allowed_fraction=fraction))
  for dim in dims:
    for num_rows in batches:
      cases.append(template_embed_case(num_rows, vocab, dim))
  return cases


# -------------------------------------------------------------------------- CUDA C
# The CUDA C comparators live beside this file as .cu sources (package data): the same contracts
# and the same hash as the Pallas kernels.
CUDA_DIR = Path(__file__).resolve().parent / "cuda"
CUDA_FILES = ("sample_stop.cu", "template_embed.cu")
_INCLUDE = re.compile(r'^#include "([^"]+)"\n', re.MULTILINE)


def cuda_source(name: str) -> str:
  """The text of ``CUDA_DIR / name`` with its local ``#include "..."`` files inlined.

  Inlined rather than passed as an include path so that the source handed to the compiler is
  the whole program: CuPy's kernel cache is keyed by that text, and a changed header must miss it.
  """
  text = (CUDA_DIR / name).read_text().replace("#pragma once\n", "")
  return _INCLUDE.sub(lambda m: cuda_source(m.group(1)), text)


# Both kernels in one translation unit, as CuPy compiles them.
CUDA_SOURCE = "".join(cuda_source(f) for f in CUDA_FILES)


@functools.cache
def _cuda_module():
  import cupy  # the caller checked it imports

  return cupy.RawModule(code=CUDA_SOURCE, options=("--std=c++14",))


def _cuda_sample_stop(args):
  """(run, fetch) for the CUDA C sample_stop on a case's inputs (zero-copy via DLPack):
  ``run()`` launches and returns device outputs, ``fetch`` brings them to the host."""
  p = prepare_inputs(*args)  # the canonical inputs the Pallas kernel gets too
  if p.allowed is not None:
    raise NotImplementedError("the CUDA C sample_stop takes no allowed-token mask")

  import cupy

  num_rows, vocab = p.logits.shape
  if p.logits.dtype != jnp.float32:
    raise NotImplementedError("the CUDA C sample_stop takes float32 logits")
  bias = p.logit_bias
  dev = {
    name: cupy.from_dlpack(jax.block_until_ready(a))
    for name, a in dict(
      logits=p.logits,
      bias=bias if bias is not None else p.logits,
      inv_t=p.inv_temperature,
      greedy=p.greedy,
      top_k=p.top_k,
      seed=p.seed,
      stop_ids=p.stop_ids,
    ).items()
  }
  step, num_stop = int(p.step[0]), p.stop_ids.shape[1]
  kernel = _cuda_module().get_function("sample_stop_f32")
  tokens = cupy.empty((num_rows,), cupy.int32)
  stop = cupy.empty((num_rows,), cupy.int32)

  def run():
    kernel(
      (num_rows,),
      (256,),
      (
        dev["logits"],
        dev["bias"],
        np.int32(bias is not None),
        dev["inv_t"],
        dev["greedy"],
        dev["top_k"],
        dev["seed"],
        np.int32(step),
        dev["stop_ids"],
        np.int32(num_stop),
        np.int32(vocab),
        tokens,
        stop,
      ),
    )
    return tokens, stop

  def fetch(out):
    return cupy.asnumpy(out[0]), cupy.asnumpy(out[1]) != 0

  return run, fetch


def _cuda_template_embed(args):
  """(run, fetch) for the CUDA C template_embed, like ``_cuda_sample_stop``."""
  import cupy

  prefix, suffix, table, ids, lengths = args
  num_rows, max_user = ids.shape
  vocab, dim = table.shape
  itemsize = jnp.dtype(table.dtype).itemsize
  as_raw = lambda a: cupy.from_dlpack(
    jax.block_until_ready(jax.lax.bitcast_convert_type(a, {4: jnp.float32, 2: jnp.uint16}[itemsize]))
  )
  dev = [as_raw(prefix), as_raw(suffix), as_raw(table)]
  ids_dev, lengths_dev = cupy.from_dlpack(ids), cupy.from_dlpack(lengths)
  out = cupy.empty((num_rows, TOTAL_LEN, dim), {4: cupy.float32, 2: cupy.uint16}[itemsize])
  kernel = _cuda_module().get_function(f"template_embed_{itemsize}byte")
  total = out.size

  def run():
    kernel(
      ((total + 255) // 256,),
      (256,),
      (
        dev[0],
        np.int32(prefix.shape[0]),
        dev[1],
        np.int32(suffix.shape[0]),
        dev[2],
        np.int32(vocab),
        ids_dev,
        np.int32(max_user),
        lengths_dev,
        np.int32(TOTAL_LEN),
        np.int32(dim),
        np.int32(1),
        out,
        np.int64(total),
      ),
    )  # 1: left padding, as the case
    return out

  def fetch(out):
    raw = cupy.asnumpy(out)
    return raw.view(jnp.bfloat16) if itemsize == 2 else raw

  return run, fetch


def _time_cuda(run: Callable, repeats: int) -> tuple[float, float, Any]:
  import cupy

  sync = cupy.cuda.Device().synchronize
  out = run()
  sync()
  rounds = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(50):
      out = run()
    sync()
    rounds.append((time.perf_counter() - start) / 50)
  return statistics.median(rounds), min(rounds), out


def cuda_unavailable_reason(on_gpu: bool) -> str | None:
  if not on_gpu:
    return "no GPU"
  try:
    import cupy

    cupy.cuda.runtime.getDeviceCount()
  except Exception as e:  # ImportError, or a CuPy that cannot see the driver
    return f"cupy unavailable: {type(e).__name__}: {e}"[:200]
  return None


# ----------------------------------------------------------------------------- running
def run_case(
  case: Case, *, on_gpu: bool, repeats: int, interpret_pallas: bool, cuda_reason: str | None, peak_gbps: float
) -> list[Result]:
  results = []

  def record(implementation, median, minimum, agrees, note=""):
    gbps = case.bytes / median / 1e9
    results.append(
      Result(
        case.op,
        case.shape,
        implementation,
        median * 1e3,
        minimum * 1e3,
        case.bytes,
        gbps,
        gbps / peak_gbps,
        agrees,
        note,
      )
    )

  median, minimum, reference = time_calls(case.implementations["xla"], case.args, repeats)
  reference = jax.device_get(reference)
  record("xla", median, minimum, True, "reference")

  if on_gpu or interpret_pallas:
    median, minimum, out = time_calls(case.implementations["pallas"], case.args, repeats if on_gpu else 1)
    record(
      "pallas" if on_gpu else "pallas (interpret)",
      median,
      minimum,
      case.compare(jax.device_get(out), reference),
      "" if on_gpu else "interpreted on CPU: an XLA loop over the grid, not a kernel",
    )
  else:
    results.append(
      Result(
        case.op,
        case.shape,
        "pallas",
        bytes=case.bytes,
        note="not timed: Pallas runs interpreted on CPU (B=1 shapes only)",
      )
    )

  if cuda_reason is None:
    try:
      run, fetch = case.cuda()
      median, minimum, out = _time_cuda(run, repeats)
      record("cuda", median, minimum, case.compare(fetch(out), reference), "CuPy RawKernel")
    except NotImplementedError as e:  # a case the CUDA C kernel does not cover
      results.append(Result(case.op, case.shape, "cuda", bytes=case.bytes, note=f"skipped: {e}"))
    except Exception as e:  # report, do not abort the other cases
      results.append(
        Result(case.op, case.shape, "cuda", bytes=case.bytes, note=f"failed: {type(e).__name__}: {e}"[:300])
      )
  else:
    results.append(Result(case.op, case.shape, "cuda", bytes=case.bytes, note=f"skipped: {cuda_reason}"))
  return results


def print_table(report: dict, results: list[Result]) -> None:
  peak = report["peak_gbps"]
  title = (
    f"thoughtjax bench kernels: {report['device']} ({report['backend']}), peak "
    f"{peak['used']:.0f} GB/s ({peak['source']})"
  )
  fmt = common.fmt
  rows = [
    (
      r.op,
      r.shape,
      r.implementation,
      fmt(r.median_ms, ".3f"),
      fmt(r.min_ms, ".3f"),
      f"{r.bytes / 1e6:.2f}",
      fmt(r.gbps, ".1f"),
      fmt(None if r.fraction_of_peak is None else 100 * r.fraction_of_peak, ".1f"),
      {None: "-", True: "yes", False: "NO"}[r.agrees_with_reference],
      r.note,
    )
    for r in results
  ]
  common.print_table(
    title,
    ("op", "shape", "impl", "median ms", "min ms", "MB", "GB/s", "% peak", "agrees", "note"),
    rows,
    width=200,
    right=("median ms", "min ms", "MB", "GB/s", "% peak"),
  )
  for note in report["notes"]:
    print(f"- {note}")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="thoughtjax bench kernels", description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", metavar="PATH", type=common.json_path, help="also write the report as JSON here")
  parser.add_argument(
    "--repeats", type=int, default=None, help="timed rounds per implementation (default 20 on GPU, 5 on CPU)"
  )
  parser.add_argument(
    "--quick", action="store_true", help="tiny shapes (V=4096, D=64, B in 1, 8): a smoke run, not a benchmark"
  )
  parser.add_argument(
    "--no-interpret", action="store_true", help="on CPU, do not time the interpreted Pallas kernel on B=1"
  )
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  on_gpu = jax.default_backend() == "gpu"
  repeats = args.repeats or (20 if on_gpu else 5)
  if repeats < 1:
    parser.error(f"--repeats must be >= 1, got {repeats}")
  measured = copy_bandwidth_gbps(32 * 2**20 if args.quick else 256 * 2**20, repeats)
  from_table = table_peak_gbps(device.device_kind) if on_gpu else None
  peak = dict(
    table=from_table,
    measured_copy=measured,
    used=from_table or measured,
    source="datasheet table" if from_table else "measured in-place x+1",
  )
  cuda_reason = cuda_unavailable_reason(on_gpu)

  results: list[Result] = []
  for case in build_cases(args.quick):
    interpret_pallas = not on_gpu and not args.no_interpret and case.shape.startswith("B=1 ")
    results += run_case(
      case,
      on_gpu=on_gpu,
      repeats=repeats,
      interpret_pallas=interpret_pallas,
      cuda_reason=cuda_reason,
      peak_gbps=peak["used"],
    )

  notes = [
    "times: hot-cache throughput (back-to-back calls, one sync), median over rounds",
    "bytes: unique bytes the op must move; sample_stop with top-k re-reads each row "
    "~32 times (binary search for the k-th value) from cache, not counted",
    "sample_stop cases: temperature 0.8, 4 stop ids; mask=P%: a random allowed-token bitmask "
    "(uint32 [B, V/32]) with P% of the vocabulary allowed; template_embed: left padding, "
    f"prefix {PREFIX_LEN} rows, suffix {SUFFIX_LEN}, user lengths in [{MAX_USER // 2}, "
    f"{MAX_USER}]",
  ]
  if not on_gpu:
    notes.append(
      "CPU: Pallas runs interpreted (not a kernel); its B=1 timings show the "
      "interpreter's cost, not GPU speed. GPU figures need a GPU run."
    )
  if cuda_reason:
    notes.append(f"CUDA C kernels skipped: {cuda_reason}")
  report = dict(
    command="thoughtjax bench kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
    backend=jax.default_backend(),
    device=device.device_kind,
    platform=platform.platform(),
    jax_version=jax.__version__,
    repeats=repeats,
    quick=args.quick,
    peak_gbps=peak,
    notes=notes,
    results=[dataclasses.asdict(r) for r in results],
  )
  print_table(report, results)
  if args.json:
    common.write_json(args.json, report)
    print(f"wrote {args.json}")
  disagreements = [r for r in results if r.agrees_with_reference is False]
  return 1 if disagreements else 0


if __name__ == "__main__":
  sys.exit(main())

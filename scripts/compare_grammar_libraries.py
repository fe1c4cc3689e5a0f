"""Compare llguidance and xgrammar on this model's tokenizer: the figures behind thoughtjax.constraint's choice.

For three JSON schemas of the extraction set (thoughtjax/data/structured/extraction.jsonl) each library
- prepares the tokenizer (once), compiles each schema (median of fresh compiles),
- walks the schema's reference answer, pretty-printed, token by token: per step it computes the next-token bitmask
  (timed; median and p90 over every step of every walk) and consumes the token (checked to be allowed),
- ends with eos (allowed exactly when the output is complete?) and rolls back 5 tokens (the same mask again?),
- fills a batch of 8 rows with 8 different schemas in lock-step (its batch API; median per step),
and the footprint of what installing it pulls in is summed from the installed distributions (dependency closure).

The parent (the project's venv) builds the codec the way thoughtjax does (GGUF -> TextCodec) and writes the
tokenizer JSON, eos ids and token ids to a temporary folder; each library runs in a child process of the Python that
has it installed (xgrammar needs torch, so it lives in a scratch venv), importing only ``tokenizers``, ``numpy`` and
the library.

  python scripts/compare_grammar_libraries.py [--xgrammar-python /tmp/xg/bin/python] [--repeats 3] [--json FILE]
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

SCHEMAS = ("invoice", "job_post", "lab_result")  # nested arrays of objects, enums, patterns, booleans, ranges
BATCH = ("contact_card", "invoice", "meeting", "recipe", "score", "job_post", "hotel_booking", "lab_result")
LIBRARIES = {"llguidance": "llguidance", "xgrammar": "xgrammar"}  # distribution name of each


# ---- worker (runs under the library's Python; no thoughtjax import) ------------------------------------------------
def _closure_bytes(dist_name: str) -> dict:
  """Installed size of a distribution and of everything it requires (recursively), from dist.files."""
  import importlib.metadata as md
  import re

  seen, stack, total, names = set(), [dist_name], 0, []
  while stack:
    name = re.split(r"[\s;<>=!~\[(]", stack.pop(), maxsplit=1)[0].lower().replace("_", "-")
    if not name or name in seen:
      continue
    seen.add(name)
    try:
      dist = md.distribution(name)
    except md.PackageNotFoundError:
      continue
    size = sum((f.size or 0) for f in (dist.files or ()))
    total += size
    names.append((name, size))
    for req in dist.requires or ():
      if "extra ==" not in req:
        stack.append(req)
  names.sort(key=lambda x: -x[1])
  own = next(s for n, s in names if n == dist_name)
  return {"own_mib": own / 2**20, "closure_mib": total / 2**20, "closure": [n for n, _ in names], "largest": names[:5]}


def _pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * len(xs)))]


def _bits(mask_row) -> set:
  import numpy as np

  return set(np.flatnonzero(np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little")).tolist())


def worker(lib: str, case_path: str, repeats: int) -> dict:
  import numpy as np

  case = json.loads(Path(case_path).read_text())
  eos, vocab = case["eos_ids"], case["vocab_size"]
  words = -(-vocab // 32)
  t = time.perf_counter()
  if lib == "llguidance":
    import llguidance
    import llguidance.numpy as llnp
  else:
    import xgrammar
  import_s = time.perf_counter() - t
  tokenizer_json = Path(case["tokenizer"]).read_text()

  t = time.perf_counter()
  if lib == "llguidance":
    lltok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
  else:
    import transformers
    from tokenizers import Tokenizer

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
  tokenizer_s = time.perf_counter() - t

  def compile_(schema_text):
    if lib == "llguidance":
      g = llguidance.LLMatcher.grammar_from_json_schema(schema_text)
      m = llguidance.LLMatcher(lltok, g, log_level=0)
      assert not m.is_error(), m.get_error()
      return m
    return compiler.compile_json_schema(schema_text, any_whitespace=True)

  def new_matcher(compiled):
    return compiled.deep_copy() if lib == "llguidance" else xgrammar.GrammarMatcher(compiled)

  def fill(m, out):  # out: int32 [1, words]
    if lib == "llguidance":
      m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    else:
      m.fill_next_token_bitmask(out, 0)

  def consume(m, tok):
    return m.consume_token(tok) if lib == "llguidance" else m.accept_token(tok)

  def accepting(m):
    return m.is_accepting() if lib == "llguidance" else m.is_completed()

  out = {"library": lib, "version": None, "import_s": import_s, "tokenizer_s": tokenizer_s, "schemas": {}}
  from importlib.metadata import version

  out["version"] = version(LIBRARIES[lib])
  mask = np.zeros((1, words), np.int32)
  fill_times, consume_times = [], []
  numpy_ok = True
  for sid, c in case["cases"].items():
    text = json.dumps(c["schema"])
    compiles = []
    for _ in range(repeats):
      t = time.perf_counter()
      compiled = compile_(text)
      compiles.append(time.perf_counter() - t)
    row = {"compile_s": statistics.median(compiles), "steps": len(c["tokens"])}
    for rep in range(repeats):
      m = new_matcher(compiled)
      masks = []
      for i, tok in enumerate(c["tokens"]):
        t = time.perf_counter()
        try:
          fill(m, mask)
        except Exception as e:  # xgrammar takes DLPack arrays; numpy's int32 array is one
          numpy_ok = False
          raise RuntimeError(f"{lib}: filling a numpy int32 mask failed: {e}") from e
        dt = time.perf_counter() - t
        if rep == 0 and i == 0:
          row["first_mask_s"] = dt
        else:
          fill_times.append(dt)
        masks.append(mask.copy())
        if tok not in _bits(mask[0]):
          raise RuntimeError(f"{lib}: {sid} step {i}: the reference answer's token {tok} is not allowed")
        t = time.perf_counter()
        ok = consume(m, tok)
        consume_times.append(time.perf_counter() - t)
        assert ok, (lib, sid, i)
      fill(m, mask)
      final = _bits(mask[0])
      row["eos_allowed_at_end"] = all(e in final for e in eos) and accepting(m)
      # Rollback: undo 5 tokens, the mask must equal the one computed at that point.
      m.rollback(5)
      fill(m, mask)
      row["rollback_same_mask"] = bool(np.array_equal(mask, masks[-5]))
      for tok in c["tokens"][-5:]:
        consume(m, tok)
      row["eos_consumed"] = bool(consume(m, eos[0]))
      row["stopped_after_eos"] = m.is_stopped() if lib == "llguidance" else m.is_terminated()
      # Eos refused mid-output (one token in).
      m2 = new_matcher(compiled)
      consume(m2, c["tokens"][0])
      fill(m2, mask)
      row["eos_refused_mid_output"] = not (set(eos) & _bits(mask[0]))
    out["schemas"][sid] = row
  out["numpy_bitmask"] = numpy_ok
  out["mask_median_us"] = 1e6 * statistics.median(fill_times)
  out["mask_p90_us"] = 1e6 * _pct(fill_times, 0.9)
  out["consume_median_us"] = 1e6 * statistics.median(consume_times)
  out["steps_timed"] = len(fill_times)

  # Batch of 8 rows, 8 schemas, lock-step; rows that finished stay in with their final state.
  rows = case["batch"]
  compiled = [compile_(json.dumps(r["schema"])) for r in rows]
  matchers = [new_matcher(c) for c in compiled]
  bmask = np.zeros((len(rows), words), np.int32)
  if lib == "llguidance":
    executor = llguidance.LLExecutor()
  else:
    batcher = xgrammar.BatchGrammarMatcher()
  steps = max(len(r["tokens"]) for r in rows)
  batch_times, serial_times = [], []
  for i in range(steps):
    t = time.perf_counter()
    for k, m in enumerate(matchers):  # one row after another, one thread
      fill(m, bmask[k : k + 1])
    serial_times.append(time.perf_counter() - t)
    t = time.perf_counter()
    if lib == "llguidance":
      llnp.fill_next_token_bitmask_par(executor, [(m, k) for k, m in enumerate(matchers)], bmask)
    else:
      batcher.batch_fill_next_token_bitmask(matchers, bmask)
    batch_times.append(time.perf_counter() - t)
    for k, (m, r) in enumerate(zip(matchers, rows)):
      if i < len(r["tokens"]):
        assert r["tokens"][i] in _bits(bmask[k]), (lib, "batch", k, i)
        consume(m, r["tokens"][i])
  out["batch8_mask_median_us"] = 1e6 * statistics.median(batch_times[1:])
  out["batch8_serial_median_us"] = 1e6 * statistics.median(serial_times[1:])
  out["batch8_steps"] = steps
  out["footprint"] = _closure_bytes(LIBRARIES[lib])
  out["torch_required"] = "torch" in out["footprint"]["closure"]
  return out


# ---- parent -----------------------------------------------------------------------------------------------------
def prepare(folder: Path) -> Path:
  import gguf

  from thoughtjax.bench.structured import load_extraction_set
  from thoughtjax.fetch import fetch
  from thoughtjax.sources.gguf_file import read_config, read_tokenizer
  from thoughtjax.tokenizer import TextCodec

  reader = gguf.GGUFReader(fetch())
  codec = TextCodec.from_gguf(read_tokenizer(reader))
  vocab = read_config(reader).vocab_size
  codec.tokenizer.save(str(folder / "tokenizer.json"))
  items = {i.id: i for i in load_extraction_set()}

  def case(sid):
    # Pretty-printed, as an instruct model tends to write JSON: whitespace runs are part of the walk.
    return {"schema": items[sid].schema, "tokens": codec.encode(json.dumps(items[sid].answer, indent=2))}

  data = {
    "tokenizer": str(folder / "tokenizer.json"),
    "eos_ids": list(codec.eos_ids),
    "vocab_size": vocab,
    "cases": {sid: case(sid) for sid in SCHEMAS},
    "batch": [case(sid) for sid in BATCH],
  }
  path = folder / "case.json"
  path.write_text(json.dumps(data))
  return path


def module_figures(case_path: Path, repeats: int) -> dict:
  """thoughtjax.constraint's own Matcher.fill (llguidance plus the eos and vocabulary fix-ups) on the same
  walks, in this process."""
  import numpy as np

  from thoughtjax.constraint import Constraint, Grammars
  from thoughtjax.tokenizer import TextCodec

  case = json.loads(case_path.read_text())
  from tokenizers import Tokenizer

  codec = TextCodec(Tokenizer.from_file(case["tokenizer"]), None, None, case["eos_ids"][0], eos_ids=case["eos_ids"])
  grammars = Grammars(codec, case["vocab_size"])
  mask = np.zeros(grammars.words, np.uint32)
  times, checks = [], []
  for c in case["cases"].values():
    constraint = Constraint.of(json_schema=c["schema"])
    t = time.perf_counter()
    grammars.check(constraint)
    checks.append(time.perf_counter() - t)
    for _ in range(repeats):
      m = grammars.matcher(constraint)
      for tok in c["tokens"]:
        t = time.perf_counter()
        m.fill(mask)
        times.append(time.perf_counter() - t)
        m.consume(tok)
  # A batch of 8 rows with 8 schemas, lock-step, through Grammars.fill_rows (llguidance's thread pool).
  rows = [grammars.matcher(Constraint.of(json_schema=r["schema"])) for r in case["batch"]]
  out = np.zeros((len(rows), grammars.words), np.uint32)
  batch = []
  for i in range(max(len(r["tokens"]) for r in case["batch"])):
    t = time.perf_counter()
    grammars.fill_rows(rows, out)
    batch.append(time.perf_counter() - t)
    for m, r in zip(rows, case["batch"]):
      if i < len(r["tokens"]):
        m.consume(r["tokens"][i])
  return {
    "fill_rows_batch8_median_us": 1e6 * statistics.median(batch[1:]),
    "fill_median_us": 1e6 * statistics.median(times),
    "fill_p90_us": 1e6 * _pct(times, 0.9),
    "first_check_ms": [1e3 * x for x in checks],
  }


def run_child(python: str, lib: str, case: Path, repeats: int) -> dict:
  cmd = [python, __file__, "--worker", lib, "--case", str(case), "--repeats", str(repeats)]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the child imports no thoughtjax
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  if proc.returncode != 0:
    return {"library": lib, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(results: list[dict]) -> None:
  def f(x, spec):
    return "-" if x is None else format(x, spec)

  libs = [r for r in results if "error" not in r]
  rows = [
    ("version", [r["version"] for r in libs]),
    ("import (s)", [f(r["import_s"], ".2f") for r in libs]),
    ("tokenizer prep (s)", [f(r["tokenizer_s"], ".2f") for r in libs]),
  ]
  for sid in SCHEMAS:
    rows.append((f"compile {sid} (ms)", [f(1e3 * r["schemas"][sid]["compile_s"], ".2f") for r in libs]))
    rows.append((f"first mask {sid} (us)", [f(1e6 * r["schemas"][sid]["first_mask_s"], ".0f") for r in libs]))
  rows += [
    ("mask/token median (us)", [f(r["mask_median_us"], ".0f") for r in libs]),
    ("mask/token p90 (us)", [f(r["mask_p90_us"], ".0f") for r in libs]),
    ("consume/token median (us)", [f(r["consume_median_us"], ".0f") for r in libs]),
    ("steps timed", [r["steps_timed"] for r in libs]),
    ("batch 8, 8 schemas: batch API/step (us)", [f(r["batch8_mask_median_us"], ".0f") for r in libs]),
    ("batch 8, 8 schemas: row by row/step (us)", [f(r["batch8_serial_median_us"], ".0f") for r in libs]),
    (
      "eos allowed at end / refused mid",
      [all(s["eos_allowed_at_end"] and s["eos_refused_mid_output"] for s in r["schemas"].values()) for r in libs],
    ),
    ("stops after eos", [all(s["stopped_after_eos"] for s in r["schemas"].values()) for r in libs]),
    ("rollback(5) restores mask", [all(s["rollback_same_mask"] for s in r["schemas"].values()) for r in libs]),
    ("fills a numpy bitmask", [r["numpy_bitmask"] for r in libs]),
    ("own wheel installed (MiB)", [f(r["footprint"]["own_mib"], ".1f") for r in libs]),
    ("with dependencies (MiB)", [f(r["footprint"]["closure_mib"], ".0f") for r in libs]),
    ("needs torch", [r["torch_required"] for r in libs]),
  ]
  width = max(len(name) for name, _ in rows)
  print(f"{'':{width}}  " + "  ".join(f"{r['library']:>12}" for r in libs))
  for name, vals in rows:
    print(f"{name:{width}}  " + "  ".join(f"{str(v):>12}" for v in vals))
  for r in results:
    if "error" in r:
      print(f"{r['library']}: not measured: {r['error']}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--worker", choices=tuple(LIBRARIES), help=argparse.SUPPRESS)
  p.add_argument("--case", help=argparse.SUPPRESS)
  p.add_argument("--repeats", type=int, default=3, help="fresh compiles and walks per schema (default 3)")
  p.add_argument("--llguidance-python", default=sys.executable, help="a Python with llguidance (default: this one)")
  p.add_argument("--xgrammar-python", default="/tmp/xg/bin/python", help="a Python with xgrammar and transformers")
  p.add_argument("--json", default=None, help="write both libraries' figures here")
  args = p.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(args.worker, args.case, args.repeats)))
    return 0
  with tempfile.TemporaryDirectory() as tmp:
    case = prepare(Path(tmp))
    results = [
      run_child(args.llguidance_python, "llguidance", case, args.repeats),
      run_child(args.xgrammar_python, "xgrammar", case, args.repeats),
    ]
    module = module_figures(case, args.repeats)
  print_table(results)
  print(
    f"thoughtjax.constraint Matcher.fill (llguidance + eos/vocabulary fix-ups): median "
    f"{module['fill_median_us']:.0f} us, p90 {module['fill_p90_us']:.0f} us per token; Grammars.check (first, "
    f"tokenizer prep included in the first): {', '.join(f'{x:.1f}' for x in module['first_check_ms'])} ms; "
    f"Grammars.fill_rows, batch 8 with 8 schemas: median {module['fill_rows_batch8_median_us']:.0f} us per step"
  )
  if args.json:
    Path(args.json).write_text(json.dumps({"libraries": results, "thoughtjax_matcher": module}, indent=2))
  return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())

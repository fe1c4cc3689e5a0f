"""``thoughtjax bench structured``: do extraction outputs parse and validate, with and without a JSON schema?

The extraction set (``thoughtjax/data/structured/extraction.jsonl``) holds 50 prompts: a short text, an instruction,
the JSON schema the answer must follow and a reference answer. Each prompt is generated with the chat template,
greedily, up to ``--max-tokens``, once unconstrained and once constrained by its schema
(``Model.generate(..., json_schema=schema)``). Every output is parsed as JSON (the whole text, surrounding blanks
aside: a fenced or commented answer does not count) and validated against the schema with ``jsonschema``; the
table gives per mode how many parse, how many validate, how many of the reference answer's top-level fields the
output got right, and tokens per second.

The seam for another server: :func:`run` takes a *generate* callable ``(item, constrained, max_tokens) ->
Output``. :func:`model_generator` makes one from a thoughtjax Model (``--generator engine``),
:func:`masked_greedy_generator` the host-side reference (``--generator reference``: a full forward per token, the
mask applied to the logits in numpy); an OpenAI-compatible peer (llama-server with
``response_format: {"type": "json_schema", ...}``) plugs in as another such callable, and its rows come out in the
same report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from thoughtjax.bench import common
from thoughtjax.errors import UserError

MODES = ("unconstrained", "constrained")
DEFAULT_MAX_TOKENS = 256


class ExtractionSetError(UserError, ValueError):
  """An extraction set file that is not what the benchmark reads; the message names the file and line."""


class BenchStructuredError(UserError, ValueError):
  """An argument of ``bench structured`` that cannot be honoured."""


@dataclasses.dataclass(frozen=True)
class Extraction:
  """One prompt of the set: ``prompt`` is the user message (text + instruction); ``answer`` validates."""

  id: str
  prompt: str
  schema: dict
  answer: Any


@dataclasses.dataclass(frozen=True)
class Output:
  """What a generator returns for one prompt: the text, tokens generated, wall seconds of the call and, when the
  generator knows it, the seconds from the first token to the last (decode alone)."""

  text: str
  tokens: int
  seconds: float
  decode_seconds: float | None = None


Generate = Callable[[Extraction, bool, int], Output]


def default_set_path() -> Path:
  from thoughtjax.shipped import shipped_file

  return shipped_file("structured", "extraction.jsonl")


def load_extraction_set(path: str | Path | None = None) -> list[Extraction]:
  """The prompts of ``path`` (default: the shipped set), one JSON object per line with id, prompt, schema and
  answer; the answer must validate against the schema."""
  import jsonschema

  path = Path(path) if path is not None else default_set_path()
  items, seen = [], set()
  for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{n}"
    try:
      d = json.loads(line)
    except ValueError as e:
      raise ExtractionSetError(f"{where}: not a JSON object ({e}); write one object per line") from None
    if not isinstance(d, dict) or {"id", "prompt", "schema", "answer"} - set(d):
      raise ExtractionSetError(f"{where}: expected an object with id, prompt, schema and answer, got {line[:80]!r}")
    if d["id"] in seen:
      raise ExtractionSetError(f"{where}: id {d['id']!r} is used twice; ids must be unique")
    seen.add(d["id"])
    try:
      jsonschema.validate(d["answer"], d["schema"])
    except jsonschema.exceptions.SchemaError as e:
      raise ExtractionSetError(f"{where}: the schema is not a valid JSON Schema ({e.message})") from None
    except jsonschema.ValidationError as e:
      raise ExtractionSetError(f"{where}: the reference answer does not follow the schema ({e.message})") from None
    items.append(Extraction(str(d["id"]), str(d["prompt"]), d["schema"], d["answer"]))
  return items


# ---- scoring ------------------------------------------------------------------------------------------------------
def score(item: Extraction, text: str) -> dict:
  """``parsed`` (the whole text is one JSON value), ``valid`` (it follows the schema), ``fields`` (the share of
  the reference answer's top-level fields it has equal, strings compared trimmed and case-blind) and ``error``;
  ``parsed_fenced`` / ``valid_fenced``: the same, leniently, for the body of a markdown code fence."""
  import jsonschema

  fenced = _unfence(text)
  lenient = {"parsed_fenced": False, "valid_fenced": False}
  if fenced is not None:
    try:
      value = json.loads(fenced)
      lenient = {"parsed_fenced": True, "valid_fenced": _validates(value, item.schema)}
    except ValueError:
      pass
  try:
    value = json.loads(text.strip())
  except ValueError as e:
    return {"parsed": False, "valid": False, "fields": 0.0, "error": f"not JSON: {e}"} | lenient
  try:
    jsonschema.validate(value, item.schema)
    valid, error = True, None
  except jsonschema.ValidationError as e:
    valid, error = False, f"invalid: {e.message}"
  result = {"parsed": True, "valid": valid, "fields": field_agreement(item.answer, value), "error": error}
  return result | {"parsed_fenced": True, "valid_fenced": valid}


_FENCE = re.compile(r"```[A-Za-z]*\s*\n(.*?)\n?```", re.S)


def _unfence(text: str) -> str | None:
  """The body of the first markdown code fence, or the text itself when it is bare."""
  m = _FENCE.search(text)
  return m.group(1) if m else text.strip()


def _validates(value, schema) -> bool:
  import jsonschema

  return jsonschema.Draft202012Validator(schema).is_valid(value)


def field_agreement(answer, value) -> float:
  if not isinstance(answer, dict):
    return float(_same(answer, value))
  if not answer:
    return 1.0
  got = value if isinstance(value, dict) else {}
  return sum(_same(v, got.get(k)) for k, v in answer.items()) / len(answer)


def _same(a, b) -> bool:
  if isinstance(a, str) and isinstance(b, str):
    return a.strip().casefold() == b.strip().casefold()
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, bool) or isinstance(b, bool):
    return a is b
  return a == b


# ---- running ------------------------------------------------------------------------------------------------------
def model_generator(model) -> Generate:
  """A :data:`Generate` over a thoughtjax Model: chat template, greedy, the schema as ``json_schema`` when
  constrained."""

  def generate(item: Extraction, constrained: bool, max_tokens: int) -> Output:
    kw = {"json_schema": item.schema} if constrained else {}
    start = time.perf_counter()
    try:
      c = model.generate(item.prompt, chat=True, max_tokens=max_tokens, temperature=0.0, **kw)
    except TypeError as e:
      if constrained and "json_schema" in str(e):
        raise BenchStructuredError(
          "constrained mode needs Model.generate(json_schema=...), which this build does not take yet; "
          "run with --modes unconstrained"
        ) from None
      raise
    seconds = time.perf_counter() - start
    t = c.timings
    decode = t["end"] - t["first_token"] if "end" in t and "first_token" in t else None
    return Output(c.text, len(c.token_ids), seconds, decode)

  return generate


def masked_greedy_generator(model) -> Generate:
  """A :data:`Generate` that decodes outside the engine: every step scores the whole sequence
  (``model.logits``), sets the ids the constraint's mask refuses to -inf and takes the argmax. A full forward per
  token, so slow; it is the reference a constrained engine's greedy output must equal, and it runs on a build
  whose engine does not take ``json_schema`` yet."""
  import numpy as np

  from thoughtjax.constraint import Constraint, Grammars

  grammars = Grammars(model.codec, model.config.vocab_size)
  eos = set(model.codec.eos_ids)
  mask = np.zeros(grammars.words, np.uint32)

  def generate(item: Extraction, constrained: bool, max_tokens: int) -> Output:
    start = time.perf_counter()
    ids = list(model.prompt_ids(item.prompt, chat=True))
    matcher = grammars.matcher(Constraint.of(json_schema=item.schema)) if constrained else None
    out, first = [], None
    for _ in range(max_tokens):
      logits = model.logits(ids)[-1]
      if matcher is not None:
        matcher.fill(mask)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
        logits = np.where(allowed, logits, -np.inf)
      token = int(np.argmax(logits))
      first = first or time.perf_counter()
      if matcher is not None:
        matcher.consume(token)
      out.append(token)
      if token in eos:
        break
      ids.append(token)
    end = time.perf_counter()
    return Output(model.codec.decode(out), len(out), end - start, end - first if first else None)

  return generate


def llama_server_generator(server) -> Generate:
  """A :data:`Generate` over a running :class:`~thoughtjax.bench.llama_server.LlamaServer`: the same chat message,
  greedy, the schema as OpenAI's ``response_format`` (llama.cpp turns it into a grammar) when constrained."""

  def generate(item: Extraction, constrained: bool, max_tokens: int) -> Output:
    body = {
      "messages": [{"role": "user", "content": item.prompt}],
      "max_tokens": max_tokens,
      "temperature": 0.0,
      "cache_prompt": False,  # every request prefills, as the engine's do
    }
    if constrained:
      body["response_format"] = {"type": "json_schema", "json_schema": {"name": item.id, "schema": item.schema}}
    start = time.perf_counter()
    r = server.post("/v1/chat/completions", body)
    seconds = time.perf_counter() - start
    t = r.get("timings") or {}
    decode = t.get("predicted_ms")
    return Output(
      r["choices"][0]["message"]["content"] or "",
      int(r["usage"]["completion_tokens"]),
      seconds,
      None if decode is None else decode / 1e3,
    )

  return generate


def mask_overhead(
  model,
  items: Sequence[Extraction],
  batch: int,
  *,
  constrained: int | None = None,
  max_tokens: int = 48,
  repeats: int = 3,
) -> dict:
  """What a constrained batch pays per decode step: ``batch`` prompts (chat template) decoded together, once free
  (``ignore_eos``, so every row runs ``max_tokens``) and once with the first ``constrained`` rows (default: all)
  each under its own schema, the others free as before; the median over ``repeats`` interleaved runs (after one
  untimed run each, which compiles) of wall ms from the first token to the last, per step. A batch with any
  constrained row decodes one step per program call and fills its masks on the host: with one constrained row
  among free ones, what its neighbours pay for it."""
  import statistics

  from thoughtjax.sampling import SamplingParams

  if len(items) < batch:
    raise BenchStructuredError(f"a batch of {batch} needs {batch} prompts, the set has {len(items)}")
  rows = items[:batch]
  prompts = [it.prompt for it in rows]
  free = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * batch
  k = batch if constrained is None else constrained
  if not 1 <= k <= batch:
    raise BenchStructuredError(f"constrained rows: expected 1 to {batch}, got {k}")
  bound = [SamplingParams(max_tokens=max_tokens, json_schema=it.schema) for it in rows[:k]] + free[k:]

  def per_step(params) -> float | None:
    g = model.stream_batch(prompts, params, chat=True)
    done = g.completions()
    steps = max(len(c.token_ids) for c in done) - 1
    t = g.trace
    return (t.end - t.first_token) / steps * 1e3 if steps > 0 else None

  per_step(free), per_step(bound)
  plain, masked = [], []
  for _ in range(repeats):
    plain.append(per_step(free))
    masked.append(per_step(bound))
  p = statistics.median(x for x in plain if x is not None)
  m = statistics.median(x for x in masked if x is not None)
  return {"batch": batch, "constrained": k, "plain_ms_per_step": p, "masked_ms_per_step": m, "overhead": m / p - 1}


def slot_overhead(
  model,
  items: Sequence[Extraction],
  slots: int = 8,
  *,
  constrained: int = 1,
  max_tokens: int = 48,
  repeats: int = 3,
) -> dict:
  """What a constrained request costs its free neighbours in a slot engine (the server's continuous batching):
  ``slots`` prompts (chat template) inserted together into a ``slots``-slot engine, the free ones with
  ``ignore_eos`` (each runs ``max_tokens``), once all free and once with the first ``constrained`` under their own
  schema. Per run, a row's decode rate is its tokens after the first over the time from the first decode chunk to
  its end (what one stream sees); the report holds the medians over ``repeats`` interleaved runs (after one
  untimed run each, which compiles) of the free rows' median rate, of the constrained rows' median rate and tokens,
  and of the decode steps per chunk while the free rows ran."""
  import statistics

  from thoughtjax.sampling import SamplingParams
  from thoughtjax.serving.slots import SlotEngine

  if len(items) < slots:
    raise BenchStructuredError(f"{slots} slots need {slots} prompts, the set has {len(items)}")
  if not 1 <= constrained < slots:
    raise BenchStructuredError(f"constrained rows: expected 1 to {slots - 1}, got {constrained}")
  rows = items[:slots]
  ids = [model.prompt_ids(it.prompt, chat=True) for it in rows]
  engine = SlotEngine(model, slots=slots, cache_len=max(len(i) for i in ids) + max_tokens)
  free = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  bound = [SamplingParams(max_tokens=max_tokens, json_schema=it.schema) for it in rows[:constrained]]

  def once(params) -> dict:
    runs = engine.insert_batch(list(zip(ids, params, strict=True)))
    is_free = [p.constraint is None for p in params]
    chunks, steps, t0 = engine.chunks, engine.steps, time.perf_counter()
    while not all(r.finished for r, f in zip(runs, is_free, strict=True) if f):
      engine.step()
    per_chunk = (engine.steps - steps) / max(engine.chunks - chunks, 1)
    while engine.active:
      engine.step()
    rate = [(len(r.token_ids) - 1) / (r.freed_at - t0) for r in runs]
    got = {"free_row_tok_s": statistics.median(x for x, f in zip(rate, is_free, strict=True) if f)}
    if not all(is_free):
      got["bound_row_tok_s"] = statistics.median(x for x, f in zip(rate, is_free, strict=True) if not f)
      got["bound_tokens"] = statistics.median(len(r.token_ids) for r, f in zip(runs, is_free, strict=True) if not f)
    return got | {"steps_per_chunk": per_chunk}

  plans = {"alone": [free] * slots, "beside": bound + [free] * (slots - constrained)}
  for params in plans.values():
    once(params)
  got: dict[str, list[dict]] = {name: [] for name in plans}
  for _ in range(repeats):
    for name, params in plans.items():
      got[name].append(once(params))
  out = {"slots": slots, "constrained": constrained, "max_tokens": max_tokens}
  for name, runs in got.items():
    for key in runs[0]:
      out[f"{name}_{key}"] = statistics.median(r[key] for r in runs)
  out["neighbour_ratio"] = out["beside_free_row_tok_s"] / out["alone_free_row_tok_s"]
  return out


def run(
  items: Sequence[Extraction],
  generate: Generate,
  *,
  modes: Sequence[str] = MODES,
  max_tokens: int = DEFAULT_MAX_TOKENS,
  warmup: bool = True,
) -> dict:
  """Generate every item in every mode with ``generate``; per mode the rows and a summary.

  ``warmup``: one untimed call per mode first, so compiling a program is not counted in tokens per second."""
  report = {"max_tokens": max_tokens, "prompts": len(items), "modes": {}}
  for mode in modes:
    if mode not in MODES:
      raise BenchStructuredError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    constrained = mode == "constrained"
    if warmup and items:
      generate(items[0], constrained, max_tokens)
    rows = []
    for item in items:
      out = generate(item, constrained, max_tokens)
      rows.append(
        {"id": item.id, "tokens": out.tokens, "seconds": out.seconds, "decode_seconds": out.decode_seconds}
        | score(item, out.text)
        | {"text": out.text}
      )
    report["modes"][mode] = {"summary": summarize(rows), "rows": rows}
  return report


def summarize(rows: Sequence[dict]) -> dict:
  n = len(rows)
  tokens = sum(r["tokens"] for r in rows)
  seconds = sum(r["seconds"] for r in rows)
  decoded = [r for r in rows if r["decode_seconds"]]
  decode_s = sum(r["decode_seconds"] for r in decoded)
  return {
    "prompts": n,
    "parsed": sum(r["parsed"] for r in rows),
    "valid": sum(r["valid"] for r in rows),
    "parsed_fenced": sum(r["parsed_fenced"] for r in rows),
    "valid_fenced": sum(r["valid_fenced"] for r in rows),
    "fields": sum(r["fields"] for r in rows) / n if n else float("nan"),
    "tokens": tokens,
    "seconds": seconds,
    "tok_s": tokens / seconds if seconds > 0 else None,
    # Decode alone: tokens after the first over the time from the first to the last.
    "decode_tok_s": sum(r["tokens"] - 1 for r in decoded) / decode_s if decode_s > 0 else None,
  }


def print_report(report: dict, title: str) -> None:
  rows = []
  for mode, m in report["modes"].items():
    s = m["summary"]
    n = s["prompts"]
    rows.append(
      [
        mode,
        n,
        f"{s['parsed']} ({100 * s['parsed'] / max(n, 1):.0f} %)",
        f"{s['valid']} ({100 * s['valid'] / max(n, 1):.0f} %)",
        f"{s['parsed_fenced']} / {s['valid_fenced']}",
        common.fmt(s["fields"], ".2f"),
        s["tokens"],
        common.fmt(s["tok_s"], ".1f"),
        common.fmt(s["decode_tok_s"], ".1f"),
      ]
    )
  cols = ["mode", "prompts", "parsed", "valid", "fenced p/v", "fields", "tokens", "tok/s call", "tok/s decode"]
  common.print_table(title, cols, rows, right=cols[1:], width=150, no_wrap=True)


def _positive(text: str) -> int:
  try:
    n = int(text)
  except ValueError:
    n = 0
  if n < 1:
    raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
  return n


def _modes(text: str) -> list[str]:
  modes = [m.strip() for m in text.split(",") if m.strip()]
  bad = [m for m in modes if m not in MODES]
  if bad or not modes:
    raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(MODES)}, got {text!r}")
  return list(dict.fromkeys(modes))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench structured", description=__doc__.splitlines()[0])
  p.add_argument("--model", default=None, help="known model name or path (default: smollm2-135m-instruct)")
  p.add_argument("--weights", default="f32", help="weight form: f32, native, int8, int8a8 (default f32)")
  p.add_argument("--prompts", type=_positive, default=None, help="the first N prompts of the set (default: all)")
  p.add_argument("--max-tokens", type=_positive, default=DEFAULT_MAX_TOKENS, help="tokens per output (default 256)")
  p.add_argument("--modes", type=_modes, default=list(MODES), help="unconstrained,constrained (default both)")
  p.add_argument("--set", default=None, help="an extraction set file (default: the shipped 50 prompts)")
  p.add_argument(
    "--generator",
    choices=("engine", "reference"),
    default="engine",
    help="engine: Model.generate (default); reference: a full forward per token with the mask applied on the host",
  )
  p.add_argument(
    "--peer",
    choices=("llama-server",),
    default=None,
    help="also run the prompts through llama.cpp's llama-server on the same GGUF (response_format json_schema)",
  )
  p.add_argument("--llama-server", default=None, metavar="BIN", help="the llama-server binary (default: on PATH)")
  p.add_argument(
    "--overhead",
    nargs="?",
    const="all",
    choices=("all", "batch", "slots"),
    default=None,
    help="also measure what a constraint costs: batch: a decode step with and without per-row schemas at batch 1 and "
    "8, and with one schema among 8 rows (the mask's cost to the row and to its free neighbours); slots: a free "
    "row's decode rate in an 8-slot engine with and without a constrained neighbour; bare --overhead: both",
  )
  p.add_argument("--json", default=None, type=common.json_path, help="write the report (with every output) here")
  args = p.parse_args(argv)

  import thoughtjax
  from thoughtjax.thoughtlet import fingerprint

  items = load_extraction_set(args.set)
  if args.prompts is not None:
    if args.prompts > len(items):
      raise BenchStructuredError(f"--prompts {args.prompts}: the set has {len(items)} prompts; ask for at most that")
    items = items[: args.prompts]
  model = thoughtjax.load(args.model, weights=args.weights)
  generate = model_generator(model) if args.generator == "engine" else masked_greedy_generator(model)
  report = run(items, generate, modes=args.modes, max_tokens=args.max_tokens)
  report |= {
    "model": model.loaded.source,
    "weights": args.weights,
    "generator": args.generator,
    "fingerprint": fingerprint(),
  }
  title = f"structured output: {len(items)} extraction prompts, greedy, max {args.max_tokens} tokens"
  print_report(report, title + (" (reference decoder)" if args.generator == "reference" else ""))
  if args.overhead in ("all", "batch"):
    shapes = [(1, None), (8, None), (8, 1)]  # (batch, constrained rows): alone, all, one among free neighbours
    report["overhead"] = [mask_overhead(model, items, b, constrained=k) for b, k in shapes if b <= len(items)]
    common.print_table(
      "constrained decode step against a free one (each constrained row its own schema)",
      ["batch", "constrained rows", "free ms/step", "constrained ms/step", "overhead"],
      [
        [
          o["batch"],
          o["constrained"],
          f"{o['plain_ms_per_step']:.2f}",
          f"{o['masked_ms_per_step']:.2f}",
          f"{100 * o['overhead']:+.1f} %",
        ]
        for o in report["overhead"]
      ],
      right=["free ms/step", "constrained ms/step", "overhead"],
    )
  if args.overhead in ("all", "slots"):
    report["slot_overhead"] = so = slot_overhead(model, items, min(8, len(items)))
    common.print_table(
      "a slot engine's free rows alone and beside a constrained one (its own schema): decode tok/s of one stream",
      ["slots", "free row: alone", "free row: beside", "ratio", "steps per chunk", "constrained row (tokens)"],
      [
        [
          so["slots"],
          f"{so['alone_free_row_tok_s']:.2f}",
          f"{so['beside_free_row_tok_s']:.2f}",
          f"{so['neighbour_ratio']:.2f}x",
          f"{so['alone_steps_per_chunk']:.1f} / {so['beside_steps_per_chunk']:.1f}",
          f"{so['beside_bound_row_tok_s']:.2f} ({so['beside_bound_tokens']:.0f})",
        ]
      ],
      right=["free row: alone", "free row: beside", "ratio", "steps per chunk", "constrained row (tokens)"],
    )
  if args.json:  # written now and again with the peer's rows: a peer that fails to start loses nothing
    common.write_json(args.json, report)
  if args.peer == "llama-server":
    from thoughtjax.bench.llama_server import LlamaServer, find_binary
    from thoughtjax.loading import resolve_source

    binary = find_binary(args.llama_server)
    with LlamaServer(binary, resolve_source(model.loaded.source), threads=os.cpu_count()) as server:
      peer = run(items, llama_server_generator(server), modes=args.modes, max_tokens=args.max_tokens)
    report["peer"] = peer | {"name": "llama-server", "binary": str(binary)}
    print_report(peer, f"{title}, llama-server (same GGUF)")
  if args.json:
    common.write_json(args.json, report)
  return 0

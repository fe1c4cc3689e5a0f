"""``thoughtjax bench shapes``: a second path of the same shape in a warm process, against the path that has run.

Programs are keyed by a path's shape, not by its layers (weights are arguments), so once one 30-layer path has
run, a request on a different 30-layer path should compile nothing and get its first token as fast as the warm
path. In one process, on the default model (or ``--model``):

1. the first path (``--first``, default the full path) runs once, cold (it compiles);
2. the second path (``--second``, default 30 layers that repeat a span) is composed from the loaded model (timed
   apart: a registry restore is not part of this measurement), and its first request runs: its time to first
   token, the compile seconds its trace reports and the programs it added to the program cache;
3. ``--repeats`` rounds, each one warm request on each path, alternating.

Time to first token is the host's, from the call to the first delta, for a chat prompt with ``--max-tokens`` new
tokens (greedy). Target (issue 15): the second path's first request compiles nothing and its first token comes
within 50 ms of the first path's warm median. ``--json FILE`` writes the report.
"""

from __future__ import annotations

import argparse
import time

from thoughtjax.bench import common

PROMPT = "Write two sentences about the sea."
DEFAULT_SECOND = "embed, blocks[0:20), blocks[10:20), head"
TARGET_MS = 50.0


def _request(model, prompt: str, max_tokens: int) -> tuple[float, float, list[int]]:
  """(seconds to the first delta, compile seconds, token ids) of one greedy chat request."""
  t0 = time.perf_counter()
  g = model.stream(prompt, chat=True, max_tokens=max_tokens, ignore_eos=True)
  it = iter(g)
  next(it)
  first = time.perf_counter() - t0
  for _ in it:
    pass
  return first, g.trace.compile_s, g.completions()[0].token_ids


def run(model, *, first: str | None, second: str, repeats: int, max_tokens: int, prompt: str = PROMPT) -> dict:
  """The figures of the module docstring for ``model`` (a loaded :class:`thoughtjax.Model`)."""
  from thoughtjax.decode import program

  a = model if first is None else model.with_path(first)
  cold_s, cold_compile_s, tokens_a = _request(a, prompt, max_tokens)
  t0 = time.perf_counter()
  b = model.with_path(second)
  compose_s = time.perf_counter() - t0
  if len(b.layers) != len(a.layers):
    raise SystemExit(f"bench shapes: the paths differ in length ({len(a.layers)} and {len(b.layers)} blocks)")
  misses = program.PROGRAMS.stats().misses
  b_first_s, b_compile_s, tokens_b = _request(b, prompt, max_tokens)
  added = program.PROGRAMS.stats().misses - misses
  warm: dict[str, list[float]] = {"first": [], "second": []}
  compiled_later = 0
  for _ in range(repeats):
    for name, m in (("first", a), ("second", b)):
      s, c, _ = _request(m, prompt, max_tokens)
      warm[name].append(s)
      compiled_later += c > 0
  warm_a = common.median(warm["first"])
  return {
    "model": model.loaded.name,
    "first_path": list(a.layers),
    "second_path": list(b.layers),
    "max_tokens": max_tokens,
    "first_cold_ttft_s": cold_s,
    "first_cold_compile_s": cold_compile_s,
    "second_compose_s": compose_s,
    "second_first_ttft_s": b_first_s,
    "second_first_compile_s": b_compile_s,
    "second_programs_added": added,
    "warm_ttft_s": warm,
    "first_warm_median_ttft_s": warm_a,
    "second_warm_median_ttft_s": common.median(warm["second"]),
    "second_first_minus_first_warm_ms": (b_first_s - warm_a) * 1e3,
    "warm_requests_that_compiled": compiled_later,
    "paths_answer_differently": tokens_a != tokens_b,
    "target_met": b_compile_s == 0 and added == 0 and (b_first_s - warm_a) * 1e3 <= TARGET_MS,
  }


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench shapes", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="model name or path (default: the default model)")
  p.add_argument("--weights", default="f32", help="weight form: f32 (default), native, int8 or int8a8")
  p.add_argument("--first", default=None, help="the path that runs first (default: the model's full path)")
  p.add_argument("--second", default=DEFAULT_SECOND, help=f"a path of the same length (default {DEFAULT_SECOND!r})")
  p.add_argument("--repeats", type=int, default=7, help="warm rounds, one request per path each (default 7)")
  p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default 16)")
  p.add_argument("--json", default=None, type=common.json_path, help="write the report to this JSON file")
  args = p.parse_args(argv)
  if args.repeats < 1 or args.max_tokens < 1:
    p.error("--repeats and --max-tokens must be >= 1")
  import thoughtjax

  model = thoughtjax.load(args.model, weights=args.weights)
  res = run(model, first=args.first, second=args.second, repeats=args.repeats, max_tokens=args.max_tokens)
  res["weights"] = args.weights
  ms = lambda s: common.fmt(s * 1e3, ".1f")  # noqa: E731
  rows = [
    ("first path, cold", ms(res["first_cold_ttft_s"]), common.fmt(res["first_cold_compile_s"], ".2f"), "-"),
    ("second path, first request", ms(res["second_first_ttft_s"]), common.fmt(res["second_first_compile_s"], ".2f"),
     str(res["second_programs_added"])),
    (f"first path, warm (median of {args.repeats})", ms(res["first_warm_median_ttft_s"]), "-", "-"),
    (f"second path, warm (median of {args.repeats})", ms(res["second_warm_median_ttft_s"]), "-", "-"),
  ]  # fmt: skip
  common.print_table(
    f"thoughtjax bench shapes: {len(res['first_path'])}-block paths, {args.weights} weights, one process",
    ["request", "TTFT ms", "compile s", "programs added"],
    rows,
    right=["TTFT ms", "compile s", "programs added"],
  )
  print(
    f"second path's first request - first path's warm median: {res['second_first_minus_first_warm_ms']:+.1f} ms "
    f"(target <= {TARGET_MS:.0f} ms, compiling nothing): {'met' if res['target_met'] else 'missed'}; "
    f"composing the second path took {ms(res['second_compose_s'])} ms (not included); the paths answer "
    f"{'differently' if res['paths_answer_differently'] else 'alike'}"
  )
  if args.json:
    common.write_json(args.json, res)
  return 0

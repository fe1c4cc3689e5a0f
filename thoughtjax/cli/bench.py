"""``thoughtjax bench NAME [ARGS...]``: the arguments after the name go to the benchmark ``thoughtjax.bench.NAME``."""

from __future__ import annotations

import importlib

BENCHMARKS = (
  "decode",
  "kernels",
  "registry",
  "synthesis",
  "speculative",
  "serve",
  "structured",
  "prefix",
  "idle",
  "shapes",
  "layers",
)


def cmd_bench(args, rest: list[str]) -> int:
  if args.what not in BENCHMARKS:
    raise SystemExit(f"unknown benchmark {args.what!r}; choose one of {', '.join(BENCHMARKS)}")
  # Imported when chosen: each benchmark pulls in what it measures.
  return importlib.import_module(f"thoughtjax.bench.{args.what}").main(rest)


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (the arguments after the name go to it)"
  )
  p.add_argument("what", choices=BENCHMARKS)
  p.set_defaults(fn=cmd_bench, passthrough=True)

"""``thoughtjax bench NAME [ARGS...]``: the arguments after the name go to the benchmark ``thoughtjax.bench.NAME``.

Each benchmark is a subcommand of ``bench`` only for its name and one-line description in ``bench --help``;
:func:`thoughtjax.cli.main` hands everything after the name to the benchmark's own parser
(``thoughtjax bench NAME --help`` prints that one).
"""

from __future__ import annotations

import importlib

from thoughtjax.bench import BENCHMARKS


def cmd_bench(args, rest: list[str]) -> int:
  # Imported when chosen: each benchmark pulls in what it measures.
  return importlib.import_module(f"thoughtjax.bench.{args.what}").main(rest)


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "bench",
    help="benchmarks that print a table and write JSON (`thoughtjax bench NAME --help` for one's arguments)",
    description="Run one benchmark; the arguments after its name go to it (`thoughtjax bench NAME --help`).",
  )
  sub = p.add_subparsers(dest="what", required=True, metavar="NAME")
  for name, description in BENCHMARKS.items():
    sub.add_parser(name, help=description, add_help=False)  # its own parser answers --help
  p.set_defaults(fn=cmd_bench, passthrough=True)

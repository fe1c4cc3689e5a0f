"""``thoughtjax bench NAME [ARGS...]``: the arguments after the name go to the benchmark ``thoughtjax.bench.NAME``.

Each benchmark is a subcommand of ``bench`` only for its name and one-line description in ``bench --help``;
:func:`thoughtjax.cli.main` hands everything after the name to the benchmark's own parser
(``thoughtjax bench NAME --help`` prints that one).
"""

from __future__ import annotations

import importlib

# Each benchmark module of thoughtjax.bench with the line `bench --help` shows for it (none is imported for it).
BENCHMARKS = {
  "decode": "prefill/decode throughput, first-token latency, start-up and memory (llama.cpp beside it if installed)",
  "kernels": "each kernel op: XLA reference against the Pallas kernel and a CUDA C kernel",
  "registry": "what restoring from a registry costs and what composing into one program buys",
  "synthesis": "what planning costs, how well it predicts latency, what it buys, and the hint router",
  "speculative": "how well a model's own early exits (and n-grams) draft for it, and what speculation buys",
  "serve": "the gRPC server with continuous batching against the library's static batch (or llama-server)",
  "structured": "whether extraction outputs parse and validate, with and without a JSON schema",
  "prefix": "time to first token in a slot engine with and without the prefix cache",
  "idle": "scale to zero and back on a real `thoughtjax serve` process",
  "soak": "a real `thoughtjax serve` under hostile load (half-open sockets, hostile regexes) beside its users",
  "shapes": "a second path of the same shape in a warm process, against the path that has run",
  "layers": "the unrolled program against the layer-indexed one, in the same run",
  "startup": "process start to exit of generate and synthesize, in-process and through a running server",
}


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

"""``thoughtjax bench decode|kernels|registry|synthesis|speculative|serve|structured|prefix|idle [ARGS...]``: the arguments after the name go to the benchmark."""

from __future__ import annotations


def cmd_bench(args, rest: list[str]) -> int:
  if args.what == "decode":
    from thoughtjax.bench import decode

    return decode.main(rest)
  if args.what == "kernels":
    from thoughtjax.bench import kernels

    return kernels.main(rest)
  if args.what == "registry":
    from thoughtjax.bench import registry

    return registry.main(rest)
  if args.what == "synthesis":
    from thoughtjax.bench import synthesis

    return synthesis.main(rest)
  if args.what == "speculative":
    from thoughtjax.bench import speculative

    return speculative.main(rest)
  if args.what == "serve":
    from thoughtjax.bench import serve

    return serve.main(rest)
  if args.what == "structured":
    from thoughtjax.bench import structured

    return structured.main(rest)
  if args.what == "prefix":
    from thoughtjax.bench import prefix

    return prefix.main(rest)
  if args.what == "idle":
    from thoughtjax.bench import idle

    return idle.main(rest)
  raise SystemExit(f"unknown benchmark {args.what!r}")


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "bench",
    help="benchmarks: decode, kernels, registry, synthesis, speculative, serve, structured, prefix, idle (args after the "
    "name go to it)",
  )
  p.add_argument(
    "what",
    choices=("decode", "kernels", "registry", "synthesis", "speculative", "serve", "structured", "prefix", "idle"),
  )
  p.set_defaults(fn=cmd_bench, passthrough=True)

"""``thoughtjax`` command line: fetch, generate, score, bench, registry.

One module per command group: :mod:`.model_commands` (fetch, generate, score), :mod:`.bench`
and :mod:`.registry`. :func:`main` holds the one error policy.

Output contracts other tools rely on:
  generate --json  -> one JSON object with ``token_ids`` (generated ids) and ``text``
  score --json     -> one JSON object with per-position ``top_ids``/``top_logits``,
                      ``nll`` and ``perplexity``
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from thoughtjax.cli import bench, model_commands, registry
from thoughtjax.cli.registry import load_from_registry

__all__ = ["build_parser", "load_from_registry", "main"]


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="thoughtjax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  model_commands.add_parsers(sub)
  bench.add_parser(sub)
  registry.add_parser(sub)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  if len(argv) >= 2 and argv[0] == "bench":
    args = parser.parse_args(argv[:2])
    return args.fn(args, argv[2:])
  args = parser.parse_args(argv)
  try:
    return args.fn(args)
  except Exception as e:
    if not _is_user_error(e):
      raise
    # User-facing failures (bad path, bad model, fetch errors, registry integrity): one line.
    print(f"thoughtjax {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


def _is_user_error(e: Exception) -> bool:
  from thoughtjax.fetch import FetchError

  if isinstance(e, (FileNotFoundError, ValueError, FetchError)):
    return True
  return isinstance(e, registry._user_errors())  # imported only when something failed

"""``thoughtjax`` command line: fetch, generate, score, bench, registry.

One module per command group: :mod:`.model_commands` (fetch, generate, score), :mod:`.bench`
and :mod:`.registry`. :func:`main` holds the one error policy.

Imports inside the command functions are deferred on purpose: a command loads the synthesis, registry, server
and benchmark modules it uses and no others, so ``thoughtjax --help`` and a plain ``generate`` start without them.

Output contracts other tools rely on:
  generate --json  -> one JSON object with ``token_ids`` (generated ids) and ``text``
  score --json     -> one JSON object with per-position ``top_ids``/``top_logits``,
                      ``nll`` and ``perplexity``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from thoughtjax.cli import bench, model_commands, registry, serve, synthesis
from thoughtjax.cli.args import Parser
from thoughtjax.cli.registry import load_from_registry
from thoughtjax.errors import UserError

__all__ = ["build_parser", "command_name", "load_from_registry", "main", "version"]


def build_parser() -> argparse.ArgumentParser:
  # A Parser's subparsers, nested ones too, are Parsers: every command's --help shows its defaults.
  parser = Parser(prog="thoughtjax", description=__doc__.splitlines()[0])
  parser.add_argument("--version", action="version", version=f"thoughtjax {version()}")
  sub = parser.add_subparsers(dest="command", required=True)
  model_commands.add_parsers(sub)
  bench.add_parser(sub)
  registry.add_parser(sub)
  synthesis.add_parsers(sub)
  serve.add_parsers(sub)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Run one command; returns its exit status.

  The one error policy: a :class:`~thoughtjax.errors.UserError` (the caller can fix it; its message says
  how) is printed as ``thoughtjax <command>: error: <Type>: <message>`` on stderr, exit status 2.
  Anything else is a bug and propagates with its traceback. argparse usage errors exit 2 too.
  """
  import thoughtjax

  thoughtjax.use_memory_scheduler()  # a process-level choice: before any command starts JAX
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  if len(argv) >= 2 and argv[0] == "bench":  # everything after the benchmark's name is its own
    args, run = parser.parse_args(argv[:2]), lambda a: a.fn(a, argv[2:])
  else:
    args = parser.parse_args(argv)
    run = args.fn
  try:
    return run(args)
  except UserError as e:
    print(f"thoughtjax {command_name(args)}: error: {type(e).__name__}: {e}", file=sys.stderr)
    return 2


def version() -> str:
  """The installed distribution's version (the source tree's pyproject when run from a checkout)."""
  from importlib import metadata

  try:
    return metadata.version("thoughtjax")
  except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
      return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
      return "unknown"


def command_name(args: argparse.Namespace) -> str:
  """``generate``, ``registry verify``, ``bench decode``: the command as the user typed it."""
  sub = getattr(args, "registry_command", None) or getattr(args, "what", None)
  return f"{args.command} {sub}" if sub else args.command

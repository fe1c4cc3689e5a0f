"""Every ``thoughtjax`` command the README and docs/ show exists as written.

A command is a line of a fenced ``bash``/``sh``/plain code block, or an inline code span, whose first program is
``thoughtjax`` (``.venv/bin/thoughtjax`` too). Its subcommands are walked down :func:`thoughtjax.cli.build_parser`
and every ``--flag`` it uses, optional ones in ``[brackets]`` included, must be an option of the parser it reaches:
in process, no subprocess and no model. ``thoughtjax bench NAME`` hands its arguments to the benchmark's own parser
(``thoughtjax.bench.NAME.main``), which is taken from there without running anything.

Placeholders (``DIR``, ``FILE``, ``N``, ``...``, ``a|b`` alternatives) are values: they are not checked, except
that each alternative of a subcommand (``bench decode|serve``) must exist and take every flag that follows.
docs/benchmarks-history.md is left out: it records the commands as they were run then.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shlex
from pathlib import Path

import pytest

from thoughtjax.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs" / "benchmarks-history.md"
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p != HISTORY)]

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL = {"", "bash", "sh", "shell", "console"}
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_.]*|\.\.\.|…)$")


def commands(text: str) -> list[tuple[int, str]]:
  """(line number, command) of every thoughtjax command in ``text``: shell blocks' lines (``\\`` continuations
  joined) and inline code spans outside fenced blocks."""
  found: list[tuple[int, str]] = []
  outside = text
  for m in FENCE.finditer(text):
    outside = outside.replace(m.group(0), "\n" * m.group(0).count("\n"), 1)
    if m.group(1).lower() not in SHELL:
      continue
    first = text.count("\n", 0, m.start(2)) + 1
    pending, start = "", first
    for i, line in enumerate(m.group(2).splitlines()):
      if not pending:
        start = first + i
      if line.rstrip().endswith("\\"):
        pending += line.rstrip()[:-1] + " "
        continue
      found += [(start, c) for c in _thoughtjax_commands(pending + line)]
      pending = ""
  for n, line in enumerate(outside.splitlines(), 1):
    for span in INLINE.findall(line):
      found += [(n, c) for c in _thoughtjax_commands(span)]
  return found


def _thoughtjax_commands(line: str) -> list[str]:
  """The thoughtjax commands of one shell line (``a && b; c`` is three), each from its ``thoughtjax`` on."""
  out = []
  for part in re.split(r"&&|;|\|\|", line):
    try:
      tokens = shlex.split(part, comments=True)
    except ValueError:  # an unbalanced quote: prose in an inline span, not a command
      continue
    for i, token in enumerate(tokens):
      if token.rsplit("/", 1)[-1] == "thoughtjax":
        out.append(shlex.join(tokens[i:]))
        break
  return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      return dict(action.choices)
  return {}


class _Built(Exception):
  def __init__(self, parser):
    self.parser = parser


@functools.cache
def bench_parser(name: str) -> argparse.ArgumentParser:
  """The parser ``thoughtjax.bench.<name>.main`` builds, caught at its ``parse_args`` before it runs anything."""

  def caught(self, *args, **kwargs):
    raise _Built(self)

  module = importlib.import_module(f"thoughtjax.bench.{name}")
  saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
  argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = caught
  try:
    module.main([])
  except _Built as built:
    return built.parser
  finally:
    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
  raise AssertionError(f"thoughtjax.bench.{name}.main built no parser before running: expected an argparse parser")


def _options(parser: argparse.ArgumentParser) -> set[str]:
  return {s for action in parser._actions for s in action.option_strings}


def check(command: str) -> list[str]:
  """What is wrong with one ``thoughtjax ...`` command: unknown subcommands and flags; empty when it is right."""
  tokens = [t.strip("[]()") for t in shlex.split(command)[1:]]
  tokens = [t for t in tokens if t and t != "|"]
  reached = [("thoughtjax", build_parser())]  # (command as typed, its parser); several for `a|b` alternatives
  i = 0
  while i < len(tokens) and all(_subparsers(p) for _, p in reached):
    token = tokens[i]
    if token.startswith("-"):
      break  # a flag of the group itself (thoughtjax --version, bench --help)
    if PLACEHOLDER.match(token):  # `thoughtjax COMMAND --help`: any subcommand, so no flag but --help is known
      rest = [t for t in tokens[i + 1 :] if FLAG.match(t) and t not in ("-h", "--help")]
      return [f"`{reached[0][0]} {token}`: a placeholder subcommand takes only --help, got {f}" for f in rest]
    below = []
    for typed, parser in reached:
      choices = _subparsers(parser)
      for name in token.split("|"):
        if name not in choices:
          return [f"`{typed}` has no subcommand {name!r} (it has: {', '.join(choices)})"]
        below.append((f"{typed} {name}", bench_parser(name) if typed == "thoughtjax bench" else choices[name]))
    reached, i = below, i + 1
  problems = []
  for token in tokens[i:]:
    for flag in (f.split("=", 1)[0] for f in token.split("|")):
      if FLAG.match(flag):  # else a value or a placeholder
        problems += [
          f"`{typed}` has no option {flag} (`{typed} --help` lists them)"
          for typed, parser in reached
          if flag not in _options(parser)
        ]
  return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_exists(doc: Path):
  found = commands(doc.read_text())
  problems = [f"{doc.name}:{line}: {cmd}\n    {p}" for line, cmd in found for p in check(cmd)]
  assert not problems, "commands in the docs that the command line refuses:\n" + "\n".join(problems)


def test_readme_shows_install_serve_and_tests():
  readme = (ROOT / "README.md").read_text()
  shown = {cmd.split()[1] for _, cmd in commands(readme) if len(cmd.split()) > 1}
  assert {"synthesize", "serve"} <= shown, f"the README's first commands: expected synthesize and serve, got {shown}"
  assert "/v1/chat/completions" in readme and "curl" in readme, "the README shows no curl to /v1/chat/completions"
  assert "pytest" in readme, "the README does not say how to run the tests with pytest"
  assert "bash .ci/run" in readme and (ROOT / ".ci" / "run").is_file(), "README: `bash .ci/run`, and the script"
  for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", readme):
    assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_docs_links_resolve():
  for doc in [*DOCS, HISTORY]:
    for link in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", doc.read_text()):
      assert (doc.parent / link).resolve().is_file(), f"{doc.relative_to(ROOT)} links to {link}: no such file"


@pytest.mark.parametrize(
  "command, wrong",
  [
    ("thoughtjax serve --no-such-flag", "no option --no-such-flag"),
    ("thoughtjax nosuch --prompt x", "no subcommand 'nosuch'"),
    ("thoughtjax bench registry --quick", "bench registry` has no option --quick"),
    ("thoughtjax generate --prompt TEXT [--chat] [--bogus N]", "no option --bogus"),
    ("thoughtjax registry nosuch DIR", "no subcommand 'nosuch'"),
    ("thoughtjax bench decode|registry [--quick]", "bench registry` has no option --quick"),
    ("thoughtjax score (--text TEXT | --tokens 1,2)", "no option --tokens"),
    ("thoughtjax COMMAND --prompt x", "placeholder subcommand takes only --help"),
    ("thoughtjax generate --max-tokenz=8", "no option --max-tokenz"),
  ],
)
def test_check_refuses(command, wrong):
  assert any(wrong in p for p in check(command)), check(command)


@pytest.mark.parametrize(
  "command",
  [
    'thoughtjax generate --prompt TEXT [--chat] [--max-tokens N] --path "embed, blocks[0:12), head"',
    "thoughtjax score --model NAME|PATH (--text TEXT | --token-ids 1,2,3) [--json]",
    "thoughtjax bench decode --weights native,f32 --json FILE",
    "thoughtjax bench --help",
    "thoughtjax --version",
    "thoughtjax registry keygen keys/mine",
    "thoughtjax serve --host 0.0.0.0 --http-port=8080",
    "thoughtjax registry ...",
    "thoughtjax COMMAND --help",
    "thoughtjax bench NAME --help",
  ],
)
def test_check_accepts(command):
  assert check(command) == []


def test_commands_found_in_blocks_and_spans():
  text = (
    "Run `thoughtjax fetch` first.\n\n```bash\n"
    "python3 -m venv .venv && .venv/bin/thoughtjax synthesize --hint h \\\n  --prompt x  # a comment\n"
    "THOUGHTJAX_CACHE=DIR thoughtjax plan --max-latency-ms 1 --prompt p\n```\n\n"
    "```python\nthoughtjax.load()  # not a shell line: thoughtjax --nope\n```\n"
  )
  assert commands(text) == [
    (4, ".venv/bin/thoughtjax synthesize --hint h --prompt x"),
    (6, "thoughtjax plan --max-latency-ms 1 --prompt p"),
    (1, "thoughtjax fetch"),
  ]

"""One convention for the whole command line: ``--registry DIR`` wherever a registry is opened (the older
positional DIR still taken), defaults and help text in every ``--help``, one default for new tokens, no choice
offered that the command then refuses, and ``bench --help`` describing each benchmark."""

from __future__ import annotations

import argparse
import importlib.util
import re

import pytest

from thoughtjax import cli
from thoughtjax.cli import args as args_lib
from thoughtjax.cli.bench import BENCHMARKS
from thoughtjax.defaults import DEFAULT_MAX_TOKENS
from thoughtjax.sampling import SamplingParams

# The other engineer's commands (thoughtjax/cli/serve.py): the formatter reaches them, their help texts are theirs.
SERVING = ("serve", "client")


def _parsers(parser: argparse.ArgumentParser, name: str = "thoughtjax"):
  """(command as typed, parser) of every parser in the tree, nested subcommands included."""
  yield name, parser
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub_name, sub in action.choices.items():
        yield from _parsers(sub, f"{name} {sub_name}")


ALL = dict(_parsers(cli.build_parser()))


def _flat(text: str) -> str:
  return " ".join(text.split())


def test_every_parser_shows_defaults():
  """The formatter is set once, on the top parser, and reaches every subparser (``registry build``, ``serve``)."""
  assert {"thoughtjax registry build", "thoughtjax serve", "thoughtjax bench decode"} <= set(ALL)
  for name, parser in ALL.items():
    assert isinstance(parser, args_lib.Parser) and parser.formatter_class is args_lib.HelpFormatter, name


@pytest.mark.parametrize("name", [n for n in ALL if not any(f"thoughtjax {s}" == n for s in SERVING)])
def test_every_argument_has_help(name):
  for action in ALL[name]._actions:
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
      continue
    assert action.help, f"{name}: {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize(
  "command, shown",
  [
    ("generate", f"--max-tokens MAX_TOKENS new tokens to generate at most (default: {DEFAULT_MAX_TOKENS})"),
    ("plan", f"(default: {DEFAULT_MAX_TOKENS})"),
    ("synthesize", "--top-p TOP_P sample within this cumulative probability; 1 = off (default: 1.0)"),
    ("paths", "--prompt-tokens PROMPT_TOKENS prompt length the latency is predicted for (default: 32)"),
    ("registry build", "--context CONTEXT profile: KV cache length (default: 256)"),
    ("registry warm", "--budget-ms BUDGET_MS [BUDGET_MS ...] latency budgets"),
    ("registry verify", "--flops-tolerance FLOPS_TOLERANCE with --hardware: allowed relative FLOP count "),
    ("registry heal", "--steps STEPS optimizer steps (default: 300)"),
    ("fetch", "known model to fetch (default: smollm2-135m-instruct)"),
  ],
)
def test_help_shows_the_defaults(command, shown):
  text = _flat(ALL[f"thoughtjax {command}"].format_help())
  assert shown in text
  assert "(default: None)" not in text and "(default: False)" not in text  # nothing to show, nothing shown


def test_one_default_for_new_tokens():
  parser = cli.build_parser()
  for argv in (
    ["generate", "--prompt", "x"],
    ["plan", "--prompt", "x", "--max-latency-ms", "1"],
    ["synthesize", "--prompt", "x", "--max-latency-ms", "1"],
    ["paths", "--registry", "r", "--hint", "h"],
  ):
    assert parser.parse_args(argv).max_tokens == DEFAULT_MAX_TOKENS, argv
  assert parser.parse_args(["registry", "warm", "r"]).max_tokens == [DEFAULT_MAX_TOKENS]
  assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("command", ["plan", "synthesize"])
def test_plan_offers_only_the_weights_it_takes(command, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main([command, "--prompt", "x", "--max-latency-ms", "1", "--weights", "int8"])
  assert info.value.code == 2 and "invalid choice: 'int8' (choose from 'f32', 'native')" in capsys.readouterr().err
  assert re.search(r"--weights \{f32,native\}", ALL[f"thoughtjax {command}"].format_help())


def test_optional_hints_are_not_shown_as_required():
  for command in ("plan", "synthesize"):
    parser = ALL[f"thoughtjax {command}"]
    assert "[--hint HINT]" in parser.format_usage()
    assert "optional (default: the registry's hint router picks one" in _flat(parser.format_help())


def test_draft_vocab_says_what_the_draft_reads():
  assert "reads only token ids 0..N-1" in _flat(ALL["thoughtjax generate"].format_help())


def test_bench_help_describes_every_benchmark(capsys):
  with pytest.raises(SystemExit):
    cli.main(["bench", "--help"])
  out = _flat(capsys.readouterr().out)
  for name, description in BENCHMARKS.items():
    assert importlib.util.find_spec(f"thoughtjax.bench.{name}") is not None, name
    assert f"{name} {_flat(description)}" in out


# ------------------------------------------------------------------------------ --registry
# Every command that opens a registry, as (argv before the registry, argv after it).
OPENERS = [
  (["paths"], ["--hint", "general_purpose"]),
  (["registry", "verify"], []),
  (["registry", "list"], []),
  (["registry", "show"], ["head"]),
  (["registry", "gc"], []),
  (["registry", "accept"], []),
  (["registry", "revoke-key"], ["0123abcd", "--sign-key", "{key}"]),
  (["registry", "heal"], ["--path", "embed, head"]),
  (["registry", "calibrate"], []),
  (["registry", "warm"], []),
  (["registry", "train-router"], []),
]
FLAG_ONLY = [
  (["generate"], ["--prompt", "x"]),
  (["score"], ["--token-ids", "1"]),
  (["plan"], ["--prompt", "x", "--max-latency-ms", "1"]),
  (["synthesize"], ["--prompt", "x", "--max-latency-ms", "1"]),
  (["corrections"], []),
]


def _fill(argv, tmp_path):
  key = tmp_path / "k.key"
  key.write_text("key")
  return [a.format(key=key) for a in argv]


def _one_error(capsys, command: str) -> str:
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  prefix = f"thoughtjax {command}: error: CommandLineError: "
  assert err.startswith(prefix), err
  return err[len(prefix) :].strip()


@pytest.mark.parametrize("head, tail", OPENERS + FLAG_ONLY, ids=lambda v: " ".join(v) if v else "-")
def test_every_opener_takes_registry(head, tail, tmp_path, capsys):
  missing = tmp_path / "missing"
  assert cli.main([*head, "--registry", str(missing), *_fill(tail, tmp_path)]) == 2
  message = _one_error(capsys, " ".join(head))
  assert message.startswith(f"--registry {missing}: expected a directory, found nothing")


@pytest.mark.parametrize("head, tail", OPENERS, ids=lambda v: " ".join(v) if v else "-")
def test_the_positional_form_still_works_and_two_that_disagree_are_refused(head, tail, tmp_path, capsys):
  missing, other = tmp_path / "missing", tmp_path / "other"
  tail = _fill(tail, tmp_path)
  assert cli.main([*head, str(missing), *tail]) == 2
  assert _one_error(capsys, " ".join(head)).startswith(f"registry directory {missing}: expected a directory")
  # --registry after the positionals: argparse fills an optional positional from the first run of them.
  assert cli.main([*head, str(missing), *tail, "--registry", str(missing)]) == 2  # the same one twice: fine
  assert _one_error(capsys, " ".join(head)).startswith(f"--registry {missing}: expected a directory")
  if head[-1] == "revoke-key":  # with --registry every positional is a key id: nothing can disagree
    return
  assert cli.main([*head, str(missing), *tail, "--registry", str(other)]) == 2
  assert _one_error(capsys, " ".join(head)) == (
    f"two registry directories given: --registry {str(other)!r} and DIR {str(missing)!r}; give one, as --registry DIR"
  )


@pytest.mark.parametrize("head, tail", OPENERS, ids=lambda v: " ".join(v) if v else "-")
def test_no_registry_is_one_line_naming_the_flag(head, tail, tmp_path, capsys):
  assert cli.main([*head, *_fill(tail, tmp_path)]) == 2
  assert _one_error(capsys, " ".join(head)) == "no registry directory given; pass --registry DIR"


def test_build_takes_registry_out_and_the_positional_form(tmp_path, capsys):
  target = tmp_path / "notes.txt"
  target.write_text("not a registry")
  for given, label in ((["--registry", str(target)], "--registry"), (["--out", str(target)], "--out")):
    assert cli.main(["registry", "build", *given]) == 2
    assert _one_error(capsys, "registry build").startswith(f"{label} {target}: expected a directory (new or existing)")
  assert cli.main(["registry", "build", "--out", str(target), "--registry", str(tmp_path / "reg")]) == 2
  assert _one_error(capsys, "registry build").startswith("two registry directories given: --registry ")
  assert cli.main(["registry", "build"]) == 2
  assert _one_error(capsys, "registry build") == "no registry directory given; pass --registry DIR"


def test_revoke_key_with_registry_takes_every_positional_as_a_key_id(tmp_path, monkeypatch, capsys):
  from thoughtjax.registry import Registry

  published = {}

  class Reg:
    root, sequence, signing_keys = tmp_path, 3, ("k",)

    def publish(self, thoughtlets, *, sign_key, settings, revoke_keys):
      published["keys"] = list(revoke_keys)
      self.sequence = 4

  monkeypatch.setattr(Registry, "open", staticmethod(lambda root, **kw: Reg()))
  key = _fill(["{key}"], tmp_path)[0]
  assert cli.main(["registry", "revoke-key", "--registry", str(tmp_path), "aaaa", "bbbb", "--sign-key", key]) == 0
  assert published["keys"] == ["aaaa", "bbbb"]
  assert cli.main(["registry", "revoke-key", str(tmp_path), "aaaa", "bbbb", "--sign-key", key]) == 0
  assert published["keys"] == ["aaaa", "bbbb"]
  capsys.readouterr()


@pytest.mark.parametrize("name", [n for n in ALL if not any(f"thoughtjax {s}" == n for s in SERVING)])
def test_registry_is_the_documented_form(name):
  """Where a command takes a registry, its help shows ``--registry DIR`` and no positional DIR."""
  parser = ALL[name]
  flags = {s for a in parser._actions for s in a.option_strings}
  if "--registry" in flags:
    usage = parser.format_usage()
    assert "--registry DIR" in usage and not re.search(r" dir\b", usage), usage


def test_trust_flags_wherever_a_registry_is_opened():
  for name, parser in ALL.items():
    flags = {s for a in parser._actions for s in a.option_strings}
    if "--registry" in flags and not name.startswith("thoughtjax bench"):
      assert {"--public-key", "--require-signatures"} <= flags, name


def test_bench_commands_that_open_a_registry_take_the_trust_flags(capsys):
  assert cli.main(["bench", "synthesis", "--require-signatures"]) == 2
  assert "check a registry you name: add --registry DIR" in capsys.readouterr().err
  for argv in (["bench", "speculative", "--require-signatures"], ["bench", "serve", "--peer", "llama-server"]):
    with pytest.raises(SystemExit) as info:
      cli.main([*argv, "--public-key", "k.pub"])
    assert info.value.code == 2 and "--public-key" in capsys.readouterr().err


def test_the_command_line_and_the_client_start_without_jax():
  """``import thoughtjax``, the whole parser tree, the gRPC client and the local-server lookup load no JAX: a
  command that talks to a running server never pays for it."""
  import subprocess
  import sys

  probe = (
    "import sys, thoughtjax, thoughtjax.client, thoughtjax.local_server, thoughtjax.cli.remote\n"
    "from thoughtjax.cli import build_parser\n"
    "build_parser().parse_args(['generate', '--prompt', 'x'])\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'numpy', 'flax', 'orbax'))\n"
    "print(heavy)"
  )
  got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
  assert got.stdout.strip() == "[]"

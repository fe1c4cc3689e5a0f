"""The one error policy of the command line, ``--kernels`` and the trust flags.

A UserError is one line on stderr and exit status 2; anything else is a bug and keeps its
traceback; usage errors are argparse's (exit 2 with the usage line).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from tests.registry.helpers import REPO
from thoughtjax import cli
from thoughtjax.cli import args as args_lib
from thoughtjax.cli import model_commands
from thoughtjax.cli import registry as registry_commands
from thoughtjax.errors import UserError
from thoughtjax.registry import RegistryError, TrustPolicy

MESSAGE = "model 'x': expected a known name, got 'x'; pass smollm2-135m-instruct"


def _raise(exc):
  def command(args):
    raise exc

  return command


def test_a_user_error_is_one_line_and_exit_2(monkeypatch, capsys):
  monkeypatch.setattr(model_commands, "cmd_fetch", _raise(UserError(MESSAGE)))
  assert cli.main(["fetch"]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err == f"thoughtjax fetch: error: UserError: {MESSAGE}\n"


def test_a_subclass_from_a_registry_subcommand_names_the_subcommand(monkeypatch, capsys):
  monkeypatch.setattr(registry_commands, "cmd_list", _raise(RegistryError("index.json: sequence 3 < 5 seen")))
  assert cli.main(["registry", "list", "somewhere"]) == 2
  assert capsys.readouterr().err == "thoughtjax registry list: error: RegistryError: index.json: sequence 3 < 5 seen\n"


@pytest.mark.parametrize(
  "bug", [ZeroDivisionError("division by zero"), KeyError("top_ids"), FileNotFoundError("/tmp/some/internal/file")]
)
def test_anything_else_is_a_bug_and_propagates(monkeypatch, bug):
  monkeypatch.setattr(model_commands, "cmd_fetch", _raise(bug))
  with pytest.raises(type(bug)):
    cli.main(["fetch"])


def test_a_jax_value_error_is_a_bug_not_a_user_error(monkeypatch):
  """JAX raises ValueError for shape bugs; the old policy printed every ValueError as a user error."""

  def broken(args):
    return len(jnp.split(jnp.ones(3), 2))  # a shape bug inside the library: JAX raises ValueError

  monkeypatch.setattr(model_commands, "cmd_fetch", broken)
  with pytest.raises(ValueError) as info:
    cli.main(["fetch"])
  assert not isinstance(info.value, UserError)


def test_a_bug_keeps_its_traceback_in_a_real_process():
  code = (
    "from thoughtjax import cli\nfrom thoughtjax.cli import model_commands\n"
    "model_commands.cmd_fetch = lambda args: 1 / 0\ncli.main(['fetch'])\n"
  )
  r = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
    env={**os.environ, "PYTHONPATH": str(REPO)},
  )
  assert r.returncode == 1
  assert "Traceback (most recent call last)" in r.stderr and "ZeroDivisionError: division by zero" in r.stderr
  assert "error: ZeroDivisionError" not in r.stderr


def _user_facing_classes():
  from thoughtjax.assembly import PathTypeError
  from thoughtjax.config import UnsupportedModelError
  from thoughtjax.fetch import FetchError
  from thoughtjax.kernels.dispatch import KernelChoiceError
  from thoughtjax.mapping import MappingError
  from thoughtjax.path_syntax import PathSyntaxError
  from thoughtjax.registry import IntegrityError, ResourceProfileMismatch, UnknownThoughtletError
  from thoughtjax.signing import SignatureError

  return [
    RegistryError,
    IntegrityError,
    UnknownThoughtletError,
    ResourceProfileMismatch,
    SignatureError,
    PathSyntaxError,
    PathTypeError,
    MappingError,
    FetchError,
    UnsupportedModelError,
    KernelChoiceError,
    args_lib.CommandLineError,
  ]


@pytest.mark.parametrize("cls", _user_facing_classes(), ids=lambda c: c.__name__)
def test_every_user_facing_error_is_a_user_error(cls):
  """The policy is ``except UserError``: a user-facing class outside it would print a traceback."""
  assert issubclass(cls, UserError)


def test_usage_errors_keep_exit_2(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["generate"])  # --prompt is required
  assert info.value.code == 2 and "the following arguments are required: --prompt" in capsys.readouterr().err


# ------------------------------------------------------------------------------ paths
def test_a_missing_model_path_is_named_where_it_is_taken(tmp_path, capsys):
  missing = tmp_path / "nope.gguf"
  assert cli.main(["score", "--model", str(missing), "--token-ids", "1,2"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"thoughtjax score: error: CommandLineError: --model '{missing}' is neither a known name")
  assert err.count("\n") == 1


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["registry", "verify", "{missing}"], "registry directory {missing}: expected a directory, found nothing"),
    (["registry", "validate", "{missing}"], "mapping {missing}: expected a file, found nothing"),
    (["registry", "build", "--out", "{tmp}/reg", "--mapping", "{missing}"], "--mapping {missing}: expected a file"),
    (["registry", "build", "--out", "{tmp}/reg", "--sign-key", "{missing}"], "--sign-key {missing}: expected a file"),
    (["registry", "gc", "{missing}"], "registry directory {missing}: expected a directory"),
    (["generate", "--registry", "{missing}", "--prompt", "x"], "--registry {missing}: expected a directory"),
  ],
)
def test_missing_user_paths_are_command_line_errors(tmp_path, capsys, argv, flag):
  missing = tmp_path / "missing"
  fill = lambda s: s.format(missing=missing, tmp=tmp_path)  # noqa: E731
  assert cli.main([fill(a) for a in argv]) == 2
  err = capsys.readouterr().err
  assert f"error: CommandLineError: {fill(flag)}" in err and err.count("\n") == 1


def test_a_build_into_a_file_is_refused_before_any_work(tmp_path, capsys):
  target = tmp_path / "notes.txt"
  target.write_text("not a registry")
  assert cli.main(["registry", "build", "--out", str(target), "--model", str(tmp_path)]) == 2
  assert capsys.readouterr().err == (
    f"thoughtjax registry build: error: CommandLineError: --out {target}: expected a "
    "directory (new or existing), found a file; pick another path\n"
  )
  assert target.read_text() == "not a registry"


def test_keygen_over_an_existing_pair_says_how_to_replace_it(tmp_path, capsys):
  assert cli.main(["registry", "keygen", str(tmp_path / "team")]) == 0
  capsys.readouterr()
  assert cli.main(["registry", "keygen", str(tmp_path / "team")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("thoughtjax registry keygen: error: CommandLineError: keygen ") and "--force" in err


def test_score_flags_that_do_not_go_together(capsys):
  assert cli.main(["score", "--text", "a", "--token-ids", "1"]) == 2
  assert "give exactly one of --text or --token-ids" in capsys.readouterr().err


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["score", "--token-ids", "1"]])
def test_kernels_accepts_only_the_dispatch_table(command, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main([*command, "--kernels", "cuda"])
  assert info.value.code == 2
  assert "argument --kernels: invalid choice: 'cuda' (choose from 'xla', 'pallas')" in capsys.readouterr().err


def test_sampler_is_gone(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["generate", "--prompt", "x", "--sampler", "xla"])
  assert info.value.code == 2 and "unrecognized arguments: --sampler xla" in capsys.readouterr().err


@pytest.mark.parametrize("choice", [None, "xla", "pallas"])
def test_kernels_reaches_the_model(monkeypatch, choice):
  import thoughtjax

  seen = {}

  class Stop(Exception):
    pass

  def fake_load(name_or_path=None, **kw):
    seen.update(kw)
    raise Stop

  monkeypatch.setattr(thoughtjax, "load", fake_load)
  argv = ["generate", "--prompt", "x"] + ([] if choice is None else ["--kernels", choice])
  with pytest.raises(Stop):
    cli.main(argv)
  assert seen == {"kernels": choice, "weights": "f32"}


# ------------------------------------------------------------------------------ trust
def test_trust_flags_become_one_trust_policy(tmp_path):
  keys = [tmp_path / "a.pub", tmp_path / "b.pub"]
  for k in keys:
    k.write_text("key")
  parser = cli.build_parser()
  for argv in (
    ["generate", "--registry", "r", "--prompt", "x"],
    ["score", "--registry", "r"],
    ["registry", "verify", "r"],
    ["registry", "list", "r"],
    ["registry", "show", "r", "head"],
    ["registry", "build", "--out", "r"],
    ["registry", "gc", "r"],
  ):
    args = parser.parse_args(
      [*argv, "--public-key", str(keys[0]), "--public-key", str(keys[1]), "--require-signatures"]
    )
    assert args_lib.trust_policy(args) == TrustPolicy(public_keys=tuple(keys), require_signatures=True)
    args = parser.parse_args(argv)
    assert args_lib.trust_policy(args) == TrustPolicy(public_keys=(), require_signatures=False)


def test_the_policy_is_what_the_registry_is_opened_with(tmp_path, monkeypatch):
  from thoughtjax.registry import Registry

  key = tmp_path / "team.pub"
  key.write_text("key")
  opened = []

  class Stop(Exception):
    pass

  def fake_open(root, trust=None, **kw):
    opened.append((Path(root), trust, kw))
    raise Stop

  monkeypatch.setattr(Registry, "open", staticmethod(fake_open))
  for argv in (["registry", "list", str(tmp_path)], ["generate", "--registry", str(tmp_path), "--prompt", "x"]):
    with pytest.raises(Stop):
      cli.main([*argv, "--public-key", str(key), "--require-signatures"])
  assert opened == [(tmp_path, TrustPolicy(public_keys=(key,), require_signatures=True), {"weights": "f32"})] * 2


def test_build_and_gc_verify_the_index_under_the_policy(tmp_path, monkeypatch):
  import thoughtjax.registry as registry_lib

  key = tmp_path / "team.pub"
  key.write_text("key")
  policy = TrustPolicy(public_keys=(key,), require_signatures=True)
  seen = []

  class Stop(Exception):
    pass

  def fake(*args, trust=None, **kw):
    seen.append(trust)
    raise Stop

  monkeypatch.setattr(registry_lib, "build", fake)
  monkeypatch.setattr(registry_lib, "collect_garbage", fake)
  for argv in (
    ["registry", "build", "--out", str(tmp_path / "reg"), "--model", str(tmp_path)],
    ["registry", "gc", str(tmp_path)],
  ):
    with pytest.raises(Stop):
      cli.main([*argv, "--public-key", str(key), "--require-signatures"])
  assert seen == [policy, policy]


def test_a_missing_public_key_file_is_named(tmp_path, capsys):
  (tmp_path / "reg").mkdir()
  assert cli.main(["registry", "list", str(tmp_path / "reg"), "--public-key", str(tmp_path / "gone.pub")]) == 2
  assert f"error: CommandLineError: --public-key {tmp_path / 'gone.pub'}: expected a file" in capsys.readouterr().err


def test_trust_flags_without_a_registry_are_refused(capsys):
  assert cli.main(["generate", "--prompt", "x", "--require-signatures"]) == 2
  assert "--public-key and --require-signatures check a registry: add --registry DIR" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra_in_one_line(monkeypatch, capsys, tmp_path):
  """matplotlib is the plot extra: its absence is one line naming the install command, exit 2, before any work
  (here the registry directory does not even exist: the plot check comes first)."""
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ModuleNotFoundError
  png = tmp_path / "front.png"
  assert cli.main(["paths", str(tmp_path / "registry"), "--hint", "general_purpose", "--plot", str(png)]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1
  assert err.startswith("thoughtjax paths: error: CommandLineError: --plot needs matplotlib")
  assert "pip install 'thoughtjax[plot]'" in err and not png.exists()


def test_version_prints_the_package_version(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--version"])
  assert e.value.code == 0
  assert capsys.readouterr().out.strip() == f"thoughtjax {cli.version()}" and cli.version()[0].isdigit()

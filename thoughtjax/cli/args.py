"""Arguments shared by several commands: the help formatter, paths a user types, ``--registry``, ``--kernels``,
and the trust flags.

A path the user gives is checked where it is taken, so a missing file is a :class:`CommandLineError`
(one line, exit status 2) naming the flag, never a ``FileNotFoundError`` from deep inside a loader.

Every parser of the command line is a :class:`Parser` (``add_subparsers`` makes its children of the parent's
class), so every ``--help``, nested ones such as ``registry build --help`` included, shows each option's default.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from thoughtjax.defaults import DEFAULT_MAX_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.kernels import dispatch


class CommandLineError(UserError, ValueError):
  """A command-line argument names something that does not exist, or flags that do not go together."""


class HelpFormatter(argparse.HelpFormatter):
  """argparse's ``ArgumentDefaultsHelpFormatter``, without the noise: an option's help ends with
  ``(default: X)`` unless there is nothing to show (``None``, a flag's ``False``, an empty list) or the help
  already says what the default is (it names "default", as where the default is computed at run time)."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    shown = _shown_default(action.default)
    if shown is None or "default" in text.lower():
      return text
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
      return text  # a required positional has no default to show
    return f"{text} (default: {shown})" if text else f"default: {shown}"


def _shown_default(default) -> str | None:
  if default is None or default is argparse.SUPPRESS or default is False:
    return None
  if isinstance(default, (list, tuple)):
    return " ".join(_shown_default(d) or "" for d in default) or None
  if isinstance(default, float) and math.isinf(default):
    return "inf" if default > 0 else "-inf"
  return str(default).replace("%", "%%")  # help strings are %-formatted


class Parser(argparse.ArgumentParser):
  """The command line's parser: :class:`HelpFormatter` unless told otherwise; its subparsers are Parsers too."""

  def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
    super().__init__(*args, formatter_class=formatter_class, **kwargs)


def existing_path(text: str, flag: str, *, kind: str = "file") -> Path:
  """``text`` as a Path that exists and is a ``kind``: "file" or "dir"."""
  path = Path(text).expanduser()
  if not (path.is_dir() if kind == "dir" else path.is_file()):
    found = "a directory" if path.is_dir() else "a file" if path.exists() else "nothing"
    wanted = "a directory" if kind == "dir" else "a file"
    raise CommandLineError(f"{flag} {text}: expected {wanted}, found {found}; check the path")
  return path


def output_dir(text: str, flag: str) -> Path:
  """A directory to create or update: it may not exist yet, but must not be a file."""
  path = Path(text).expanduser()
  if path.exists() and not path.is_dir():
    raise CommandLineError(f"{flag} {text}: expected a directory (new or existing), found a file; pick another path")
  return path


def model_source(text: str | None, flag: str = "--model") -> str | None:
  """A known model name, or a path that exists (None: the default model)."""
  from thoughtjax.fetch import KNOWN_MODELS

  if text is None or text in KNOWN_MODELS or Path(text).expanduser().exists():
    return text
  raise CommandLineError(
    f"{flag} {text!r} is neither a known name ({', '.join(KNOWN_MODELS)}) nor an existing "
    f".gguf file or safetensors directory; pass a known name or fix the path"
  )


def add_registry_arg(
  p: argparse.ArgumentParser, help: str = "thoughtlet registry directory", *, positional: bool = True
) -> None:
  """``--registry DIR``, the one documented way to name a registry; ``positional`` also takes the older
  ``COMMAND DIR`` form (hidden from the help, kept for scripts). :func:`registry_dir` reads the two."""
  p.add_argument("--registry", default=None, metavar="DIR", help=help if not positional else f"{help} (required)")
  if positional:
    p.add_argument("dir", nargs="?", default=None, help=argparse.SUPPRESS)


def registry_dir(args, *, required: bool = True, others: tuple[str, ...] = ()) -> tuple[str | None, str]:
  """The registry directory the user gave and how to name it in an error (the flag, or "registry directory"
  for the positional form): ``--registry DIR``, the positional ``DIR``, or an older flag named in ``others``
  (``registry build --out``). Two of them naming different directories is a :class:`CommandLineError`, and
  so is none when ``required``."""
  given = [(f"--{f.replace('_', '-')}", getattr(args, f, None)) for f in ("registry", *others)]
  given.append(("registry directory", getattr(args, "dir", None)))
  given = [(label, text) for label, text in given if text is not None]
  if len({Path(text).expanduser().resolve() for _, text in given}) > 1:
    shown = " and ".join(f"{'DIR' if label == 'registry directory' else label} {text!r}" for label, text in given)
    raise CommandLineError(f"two registry directories given: {shown}; give one, as --registry DIR")
  if not given:
    if required:
      raise CommandLineError("no registry directory given; pass --registry DIR")
    return None, "--registry"
  label, text = given[0]
  return text, label


def add_no_server_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--no-server",
    action="store_true",
    help="run in this process even when a local `thoughtjax serve` of the same registry is running (by default "
    "the command uses it: its weights and programs are warm; env THOUGHTJAX_NO_SERVER=1 does the same)",
  )


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--kernels",
    choices=tuple(dispatch.IMPLEMENTATIONS),
    default=None,
    help="implementation of both kernel ops, sampling and template embedding (default: pallas on a GPU, xla "
    "elsewhere; see thoughtjax/kernels/dispatch.py)",
  )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
  """``--max-tokens``, ``--temperature``, ``--top-k``, ``--top-p``, ``--seed``, ``--stop``: the same flags, help
  and defaults for every command that generates (``generate``, ``synthesize``)."""
  p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="new tokens to generate at most")
  p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens; 0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="sample within this cumulative probability; 1 = off")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (32-bit)")
  p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
  """``--json-schema FILE``, ``--regex PATTERN``, ``--grammar FILE``: at most one (argparse refuses two)."""
  g = p.add_mutually_exclusive_group()
  g.add_argument("--json-schema", default=None, metavar="FILE", help="the output is JSON that validates against it")
  g.add_argument("--regex", default=None, metavar="PATTERN", help="the whole output matches this regular expression")
  g.add_argument(
    "--grammar", default=None, metavar="FILE", help="the output is a sentence of this grammar (Lark or GBNF)"
  )


def sampling_kwargs(args) -> dict:
  """The request fields of :func:`add_sampling_args`' flags and the constraint flags (:func:`constraint_kwargs`):
  SamplingParams' keywords, and the wire request's."""
  return dict(
    max_tokens=args.max_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
    stop_strings=tuple(args.stop or ()),
    **constraint_kwargs(args),
  )


def constraint_kwargs(args) -> dict:
  """The SamplingParams fields of the constraint flags, files read (a missing one: :class:`CommandLineError`)."""
  out = {}
  for flag, field in (("--json-schema", "json_schema"), ("--grammar", "grammar")):
    given = getattr(args, field, None)
    if given is not None:
      path = existing_path(given, flag)
      try:
        out[field] = path.read_text(encoding="utf-8")
      except UnicodeDecodeError:
        raise CommandLineError(f"{flag} {given}: expected UTF-8 text; save it as UTF-8") from None
  if getattr(args, "regex", None) is not None:
    out["regex"] = args.regex
  return out


def add_trust_args(p: argparse.ArgumentParser, *, keys_help: str | None = None) -> None:
  p.add_argument(
    "--public-key",
    action="append",
    default=None,
    metavar="FILE",
    help=keys_help or "trusted Ed25519 public key (repeatable); signatures must verify against one",
  )
  p.add_argument("--require-signatures", action="store_true", help="refuse unsigned manifests and indexes")


def trust_policy(args):
  """The ``TrustPolicy`` of ``--public-key`` (each file checked) and ``--require-signatures``."""
  from thoughtjax.registry import TrustPolicy

  keys = tuple(existing_path(k, "--public-key") for k in args.public_key or ())
  return TrustPolicy(public_keys=keys, require_signatures=bool(args.require_signatures))


def registry_weights(weights: str | None) -> str:
  """The form a registry's restores take (``--weights``; default f32). int8 is not one: a registry's int8
  blocks are variants named in a path, so ``--weights int8``/``int8a8`` with a registry is refused."""
  if weights in ("int8", "int8a8"):
    raise CommandLineError(
      f"--weights {weights} applies to --model; a registry's int8 blocks are variants: name them in --path, "
      "e.g. 'embed, blocks[0:30)@int8, head' (built with `registry build --variants int8`)"
    )
  return weights or "f32"


def open_registry(directory: str, args, flag: str = "registry directory", *, weights: str = "f32"):
  """``Registry.open(directory, trust=trust_policy(args), weights=weights)`` after checking that the directory
  exists; ``weights`` is the form restores return (f32, or native: a quantized model's blocks kept packed)."""
  from thoughtjax.registry import Registry

  return Registry.open(existing_path(directory, flag, kind="dir"), trust=trust_policy(args), weights=weights)


def open_given_registry(args, *, weights: str = "f32"):
  """The registry of ``--registry DIR`` (or the positional DIR), opened under the trust flags."""
  directory, label = registry_dir(args)
  return open_registry(directory, args, label, weights=weights)

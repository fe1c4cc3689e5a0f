"""Arguments shared by several commands: paths a user types, ``--kernels``, and the trust flags.

A path the user gives is checked where it is taken, so a missing file is a :class:`CommandLineError`
(one line, exit status 2) naming the flag, never a ``FileNotFoundError`` from deep inside a loader.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thoughtjax.errors import UserError
from thoughtjax.kernels import dispatch


class CommandLineError(UserError, ValueError):
  """A command-line argument names something that does not exist, or flags that do not go together."""


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


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--kernels",
    choices=tuple(dispatch.IMPLEMENTATIONS),
    default=None,
    help="implementation of both kernel ops, sampling and template embedding (default: xla on every "
    "backend until the GPU check earns pallas; see thoughtjax/kernels/dispatch.py)",
  )


def add_constraint_args(p: argparse.ArgumentParser) -> None:
  """``--json-schema FILE``, ``--regex PATTERN``, ``--grammar FILE``: at most one (argparse refuses two)."""
  g = p.add_mutually_exclusive_group()
  g.add_argument("--json-schema", default=None, metavar="FILE", help="the output is JSON that validates against it")
  g.add_argument("--regex", default=None, metavar="PATTERN", help="the whole output matches this regular expression")
  g.add_argument(
    "--grammar", default=None, metavar="FILE", help="the output is a sentence of this grammar (Lark or GBNF)"
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

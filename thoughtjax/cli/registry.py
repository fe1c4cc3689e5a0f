"""``thoughtjax registry ...``: build, verify, keygen, validate, list, show, gc, accept, revoke-key, heal.

Every subcommand that opens a registry names it with ``--registry DIR``; the older positional form
(``registry verify DIR``, and ``registry build --out DIR``) still works, and two of them naming different
directories is refused. ``thoughtjax generate`` and ``thoughtjax score`` take ``--registry DIR`` too: the
``--path`` is then composed from that registry (versions, templates and type checks
included) instead of slicing a freshly loaded model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from thoughtjax.cli.args import (
  CommandLineError,
  add_registry_arg,
  add_trust_args,
  existing_path,
  model_source,
  open_given_registry,
  open_registry,
  output_dir,
  registry_dir,
  trust_policy,
)
from thoughtjax.fetch import DEFAULT_MODEL
from thoughtjax.shipped import shipped_file


def _profile_settings(args):
  from thoughtjax.thoughtlet import ProfileSettings

  if args.no_profile:
    return None
  return ProfileSettings(batch=args.batch, context=args.context, reps=args.reps)


def _variants(text: str) -> tuple[str, ...]:
  import argparse

  from thoughtjax.path_syntax import VARIANTS

  names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
  bad = [n for n in names if n not in VARIANTS]
  if not names or bad:
    raise argparse.ArgumentTypeError(f"--variants {text!r}: expected comma-separated names from {', '.join(VARIANTS)}")
  return names


def cmd_build(args) -> int:
  from rich.console import Console
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

  from thoughtjax.registry import build

  out = output_dir(*registry_dir(args, others=("out",)))
  mapping = existing_path(args.mapping, "--mapping") if args.mapping else _default_mapping()
  sign_key = existing_path(args.sign_key, "--sign-key") if args.sign_key else None
  model_source(args.model)  # a wrong --model fails before the progress bars start
  trust = trust_policy(args)  # of the existing index a build publishes onto
  console = Console(stderr=True)
  stages = {}
  with Progress(
    TextColumn("{task.description:<8}"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("{task.fields[item]}"),
    TimeElapsedColumn(),
    console=console,
    transient=False,
  ) as bar:

    def progress(stage, name, done, total):
      if stage == "done":
        return
      if stage == "replace" and done == 0:
        console.print(f"{name} holds a registry of an older format; removing it and building a new one there")
      if stage not in stages:
        stages[stage] = bar.add_task(stage, total=total, item="")
      bar.update(stages[stage], completed=done if stage != "profile" else done + 1, item=name)

    reg = build(
      out,
      mapping,
      model_source(args.model) or DEFAULT_MODEL,
      sign_key=sign_key,
      settings=_profile_settings(args),
      progress=progress,
      trust=trust,
      variants=args.variants,
      weights=args.weights,
      replace_old_format=args.replace_old_format,
    )
  console.print(
    f"registry {reg.root}: generation {reg.generation}, {len(reg.names)} thoughtlets"
    + ("" if args.sign_key else " (unsigned: pass --sign-key to sign)")
  )
  _print_table(reg)
  return 0


def _default_mapping() -> Path:
  """The package's mapping; a mapping of the working directory is used only when named with --mapping."""
  return shipped_file("semantic_mapping.yaml")


def _print_table(reg) -> None:
  from rich.console import Console
  from rich.table import Table

  table = Table(title=f"{reg.root} (generation {reg.generation})")
  for i, col in enumerate(
    ("thoughtlet", "version", "in -> out", "MiB", "MFLOP/tok", "peak MiB", "ms/tok mean±std (p99)", "key")
  ):
    table.add_column(col, overflow="fold", no_wrap=i < 2)
  for m in reg.manifests():
    p = m.profile
    lat = (
      "-" if p is None else (f"{p.latency_mean_s * 1e3:.3f}±{p.latency_std_s * 1e3:.3f} ({p.latency_p99_s * 1e3:.3f})")
    )
    table.add_row(
      m.name,
      m.version[:8],
      f"{m.signature.input.role} -> {m.signature.output.role}",
      f"{m.param_bytes / 2**20:.2f}",
      "-" if p is None else f"{p.flops_per_token / 1e6:.3f}",
      "-" if p is None else f"{p.peak_memory_bytes / 2**20:.2f}",
      lat,
      (m.signed_by or "unsigned")[:8],
    )
  Console().print(table)


def cmd_verify(args) -> int:
  from thoughtjax.registry import ResourceProfileMismatch, Tolerance

  if args.hardware:
    import thoughtjax.synthesis.router_store  # noqa: F401  (registers the router kind's profile step)
  reg = open_given_registry(args)
  tol = Tolerance(
    flops=args.flops_tolerance,
    peak_memory=args.memory_tolerance,
    latency=None if args.latency_tolerance < 0 else args.latency_tolerance,
    latency_floor_s=args.latency_floor_ms / 1e3,
  )
  try:
    report = reg.verify(hardware=args.hardware, all_versions=args.all_versions, tolerance=tol)
  except ResourceProfileMismatch as e:
    print(f"thoughtjax registry verify: error: ResourceProfileMismatch: {e}", file=sys.stderr)
    return 3
  trust = "trusted keys given" if args.public_key else "keys stored in the registry (integrity, not authenticity)"
  if args.json:
    print(
      json.dumps(
        {
          "root": report.root,
          "generation": report.generation,
          "sequence": report.sequence,
          "registry_id": report.registry_id,
          "signing_keys": report.signing_keys,
          "index_signed": report.index_signed,
          "thoughtlets": report.thoughtlets,
          "trust": trust,
        }
      )
    )
    return 0
  for t in report.thoughtlets:
    print(f"ok  {t['ref']:<40} files={t['files']} signed_by={t['signed_by'] or 'unsigned'}")
  print(
    f"{len(report.thoughtlets)} version(s) verified (digests, signatures, versioned hashes); "
    f"index sequence {report.sequence} ({'signed' if report.index_signed else 'unsigned'}); "
    f"signatures checked against {trust}" + ("; resource profiles match this machine" if args.hardware else "")
  )
  return 0


def cmd_keygen(args) -> int:
  from thoughtjax.signing import key_id, keygen, load_public_key

  try:
    priv, pub = keygen(args.path, overwrite=args.force)
  except FileExistsError as e:  # a user-given path: say so in one line, with the fix
    raise CommandLineError(f"keygen {args.path}: {e}") from None
  print(f"private key {priv} (keep secret; pass to `registry build --sign-key`)")
  print(f"public key  {pub} (key id {key_id(load_public_key(pub))}; pass to `registry verify --public-key`)")
  return 0


def cmd_validate(args) -> int:
  from thoughtjax.mapping import load_mapping

  m = load_mapping(existing_path(args.mapping, "mapping"), args.num_layers)
  print(f"{args.mapping}: ok, {len(m.entries)} thoughtlets: {', '.join(e.name for e in m.entries)}")
  return 0


def cmd_list(args) -> int:
  _print_table(open_given_registry(args))
  return 0


def cmd_show(args) -> int:
  from thoughtjax.path_syntax import parse_path

  reg = open_given_registry(args)
  ref = parse_path(args.ref)[0]
  print(json.dumps(reg.manifest(ref.name, ref.version).raw, indent=1, sort_keys=True))
  return 0


def cmd_gc(args) -> int:
  from thoughtjax.registry import collect_garbage

  report = collect_garbage(
    existing_path(*registry_dir(args), kind="dir"),
    keep=args.keep,
    dry_run=args.dry_run,
    trust=trust_policy(args),
  )
  for p in report.removed:
    print(("would remove " if args.dry_run else "removed ") + str(p))
  for p, reason in report.skipped:
    print(f"kept {p}: {reason}")
  n = len(report.removed)
  print(
    f"{n} version director{'y' if n == 1 else 'ies'} {'to remove' if args.dry_run else 'removed'}, "
    f"{len(report.skipped)} kept because a reader holds them"
  )
  return 0


def cmd_accept(args) -> int:
  from thoughtjax.registry import accept

  root = existing_path(*registry_dir(args), kind="dir")
  entry = accept(root, trust_policy(args))
  print(
    f"accepted {root} as registry {entry['registry_id']} at sequence {entry['sequence']} "
    f"({'signed by ' + ', '.join(entry['keys']) if entry['keys'] else 'unsigned'}); readers of this user now "
    f"refuse anything older than it there"
    + (f"; revoked keys {entry['revoked']} stay revoked" if entry["revoked"] else "")
  )
  return 0


def cmd_revoke_key(args) -> int:
  if args.registry and args.dir is not None and Path(args.registry).resolve() != Path(args.dir).resolve():
    # With --registry every positional is a key id; argparse gave the first to the older DIR slot.
    args.key_id, args.dir = [args.dir, *args.key_id], None
  reg = open_given_registry(args)
  before = reg.sequence
  reg.publish([], sign_key=existing_path(args.sign_key, "--sign-key"), settings=None, revoke_keys=args.key_id)
  print(
    f"{reg.root}: sequence {before} -> {reg.sequence}; revoked keys {', '.join(args.key_id)} (signing keys now "
    f"{', '.join(reg.signing_keys)}); readers that open it refuse what only a revoked key signed"
  )
  return 0


def load_from_registry(args):
  """The model of ``generate``/``score --registry DIR [--path P] [--public-key F] [--require-signatures]``."""
  from thoughtjax.assembly import full_path
  from thoughtjax.compose import compose

  reg = open_registry(args.registry, args, "--registry", weights=getattr(args, "weights", None) or "f32")
  return compose(args.path or full_path(reg), reg, kernels=args.kernels)


def add_parser(subparsers) -> None:
  p = subparsers.add_parser("registry", help="build, verify and inspect a thoughtlet registry")
  sub = p.add_subparsers(dest="registry_command", required=True)

  b = sub.add_parser("build", help="cut a model into thoughtlets along a mapping and publish them")
  b.add_argument("--model", default=None, help=f"known model name or path (default: {DEFAULT_MODEL})")
  b.add_argument(
    "--mapping",
    default=None,
    help="semantic_mapping.yaml (default: the package's own, registry/semantic_mapping.yaml of its checkout)",
  )
  add_registry_arg(b, "registry directory to build (created, or updated atomically)")
  b.add_argument("--out", default=None, metavar="DIR", help="the older name of --registry")
  b.add_argument("--sign-key", default=None, help="Ed25519 private key (PEM) from `registry keygen`")
  b.add_argument("--batch", type=int, default=1, help="profile: rows per decode step")
  b.add_argument("--context", type=int, default=256, help="profile: KV cache length")
  b.add_argument("--reps", type=int, default=20, help="profile: timed runs per thoughtlet")
  b.add_argument("--no-profile", action="store_true", help="publish without resource profiles")
  b.add_argument(
    "--variants",
    type=_variants,
    default=(),
    metavar="LIST",
    help="weight variants of every block thoughtlet to publish too, comma-separated (int8: per-row int8, lossy; "
    "int8a8: the same int8 weights computed with int8 activations, lossier, batches best; a path names one as "
    "blocks[a:b)@int8)",
  )
  b.add_argument(
    "--weights",
    choices=("native", "f32"),
    default="native",
    help="how matrices are stored (native: a quantized GGUF's blocks, packed, as large as the GGUF, the default; "
    "f32: dequantized float32). Readers get float32 either way unless they ask for native",
  )
  b.add_argument(
    "--replace-old-format",
    action="store_true",
    help="the directory holds a registry of an older format: remove it (its thoughtlets too) and build a new one",
  )
  add_trust_args(b, keys_help="trusted public key (repeatable) for the existing index the build publishes onto")
  b.set_defaults(fn=cmd_build)

  v = sub.add_parser("verify", help="check digests, signatures, versioned hashes (and profiles)")
  add_registry_arg(v, "registry directory to verify")
  v.add_argument("--hardware", action="store_true", help="re-measure resource profiles here")
  add_trust_args(
    v,
    keys_help="trusted public key (repeatable); default: the keys stored in the registry, "
    "which prove integrity, not authenticity",
  )
  v.add_argument("--all-versions", action="store_true", help="every published version, not only current")
  v.add_argument(
    "--latency-tolerance",
    type=float,
    default=1.0,
    help="measured/declared latency must lie in [1/(1+x), 1+x]; negative skips latency",
  )
  v.add_argument(
    "--latency-floor-ms",
    type=float,
    default=0.1,
    help="latency differences smaller than this never count as a mismatch",
  )
  v.add_argument(
    "--flops-tolerance", type=float, default=0.02, help="with --hardware: allowed relative FLOP count difference"
  )
  v.add_argument(
    "--memory-tolerance", type=float, default=0.25, help="with --hardware: allowed relative peak memory difference"
  )
  v.add_argument("--json", action="store_true", help="print one JSON object")
  v.set_defaults(fn=cmd_verify)

  k = sub.add_parser("keygen", help="create an Ed25519 key pair PATH.key / PATH.pub")
  k.add_argument("path", help="where to write the pair: PATH.key (private, mode 0600) and PATH.pub")
  k.add_argument("--force", action="store_true", help="overwrite an existing pair")
  k.set_defaults(fn=cmd_keygen)

  m = sub.add_parser("validate", help="check a semantic_mapping.yaml")
  m.add_argument("mapping", help="the semantic_mapping.yaml to check")
  m.add_argument("--num-layers", type=int, default=None, help="check spans against this many layers")
  m.set_defaults(fn=cmd_validate)

  ls = sub.add_parser("list", help="current thoughtlets with signatures and profiles")
  add_registry_arg(ls)
  add_trust_args(ls)
  ls.set_defaults(fn=cmd_list)

  sh = sub.add_parser("show", help="print one manifest (NAME or NAME@VERSION)")
  add_registry_arg(sh)
  sh.add_argument("ref", metavar="REF", help="thoughtlet NAME or NAME@VERSION")
  add_trust_args(sh)
  sh.set_defaults(fn=cmd_show)

  g = sub.add_parser("gc", help="remove version directories that are neither current nor recent")
  add_registry_arg(g)
  g.add_argument("--keep", type=int, default=2, help="versions kept per thoughtlet, current included")
  g.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
  add_trust_args(g, keys_help="trusted public key (repeatable); gc verifies the index before it removes anything")
  g.set_defaults(fn=cmd_gc)

  a = sub.add_parser(
    "accept",
    help="accept a deliberately rebuilt or replaced registry at DIR (readers refuse a swap or rollback until then)",
  )
  add_registry_arg(a, "registry directory to accept")
  add_trust_args(
    a, keys_help="trusted public key (repeatable); the registry is verified under it before it is accepted"
  )
  a.set_defaults(fn=cmd_accept)

  r = sub.add_parser("revoke-key", help="publish an index that revokes signing keys (key rotation)")
  add_registry_arg(r)
  r.add_argument(
    "key_id", nargs="+", metavar="KEY_ID", help="id of a signing key to revoke (`registry verify --json` lists them)"
  )
  r.add_argument("--sign-key", required=True, help="private key (PEM) that signs the new index; not a revoked one")
  add_trust_args(r)
  r.set_defaults(fn=cmd_revoke_key)

  from thoughtjax.cli.heal import add_heal_parser  # registry heal

  add_heal_parser(sub)

  from thoughtjax.cli.synthesis import add_registry_parsers  # registry calibrate, registry warm

  add_registry_parsers(sub)

  from thoughtjax.cli.router import add_router_parser  # registry train-router

  add_router_parser(sub)

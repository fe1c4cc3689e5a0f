"""``thoughtjax registry heal --registry DIR --path P [--steps N] [--rank R]``: train and publish a bridge for a cut path.

Trains on text the model generates itself plus the calibration splits of the hint corpora; the held-out
splits measure quality before and after (top-1 agreement, KL, ΔNLL), which is printed and stored in the
bridge's manifest. The bridge is published through the registry (hashed, signed with ``--sign-key``,
profiled) and the bridged path composes like any other.
"""

from __future__ import annotations

import json
import sys

from thoughtjax.cli.args import CommandLineError, add_registry_arg, add_trust_args, existing_path, open_given_registry


def _corpora(args) -> tuple[list[str], list[str]]:
  """(calibration, held-out) documents of every hint in the synthesis dictionary (none with --no-corpora)."""
  if args.no_corpora:
    return [], []
  from thoughtjax.synthesis.dictionary import load_dictionary

  d = load_dictionary(existing_path(args.dictionary, "--dictionary") if args.dictionary else None)
  cal, held = [], []
  for hint in d:
    cal += hint.documents("calibration")
    held += hint.documents("heldout")
  return cal, held


def cmd_heal(args) -> int:
  from rich.console import Console
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

  from thoughtjax.synthesis.heal import HealError, HealSettings, heal, publish_bridge
  from thoughtjax.thoughtlet import ProfileSettings

  reg = open_given_registry(args)
  sign_key = existing_path(args.sign_key, "--sign-key") if args.sign_key else None
  if reg.signed and sign_key is None:
    raise CommandLineError(
      f"{reg.root} is signed; publishing a bridge into it needs --sign-key (a key of "
      f"this registry), or it would be refused as a signature downgrade"
    )
  try:
    settings = HealSettings(
      rank=args.rank,
      steps=args.steps,
      learning_rate=args.lr,
      batch=args.batch,
      window=args.window,
      seed=args.seed,
      generated=args.generated,
    )
  except HealError as e:
    raise CommandLineError(str(e)) from None
  documents, heldout = _corpora(args)
  console = Console(stderr=True)
  with Progress(
    TextColumn("heal"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("loss {task.fields[loss]}"),
    TimeElapsedColumn(),
    console=console,
  ) as bar:
    task = bar.add_task("heal", total=settings.steps, loss="-")

    def progress(step, steps, loss):
      bar.update(task, completed=step, loss=f"{loss:.4f}")

    console.print(
      f"healing {args.path}: rank {settings.rank}, {settings.steps} steps, seed {settings.seed}; "
      f"generating training text"
    )
    params, report = heal(reg, args.path, settings, documents=documents, heldout_documents=heldout, progress=progress)
  version = publish_bridge(
    reg, params, report, sign_key=sign_key, settings=ProfileSettings(batch=1, context=args.context, reps=args.reps)
  )
  if args.json:
    print(json.dumps({**report.to_json(), "version": version}))
    return 0
  print(
    f"bridge   {report.name}@{version}  rank {report.rank}  {report.param_bytes / 2**20:.2f} MiB  "
    f"trained {report.train_seconds:.1f} s on {report.train_windows} windows of {report.window} tokens"
  )
  print(f"before   {report.before}")
  print(f"after    {report.after}")
  print(f"path     {report.bridged_path}")
  if report.after.mean_kl >= report.before.mean_kl:
    print("warning: the bridge did not lower held-out KL; try more --steps or a larger --rank", file=sys.stderr)
  return 0


def add_heal_parser(sub) -> None:
  h = sub.add_parser("heal", help="train a bridge that heals a cut path (distillation) and publish it")
  add_registry_arg(h, "registry directory to publish the bridge into")
  h.add_argument("--path", required=True, help='the cut path, e.g. "embed, blocks[0:10), head"')
  h.add_argument("--steps", type=int, default=300, help="optimizer steps")
  h.add_argument("--rank", type=int, default=64, help="bridge rank R (down [D, R], up [R, D])")
  h.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
  h.add_argument("--batch", type=int, default=8, help="windows per step")
  h.add_argument("--window", type=int, default=64, help="tokens per window")
  h.add_argument("--generated", type=int, default=32, help="continuations the model generates to train on")
  h.add_argument("--seed", type=int, default=0, help="seed of the initialization, the batches and the generated text")
  h.add_argument(
    "--dictionary", default=None, help="synthesis_dict.yaml whose corpora to use (default: the package's own)"
  )
  h.add_argument("--no-corpora", action="store_true", help="train and hold out only self-generated text")
  h.add_argument("--sign-key", default=None, help="Ed25519 private key (PEM) of the registry")
  h.add_argument("--context", type=int, default=256, help="profile: context length")
  h.add_argument("--reps", type=int, default=20, help="profile: timed runs")
  h.add_argument("--json", action="store_true", help="print the report as JSON")
  add_trust_args(h, keys_help="trusted public key (repeatable) for the index the bridge is published onto")
  h.set_defaults(fn=cmd_heal)

"""``thoughtjax registry train-router --registry DIR``: train the hint router on the registry's embed and store it signed.

Prints the held-out report (accuracy, per-hint precision/recall, confusion matrix, time per prompt) and the
published ref; ``--json`` prints one object: the report's fields plus ``ref``, ``version`` and
``registry_sequence``. Progress goes to stderr.
"""

from __future__ import annotations

import json

from thoughtjax.cli.args import add_registry_arg, add_trust_args, existing_path, open_given_registry


def cmd_train_router(args) -> int:
  from thoughtjax.cli.synthesis import progress_bars
  from thoughtjax.synthesis.router_data import load_router_prompts
  from thoughtjax.synthesis.router_store import train_registry_router

  reg = open_given_registry(args)
  sign_key = existing_path(args.sign_key, "--sign-key") if args.sign_key else None
  prompts = existing_path(args.prompts, "--prompts", kind="dir") if args.prompts else None
  train, heldout = load_router_prompts("train", prompts), load_router_prompts("heldout", prompts)
  with progress_bars() as progress:
    _, report, version = train_registry_router(
      reg,
      train,
      heldout,
      sign_key=sign_key,
      name=args.name,
      seed=args.seed,
      steps=args.steps,
      labels=args.hint,
      progress=lambda done, total, what: progress(what, done, total, ""),
      publish=not args.no_publish,
    )
  ref = None if version is None else f"{args.name}@{version}"
  if args.json:
    print(json.dumps(report.as_dict() | {"ref": ref, "version": version, "registry_sequence": reg.sequence}))
    return 0
  print(report.table())
  print(
    f"time per prompt {report.predict_ms:.3f} ms median, p90 {report.predict_ms_p90:.3f} ms; "
    f"trained on {report.n_train} prompts in {report.train_s:.1f} s"
  )
  print(f"published {ref} (registry sequence {reg.sequence})" if ref else "not published (--no-publish)")
  return 0


def add_router_parser(sub) -> None:
  """``registry train-router`` (added to the ``registry`` group)."""
  r = sub.add_parser("train-router", help="train the hint router on the registry's embed; store it signed")
  add_registry_arg(r, "registry directory whose embed the router reads and where it is published")
  r.add_argument("--sign-key", default=None, help="Ed25519 private key (required when the registry is signed)")
  r.add_argument(
    "--prompts", default=None, help="directory with train.jsonl and heldout.jsonl (default: registry/router_prompts)"
  )
  r.add_argument(
    "--hint",
    action="append",
    default=None,
    help="hints the router chooses among (repeatable; default: every dictionary hint)",
  )
  r.add_argument("--steps", type=int, default=300, help="optimizer steps (full batch)")
  r.add_argument("--seed", type=int, default=0, help="training seed")
  r.add_argument("--name", default="router", help="thoughtlet name of the router")
  r.add_argument("--no-publish", action="store_true", help="train and report only")
  r.add_argument("--json", action="store_true", help="print one JSON object")
  add_trust_args(r)
  r.set_defaults(fn=cmd_train_router)

"""``thoughtjax plan``, ``synthesize``, ``paths``, ``corrections`` and ``registry calibrate`` / ``registry warm``.

Contracts (checked by tools that read the output):
  plan --json        one object with at least path, path_hash, hints, corrected_hints,
                     predicted_ms {total, synthesis, restore, compile, prefill, decode}, quality, degraded, reason;
                     also corrections {stage: {factor, from, observations, context}} and latency_context
  synthesize         the answer streamed to stdout, the trace (predicted vs actual per stage) to stderr
  synthesize --json  one object: the plan's fields plus token_ids, text, actual_ms {total, restore, compile,
                     prefill, decode, synthesis, startup} (startup: the first request's one-off imports and
                     tokenizer loading, not predicted)
  corrections        the learned latency corrections per execution context; --reset forgets them
  paths --registry DIR --hint H
                     the hint's calibrated front; --plot FILE.png plots quality against predicted latency,
                     --max-latency-ms MS marks the plan chosen within that budget
                     (matplotlib: the plot extra, pip install 'thoughtjax[plot]'; without it, exit 2)
A misspelt hint is corrected and the correction printed to stderr; an unknown one exits 2 with the list.
Without --registry, the default registry in the cache dir is used (built and calibrated on first use).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time

from thoughtjax.cli.args import (
  CommandLineError,
  add_constraint_args,
  add_kernels_arg,
  add_no_server_arg,
  add_registry_arg,
  add_sampling_args,
  add_trust_args,
  constraint_kwargs,
  existing_path,
  open_given_registry,
  open_registry,
  registry_dir,
  registry_weights,
  sampling_kwargs,
)
from thoughtjax.defaults import DEFAULT_MAX_TOKENS


@contextlib.contextmanager
def progress_bars():
  """A ``progress(stage, done, total, item)`` callback drawing one rich bar per stage on stderr."""
  from rich.console import Console
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

  tasks: dict[str, int] = {}
  with Progress(
    TextColumn("{task.description:<16}"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("{task.fields[item]}"),
    TimeElapsedColumn(),
    console=Console(stderr=True),
    transient=False,
  ) as bar:

    def progress(stage: str, done: int, total: int, item: str) -> None:
      if stage == "done":
        return
      if stage not in tasks:
        tasks[stage] = bar.add_task(stage, total=max(total, 1), item="")
      bar.update(tasks[stage], completed=done, total=max(total, 1), item=str(item)[:60])

    yield progress


def _registry(args):
  """The registry of ``--registry DIR`` (trust flags applied), else the default one (built on first use)."""
  weights = registry_weights(getattr(args, "weights", None))
  if getattr(args, "registry", None):
    return open_registry(args.registry, args, "--registry", weights=weights)
  if args.public_key or args.require_signatures:
    raise CommandLineError("--public-key and --require-signatures check a registry you name: add --registry DIR")
  from thoughtjax.synthesis.default_registry import default_registry_dir, ensure_default

  root = default_registry_dir()
  print(f"using the default registry {root}", file=sys.stderr)
  with progress_bars() as progress:
    return ensure_default(progress, weights=weights)


def _synthesizer(args, reg):
  from thoughtjax.synthesis.synthesize import Synthesizer

  return Synthesizer.open(reg, kernels=getattr(args, "kernels", None))


def _print_corrections(plan) -> None:
  for given, hint in plan.corrected_hints:
    print(f"hint {given!r} corrected to {hint!r}", file=sys.stderr)
  for note in plan.notes:
    if note.startswith("no hints given"):
      print(note, file=sys.stderr)


def _budget(args) -> float:
  b = args.max_latency_ms
  if not b > 0:
    raise CommandLineError(f"--max-latency-ms: expected a budget > 0 ms (inf for none), got {b}")
  return b


def _age(seconds: float | None) -> str:
  if seconds is None:
    return "never"
  for unit, n in (("h", 3600), ("min", 60)):
    if seconds >= n:
      return f"{seconds / n:.0f} {unit} ago"
  return f"{seconds:.0f} s ago"


def _plan_text(plan, explain: bool, latency=None) -> str:
  """The plan as the command line prints it; ``latency`` (the synthesizer's model), with ``explain``, also
  names the corrections learned in other execution contexts, which this prediction does not use."""
  p = plan.predicted
  lines = [
    f"path        {plan.path}",
    f"path_hash   {plan.path_hash} ({plan.kind}, registry sequence {plan.sequence})",
    f"hints       {', '.join(plan.hints)}",
    f"predicted   {p.total:.1f} ms = synthesis {p.synthesis:.2f} + restore {p.restore:.1f} + compile "
    f"{p.compile:.1f} + prefill {p.prefill:.1f} + decode {p.decode:.1f} (budget {plan.max_latency_ms:g} ms)",
  ]
  for hint, q in plan.quality.items():
    lines.append(
      f"quality     {hint}: top-1 agreement {q.top1_agreement:.3f}, mean KL {q.mean_kl:.4f}, "
      f"ΔNLL {q.delta_nll:+.4f} (held-out, {q.tokens} tokens)"
    )
  if p.corrections:
    applied = ", ".join(
      f"{s} x{f:.3g} ({'this path' if src == 'path' else 'all paths'}, "
      + (f"{p.observations.get(s, 0)} observations)" if p.observations.get(s, 0) else "measured by calibration)")
      for s, (f, src) in p.corrections.items()
    )
    learned = any(p.observations.get(s, 0) for s in p.corrections)
    where = (
      f"learned from earlier requests in this context, last {_age(p.correction_age_s)}" if learned else "calibration"
    )
    lines.append(f"corrected   {applied}: {where}")
  if explain:
    lines.append(f"context     {p.context.label()} ({p.context.key}); only corrections learned here apply")
    others = {} if latency is None else {k: r for k, r in latency.learned().items() if k != p.context.key}
    for key, rec in sorted(others.items()):
      lines.append(
        f"not applied corrections of {key}: {rec.observations} observations, last {_age(time.time() - rec.updated)}"
      )
  lines.append(f"degraded    {str(plan.degraded).lower()}" + (f" ({plan.reason})" if plan.degraded else ""))
  lines.append(f"reason      {plan.reason}")
  if plan.tokens_that_fit is not None:
    lines.append(f"fits        {plan.tokens_that_fit} of {plan.max_tokens} tokens within the budget")
  if explain:
    for note in plan.notes:
      lines.append(f"note        {note}")
    for r in plan.rejected:
      lines.append(f"rejected    {r.path} [{r.why}] {r.detail}")
  return "\n".join(lines)


def cmd_plan(args) -> int:
  from thoughtjax.sampling import SamplingParams

  reg = _registry(args)
  syn = _synthesizer(args, reg)
  constraint = SamplingParams(**constraint_kwargs(args)).constraint  # checked as synthesize would
  if constraint is not None:
    from thoughtjax.decode.masks import grammars_for

    grammars_for(reg.codec, int(reg.config.vocab_size)).check(constraint)
  plan = syn.plan(
    args.prompt,
    args.hint,
    max_latency_ms=_budget(args),
    max_tokens=args.max_tokens,
    chat=args.chat,
    constraint=constraint,
  )
  _print_corrections(plan)
  if args.json:
    print(json.dumps(plan.to_json()))
  else:
    print(_plan_text(plan, args.explain, syn.latency))
  return 0


def cmd_synthesize(args) -> int:
  from thoughtjax.cli import remote

  server = remote.server_for(args, args.registry)
  if server is not None:
    code = remote.synthesize(args, server)
    if code is not None:
      return code
  reg = _registry(args)
  syn = _synthesizer(args, reg)
  result = syn.synthesize(
    args.prompt,
    args.hint,
    max_latency_ms=_budget(args),
    chat=args.chat,
    **sampling_kwargs(args),
  )
  _print_corrections(result.plan)
  if args.explain and not args.json:
    print(_plan_text(result.plan, True, syn.latency), file=sys.stderr)
  # Leaving early (an interrupt, a closed stdout) abandons the generation: no more device work.
  with result:
    for d in result:
      if not args.json:
        sys.stdout.write(d.text)
        sys.stdout.flush()
  if args.json:
    print(json.dumps(result.to_json()))
  else:
    sys.stdout.write("\n")
    print(result.trace.table(), file=sys.stderr)
  return 0


# ------------------------------------------------------------------------------ paths
def front_rows(cal, hint: str, floors, prompt_tokens: int = 32, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[dict]:
  """Every candidate calibrated on ``hint``: held-out quality, predicted warm latency (restored and
  compiled) for a ``prompt_tokens`` prompt and ``max_tokens`` tokens, floor met, on the Pareto front."""
  from thoughtjax.synthesis.latency import LatencyModel

  model = LatencyModel(cal.latency)
  warm = model.warm_residency(cal.candidates, prompt_tokens, max_tokens)
  floor = floors[hint]
  rows = []
  for c in cal.candidates:
    q = cal.hint_quality(c.path_hash, hint)
    if q is None:
      continue
    p = model.predict(c, prompt_tokens, max_tokens, warm, hints=(hint,))
    rows.append(
      {
        "path": c.path,
        "path_hash": c.path_hash,
        "kind": c.kind.value,
        "predicted_ms": p.total,
        "top1_agreement": q.heldout.top1_agreement,
        "mean_kl": q.heldout.mean_kl,
        "calibration_top1_agreement": q.calibration.top1_agreement,
        "meets_floor": floor.miss(q.calibration) is None,
      }
    )
  for r in rows:  # on the front: no other path is at least as good on both and better on one
    r["front"] = not any(
      o is not r
      and o["top1_agreement"] >= r["top1_agreement"]
      and o["predicted_ms"] <= r["predicted_ms"]
      and (o["top1_agreement"] > r["top1_agreement"] or o["predicted_ms"] < r["predicted_ms"])
      for o in rows
    )
  return sorted(rows, key=lambda r: (r["predicted_ms"], r["path_hash"]))


def chosen_at(cal, hint: str, floors, prompt_tokens: int, max_tokens: int, budget_ms: float):
  """The plan synthesis makes for ``hint`` within ``budget_ms`` on a warm process (every candidate restored
  and compiled, the latency model of ``front_rows``): the one ``paths --max-latency-ms`` marks."""
  from thoughtjax.synthesis.latency import LatencyModel
  from thoughtjax.synthesis.planner import Planner, PlanRequest

  model = LatencyModel(cal.latency)
  request = PlanRequest((hint,), prompt_tokens, max_tokens, budget_ms)
  return Planner(cal, floors).plan(request, model, model.warm_residency(cal.candidates, prompt_tokens, max_tokens))


PLOT_EXTRA = "pip install 'thoughtjax[plot]'"


def _require_matplotlib() -> None:
  """Plotting is the ``plot`` extra: without it, a one-line error naming the install command."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise CommandLineError(
      f"--plot needs matplotlib, which is not installed; install the plot extra ({PLOT_EXTRA}) or drop --plot"
    ) from None


def cmd_paths(args) -> int:
  if args.plot:  # refused before the registry is opened: nothing is half done
    _require_matplotlib()
  from thoughtjax.synthesis.calibration_store import read_calibration
  from thoughtjax.synthesis.dictionary import load_dictionary
  from thoughtjax.synthesis.hints import normalize_hints
  from thoughtjax.synthesis.planner import floors_of

  reg = open_given_registry(args)
  cal = read_calibration(reg)
  dictionary = load_dictionary()
  res = normalize_hints([args.hint], dictionary)
  for c in res.corrections:
    print(f"hint {c.given!r} corrected to {c.corrected!r}", file=sys.stderr)
  hint = res.hints[0]
  if hint not in cal.hints:
    raise CommandLineError(
      f"hint {hint!r} is not calibrated in {reg.root} (calibrated: {', '.join(cal.hints)}); "
      f"calibrate it: thoughtjax registry calibrate --registry {reg.root} --hint {hint}"
    )
  floors = floors_of(dictionary)
  rows = front_rows(cal, hint, floors, args.prompt_tokens, args.max_tokens)
  plan = None
  if args.max_latency_ms is not None:
    plan = chosen_at(cal, hint, floors, args.prompt_tokens, args.max_tokens, _budget(args))
    for r in rows:
      r["chosen"] = r["path_hash"] == plan.path_hash
  shown = rows if args.all else [r for r in rows if r["front"] or r.get("chosen")]
  if args.json:
    out = {"hint": hint, "registry_sequence": cal.sequence, "fingerprint": cal.fingerprint, "paths": shown}
    if plan is not None:
      out["max_latency_ms"] = args.max_latency_ms
      out["chosen"] = {
        "path": plan.path,
        "path_hash": plan.path_hash,
        "kind": plan.kind,
        "degraded": plan.degraded,
        "reason": plan.reason,
        "predicted_ms": plan.predicted.total,
      }
    print(json.dumps(out))
  else:
    print(
      f"{hint}: {len(shown)} of {len(rows)} calibrated paths ({'all' if args.all else 'Pareto front'}); "
      f"predicted warm ms for {args.prompt_tokens} prompt tokens and {args.max_tokens} new tokens"
    )
    print(f"{'predicted ms':>12}  {'top-1 (held-out)':>16}  {'mean KL':>8}  {'floor':>5}  path")
    for r in shown:
      print(
        f"{r['predicted_ms']:>12.1f}  {r['top1_agreement']:>16.3f}  {r['mean_kl']:>8.4f}  "
        f"{'met' if r['meets_floor'] else 'no':>5}  {r['path']}{'  <- chosen' if r.get('chosen') else ''}"
      )
    if plan is not None:
      print(
        f"chosen within {args.max_latency_ms:g} ms (warm): {plan.path} ({plan.kind}, predicted "
        f"{plan.predicted.total:.1f} ms){'  DEGRADED: ' if plan.degraded else ': '}{plan.reason}"
      )
  if args.plot:
    _plot(rows, hint, floors[hint], args.plot, plan, args.max_latency_ms)
    print(f"plot written to {args.plot}", file=sys.stderr)
  return 0


def _plot(rows, hint: str, floor, out: str, plan=None, budget_ms: float | None = None) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  other = [r for r in rows if not r["front"]]
  front = sorted((r for r in rows if r["front"]), key=lambda r: r["predicted_ms"])
  ax.scatter([r["predicted_ms"] for r in other], [r["top1_agreement"] for r in other], c="0.6", label="candidates")
  ax.plot([r["predicted_ms"] for r in front], [r["top1_agreement"] for r in front], "o-", c="C0", label="front")
  for r in front:
    ax.annotate(
      r["path"].replace("embed, ", "").replace(", head", ""),
      (r["predicted_ms"], r["top1_agreement"]),
      fontsize=7,
      xytext=(3, 3),
      textcoords="offset points",
    )
  ax.axhline(floor.top1_agreement, ls="--", c="C3", label=f"floor {floor.top1_agreement:g}")
  title = f"{hint}: quality against predicted latency"
  if plan is not None:
    if budget_ms is not None and budget_ms != float("inf"):
      ax.axvline(budget_ms, ls=":", c="C2", label=f"budget {budget_ms:g} ms")
    chosen = [r for r in rows if r.get("chosen")]
    if chosen:
      ax.scatter(
        [r["predicted_ms"] for r in chosen],
        [r["top1_agreement"] for r in chosen],
        marker="*",
        s=220,
        c="C1",
        zorder=3,
        label=f"chosen ({plan.kind})",
      )
    else:  # a speculative plan: no quality row of its own (it keeps the full path's)
      title += f"\nchosen: {plan.path} ({plan.kind})"
  ax.set_xlabel("predicted latency, warm (ms)")
  ax.set_ylabel("top-1 agreement with the full path (held-out)")
  ax.set_title(title)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------------------ registry calibrate / warm
def cmd_calibrate(args) -> int:
  from thoughtjax.synthesis import calibrate as cal_lib
  from thoughtjax.synthesis.calibrate_settings import CalibrateReport, CalibrateSettings
  from thoughtjax.synthesis.calibration_store import read_calibration, write_calibration
  from thoughtjax.synthesis.default_registry import latency_settings

  reg = open_given_registry(args)
  sign_key = existing_path(args.sign_key, "--sign-key") if args.sign_key else None
  if (reg.signed or reg.signing_keys) and sign_key is None:  # refuse before minutes of measurement
    raise CommandLineError(
      f"{reg.root} is signed (keys {reg.signing_keys}); its calibration must be signed too: "
      f"pass --sign-key with the private key of one of its signing keys"
    )
  report = CalibrateReport()
  t0 = time.perf_counter()
  with progress_bars() as progress:
    if args.latency_only:
      cal = cal_lib.recalibrate_latency(
        reg, read_calibration(reg), latency_settings(), progress=progress, report=report, kernels=args.kernels
      )
    else:
      settings = CalibrateSettings(latency=latency_settings())
      changes = {}
      if args.hint:
        from thoughtjax.synthesis.dictionary import load_dictionary
        from thoughtjax.synthesis.hints import normalize_hints

        changes["hints"] = normalize_hints(args.hint, load_dictionary()).hints
      if args.max_windows is not None:
        changes["max_windows"] = None if args.max_windows <= 0 else args.max_windows
      if args.window is not None:
        changes["window"] = args.window
      import dataclasses

      cal = cal_lib.calibrate(
        reg, settings=dataclasses.replace(settings, **changes), progress=progress, report=report, kernels=args.kernels
      )
  path = write_calibration(reg, cal, sign_key=sign_key)
  from thoughtjax.synthesis.corrections import CorrectionsFileError, forget_corrections

  try:  # corrections refined the latency just replaced: they start again from the new one
    forgot = sum(forget_corrections(reg.registry_id).values())
  except CorrectionsFileError as e:
    print(f"warning: {e}", file=sys.stderr)
    forgot = 0
  wall = time.perf_counter() - t0
  stages = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
  print(
    f"calibration of {reg.root} at sequence {cal.sequence} written to {path} "
    f"({'signed' if sign_key else 'unsigned'}); {len(cal.candidates)} candidates, hints "
    f"{', '.join(cal.hints)}; fingerprint {cal.fingerprint}"
  )
  print(f"wall time {wall:.1f} s ({stages})")
  if forgot:
    print(f"forgot {forgot} learned latency correction context(s) of this registry (they refined the old latency)")
  for p, why in report.refused:
    print(f"refused {p}: {why}", file=sys.stderr)
  return 0


def cmd_warm(args) -> int:
  reg = open_given_registry(args)
  syn = _synthesizer(args, reg)
  t0 = time.perf_counter()
  bad = [b for b in args.budget_ms if not b > 0]
  if bad:
    raise CommandLineError(f"--budget-ms: expected budgets > 0 ms (inf for none), got {bad}")
  warmed = syn.warm(
    args.hint or None, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, budgets=args.budget_ms
  )
  print(
    f"warmed {len(warmed)} path(s) in {time.perf_counter() - t0:.1f} s (thoughtlets restored in this process; "
    f"programs compiled into the persistent compilation cache):"
  )
  for p in warmed:
    print(f"  {p}")
  return 0


# ------------------------------------------------------------------------------ corrections
def cmd_corrections(args) -> int:
  from thoughtjax.synthesis import corrections as corr_lib

  directory, label = registry_dir(args, required=False)
  reg = open_registry(directory, args, label) if directory else None  # a wrong --registry is an error either way
  path = corr_lib.corrections_path()
  if path is None:
    print(f"learned latency corrections are kept in process only ({corr_lib.ENV}=off); nothing stored")
    return 0
  registry_id = corr_lib.EVERY_REGISTRY if reg is None else reg.registry_id
  prefix = None if reg is None else f"{reg.registry_id or 'unnamed'}|"
  if args.reset:
    gone = corr_lib.forget_corrections(registry_id, path)
    whose = "every registry" if reg is None else f"registry {reg.root}"
    print(
      f"forgot {sum(gone.values())} learned context(s) in {len(gone)} entr{'y' if len(gone) == 1 else 'ies'} of "
      f"{whose} ({path}); predictions use the calibration until requests teach them again"
    )
    return 0
  entries = {k: e for k, e in corr_lib.read_entries(path).items() if prefix is None or k.startswith(prefix)}
  if args.json:
    doc = {k: {c: r.to_json() for c, r in e["contexts"].items()} for k, e in entries.items()}
    print(json.dumps({"file": str(path), "entries": doc}))
    return 0
  print(f"{path}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} (registry|machine|latency model)")
  now = time.time()
  for key, e in entries.items():
    print(key)
    for ctx, rec in sorted(e["contexts"].items()):
      factors = ", ".join(f"{s} x{f:.3g}" for s, f in rec.glob.items()) or "no machine-wide factor"
      print(
        f"  {ctx:<28} {rec.observations:>5} observations, last {_age(now - rec.updated)}; {factors}; "
        f"{len(rec.paths)} path(s) with their own"
      )
  return 0


# ------------------------------------------------------------------------------ parsers
HINT_HELP = "hint from registry/synthesis_dict.yaml, repeatable, in priority order (at most 3)"


def _request_args(p: argparse.ArgumentParser) -> None:
  add_registry_arg(
    p,
    "registry with a stored calibration (default: the default registry in the cache dir, "
    "built and calibrated on first use)",
    positional=False,
  )
  p.add_argument(
    "--hint",
    action="append",
    default=None,
    help=f"{HINT_HELP}; optional (default: the registry's hint router picks one, else general_purpose)",
  )
  p.add_argument("--max-latency-ms", type=float, required=True, help="latency budget of the whole request (inf: none)")
  p.add_argument("--prompt", required=True, help="the request's text (with --chat: the user's message)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--explain", action="store_true", help="also print the notes and the rejected alternatives")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  add_trust_args(p, keys_help="with --registry: trusted Ed25519 public key (repeatable)")
  p.add_argument(
    "--weights",
    choices=("f32", "native"),
    default=None,
    help="the form restores give (default f32): f32 (dequantized float32) or native (a quantized model's blocks kept packed, "
    "computed in float32: the same logits); int8 blocks are variants a path names (blocks[a:b)@int8)",
  )


def add_parsers(sub) -> None:
  p = sub.add_parser("plan", help="the path GetOptimalPath chooses for hints, a prompt and a latency budget")
  _request_args(p)
  p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="new tokens the request generates at most")
  add_constraint_args(p)
  p.set_defaults(fn=cmd_plan)

  p = sub.add_parser("synthesize", help="plan, then run the chosen path: the answer streamed, the trace on stderr")
  _request_args(p)
  add_no_server_arg(p)
  add_kernels_arg(p)
  add_sampling_args(p)
  add_constraint_args(p)
  p.set_defaults(fn=cmd_synthesize)

  p = sub.add_parser("paths", help="a hint's calibrated paths: quality against predicted latency")
  add_registry_arg(p, "registry with a stored calibration")
  p.add_argument("--hint", required=True, help="the hint whose calibrated paths to list (a misspelling is corrected)")
  p.add_argument(
    "--plot",
    default=None,
    metavar="FILE.png",
    help=f"plot quality against predicted latency (needs the plot extra: {PLOT_EXTRA})",
  )
  p.add_argument("--all", action="store_true", help="every calibrated path, not only the Pareto front")
  p.add_argument(
    "--max-latency-ms",
    type=float,
    default=None,
    help="also mark the plan synthesis chooses within this budget (warm), in the table, --json and --plot",
  )
  p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length the latency is predicted for")
  p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="new tokens the latency is predicted for")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  add_trust_args(p)
  p.set_defaults(fn=cmd_paths)

  p = sub.add_parser(
    "corrections",
    help="the latency corrections learned from requests on this machine, per execution context; --reset forgets",
  )
  add_registry_arg(p, "only this registry's (default: every registry's)", positional=False)
  p.add_argument("--reset", action="store_true", help="forget them: predictions use the calibration alone again")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  add_trust_args(p, keys_help="with --registry: trusted Ed25519 public key (repeatable)")
  p.set_defaults(fn=cmd_corrections)


def add_registry_parsers(sub) -> None:
  """``registry calibrate`` and ``registry warm`` (added to the ``registry`` group)."""
  c = sub.add_parser("calibrate", help="measure candidate paths per hint and this machine's latency; store signed")
  add_registry_arg(c)
  c.add_argument("--sign-key", default=None, help="Ed25519 private key (required when the registry is signed)")
  c.add_argument(
    "--latency-only",
    action="store_true",
    help="keep the stored candidates and quality, re-measure latency on this machine",
  )
  c.add_argument(
    "--hint", action="append", default=None, help="calibrate these hints only (repeatable; default: every hint)"
  )
  c.add_argument("--window", type=int, default=None, help="tokens per quality window (default 128)")
  c.add_argument(
    "--max-windows",
    type=int,
    default=None,
    help="windows per split per hint (default 6; 0: every window of the corpus)",
  )
  add_kernels_arg(c)
  add_trust_args(c)
  c.set_defaults(fn=cmd_calibrate)

  w = sub.add_parser("warm", help="restore and compile the chosen paths of hints ahead of time")
  add_registry_arg(w)
  w.add_argument("--hint", action="append", default=None, help="hints to warm (default: every calibrated hint)")
  w.add_argument("--prompt-tokens", type=int, nargs="+", default=[16], help="prompt lengths (shape buckets)")
  w.add_argument(
    "--max-tokens", type=int, nargs="+", default=[DEFAULT_MAX_TOKENS], help="new-token lengths (shape buckets)"
  )
  w.add_argument(
    "--budget-ms",
    type=float,
    nargs="+",
    default=[math.inf],
    help="latency budgets whose plans (as chosen on a warm process) to warm (default: inf, the best quality)",
  )
  add_kernels_arg(w)
  add_trust_args(w)
  w.set_defaults(fn=cmd_warm)

"""``generate`` and ``synthesize`` through a running local ``thoughtjax serve`` (:mod:`thoughtjax.local_server`).

The server holds the weights and compiled programs warm, so the command costs an interpreter start, the gRPC
client and one call; in-process it costs JAX, a restore and a compile-cache load. ``generate`` comes here for
greedy requests only, whose text and token ids are the in-process ones (greedy decoding is exact on every weight
form the server runs); ``synthesize`` gets the server's plan. The ``--json`` fields are the in-process ones plus
``server`` (the address that answered). A server that does not answer before the first
token (gone, draining) is noted on stderr and the command runs in-process instead; a refusal (a bad request,
an exhausted server) is the command's error, as in-process.

Nothing here imports JAX: the point is not to pay for it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from thoughtjax import local_server
from thoughtjax.cli.args import sampling_kwargs

# Flags whose request the server does not take as given: with any of them set, the command runs in-process.
_IN_PROCESS_FLAGS = ("weights", "kernels", "draft", "draft_vocab", "draft_tokens", "public_key", "require_signatures")


class Unanswered(Exception):
  """The server did not answer before anything was written (gone, or draining)."""


def server_for(args, registry: str | os.PathLike | None) -> local_server.Announcement | None:
  """The local server that runs this command's request as in-process would, or None (run in-process).
  ``registry``: the registry the command would open itself (None: the default one)."""
  if getattr(args, "no_server", False) or local_server.disabled():
    return None
  if any(getattr(args, f, None) for f in _IN_PROCESS_FLAGS):
    return None
  if getattr(args, "system", None) is not None and not getattr(args, "chat", False):
    return None  # what in-process makes of it, in-process
  if registry is None:
    from thoughtjax.cachedir import default_registry_dir

    registry = default_registry_dir()
  return local_server.find(registry)


def generate(args, server: local_server.Announcement) -> int | None:
  """``thoughtjax generate`` through ``server``: ``--path`` (default: the server's whole model) run as given."""
  messages = None
  if args.chat:
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages = [*system, {"role": "user", "content": args.prompt}]
  out = _run(
    server,
    args,
    prompt=None if messages else args.prompt,
    messages=messages,
    path=args.path or server.full_path,
    **sampling_kwargs(args),
  )
  if out is None:
    return None
  if args.json:
    print(
      json.dumps(
        {
          "prompt_ids": list(out.final.prompt_token_ids),
          "token_ids": out.token_ids,
          "text": out.text,
          "finish_reason": out.final.finish_reason,
          "time_to_first_token_s": (out.first_token or out.end) - out.start,
          "total_s": out.end - out.start,
          "server": server.target,
        }
      )
    )
  else:
    sys.stdout.write("\n")
  return 0


def synthesize(args, server: local_server.Announcement) -> int | None:
  """``thoughtjax synthesize`` through ``server``: its planner chooses (with its warm programs priced as such)."""
  messages = [{"role": "user", "content": args.prompt}] if args.chat else None
  budget = args.max_latency_ms
  out = _run(
    server,
    args,
    prompt=None if messages else args.prompt,
    messages=messages,
    hints=args.hint or (),
    max_latency_ms=budget if math.isfinite(budget) else None,
    **sampling_kwargs(args),
  )
  if out is None:
    return None
  final, t = out.final, out.final.trace
  if args.json:
    plan = _plan_json(out.plan)
    plan.update(
      {
        "token_ids": out.token_ids,
        "text": out.text,
        "actual_ms": dict(t.actual_ms),
        "tokens_in": final.usage.tokens_in,
        "tokens_out": final.usage.tokens_out,
        "compute_seconds": final.usage.compute_seconds,
        "finish_reason": final.finish_reason,
        "server": server.target,
      }
    )
    print(json.dumps(plan))
    return 0
  sys.stdout.write("\n")
  print(f"path {t.path} ({t.path_hash}){'  DEGRADED: ' + t.reason if t.degraded else ''}", file=sys.stderr)
  print(f"{'stage':<10}{'predicted ms':>14}{'actual ms':>12}", file=sys.stderr)
  for s in ("synthesis", "restore", "compile", "prefill", "decode", "queue", "total"):
    a = t.actual_ms.get(s)
    if s == "queue" and a is None:
      continue
    print(f"{s:<10}{t.predicted_ms.get(s, 0.0):>14.2f}{'-' if a is None else f'{a:.2f}':>12}", file=sys.stderr)
  u = final.usage
  print(
    f"tokens in {u.tokens_in}, out {u.tokens_out}; compute {u.compute_seconds:.3f} s; served by {server.target}",
    file=sys.stderr,
  )
  return 0


@dataclasses.dataclass
class _Answer:
  plan: object  # thoughtjax.v1.Plan
  final: object  # thoughtjax.v1.Final
  token_ids: list[int]
  text: str
  start: float
  first_token: float | None
  end: float


def _run(server, args, **request) -> _Answer | None:
  """Stream the request: text to stdout as it comes (unless ``--json``), hint corrections and ``--explain`` to
  stderr. None when the server refused or did not answer before its plan (noted on stderr): the caller runs
  in-process, which gives the in-process answer or error. A failure after the plan is the command's error."""
  from thoughtjax.client import Client, ClientError

  token = os.environ.get(local_server.TOKEN_ENV) if server.token else None
  ids: list[int] = []
  text, plan, final = "", None, None
  t0 = time.perf_counter()
  t_first = None
  with Client(server.target, token=token) as c:
    try:
      for r in c.synthesize(**request):
        kind = r.WhichOneof("kind")
        if kind == "plan":
          plan = r.plan
          _print_plan_notes(plan, args)
        elif kind == "delta":
          if t_first is None and r.delta.token_ids:
            t_first = time.perf_counter()
          ids.extend(r.delta.token_ids)
          text += r.delta.text
          if not args.json and r.delta.text:
            sys.stdout.write(r.delta.text)
            sys.stdout.flush()
        elif kind == "final":
          final = r.final
    except ClientError as e:
      if plan is None:
        print(f"the local server at {server.target} refused ({e.code.name}); running in-process", file=sys.stderr)
        return None
      raise
  if final is None:  # the stream ended without its final message: the server went away mid-answer
    import grpc

    raise ClientError(grpc.StatusCode.UNAVAILABLE, f"the stream from {server.target} ended early", "Synthesize")
  return _Answer(plan, final, ids, text, t0, t_first, time.perf_counter())


def _print_plan_notes(plan, args) -> None:
  for c in plan.corrected_hints:
    print(f"hint {c.given!r} corrected to {c.corrected!r}", file=sys.stderr)
  if getattr(args, "explain", False) and not args.json:
    p = plan.predicted_ms
    print(f"path        {plan.path}", file=sys.stderr)
    print(f"path_hash   {plan.path_hash} ({plan.kind}, registry sequence {plan.registry_sequence})", file=sys.stderr)
    print(f"hints       {', '.join(plan.hints)}", file=sys.stderr)
    stages = " + ".join(f"{s} {p.get(s, 0.0):.1f}" for s in ("synthesis", "restore", "compile", "prefill", "decode"))
    print(f"predicted   {p.get('total', 0.0):.1f} ms = {stages}", file=sys.stderr)
    print(f"degraded    {str(plan.degraded).lower()}", file=sys.stderr)
    print(f"reason      {plan.reason}", file=sys.stderr)
    for note in plan.notes:
      print(f"note        {note}", file=sys.stderr)
    for r in plan.rejected:
      print(f"rejected    {r.path} [{r.why}] {r.detail}", file=sys.stderr)


def _plan_json(plan) -> dict:
  """The fields of the in-process ``--json`` plan that the wire's Plan carries."""
  return {
    "path": plan.path,
    "refs": list(plan.refs),
    "path_hash": plan.path_hash,
    "kind": plan.kind,
    "hints": list(plan.hints),
    "corrected_hints": {c.given: c.corrected for c in plan.corrected_hints},
    "predicted_ms": dict(plan.predicted_ms),
    "quality": json.loads(plan.quality_json) if plan.quality_json else {},
    "degraded": plan.degraded,
    "reason": plan.reason,
    "notes": list(plan.notes),
    "registry_sequence": plan.registry_sequence,
    "max_tokens": plan.max_tokens,
    "tokens_that_fit": plan.tokens_that_fit if plan.HasField("tokens_that_fit") else None,
    "rejected": [{"path": r.path, "path_hash": r.path_hash, "why": r.why, "detail": r.detail} for r in plan.rejected],
  }

"""``thoughtjax serve`` (the gRPC server of ``server/``) and ``thoughtjax client`` (stream one request).

``serve`` prints one line ``serving on HOST:PORT`` once the port is bound (and ``metrics on URL`` when the
Prometheus endpoint is on, then ``openai http on URL`` when the OpenAI-compatible endpoint is), before the registry is loaded: health says NOT_SERVING (and calls are UNAVAILABLE)
until the registry is loaded (built and calibrated on a first start of the default one) and the configured
fronts are warm. It drains on SIGTERM. ``client`` streams the text to stdout and
prints the plan and the trace to stderr (``--json``: one JSON object on stdout instead, with the trailing
metadata's ``x-thoughtjax-*`` fields under ``trailer``).
"""

from __future__ import annotations

import json
import sys

from thoughtjax.cli.args import CommandLineError, add_kernels_arg, add_trust_args, existing_path, open_registry


def add_parsers(sub) -> None:
  p = sub.add_parser("serve", help="serve synthesis over gRPC (thoughtjax.v1.Synthesizer, health, reflection)")
  p.add_argument(
    "--registry",
    default=None,
    metavar="DIR",
    help="a calibrated registry (default: the default model's registry, built on first use)",
  )
  p.add_argument("--config", default=None, metavar="FILE", help="server settings (default: server/config.yaml)")
  p.add_argument("--port", type=int, default=None, help="override the config's port (0: any free port)")
  p.add_argument("--bind", default=None, help="override the config's bind address (default 127.0.0.1)")
  p.add_argument(
    "--metrics-port",
    type=int,
    default=None,
    help="serve Prometheus metrics on the config's metrics_bind (default 127.0.0.1) at this port (0: any free port)",
  )
  p.add_argument(
    "--http-port",
    type=int,
    default=None,
    help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) on the "
    "bind address at this port, on the same engines (0: any free port)",
  )
  p.add_argument(
    "--weights",
    choices=("f32", "native"),
    default=None,
    help="the form the registry's restores take: f32 (dequantized float32, the default) or native (a quantized "
    "model's blocks kept packed, computed in float32: the same logits, fewer bytes per step); weight variants "
    "(@int8, @int8a8) are paths of their own",
  )
  add_kernels_arg(p)
  add_trust_args(p)
  p.set_defaults(fn=cmd_serve)

  c = sub.add_parser("client", help="send one request to a thoughtjax server and stream the answer")
  c.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server")
  c.add_argument("--prompt", default=None, help="plain-text prompt")
  c.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
  c.add_argument("--hint", action="append", default=None, help="hint, in priority order (repeatable, at most 3)")
  c.add_argument("--max-tokens", type=int, default=None)
  c.add_argument("--max-latency-ms", type=float, default=None)
  c.add_argument("--temperature", type=float, default=None)
  c.add_argument("--top-k", type=int, default=None)
  c.add_argument("--top-p", type=float, default=None)
  c.add_argument("--seed", type=int, default=None)
  c.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
  c.add_argument("--path", default=None, help="run this explicit path instead of the plan")
  c.add_argument("--plan-only", action="store_true", help="GetOptimalPath: print the plan, run nothing")
  c.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
  c.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM CA that signed the server's certificate")
  c.add_argument("--cert", default=None, metavar="FILE", help="client certificate (mTLS)")
  c.add_argument("--key", default=None, metavar="FILE", help="client private key (mTLS)")
  c.add_argument("--json", action="store_true", help="one JSON object (plan, text, final) on stdout")
  c.set_defaults(fn=cmd_client)


def cmd_serve(args) -> int:
  import asyncio
  import dataclasses

  from thoughtjax.server.app import serve
  from thoughtjax.server.config import load_config
  from thoughtjax.synthesis.synthesize import Synthesizer

  config = load_config(existing_path(args.config, "--config") if args.config else None)
  changes = {
    k: v
    for k, v in (
      ("port", args.port),
      ("bind", args.bind),
      ("metrics_port", args.metrics_port),
      ("http_port", args.http_port),
    )
    if v is not None
  }
  config = dataclasses.replace(config, **changes) if changes else config
  weights = args.weights or "f32"
  if args.registry:  # a bad --registry fails before listening
    registry = open_registry(args.registry, args, "--registry", weights=weights)
  elif args.public_key or args.require_signatures:
    raise CommandLineError("--public-key/--require-signatures check a given registry: add --registry DIR")
  else:
    registry = None

  def load():
    # Building and calibrating the default registry takes minutes on a first start: the server listens
    # first (health NOT_SERVING, calls UNAVAILABLE) and serves once this returns.
    from thoughtjax.synthesis.default_registry import ensure_default

    reg = registry if registry is not None else ensure_default(weights=weights)
    return Synthesizer.open(reg, kernels=args.kernels, context=serving_context(config, reg, args.kernels))

  def on_port(port: int) -> None:
    print(f"serving on {config.bind}:{port}", flush=True)

  def on_metrics_port(port: int) -> None:
    print(f"metrics on http://{config.metrics_bind}:{port}/metrics", flush=True)

  def on_http_port(port: int) -> None:
    scheme = "https" if config.tls.enabled else "http"
    print(f"openai http on {scheme}://{config.bind}:{port}/v1", flush=True)

  asyncio.run(
    serve(None, config, load=load, on_port=on_port, on_metrics_port=on_metrics_port, on_http_port=on_http_port)
  )
  return 0


def serving_context(config, registry, kernels: str | None):
  """The latency context a server's plans are predicted in: its slot engines' (continuous batching decodes
  ``max_concurrent`` slots every chunk), so the server predicts with what those engines taught and never
  with a one-shot program's corrections; ``None`` (a plain program per request) for the simple scheduler."""
  # Imported here: the command line starts without JAX and the synthesis stack.
  from thoughtjax.kernels.dispatch import resolve as resolve_kernels
  from thoughtjax.synthesis.latency import LatencyContext

  if config.scheduler != "continuous":
    return None
  weights = getattr(registry, "weights", None) or "f32"
  return LatencyContext("slots", weights, int(config.max_concurrent), resolve_kernels(kernels))


def cmd_client(args) -> int:
  from google.protobuf.json_format import MessageToDict

  from thoughtjax.client import Client

  if not args.prompt:
    raise CommandLineError("--prompt is required (the text to send); give --prompt TEXT")
  if (args.cert is None) != (args.key is None):
    raise CommandLineError("--cert and --key go together (mTLS); give both or neither")
  paths = {
    k: existing_path(v, f"--{k.replace('_', '-')}")
    for k, v in (("tls_ca", args.tls_ca), ("cert", args.cert), ("key", args.key))
    if v is not None
  }
  fields = dict(
    max_tokens=args.max_tokens,
    max_latency_ms=args.max_latency_ms,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
    stop_strings=tuple(args.stop or ()),
    path=args.path,
    timeout=args.timeout,
  )
  if args.chat:
    fields["messages"] = [{"role": "user", "content": args.prompt}]
    prompt = None
  else:
    prompt = args.prompt
  with Client(args.target, ca=paths.get("tls_ca"), cert=paths.get("cert"), key=paths.get("key")) as c:
    if args.plan_only:
      plan = c.plan(prompt, args.hint or (), **fields)
      print(json.dumps(MessageToDict(plan), indent=None if args.json else 2))
      return 0
    text = []
    for piece in c.stream(prompt, args.hint or (), **fields):
      text.append(piece)
      if not args.json:
        sys.stdout.write(piece)
        sys.stdout.flush()
    final = c.last_final
    if args.json:
      trailer = c.last_trailer.fields if c.last_trailer is not None else {}
      print(
        json.dumps(
          {"plan": MessageToDict(c.last_plan), "text": "".join(text), "final": MessageToDict(final), "trailer": trailer}
        )
      )
      return 0
    print()
    t = final.trace
    print(f"path {t.path} ({t.path_hash}){'  DEGRADED: ' + t.reason if t.degraded else ''}", file=sys.stderr)
    print(f"{'stage':<10}{'predicted ms':>14}{'actual ms':>12}", file=sys.stderr)
    for s in ("synthesis", "restore", "compile", "prefill", "decode", "total"):
      a = t.actual_ms.get(s)
      print(f"{s:<10}{t.predicted_ms.get(s, 0.0):>14.2f}{'-' if a is None else f'{a:.2f}':>12}", file=sys.stderr)
    print(
      f"finish {final.finish_reason}; tokens in {final.usage.tokens_in}, out {final.usage.tokens_out}; "
      f"compute {final.usage.compute_seconds:.3f} s",
      file=sys.stderr,
    )
  return 0

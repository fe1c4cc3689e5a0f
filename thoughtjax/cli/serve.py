"""``thoughtjax serve`` (the server of ``server/``: OpenAI-compatible HTTP and gRPC) and ``thoughtjax client``
(stream one request over gRPC).

``serve`` reads its settings in ``server/config.py`` (:func:`~thoughtjax.server.config.serve_config`: flags over
``THOUGHTJAX_*`` environment variables over the YAML file over the built-in defaults). It prints one line
``serving on HOST:PORT`` (gRPC) once the port is bound (and ``metrics on URL`` when the Prometheus port is on, then
``openai http on URL`` when the OpenAI-compatible endpoint is: by default, on 8080), before the registry is loaded:
health says NOT_SERVING (and calls are UNAVAILABLE)
until the registry is loaded (built and calibrated on a first start of the default one) and the configured
fronts are warm. It drains on SIGTERM. ``client`` streams the text to stdout and
prints the plan and the trace to stderr (``--json``: one JSON object on stdout instead, with the trailing
metadata's ``x-thoughtjax-*`` fields under ``trailer``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from thoughtjax.cli.args import CommandLineError, add_kernels_arg, add_trust_args, existing_path, open_registry


def add_parsers(sub) -> None:
  p = sub.add_parser(
    "serve",
    help="serve a model: the OpenAI-compatible HTTP API (default port 8080) and gRPC (thoughtjax.v1.Synthesizer, "
    "health, reflection; default port 50051)",
    description="Serve a model over HTTP (OpenAI-compatible, /health, /metrics, /tokenize) and gRPC, on the same "
    "engines. Settings: a flag wins over its THOUGHTJAX_* environment variable, which wins over --config, which "
    "wins over the built-in default.",
  )
  what = p.add_mutually_exclusive_group()
  what.add_argument(
    "--model",
    default=None,
    metavar="FILE.gguf|NAME",
    help="serve this GGUF file, or a known model name (smollm2-135m-instruct), with no registry to build first. "
    "The default model's file (same sha256) serves the default registry; another GGUF gets a registry of its own "
    "in the cache directory (keyed by its sha256), built and calibrated on first use with its full path as the only "
    "candidate (hints and budgets then choose nothing else). Default: the default model",
  )
  what.add_argument(
    "--registry",
    default=None,
    metavar="DIR",
    help="serve a calibrated registry (default: the default model's registry, built on first use)",
  )
  p.add_argument("--config", default=None, metavar="FILE", help="server settings (default: server/config.yaml)")
  p.add_argument(
    "--host",
    "--bind",
    dest="bind",
    default=None,
    metavar="ADDR",
    help="address of both ports (default: the config's bind, 127.0.0.1); 0.0.0.0 only behind TLS or a trusted network",
  )
  p.add_argument(
    "--port", type=int, default=None, help="the gRPC port (default: the config's port, 50051; 0: any free port)"
  )
  http = p.add_mutually_exclusive_group()
  http.add_argument(
    "--http-port",
    type=int,
    default=None,
    help="the OpenAI-compatible HTTP port (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, "
    "/tokenize, /detokenize), on the same engines (default: the config's http_port, 8080; 0: any free port)",
  )
  http.add_argument("--no-http", action="store_true", help="serve no HTTP, gRPC only (config: http_port: null)")
  p.add_argument(
    "--metrics-port",
    type=int,
    default=None,
    help="also serve Prometheus metrics on the config's metrics_bind (default 127.0.0.1) at this port (0: any "
    "free port); /metrics on the HTTP port serves them as well",
  )
  p.add_argument(
    "--api-key",
    default=None,
    metavar="KEY",
    help="the client token every call must carry (HTTP 'Authorization: Bearer KEY', gRPC metadata), at least 16 "
    "characters (env THOUGHTJAX_API_KEY, which a process list does not show; config clients.token; default: none)",
  )
  p.add_argument(
    "--alias",
    "--served-model-name",
    dest="alias",
    default=None,
    metavar="NAME",
    help="the model id /v1/models lists and requests name (env THOUGHTJAX_MODEL_ALIAS; config model_name; "
    "default: the GGUF's file name with --model, else the registry's folder name, which requests may name too)",
  )
  p.add_argument(
    "--parallel",
    "-np",
    "--slots",
    dest="slots",
    default=None,
    metavar="N",
    help="requests generating at once, the slots of each engine (env THOUGHTJAX_SLOTS; config max_concurrent; "
    "default 16)",
  )
  p.add_argument(
    "--warm",
    default=None,
    metavar="HINT[,HINT]",
    help="hints whose paths are restored and compiled before the server reports ready, or 'all': every calibrated "
    "hint and the hint router (env THOUGHTJAX_WARM; config warm.hints; default: all)",
  )
  p.add_argument(
    "--strict-fields",
    action="store_true",
    default=None,
    help="refuse an HTTP body field the server does not know (400) instead of ignoring it with a logged warning "
    "(config strict_fields)",
  )
  p.add_argument(
    "--weights",
    choices=("f32", "native"),
    default=None,
    help="the form the registry's restores take: f32 (dequantized float32) or native (a quantized model's blocks "
    "kept packed, computed in float32: the same logits, fewer bytes per step); weight variants (@int8, @int8a8) are "
    "paths of their own (env THOUGHTJAX_WEIGHTS; config weights; default native)",
  )
  add_kernels_arg(p)
  add_trust_args(p)
  p.set_defaults(fn=cmd_serve)

  c = sub.add_parser("client", help="send one request to a thoughtjax server over gRPC and stream the answer")
  c.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server's gRPC port")
  c.add_argument("--prompt", required=True, help="the text to send (plain text, or one user message with --chat)")
  c.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
  c.add_argument("--hint", action="append", default=None, help="hint, in priority order (repeatable, at most 3)")
  c.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (default: the server's, 64)")
  c.add_argument(
    "--max-latency-ms", type=float, default=None, help="latency budget the plan must fit (default: the deadline)"
  )
  c.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0: greedy)")
  c.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens (default 0: off)")
  c.add_argument("--top-p", type=float, default=None, help="sample within this cumulative probability (default 1)")
  c.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
  c.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
  c.add_argument("--path", default=None, help="run this explicit path instead of the plan")
  c.add_argument("--plan-only", action="store_true", help="GetOptimalPath: print the plan, run nothing")
  c.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds (default: none)")
  c.add_argument(
    "--token",
    default=None,
    metavar="TOKEN",
    help="bearer token for a server that requires one (its --api-key / clients.token; default: "
    "$THOUGHTJAX_API_KEY when set, else none)",
  )
  c.add_argument("--tls-ca", default=None, metavar="FILE", help="PEM CA that signed the server's certificate")
  c.add_argument("--cert", default=None, metavar="FILE", help="client certificate (mTLS)")
  c.add_argument("--key", default=None, metavar="FILE", help="client private key (mTLS)")
  c.add_argument("--json", action="store_true", help="one JSON object (plan, text, final) on stdout")
  c.set_defaults(fn=cmd_client)


def served_model(text: str):
  """What ``serve --model TEXT`` serves: a function of the weight form opening its registry (built and calibrated
  on first use; called after the ports are bound) and the model id it goes by. A missing file or one that is not a
  GGUF is a :class:`CommandLineError` now, before anything listens."""
  from thoughtjax import fetch as fetch_lib

  if text in fetch_lib.KNOWN_MODELS:
    if text == fetch_lib.DEFAULT_MODEL:
      from thoughtjax.synthesis.default_registry import ensure_default

      return lambda weights: ensure_default(weights=weights), text

    def fetched(weights: str):
      from thoughtjax.synthesis.default_registry import ensure_gguf

      return ensure_gguf(fetch_lib.fetch(text), weights=weights)

    return fetched, text
  path = Path(text).expanduser()
  if path.is_dir():
    raise CommandLineError(
      f"--model {text}: expected a .gguf file, found a directory; build a registry from it "
      f"(thoughtjax registry build --model {text} --out DIR) and serve that with --registry DIR"
    )
  path = existing_path(text, "--model")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CommandLineError(
      f"--model {text}: expected a GGUF file (its first bytes 'GGUF'), got {magic!r}; pass a .gguf file, a known "
      f"model name ({', '.join(fetch_lib.KNOWN_MODELS)}) or a registry with --registry DIR"
    )

  def built(weights: str):
    from thoughtjax.synthesis.default_registry import ensure_gguf

    return ensure_gguf(path, weights=weights)

  return built, path.name.removesuffix(".gguf")


def cmd_serve(args) -> int:
  import asyncio

  from thoughtjax import heap
  from thoughtjax.cli.model_commands import trim_heap_after_compiles

  heap.cap_arenas()  # first, before the server's threads allocate (thoughtjax.heap: RSS under a flood)
  trim_heap_after_compiles()  # the warm set's compiles free hundreds of MiB glibc would keep
  from thoughtjax.server.app import serve
  from thoughtjax.server.config import serve_config
  from thoughtjax.synthesis.synthesize import Synthesizer

  opened, model_name = None, None
  if args.model is not None:  # a missing or non-GGUF file fails before listening
    opened, model_name = served_model(args.model)
  flags = {
    "port": args.port,
    "bind": args.bind,
    "metrics_port": args.metrics_port,
    "http_port": "off" if args.no_http else args.http_port,
    "clients.token": args.api_key,
    "model_name": args.alias,
    "max_concurrent": args.slots,
    "warm.hints": args.warm,
    "strict_fields": args.strict_fields,
    "weights": args.weights,
  }
  config = serve_config(
    existing_path(args.config, "--config") if args.config else None,
    flags,
    defaults={"model_name": model_name} if model_name else None,
  )
  weights = config.weights
  if args.registry:  # a bad --registry fails before listening
    registry = open_registry(args.registry, args, "--registry", weights=weights)
  elif args.public_key or args.require_signatures:
    raise CommandLineError("--public-key/--require-signatures check a given registry: add --registry DIR")
  else:
    registry = None

  def load():
    # Building and calibrating a registry takes minutes on a first start: the server listens first (health
    # NOT_SERVING, calls UNAVAILABLE) and serves once this returns.
    from thoughtjax.synthesis.default_registry import ensure_default

    if registry is not None:
      reg = registry
    elif opened is not None:
      reg = opened(weights)
    else:
      reg = ensure_default(weights=weights)
    return Synthesizer.open(reg, kernels=args.kernels, context=serving_context(config, reg, args.kernels))

  def on_port(port: int) -> None:
    print(f"serving on {config.bind}:{port}", flush=True)

  def on_metrics_port(port: int) -> None:
    print(f"metrics on http://{config.metrics_bind}:{port}/metrics", flush=True)

  def on_http_port(port: int) -> None:
    scheme = "https" if config.tls.enabled else "http"
    print(f"openai http on {scheme}://{config.bind}:{port}/v1", flush=True)

  announced, bound = [], []

  def on_ready(reg) -> None:
    # Found by `thoughtjax generate`/`synthesize` on this machine (thoughtjax/local_server.py) from now on.
    from thoughtjax import local_server
    from thoughtjax.assembly import full_path

    target = local_server.dial_address(config.bind, bound[0])
    token = config.clients.token is not None or config.clients.token_file is not None
    announced.append(local_server.announce(target, reg.root, full_path(reg), token=token, tls=config.tls.enabled))

  try:
    asyncio.run(
      serve(
        None,
        config,
        load=load,
        on_port=lambda port: (bound.append(port), on_port(port)),
        on_metrics_port=on_metrics_port,
        on_http_port=on_http_port,
        on_ready=on_ready,
      )
    )
  finally:
    for file in announced:
      from thoughtjax import local_server

      local_server.withdraw(file)
  return 0


def serving_context(config, registry, kernels: str | None):
  """The latency context a server's plans are predicted in: its slot engines' (continuous batching decodes
  ``max_concurrent`` slots every chunk), so the server predicts with what those engines taught and never
  with a one-shot program's corrections; ``None`` (a plain program per request) for the simple scheduler."""
  # Imported here: the command line starts without JAX and the synthesis stack.
  from thoughtjax.kernels.dispatch import resolve as resolve_kernels
  from thoughtjax.synthesis.latency_context import LatencyContext

  if config.scheduler != "continuous":
    return None
  weights = getattr(registry, "weights", None) or "f32"
  return LatencyContext("slots", weights, int(config.max_concurrent), resolve_kernels(kernels))


def cmd_client(args) -> int:
  from google.protobuf.json_format import MessageToDict

  from thoughtjax.client import Client

  if not args.prompt:
    raise CommandLineError("--prompt is empty; give the text to send, --prompt TEXT")
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
  token = args.token or os.environ.get("THOUGHTJAX_API_KEY") or None
  with Client(args.target, ca=paths.get("tls_ca"), cert=paths.get("cert"), key=paths.get("key"), token=token) as c:
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

"""``thoughtjax fetch``, ``generate`` and ``score``: the commands that run one model."""

from __future__ import annotations

import argparse
import json
import sys

from thoughtjax.cli.args import (
  CommandLineError,
  add_constraint_args,
  add_kernels_arg,
  add_no_server_arg,
  add_sampling_args,
  add_trust_args,
  model_source,
  registry_weights,
  sampling_kwargs,
)
from thoughtjax.defaults import DEFAULT_DRAFT_TOKENS
from thoughtjax.fetch import DEFAULT_MODEL, KNOWN_MODELS


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--model",
    default=None,
    help=f"known model name or path to a .gguf / safetensors dir (default: {DEFAULT_MODEL})",
  )
  p.add_argument(
    "--path", default=None, help='thoughtlet path, e.g. "embed, blocks[0:12), head" (default: the full model)'
  )
  p.add_argument(
    "--registry",
    default=None,
    metavar="DIR",
    help="compose --path from this thoughtlet registry instead of loading --model "
    "(default path: embed, every block thoughtlet in layer order, head)",
  )
  p.add_argument(
    "--weights",
    choices=("native", "f32", "int8", "int8a8"),
    default=None,
    help="native: the GGUF's quantized blocks, read packed and computed in float32 (same logits); "
    "f32: dequantized float32 weights (the default); int8: per-row int8 quantized at load (lossy; with --registry "
    "name int8 variants in --path instead); int8a8: int8 weights and int8 activations per row (lossier)",
  )
  add_kernels_arg(p)
  add_trust_args(p, keys_help="with --registry: trusted Ed25519 public key (repeatable)")


# A compile or a compiled-executable load from the persistent cache this long (s) is followed by a heap trim.
TRIM_AFTER_COMPILE_S = 0.25
_TRIM_INSTALLED = False


def trim_heap_after_compiles() -> bool:
  """Give freed heap back to the OS after every long XLA compile or executable load, before it runs.

  Loading the default model's generation program from the compilation cache allocates ~290 MB of which
  ~160 MB is freed at once but kept by glibc's malloc; the prefill then allocates its temp buffers on top,
  which sets the process's peak. ``malloc_trim`` (~10 ms) returns those pages first. A process-level
  policy, so the commands install it and the library does not. False where libc has no ``malloc_trim``.
  """
  global _TRIM_INSTALLED
  import jax

  from thoughtjax import heap

  if not heap.trim():  # not glibc: nothing to trim
    return False
  if _TRIM_INSTALLED:  # once per process, however many commands run in it
    return True
  _TRIM_INSTALLED = True

  def on_duration(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and seconds >= TRIM_AFTER_COMPILE_S:
      heap.trim()

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  return True


def _load(args):
  """The model to run: composed from ``--registry`` (with the trust flags), or loaded from ``--model``."""
  import thoughtjax

  trim_heap_after_compiles()
  if args.registry:
    if args.model is not None:
      raise CommandLineError("--model and --registry both given: the registry holds the weights; drop one")
    registry_weights(args.weights)
    from thoughtjax.cli.registry import load_from_registry

    return load_from_registry(args)
  if args.public_key or args.require_signatures:
    raise CommandLineError("--public-key and --require-signatures check a registry: add --registry DIR or drop them")
  model = thoughtjax.load(model_source(args.model), kernels=args.kernels, weights=args.weights or "f32")
  if args.path:
    from thoughtjax.path_syntax import layers_of_path

    model = model.with_path(layers_of_path(args.path, model.config.num_layers))
  return model


def cmd_fetch(args) -> int:
  from thoughtjax.fetch import fetch

  path = fetch(args.name, progress=True, force=args.force)
  print(path)
  return 0


def cmd_generate(args) -> int:
  from thoughtjax.cli import remote

  # The default model is the default registry's; another --model is not a server's (in-process). Sampling runs
  # in-process too: a server's slot engine keys its random stream by its own step and row, so the same seed would
  # give other text there (greedy tokens are the same).
  ours = args.model is None or (args.registry is None and args.model == DEFAULT_MODEL)
  if ours and args.temperature == 0:
    server = remote.server_for(args, args.registry)
    if server is not None:
      code = remote.generate(args, server)
      if code is not None:
        return code
  from thoughtjax.sampling import SamplingParams

  model = _load(args)
  params = SamplingParams(**sampling_kwargs(args))
  ids: list[int] = []
  text, reason = "", None
  # Leaving the block early (an interrupt, a closed stdout) abandons the generation: no more device work.
  draft = None
  if args.draft:
    from thoughtjax.decode.speculative import Draft

    draft = Draft(args.draft, vocab=args.draft_vocab)
  elif args.draft_vocab is not None or args.draft_tokens is not None:
    raise CommandLineError("--draft-tokens and --draft-vocab set up a draft: add --draft PATH or drop them")
  draft_kw = {} if draft is None else {"draft": draft, "draft_tokens": args.draft_tokens or DEFAULT_DRAFT_TOKENS}
  with model.stream_batch([args.prompt], params, chat=args.chat, system=args.system, **draft_kw) as stream:
    for d in stream:
      ids.extend(d.token_ids)
      text += d.text
      if d.finished:
        reason = d.finish_reason
      if not args.json:
        sys.stdout.write(d.text)
        sys.stdout.flush()
  if args.json:
    t = stream.trace
    print(
      json.dumps(
        {
          "prompt_ids": t.prompt_ids[0],
          "token_ids": ids,
          "text": text,
          "finish_reason": reason,
          "time_to_first_token_s": (t.first_token or 0) - t.start,
          "total_s": (t.end or 0) - t.start,
          **({} if draft is None else {"drafted": t.drafted, "accepted": t.accepted, "verify_passes": t.verify_passes}),
        }
      )
    )
  else:
    sys.stdout.write("\n")
  return 0


def cmd_score(args) -> int:
  if (args.text is None) == (args.token_ids is None):
    raise CommandLineError("give exactly one of --text or --token-ids")
  model = _load(args)
  if args.text is not None:
    ids = model.codec.encode(args.text)
  else:
    try:
      ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
    except ValueError:
      raise CommandLineError(
        f"--token-ids must be comma-separated integers, e.g. 1,2,3; got {args.token_ids!r}"
      ) from None
  bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
  if bad:
    raise CommandLineError(f"--token-ids {bad[:5]} are outside this model's vocabulary [0, {model.config.vocab_size})")
  s = model.score(ids, top_k=args.top_k)
  if args.json:
    print(
      json.dumps(
        {
          "token_ids": s.token_ids,
          "top_ids": s.top_ids,
          "top_logits": s.top_logits,
          "token_logprobs": s.token_logprobs,
          "nll": s.nll,
          "perplexity": s.perplexity,
        }
      )
    )
    return 0
  for t, (tid, tops, vals) in enumerate(zip(s.token_ids, s.top_ids, s.top_logits)):
    nxt = s.token_logprobs[t] if t < len(s.token_logprobs) else None
    shown = ", ".join(f"{i}:{model.codec.decode([i])!r}={v:.3f}" for i, v in zip(tops, vals))
    lp = "" if nxt is None else f"  logp(next)={nxt:.4f}"
    print(f"{t:4d} {tid:6d} {model.codec.decode([tid])!r:>14}  top: {shown}{lp}")
  print(f"nll={s.nll:.6f} perplexity={s.perplexity:.4f}")
  return 0


def add_parsers(sub) -> None:
  p = sub.add_parser("fetch", help="download and verify a known model into the cache directory")
  p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=tuple(KNOWN_MODELS), help="known model to fetch")
  p.add_argument("--force", action="store_true", help="download again even if cached")
  p.set_defaults(fn=cmd_fetch)

  p = sub.add_parser("generate", help="stream a continuation or a chat answer")
  _add_model_args(p)
  p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--system", default=None, help="system message (with --chat)")
  add_sampling_args(p)
  p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
  add_constraint_args(p)
  add_no_server_arg(p)
  p.add_argument(
    "--draft",
    default=None,
    metavar="PATH",
    help='self-speculative decoding: a prefix of the path drafts, e.g. "embed, blocks[0:10), head", or the '
    'text itself, "ngram:N" (what followed the latest earlier match of the last N..1 tokens, N in [1, 16]; '
    '"ngram:N:M": only from a match of at least M tokens, a plain step otherwise) '
    "(greedy output identical, sampling keeps its distribution)",
  )
  p.add_argument(
    "--draft-tokens",
    type=int,
    default=None,
    metavar="K",
    help=f"tokens drafted per verify pass (default {DEFAULT_DRAFT_TOKENS})",
  )
  p.add_argument(
    "--draft-vocab",
    type=int,
    default=None,
    metavar="N",
    help="the draft's head reads only token ids 0..N-1 (a BPE vocabulary's lowest ids, its earliest merges, "
    "stand in for the most frequent tokens; default: the whole vocabulary)",
  )
  p.set_defaults(fn=cmd_generate)

  p = sub.add_parser("score", help="per-position top-K logits and log-likelihood of a sequence")
  _add_model_args(p)
  p.add_argument("--text", default=None, help="text to score (tokenized by the model; or give --token-ids)")
  p.add_argument("--token-ids", default=None, help="comma-separated ids to score, e.g. 1,2,3 (or give --text)")
  p.add_argument("--top-k", type=int, default=5, help="top logits listed per position")
  p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  p.set_defaults(fn=cmd_score)

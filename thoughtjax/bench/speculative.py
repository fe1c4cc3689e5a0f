"""``thoughtjax bench speculative``: how well a model's own early exits draft for it, and what speculation buys.

Measured in one run, on one model (default: the default model), greedy, EOS ignored so every request
decodes ``--max-tokens``:

1. **plain** decode tok/s of the full path at batch 1 (each prompt alone) and batch B (the prompts
   repeated to B rows);
2. per **draft** (an early exit after each ``--depths`` layer count, raw; with a bridge for that exit when
   ``--registry`` holds ``bridge.d-L`` or ``--heal-steps`` trains one here; optionally a truncated draft
   head ``--draft-vocab``) and per K in ``--draft-tokens``: acceptance (drafts accepted / drafted),
   tokens per verify pass, decode tok/s and speedup over plain at batch 1 and batch B, and whether the
   tokens are identical to plain greedy decoding (they must be: the run fails otherwise);
   Besides the exits, a **weight variant** of the whole full path drafts (``embed, blocks[0:L)@int8, head``:
   per-row int8 weights, alone and with the truncated head; its blocks keep a KV cache of their own), unless
   ``--no-int8``; and the **n-gram** draft of each N in ``--ngram`` (``ngram:N``: no weights, the
   continuation of the latest earlier match of the last N..1 tokens in the row's own text; ``N:M``: only
   from a match of at least M tokens, a plain step otherwise), unless
   ``--no-ngram``. ``--text repeating`` swaps the prompts for ones whose continuation repeats text (code
   that reuses names, JSON with repeated keys, an answer quoting the prompt), where such drafts pay;
   per draft, ms per verify pass beside plain decode's ms per step says what one pass of K+1 rows costs;
3. **reuse**: for the first draft, verify starting from the draft's saved residual (the default) vs
   recomputing the shared blocks, batch 1.

Decode tok/s = tokens after the first / (last token time - first token time), summed over rows; every
program is run once before it is timed (compile excluded). Prints tables; ``--json FILE`` writes every
number; ``--quick`` uses few prompts, short decodes and small sizes (CI, on a tiny model).
"""

from __future__ import annotations

import argparse
import sys

from thoughtjax.bench import common
from thoughtjax.cli.args import add_trust_args, trust_policy
from thoughtjax.errors import UserError

REPEATING = (  # the continuation repeats text of the prompt or of itself
  "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
  '[\n  {"name": "Alice", "age": 30, "city": "Paris", "email": "alice@example.com"},\n'
  '  {"name": "Bob", "age": 25, "city": "Rome", "email": "bob@example.com"},\n  {"name": "Carol",',
  "Repeat this sentence three times: The quick brown fox jumps over the lazy dog beside the river.\n"
  "1. The quick brown fox jumps over the lazy dog beside the river.\n2.",
  "class Point:\n    def __init__(self, x, y, z):\n        self.x = x\n        self.y = y\n        self.z = z\n\n"
  "    def __add__(self, other):\n        return Point(",
)
PROMPTS = (
  "The capital of France is",
  "def fibonacci(n):",
  "Once upon a time, a small fox",
  "The three laws of motion are",
  "Water boils at",
  "A good breakfast has",
  "In 1969, the first",
  "To make bread, you",
)


def _table(title, columns, rows, **kw) -> None:
  common.print_table(title, columns, rows, width=160, **kw)  # wide: a log keeps every column unwrapped


class BenchArgumentError(UserError, ValueError):
  """Benchmark settings this model cannot run; the message names the setting and the valid range."""


def _ints(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 8,16,24; got {text!r}") from None


def _decode_rate(gen) -> tuple[float, list[list[int]]]:
  """(decode tok/s over all rows, token ids per row) of a finished Generation."""
  comps = gen.completions()
  t = gen.trace
  decoded = sum(max(n - 1, 0) for n in t.tokens_out)
  return (decoded / t.decode_s if t.decode_s else float("nan")), [c.token_ids for c in comps]


def _run(model, prompts, max_tokens: int, batch: int, plain_ms: float | None = None, **draft) -> dict:
  """Batch 1 (each prompt alone) and batch ``batch`` (prompts repeated), each program warmed first.

  ms per decode step (plain) or per verify pass (a draft), the median over the batch-1 prompts. An n-gram
  draft's iterations without a match are plain one-token steps, not verify passes: ``plain_steps`` counts
  them (tokens less those the passes appended) and its ms per pass is what is left of the decode time after
  them at the plain run's ``plain_ms`` per step; ``tokens_per_pass`` counts what the passes appended."""
  from thoughtjax.sampling import SamplingParams

  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  model.generate_batch(prompts[:1], params, **draft)  # compile batch 1
  rates, tokens, traces = [], [], []
  for p in prompts:
    g = model.stream_batch([p], params, **draft)
    rate, toks = _decode_rate(g)
    rates.append(rate)
    tokens.append(toks[0])
    traces.append(g.trace)
  rows = [prompts[i % len(prompts)] for i in range(batch)]
  model.generate_batch(rows, params, **draft)  # compile batch B
  g = model.stream_batch(rows, params, **draft)
  rate_b, toks_b = _decode_rate(g)
  out = {
    "tok_s_b1": common.median(rates),
    "tok_s_bn": rate_b,
    "tokens_b1": tokens,
    "tokens_bn": toks_b,
  }
  if not draft:
    out["ms_per_step"] = common.median([1e3 * t.decode_s / (t.tokens_out[0] - 1) for t in traces if t.decode_s])
    return out
  steps = [max(t.tokens_out[0] - 1 - t.accepted - t.verify_passes, 0) for t in traces]
  out["ms_per_step"] = common.median(
    [
      (1e3 * t.decode_s - n * (plain_ms or 0.0)) / t.verify_passes
      for t, n in zip(traces, steps, strict=True)
      if t.decode_s and t.verify_passes
    ]
  )
  drafted = sum(t.drafted for t in traces)
  out["acceptance"] = sum(t.accepted for t in traces) / drafted if drafted else float("nan")
  passes = sum(t.verify_passes for t in traces)
  out["tokens_per_pass"] = (sum(t.accepted for t in traces) + passes) / passes if passes else float("nan")
  out["plain_steps"] = sum(steps)
  out["acceptance_bn"] = g.trace.accepted / g.trace.drafted if g.trace.drafted else float("nan")
  return out


def _bridges(args, model, depths) -> dict[int, tuple[dict, str]]:
  """Bridge params per depth: from ``--registry`` (``bridge.d-L``) or trained here (``--heal-steps``)."""
  L = model.config.num_layers
  found: dict[int, tuple[dict, str]] = {}
  if args.registry:
    from thoughtjax.registry import Registry

    reg = Registry.open(args.registry, trust=trust_policy(args))
    for d in depths:
      name = f"bridge.{d}-{L}"
      if name in reg.names:
        found[d] = (reg.restore(name), f"registry {name}@{reg.current[name][:8]}")
  if args.heal_steps:
    from thoughtjax.synthesis.heal import HealSettings, heal

    settings = HealSettings(steps=args.heal_steps, rank=args.heal_rank, **({"generated": 8} if args.quick else {}))
    for d in depths:
      if d in found:
        continue
      params, report = heal(model, f"embed, blocks[0:{d}), head", settings)
      found[d] = (params, f"healed here: {args.heal_steps} steps, rank {args.heal_rank}, {report.train_seconds:.0f} s")
      print(f"bridge for depth {d}: {report.before} -> {report.after}", file=sys.stderr, flush=True)
  return found


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench speculative", description=__doc__.splitlines()[0])
  p.add_argument("--model", default=None, help="known model name or path (default: smollm2-135m-instruct)")
  p.add_argument("--quick", action="store_true", help="few prompts, short decodes (CI)")
  p.add_argument("--depths", type=_ints, default=None, help="early exits to draft from (default 8,16,24,28)")
  p.add_argument("--draft-tokens", type=_ints, default=None, help="K values (default 4)")
  p.add_argument("--draft-vocab", type=int, default=None, help="also a truncated draft head over N ids")
  p.add_argument("--prompts", type=int, default=None, help="prompts at batch 1 (default 4; quick 2)")
  p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64; quick 8)")
  p.add_argument("--batch", type=int, default=None, help="the larger batch (default 8; quick 2)")
  p.add_argument("--registry", default=None, metavar="DIR", help="registry holding bridges bridge.d-L for the exits")
  add_trust_args(p, keys_help="with --registry: trusted Ed25519 public key (repeatable)")
  p.add_argument("--heal-steps", type=int, default=0, help="train a bridge per exit here with this many steps")
  p.add_argument("--heal-rank", type=int, default=64)
  p.add_argument("--no-int8", action="store_true", help="leave out the int8 weight-variant drafts")
  p.add_argument(
    "--ngram",
    type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
    default=None,
    help="n-gram drafts ngram:SPEC for these SPECs, N or N:M (longest, shortest match; default 3)",
  )
  p.add_argument("--no-ngram", action="store_true", help="leave out the n-gram drafts")
  p.add_argument("--no-exits", action="store_true", help="leave out the early-exit drafts (and their bridges)")
  p.add_argument("--text", default="plain", choices=("plain", "repeating"), help="prompt set (default plain)")
  p.add_argument("--weights", default="f32", choices=("f32", "native"), help="weights of the model (default f32)")
  p.add_argument("--kernels", default=None, choices=("xla", "pallas"))
  p.add_argument("--json", default=None, type=common.json_path, help="write the results here")
  args = p.parse_args(argv)
  if (args.public_key or args.require_signatures) and not args.registry:
    p.error("--public-key and --require-signatures check a registry you name: add --registry DIR")

  import thoughtjax
  from thoughtjax.decode.speculative import Draft
  from thoughtjax.thoughtlet import fingerprint

  quick = args.quick
  model = thoughtjax.load(args.model, kernels=args.kernels, weights=args.weights)
  L = model.config.num_layers
  depths = args.depths or ([L - 1] if quick else [8, 16, 24, 28])
  bad = [d for d in depths if not 0 <= d < L]
  if bad:
    raise BenchArgumentError(f"--depths {bad}: an exit runs 0..{L - 1} of this model's {L} layers; pick depths there")
  ks = args.draft_tokens or ([2] if quick else [4])
  n_prompts = args.prompts or (2 if quick else 4)
  max_tokens = args.max_tokens or (8 if quick else 64)
  batch = args.batch or (2 if quick else 8)
  texts = REPEATING if args.text == "repeating" else PROMPTS
  prompts = [model.prompt_ids(t) for t in texts[:n_prompts]]
  if len(prompts) < n_prompts:
    raise BenchArgumentError(
      f"--prompts {n_prompts}: this benchmark has {len(texts)} {args.text} prompts; ask for at most that"
    )
  ngrams = [] if args.no_ngram else (args.ngram or ["3"])

  result: dict = {
    "model": model.loaded.source,
    "quick": quick,
    "fingerprint": fingerprint(),
    "prompts": len(prompts),
    "max_tokens": max_tokens,
    "batch": batch,
    "depths": depths,
    "draft_tokens": ks,
    "text": args.text,
    "weights": args.weights,
  }
  print(f"plain decode, batch 1 and {batch} ...", file=sys.stderr, flush=True)
  plain = _run(model, prompts, max_tokens, batch)
  result["plain"] = {"tok_s_b1": plain["tok_s_b1"], "tok_s_bn": plain["tok_s_bn"], "ms_per_step": plain["ms_per_step"]}

  drafts: list[tuple[str, int, Draft, str]] = []
  if args.no_exits:
    depths = []
  for d in depths:
    drafts.append((f"exit {d}", d, Draft(f"embed, blocks[0:{d}), head"), "raw"))
  for d, (params, origin) in _bridges(args, model, depths).items():
    drafts.append((f"exit {d} + bridge", d, Draft(f"embed, blocks[0:{d}), head", bridge=params), origin))
  if args.draft_vocab:
    for d in depths:
      drafts.append(
        (f"exit {d}, vocab {args.draft_vocab}", d, Draft(f"embed, blocks[0:{d}), head", vocab=args.draft_vocab), "raw")
      )

  if not args.no_int8:  # the full path in int8 weights: cheaper per step, and it agrees far more than a cut
    drafts.append((f"int8 blocks[0:{L})", L, Draft(f"embed, blocks[0:{L})@int8, head"), "int8"))
    if args.draft_vocab:
      drafts.append(
        (
          f"int8 blocks[0:{L}), vocab {args.draft_vocab}",
          L,
          Draft(f"embed, blocks[0:{L})@int8, head", vocab=args.draft_vocab),
          "int8",
        )
      )

  for n in ngrams:  # no weights: drafts looked up in the row's own text
    drafts.append((f"ngram:{n}", 0, Draft(f"ngram:{n}"), "text"))

  rows, identical = [], True
  for label, d, draft, origin in drafts:
    for k in ks:
      print(f"draft {label}, K={k} ...", file=sys.stderr, flush=True)
      r = _run(model, prompts, max_tokens, batch, plain["ms_per_step"], draft=draft, draft_tokens=k)
      same = r["tokens_b1"] == plain["tokens_b1"] and r["tokens_bn"] == plain["tokens_bn"]
      identical &= same
      rows.append(
        {
          "draft": label,
          "depth": d,
          "bridge": draft.bridge is not None,
          "weights": "none" if origin == "text" else "int8" if "@int8" in str(draft.path) else "f32",
          "origin": origin,
          "vocab": draft.vocab,
          "k": k,
          "acceptance": r["acceptance"],
          "acceptance_bn": r["acceptance_bn"],
          "tokens_per_pass": r["tokens_per_pass"],
          "tok_s_b1": r["tok_s_b1"],
          "ms_per_pass": r["ms_per_step"],
          "plain_steps": r["plain_steps"],
          "speedup_b1": r["tok_s_b1"] / plain["tok_s_b1"],
          "tok_s_bn": r["tok_s_bn"],
          "speedup_bn": r["tok_s_bn"] / plain["tok_s_bn"],
          "identical": same,
        }
      )
  result["drafts"] = rows
  result["identical"] = identical

  result["reuse"] = None
  if depths:  # the first exit: verify from its saved residual or recompute the shared blocks
    first = drafts[0]
    recompute = Draft(first[2].path, vocab=first[2].vocab, bridge=first[2].bridge, reuse=False)
    r = _run(model, prompts, max_tokens, 1, plain["ms_per_step"], draft=recompute, draft_tokens=ks[0])
    result["reuse"] = {
      "draft": first[0],
      "k": ks[0],
      "tok_s_reuse": rows[0]["tok_s_b1"],
      "tok_s_recompute": r["tok_s_b1"],
      "identical": r["tokens_b1"] == plain["tokens_b1"],
    }
    identical &= result["reuse"]["identical"]
  result["identical"] = identical

  _table(
    f"plain decode of the full path ({L} layers, {args.weights}), greedy, {max_tokens} tokens, {len(prompts)} "
    f"{args.text} prompts",
    ["batch", "tok/s", "ms/step"],
    [
      [1, common.fmt(plain["tok_s_b1"], ".1f"), common.fmt(plain["ms_per_step"], ".1f")],
      [batch, common.fmt(plain["tok_s_bn"], ".1f"), ""],
    ],
    right=("batch", "tok/s", "ms/step"),
  )
  _table(
    "self-speculative decoding: the draft proposes K tokens, the full path verifies them in one pass",
    [
      "draft",
      "K",
      "acceptance",
      "tokens/pass",
      "tok/s b1",
      "ms/pass b1",
      "plain steps",
      "x plain b1",
      f"tok/s b{batch}",
      f"x plain b{batch}",
      "same",
    ],
    [
      [
        r["draft"],
        r["k"],
        common.fmt(r["acceptance"], ".1%"),
        common.fmt(r["tokens_per_pass"], ".2f"),
        common.fmt(r["tok_s_b1"], ".1f"),
        common.fmt(r["ms_per_pass"], ".1f"),
        r["plain_steps"],
        common.fmt(r["speedup_b1"], ".2f"),
        common.fmt(r["tok_s_bn"], ".1f"),
        common.fmt(r["speedup_bn"], ".2f"),
        "yes" if r["identical"] else "NO",
      ]
      for r in rows
    ],
    right=(
      "K",
      "acceptance",
      "tokens/pass",
      "tok/s b1",
      "ms/pass b1",
      "plain steps",
      "x plain b1",
      f"tok/s b{batch}",
      f"x plain b{batch}",
    ),
  )
  u = result["reuse"]
  if u is not None:
    _table(
      f"verify from the draft's saved residual vs recomputing the shared blocks ({u['draft']}, K={u['k']}, batch 1)",
      ["reuse tok/s", "recompute tok/s", "same"],
      [
        [
          common.fmt(u["tok_s_reuse"], ".1f"),
          common.fmt(u["tok_s_recompute"], ".1f"),
          "yes" if u["identical"] else "NO",
        ]
      ],
    )
  print(f"greedy tokens identical to plain decoding: {'yes' if identical else 'NO'}")
  if args.json:
    common.write_json(args.json, result)
  return 0 if identical else 1

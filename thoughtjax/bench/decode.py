"""``thoughtjax bench decode``: prefill/decode throughput, first-token latency, start-up, memory.

Everything is measured in one run so the figures can be compared side by side:
thoughtjax (chunked streaming and callback streaming), the machine's copy bandwidth,
and llama.cpp on the same GGUF when ``llama-cpp-python`` is installed.

``--weights f32,native,int8,int8a8`` also compares weight formats in this one process: each form's
decode rate at batch 1 and 8 and its prefill rate, runs interleaved across the forms (medians), and
each form's quality against the exact float32 weights on held-out text (next-token top-1 agreement,
mean KL(f32 || form), ΔNLL per token). ``--quick`` shrinks every section (CI runs it on a tiny model).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from thoughtjax.bench import common

CHAT_PROMPT = "What is the capital of France?"
LONG_TEXT = (
  "The history of the city spans many centuries, from its founding as a small settlement on "
  "the river to its growth into a center of trade, learning and art. "
) * 8


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
  """STREAM-style host copy bandwidth in GB/s, counting bytes read plus bytes written."""
  return common.copy_bandwidth_gbps(nbytes, repeats, on="host")


def _decode_rate(model, prompts, max_tokens, repeats, stream_mode="chunks", chat=False):
  from thoughtjax.sampling import SamplingParams

  # Without EOS in the stop set every row runs the full length.
  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  rates, ttfts = [], []
  for _ in range(repeats + 1):  # first run compiles
    out = model.generate_batch(prompts, [params] * len(prompts), chat=chat, stream_mode=stream_mode)
    t = out[0].timings
    n = sum(len(c.token_ids) for c in out)
    rates.append((n - len(prompts)) / (t["end"] - t["first_token"]))
    ttfts.append(t["first_token"] - t["start"])
  return statistics.median(rates[1:]), statistics.median(ttfts[1:])


def _one_rate(model, prompts, max_tokens: int) -> tuple[float, float]:
  """(decode tok/s, seconds to first token) of one generate_batch call, EOS ignored."""
  from thoughtjax.sampling import SamplingParams

  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  out = model.generate_batch(prompts, [params] * len(prompts))
  t = out[0].timings
  n = sum(len(c.token_ids) for c in out)
  return (n - len(prompts)) / (t["end"] - t["first_token"]), t["first_token"] - t["start"]


def _prefill_tokens(args) -> int:
  return 64 if args.quick else 250


def heldout_documents() -> list[str]:
  """The general_purpose hint's held-out documents (text the quality figures are measured on)."""
  from thoughtjax.synthesis.dictionary import default_dictionary_path, load_dictionary

  return load_dictionary(default_dictionary_path())["general_purpose"].documents("heldout")


def weights_quality(reference, model, documents, window: int = 128, max_windows: int | None = None):
  """:class:`~thoughtjax.synthesis.calibration.PathQuality` of ``model`` against ``reference`` (the same
  path on exact weights): per predicted position of each window of at most ``window`` tokens, top-1
  agreement, KL(reference || model) and ΔNLL of the text's next token, averaged in float64."""
  import numpy as np

  from thoughtjax.synthesis.quality import Sums, windows

  sums = Sums()
  wins = windows(reference.codec, documents, window)
  for ids in wins[:max_windows]:
    ref = _log_softmax(reference.logits(ids)[:-1])
    got = _log_softmax(model.logits(ids)[:-1])
    y = np.asarray(ids[1:])
    at = np.arange(len(y))
    kl = np.sum(np.exp(ref) * (ref - got), axis=-1)
    sums.add(np.argmax(ref, -1) == np.argmax(got, -1), kl, ref[at, y] - got[at, y])
  return sums.quality()


def _log_softmax(logits):
  import numpy as np

  x = np.asarray(logits, np.float64)
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def bench_weights(args) -> dict:
  """Each weight form of ``args.weights`` side by side: decode at batch 1 and 8, prefill, runs
  interleaved across the forms (medians), and quality against float32 on held-out text."""
  import jax

  import thoughtjax

  forms = list(dict.fromkeys(args.weights))
  models = load_forms(args.model, forms)
  reference = models.get("f32") or thoughtjax.load(args.model, weights="f32")
  any_model = next(iter(models.values()))
  chat_ids = any_model.prompt_ids(CHAT_PROMPT, chat=True)
  long_ids = any_model.codec.encode(LONG_TEXT)[: _prefill_tokens(args)]
  runs = {w: {"b1": [], "b8": [], "prefill": []} for w in forms}
  for rep in range(args.repeats + 1):  # the first round compiles
    for w, m in models.items():
      b1, _ = _one_rate(m, [chat_ids], args.tokens)
      b8, _ = _one_rate(m, [chat_ids] * 8, args.tokens)
      _, ttft = _one_rate(m, [long_ids], 2)
      if rep:
        runs[w]["b1"].append(b1)
        runs[w]["b8"].append(b8)
        runs[w]["prefill"].append(len(long_ids) / ttft)
  docs = heldout_documents()
  out = {}
  for w, m in models.items():
    q = weights_quality(reference, m, docs, max_windows=2 if args.quick else None)
    out[w] = {
      "weight_bytes": sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(m.parts)),
      "decode_b1_tok_s": statistics.median(runs[w]["b1"]),
      "decode_b8_tok_s": statistics.median(runs[w]["b8"]),
      "prefill_tok_s": statistics.median(runs[w]["prefill"]),
      "quality_vs_f32": q.to_json(),
    }
  return out


def load_forms(model_arg, forms: list[str]) -> dict:
  """{form: model} for each weight form; a derived form (``quantized.DERIVED_FORMATS``, e.g. int8a8) is
  its base form's model with the parts transformed, sharing the base's weight buffers when both run."""
  import thoughtjax
  from thoughtjax import quantized

  models = {}
  for w in forms:
    if w in quantized.DERIVED_FORMATS:
      base, transform = quantized.DERIVED_FORMATS[w]
      m = models.get(base) or thoughtjax.load(model_arg, weights=base)
      models[w] = m.with_path(m.layers, parts=transform(m.parts))
    else:
      models[w] = thoughtjax.load(model_arg, weights=w)
  return models


def _process_first_token(model_arg: str, cache_dir: str | None, prompt: str, weights: str = "f32", rss=None) -> float:
  """Seconds from spawning ``thoughtjax generate --chat --max-tokens 8`` to its first byte of answer text.

  ``cache_dir``: a compile cache of its own (exported programs in its ``exported/`` folder), e.g. an
  empty one for a cold start; None: the user's caches. ``rss``: a list that gets the child's peak RSS (MiB,
  ``ru_maxrss`` of the whole process: weights, compiled programs and their buffers, the interpreter).
  """
  env = dict(os.environ)
  if cache_dir:
    env["THOUGHTJAX_COMPILE_CACHE"] = cache_dir
    env["THOUGHTJAX_EXPORT_CACHE"] = os.path.join(cache_dir, "exported")
  cmd = [sys.executable, "-m", "thoughtjax.cli", "generate", "--chat", "--prompt", prompt, "--max-tokens", "8"]
  cmd += (["--model", model_arg] if model_arg else []) + ["--weights", weights]
  fb = common.first_byte(cmd, env)
  if rss is not None:
    rss.append(fb.peak_rss_mib)
  return fb.seconds


def bench_startup(args) -> dict:
  """Fresh ``thoughtjax generate`` processes to their first answer byte, for each weight form in
  ``args.weights``: cold ones with a new empty compile cache each, warm ones on the user's caches after one
  unmeasured run per form; forms interleaved in every round, medians, and each form's peak RSS.

  ``args.quick``: one round, and the warm process of a form runs on the caches its cold process just filled
  (a temporary folder) instead of the user's, with no unmeasured run.
  """
  forms = {w: {"cold": [], "warm": [], "rss_cold": [], "rss_warm": []} for w in args.weights}
  if not args.quick:
    for w in forms:  # the user's caches are warm for every form now
      _process_first_token(args.model, None, CHAT_PROMPT, w)
  for _ in range(args.repeats):
    for w, f in forms.items():
      with tempfile.TemporaryDirectory() as d:
        f["cold"].append(_process_first_token(args.model, d, CHAT_PROMPT, w, f["rss_cold"]))
        warm_cache = d if args.quick else None
        f["warm"].append(_process_first_token(args.model, warm_cache, CHAT_PROMPT, w, f["rss_warm"]))
  per_form = {
    w: {
      "process_first_token_cold_s": statistics.median(f["cold"]),
      "process_first_token_warm_s": statistics.median(f["warm"]),
      "process_peak_rss_mb": max(f["rss_warm"]),
      "process_peak_rss_cold_mb": max(f["rss_cold"]),
      "cold_runs_s": f["cold"],
      "warm_runs_s": f["warm"],
      "peak_rss_runs_mb": f["rss_warm"],
    }
    for w, f in forms.items()
  }
  first = per_form[args.weights[0]]
  return {
    "model": args.model or "smollm2-135m-instruct",
    "weights": args.weights[0],
    "forms": per_form,
    "quick": args.quick,
    **{k: first[k] for k in ("process_first_token_cold_s", "process_first_token_warm_s", "cold_runs_s")},
    **{k: first[k] for k in ("warm_runs_s", "process_peak_rss_mb")},
    "loadavg": list(os.getloadavg()),
  }


def _print_startup(res: dict, repeats: int) -> None:
  fmt = common.fmt
  forms = res["forms"]
  rows = [
    ("process start -> first byte, empty compile cache, s", "process_first_token_cold_s", ".2f"),
    ("process start -> first byte, warm caches, s", "process_first_token_warm_s", ".2f"),
    ("peak RSS of a warm process, MiB", "process_peak_rss_mb", ".0f"),
    ("peak RSS of a cold process, MiB", "process_peak_rss_cold_mb", ".0f"),
  ]
  common.print_table(
    f"thoughtjax bench decode --startup ({res['model']}, medians of {repeats}; load average {res['loadavg'][0]:.2f})",
    ["figure", *forms],
    [(label, *(fmt(forms[w][key], spec) for w in forms)) for label, key, spec in rows],
    right=tuple(forms),
    width=110,
  )


def bench_thoughtjax(args) -> dict:
  import jax

  import thoughtjax

  t0 = time.perf_counter()
  model = thoughtjax.load(args.model, weights=args.weights[0])
  load_s = time.perf_counter() - t0
  weight_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(model.parts))
  chat_ids = model.prompt_ids(CHAT_PROMPT, chat=True)
  long_ids = model.codec.encode(LONG_TEXT)[: _prefill_tokens(args)]
  res = {
    "model": args.model or "smollm2-135m-instruct",
    "weights": args.weights[0],
    "load_s": load_s,
    "weight_bytes": weight_bytes,
    "chat_prompt_tokens": len(chat_ids),
    "prefill_prompt_tokens": len(long_ids),
  }

  _, ttft_long = _decode_rate(model, [long_ids], 2, args.repeats)
  res["prefill_tok_s"] = len(long_ids) / ttft_long
  # A chat string goes through the template path (fused template embedding in the prefill).
  _, res["ttft_chat_s"] = _decode_rate(model, [CHAT_PROMPT], 2, args.repeats, chat=True)
  for mode in ("chunks", "callback"):
    rate, ttft = _decode_rate(model, [chat_ids], args.tokens, args.repeats, mode)
    res[f"decode_b1_tok_s_{mode}"] = rate
    res[f"ttft_chat_s_{mode}"] = ttft
  res["decode_b1_tok_s_by_chunk"] = {str(model.chunk): res["decode_b1_tok_s_chunks"]}
  for chunk in args.chunks:
    rate, _ = _decode_rate(model.with_chunk(chunk), [chat_ids], args.tokens, args.repeats)
    res["decode_b1_tok_s_by_chunk"][str(chunk)] = rate
  res["chunk"] = model.chunk
  rate8, _ = _decode_rate(model, [chat_ids] * 8, args.tokens, args.repeats)
  res["decode_b1_tok_s"] = res["decode_b1_tok_s_chunks"]
  res["decode_b8_tok_s"] = rate8
  res["b8_over_b1"] = rate8 / res["decode_b1_tok_s"]
  res["weight_bandwidth_gb_s"] = weight_bytes * res["decode_b1_tok_s"] / 1e9
  res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  if not args.skip_process:
    with tempfile.TemporaryDirectory() as cold:
      res["process_first_token_cold_s"] = _process_first_token(args.model, cold, CHAT_PROMPT)
    _process_first_token(args.model, None, CHAT_PROMPT)  # make sure the user cache is warm
    res["process_first_token_warm_s"] = statistics.median(
      _process_first_token(args.model, None, CHAT_PROMPT) for _ in range(3)
    )
    res["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
  return res


_STREAM_PROBE = """
import sys, time
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
import thoughtjax
m = thoughtjax.load(sys.argv[2] or None)
t = time.perf_counter()
c = m.generate("Hi", max_tokens=4, stream_mode=sys.argv[1])
print(c.timings["first_token"] - t, len(hits))
"""


def stream_startup(args) -> dict:
  """Load call -> first token in two fresh processes per streaming mode, sharing a new
  compile cache: shows which mode's program the persistent cache can serve."""
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "THOUGHTJAX_COMPILE_CACHE": cache}
    for mode in ("callback", "chunks"):
      runs = []
      for _ in range(2):
        r = subprocess.run(
          [sys.executable, "-c", _STREAM_PROBE, mode, args.model or ""],
          env=env,
          capture_output=True,
          text=True,
          check=True,
        )
        seconds, hits = r.stdout.split()[-2:]
        runs.append({"first_token_s": float(seconds), "cache_hits": int(hits)})
      out[mode] = runs
  return out


def bench_llama_cpp(args) -> dict | None:
  try:
    import llama_cpp
  except ImportError:
    return None
  from thoughtjax.fetch import DEFAULT_MODEL, fetch

  path = str(fetch(args.model or DEFAULT_MODEL)) if not args.model or not os.path.exists(args.model) else args.model
  t = time.perf_counter()
  llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=os.cpu_count(), verbose=False, n_batch=512)
  ready = time.perf_counter() - t
  chat = llm.tokenize(
    (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
      f"<|im_start|>user\n{CHAT_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    ).encode(),
    add_bos=False,
    special=True,
  )
  long_ids = llm.tokenize(LONG_TEXT.encode(), add_bos=False)[:250]

  def run(ids, n):
    llm.reset()
    t = time.perf_counter()
    first = None
    count = 0
    for _tok in llm.generate(ids, temp=0.0, reset=True):
      count += 1
      if first is None:
        first = time.perf_counter()
      if count >= n:
        break
    end = time.perf_counter()
    return first - t, (count - 1) / (end - first) if count > 1 else float("nan")

  def prefill(ids):
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - t

  prefill_s = statistics.median(prefill(long_ids) for _ in range(args.repeats + 1))
  chat_runs = [run(chat, args.tokens) for _ in range(args.repeats + 1)][1:]
  res = {
    "ready_s": ready,
    "prefill_tok_s": len(long_ids) / prefill_s,
    "ttft_chat_s": statistics.median(r[0] for r in chat_runs),
    "decode_b1_tok_s": statistics.median(r[1] for r in chat_runs),
    "chat_prompt_tokens": len(chat),
    "version": getattr(llama_cpp, "__version__", "?"),
  }
  if not args.skip_process:
    res["process_first_token_s"] = statistics.median(_llama_process_first_token(path) for _ in range(3))
  return res


_LLAMA_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, verbose=False)
prompt = llm.tokenize(sys.argv[2].encode(), add_bos=False, special=True)
for tok in llm.generate(prompt, temp=0.0):
    sys.stdout.write(llm.detokenize([tok]).decode(errors="replace") or "?")
    sys.stdout.flush()
    break
"""


def _llama_process_first_token(path: str) -> float:
  """Seconds from spawning a llama-cpp-python process to its first byte of answer text."""
  chat = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    f"<|im_start|>user\n{CHAT_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
  )
  return common.first_byte([sys.executable, "-c", _LLAMA_PROBE, path, chat]).seconds


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench decode", description=__doc__.splitlines()[0])
  p.add_argument("--model", default=None)
  p.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
  p.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 3; --quick 1)")
  p.add_argument("--json", default=None, type=common.json_path, help="write results to this JSON file")
  p.add_argument(
    "--chunks",
    type=lambda t: [int(x) for x in t.split(",")],
    default=[1, 4, 16],
    help="other decode chunk sizes to compare with the default (comma-separated)",
  )
  p.add_argument("--skip-process", action="store_true", help="skip the new-process start-up runs")
  p.add_argument(
    "--weights",
    type=_weight_forms,
    default=["f32"],
    help="weight forms, comma-separated (f32, native, int8, int8a8): the first (not int8a8) runs the main table; "
    "two or more are also compared side by side (speed and quality against f32)",
  )
  p.add_argument(
    "--quick",
    action="store_true",
    help="small sizes everywhere (16 tokens, 1 repeat, no chunk sweep, no process start-up, a small copy)",
  )
  p.add_argument("--skip-llama", action="store_true", help="do not run llama.cpp even when installed")
  p.add_argument(
    "--startup",
    action="store_true",
    help="only the fresh-process start-up: generate --chat --max-tokens 8 to its first byte and its peak RSS, "
    "cold (empty compile cache) and warm, for each --weights form, --repeats times each, interleaved",
  )
  p.add_argument(
    "--stream-startup",
    action="store_true",
    help="only compare start-up of chunked vs callback streaming in fresh processes",
  )
  args = p.parse_args(argv)
  if args.quick:
    args.tokens, args.chunks, args.skip_process = min(args.tokens, 16), [], True
  args.repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3

  if args.startup:
    res = bench_startup(args)
    _print_startup(res, args.repeats)
    if args.json:
      common.write_json(args.json, res)
    return 0

  if args.stream_startup:
    res = stream_startup(args)
    for mode, runs in res.items():
      print(
        f"{mode:9s} "
        + "  ".join(
          f"process {i + 1}: {r['first_token_s']:.2f} s to first token ({r['cache_hits']} cache hits)"
          for i, r in enumerate(runs)
        )
      )
    if args.json:
      common.write_json(args.json, res)
    return 0

  bw = copy_bandwidth(64 << 20 if args.quick else 512 << 20)
  res = {
    "copy_bandwidth_gb_s": bw,
    "quick": args.quick,
    "thoughtjax": bench_thoughtjax(args),
    "weights": bench_weights(args) if len(args.weights) > 1 else None,
    "llama_cpp": None if args.skip_llama else bench_llama_cpp(args),
    "cpu_count": os.cpu_count(),
  }
  tj = res["thoughtjax"]
  tj["bandwidth_fraction"] = tj["weight_bandwidth_gb_s"] / bw
  if args.json:
    common.write_json(args.json, res)
  _print_table(res)
  if res["weights"]:
    _print_weights(res["weights"])
  return 0


def _weight_forms(text: str) -> list[str]:
  from thoughtjax.quantized import DERIVED_FORMATS, WEIGHT_FORMATS

  known = (*WEIGHT_FORMATS, *DERIVED_FORMATS)
  forms = [t.strip() for t in text.split(",") if t.strip()]
  bad = [f for f in forms if f not in known]
  if not forms or bad:
    raise argparse.ArgumentTypeError(
      f"--weights {text!r}: expected comma-separated forms from {', '.join(known)}, e.g. f32,native,int8"
    )
  if forms[0] in DERIVED_FORMATS:  # the main table and the start-up runs load the first form by name
    raise argparse.ArgumentTypeError(
      f"--weights {text!r}: {forms[0]} is compared in the weight-forms table only; put a loadable form "
      f"({', '.join(WEIGHT_FORMATS)}) first, e.g. native,{forms[0]}"
    )
  return forms


def _print_weights(rows: dict) -> None:
  fmt = common.fmt
  common.print_table(
    "weight forms (interleaved runs, medians; quality against f32 on held-out text)",
    ["weights", "MB", "b1 tok/s", "b8 tok/s", "prefill tok/s", "top-1", "KL", "ΔNLL", "tokens"],
    [
      (
        w,
        fmt(r["weight_bytes"] / 1e6, ".0f"),
        fmt(r["decode_b1_tok_s"], ".1f"),
        fmt(r["decode_b8_tok_s"], ".1f"),
        fmt(r["prefill_tok_s"], ".1f"),
        fmt(r["quality_vs_f32"]["top1_agreement"], ".4f"),
        fmt(r["quality_vs_f32"]["mean_kl"], ".5f"),
        fmt(r["quality_vs_f32"]["delta_nll"], "+.5f"),
        str(r["quality_vs_f32"]["tokens"]),
      )
      for w, r in rows.items()
    ],
    right=("MB", "b1 tok/s", "b8 tok/s", "prefill tok/s", "top-1", "KL", "ΔNLL", "tokens"),
    width=120,
  )


def _print_table(res: dict) -> None:
  tj, lc = res["thoughtjax"], res["llama_cpp"] or {}
  fmt = common.fmt
  rows = [
    ("prefill tok/s (250-token prompt)", tj.get("prefill_tok_s"), lc.get("prefill_tok_s"), ".1f"),
    (
      f"time to first token, chat ({tj['chat_prompt_tokens']} tok), s",
      tj.get("ttft_chat_s"),
      lc.get("ttft_chat_s"),
      ".3f",
    ),
    (
      f"decode tok/s, batch 1 (chunked stream, {tj['chunk']} steps)",
      tj.get("decode_b1_tok_s_chunks"),
      lc.get("decode_b1_tok_s"),
      ".1f",
    ),
    ("decode tok/s, batch 1 (callback stream)", tj.get("decode_b1_tok_s_callback"), None, ".1f"),
    *(
      (f"decode tok/s, batch 1, chunks of {c}", rate, None, ".1f")
      for c, rate in sorted(tj["decode_b1_tok_s_by_chunk"].items(), key=lambda kv: int(kv[0]))
    ),
    ("decode tok/s, batch 8 aggregate", tj.get("decode_b8_tok_s"), None, ".1f"),
    ("batch 8 / batch 1", tj.get("b8_over_b1"), None, ".2f"),
    ("weight bytes read per token, MB", tj["weight_bytes"] / 1e6, None, ".0f"),
    ("achieved weight bandwidth, GB/s", tj.get("weight_bandwidth_gb_s"), None, ".2f"),
    ("machine copy bandwidth, GB/s", res["copy_bandwidth_gb_s"], None, ".2f"),
    ("fraction of copy bandwidth", tj.get("bandwidth_fraction"), None, ".2f"),
    (
      "process start -> first token, cold, s",
      tj.get("process_first_token_cold_s"),
      lc.get("process_first_token_s"),
      ".2f",
    ),
    ("model ready after load call, s", tj.get("load_s"), lc.get("ready_s"), ".2f"),
    ("process start -> first token, warm cache, s", tj.get("process_first_token_warm_s"), None, ".2f"),
    ("peak RSS (bench process), MB", tj.get("peak_rss_mb"), None, ".0f"),
  ]
  common.print_table(
    "thoughtjax bench decode",
    ["figure", "thoughtjax", "llama.cpp"],
    [(name, fmt(a, spec), fmt(b, spec)) for name, a, b, spec in rows],
    right=("thoughtjax", "llama.cpp"),
  )


if __name__ == "__main__":
  raise SystemExit(main())

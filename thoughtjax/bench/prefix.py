"""``thoughtjax bench prefix``: time to first token in a slot engine with and without the prefix cache, on chat
requests that share a long system prompt.

Workload: ``--requests`` chat prompts, each the same system prompt (``--system-tokens``, about 300 by default:
sentences of a fixed text until the chat template's system part reaches that many tokens) and a different short
question, one request at a time through a :class:`~thoughtjax.serving.SlotDriver` (a server's engine, one user),
greedy, ``--max-tokens`` new tokens. Two engines of the same layout run side by side, request by request: one
without a prefix cache, one with (:class:`~thoughtjax.serving.PrefixCache`, ``--block-tokens``). A first pass over
the same prompts compiles every program both need; the cache is then emptied, so the measured pass starts cold:
its first request misses and stores the system prompt, the others reuse it.

TTFT is the host's time from ``submit`` to the first delta. The table gives the median (and p90) with and without,
their ratio, the prompt tokens reused and whether every request's tokens were the same in both engines. Requests
that compiled anything are left out of the figures and counted. ``--json FILE`` writes the report.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from thoughtjax.bench import common

SYSTEM_TEXT = (
  "You are a support assistant for a company that builds weather stations. Answer questions about installation, "
  "calibration, data export and maintenance. Be precise and brief, use metric units, and say when you do not know. "
  "Never invent part numbers. When a question is about safety, tell the user to switch off the power first. "
  "If the user asks about pricing, refer them to the sales team. Keep answers under five sentences. "
  "Stations report temperature, humidity, pressure, wind speed, wind direction and rainfall every minute. "
  "Data can be exported as CSV or JSON from the web console, or streamed over MQTT. "
  "Firmware updates are installed from the console and take about ten minutes. "
)
QUESTIONS = [
  "How do I calibrate the rain gauge?",
  "Can I export a week of data as CSV?",
  "Why does the wind vane point the wrong way?",
  "How often should I clean the sensors?",
  "What does a blinking red light mean?",
  "How do I stream readings over MQTT?",
  "Is it safe to open the battery box in the rain?",
  "How long does a firmware update take?",
  "Why is the humidity stuck at 100 percent?",
  "Can two stations share one console?",
  "How do I reset the station to factory settings?",
  "What units does the pressure sensor use?",
  "How do I mount the station on a pole?",
  "Where do I find the serial number?",
  "Why are there gaps in my temperature data?",
  "Can I change the reporting interval?",
]


def system_prompt(model, tokens: int) -> str:
  """Sentences of :data:`SYSTEM_TEXT` (repeated as needed) until the chat template's system part of a prompt holds
  about ``tokens`` tokens."""
  sentences = [s.strip() + "." for s in SYSTEM_TEXT.split(".") if s.strip()]
  text, i = "", 0
  base = len(model.prompt_ids("x", chat=True, system="x"))
  while len(model.prompt_ids("x", chat=True, system=text or "x")) - base < tokens:
    text = (text + " " + sentences[i % len(sentences)]).strip()
    i += 1
  return text


def _ttft(driver, ids, params) -> tuple[float, object]:
  """Seconds from submit to the first delta, and the run (drained)."""
  first = threading.Event()
  t0 = time.perf_counter()
  run = driver.submit(ids, params, on_delta=lambda d: first.set())
  first.wait()
  seconds = time.perf_counter() - t0
  list(run)
  return seconds, run


def run(model, *, requests: int, system_tokens: int, max_tokens: int, block_tokens: int, cache_len: int) -> dict:
  """The measured pass's figures (see the module docstring)."""
  from thoughtjax.sampling import SamplingParams
  from thoughtjax.serving import PrefixCache, SlotDriver, SlotEngine

  system = system_prompt(model, system_tokens)
  prompts = [model.prompt_ids(QUESTIONS[i % len(QUESTIONS)], chat=True, system=system) for i in range(requests)]
  params = SamplingParams(max_tokens=max_tokens)
  cache = PrefixCache(block_tokens)
  engines = {
    "without": SlotEngine(model, slots=4, cache_len=cache_len),
    "with": SlotEngine(model, slots=4, cache_len=cache_len, prefix_cache=cache),
  }
  drivers = {k: SlotDriver(e) for k, e in engines.items()}
  try:
    for ids in prompts:  # compile every program of the workload in both engines
      for d in drivers.values():
        _ttft(d, ids, params)
    cache.clear()
    hits0, reused0 = cache.hits, cache.tokens_reused
    ttft: dict[str, list[float]] = {k: [] for k in drivers}
    compiled = {k: 0 for k in drivers}
    same = 0
    for ids in prompts:
      tokens = {}
      for k, d in drivers.items():
        seconds, r = _ttft(d, ids, params)
        tokens[k] = r.token_ids
        if r.trace.compile_s > 0:
          compiled[k] += 1
        else:
          ttft[k].append(seconds)
      same += tokens["with"] == tokens["without"]
  finally:
    for d in drivers.values():
      d.close()
  med = {k: statistics.median(v) if v else None for k, v in ttft.items()}
  p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] if v else None for k, v in ttft.items()}
  ratio = med["with"] / med["without"] if med["with"] and med["without"] else None
  return {
    "model": model.loaded.name,
    "requests": requests,
    "prompt_tokens": [len(p) for p in prompts],
    "system_tokens": system_tokens,
    "max_tokens": max_tokens,
    "block_tokens": block_tokens,
    "cache_len": cache_len,
    "ttft_s": ttft,
    "median_ttft_s": med,
    "p90_ttft_s": p90,
    "ratio_with_over_without": ratio,
    "hits": cache.hits - hits0,
    "tokens_reused": cache.tokens_reused - reused0,
    "identical_outputs": same,
    "compiled_requests": compiled,
  }


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="thoughtjax bench prefix", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="model name or path (default: the default model)")
  p.add_argument("--weights", default="f32", help="weight form: f32 (default) or native")
  p.add_argument("--requests", type=int, default=12, help="measured requests (default 12)")
  p.add_argument("--system-tokens", type=int, default=300, help="tokens of the shared system prompt (default 300)")
  p.add_argument("--max-tokens", type=int, default=8, help="new tokens per request (default 8)")
  p.add_argument("--block-tokens", type=int, default=16, help="prefix cache block (default 16)")
  p.add_argument("--cache-len", type=int, default=512, help="slot engine ring length (default 512)")
  p.add_argument("--json", default=None, type=common.json_path, help="write the report to this JSON file")
  args = p.parse_args(argv)
  import thoughtjax

  model = thoughtjax.load(args.model, weights=args.weights)
  res = run(
    model,
    requests=args.requests,
    system_tokens=args.system_tokens,
    max_tokens=args.max_tokens,
    block_tokens=args.block_tokens,
    cache_len=args.cache_len,
  )
  med, p90 = res["median_ttft_s"], res["p90_ttft_s"]
  rows = [
    (k, len(res["ttft_s"][k]), common.fmt(med[k] and med[k] * 1e3, ".1f"), common.fmt(p90[k] and p90[k] * 1e3, ".1f"))
    for k in ("without", "with")
  ]
  common.print_table(
    f"thoughtjax bench prefix: TTFT, shared system prompt of ~{args.system_tokens} tokens "
    f"(prompts {min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} tokens, one request at a time)",
    ["prefix cache", "requests", "median TTFT ms", "p90 TTFT ms"],
    rows,
    right=["requests", "median TTFT ms", "p90 TTFT ms"],
  )
  print(
    f"ratio with/without: {common.fmt(res['ratio_with_over_without'], '.3f')}; hits {res['hits']}/{args.requests}, "
    f"tokens reused {res['tokens_reused']}; identical outputs {res['identical_outputs']}/{args.requests}; "
    f"requests that compiled (left out): {res['compiled_requests']}"
  )
  if args.json:
    common.write_json(args.json, res)
  return 0

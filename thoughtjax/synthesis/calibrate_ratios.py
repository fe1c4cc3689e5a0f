"""Latency ratios over the plain full path that the layer-cost fit cannot give, timed interleaved with it.

:func:`measure_factors`: a speculative candidate's decode and a weight variant's prefill and decode, as factors
over the plain full path (``latency.corrections["paths"]``). :func:`measure_hint_factors`: the n-gram drafts'
decode factor per hint, on the hint's own requests (``latency.corrections["hints"]``). :func:`measure_rows`: how
a path batches, a decode step of W rows over one row's (``latency.rows``). Every ratio is of two times measured
in one process, after a run that compiles; factors are clipped to the latency model's ``FACTOR_BOUNDS``.

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``,
``synthesis.router_data``; the functions that need them do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from thoughtjax.decode.program import bucket
from thoughtjax.decode.speculative import Draft, ngram_order
from thoughtjax.sampling import SamplingParams
from thoughtjax.synthesis.calibrate_settings import (
  CalibrateError,
  CalibrateProgress,
  CalibrateReport,
  LatencySettings,
  no_progress,
)
from thoughtjax.synthesis.candidate import Candidate, CandidateKind
from thoughtjax.synthesis.latency_params import FACTOR_BOUNDS, ROWS_DEFAULT, LinearCost, fit_linear


def measure_factors(
  registry,
  candidates: Sequence[Candidate],
  texts: Sequence[Sequence[int]],
  settings: LatencySettings = LatencySettings(),
  *,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
) -> dict[str, dict[str, float]]:
  """``{path hash: {stage: factor}}`` of the candidates the fitted latency model cannot price by their layers: a
  speculative one's decode (its median decode ms per token over the plain full path's, greedy on prompts of the
  calibration ``texts``, so the draft's acceptance on that text is in it), and a weight variant's prefill and
  decode (its own plain program over the full path's: its layers cost what its weights cost). Every program runs
  interleaved with the plain full path's in one process, ``speculative_reps`` rounds after one warm-up call of
  each per prompt bucket (its first device call, which compiles it). Clipped to the latency model's factor
  bounds."""
  from thoughtjax.compose import compose

  progress = progress or no_progress
  spec = [c for c in candidates if c.draft is not None]
  timed = spec + [c for c in candidates if c.kind is CandidateKind.VARIANT]
  if not timed:
    return {}
  full = next(c for c in candidates if c.kind is CandidateKind.FULL)
  model = compose(", ".join(u.ref for u in full.units), registry, kernels=kernels)
  own = {c.path_hash: compose(c.path, registry, kernels=kernels) for c in timed if c.draft is None}
  n = settings.speculative_tokens
  room = model.config.max_context - n - max((c.draft.draft_tokens for c in spec), default=0) - 1
  prompts = [list(t)[: min(settings.speculative_prompt_tokens, room)] for t in texts if len(t) >= 2]
  prompts = prompts[: settings.speculative_prompts]
  if not prompts or room < 1:
    raise CalibrateError(
      f"speculative and weight-variant candidates need calibration text to time them on (prompts of >= 2 tokens "
      f"within the context of {model.config.max_context} minus {n} new tokens), got {len(texts)} documents; give "
      f"the first hint a calibration split, or calibrate without them (SpeculativeSettings(drafts=0, variants=(), "
      f"ngram=()), variants=())"
    )

  # One prompt per prompt bucket compiles every program the rounds run.
  warm = list({bucket(len(p)): p for p in prompts}.values())

  def per_token(c: Candidate | None, prompts: list[list[int]], compile_only: bool = False):
    """(prefill ms, decode ms per token, drafted, accepted): means over ``prompts``, sums of the counts."""
    pre, ms, drafted, accepted = [], [], 0, 0
    runner = model if c is None else own.get(c.path_hash, model)
    kw = {}
    if c is not None and c.draft is not None:
      kw = {"draft": Draft(c.draft.path, vocab=c.draft.vocab), "draft_tokens": c.draft.draft_tokens}
    for ids in prompts:
      g = runner.stream(ids, max_tokens=n, ignore_eos=True, **kw)
      if compile_only:  # the first delta follows the first device call, which compiled the one program
        next(g, None)
        g.close()
        continue
      for _ in g:
        pass
      t = g.trace
      pre.append((t.prefill_s or 0.0) * 1e3)
      ms.append((t.decode_s or 0.0) * 1e3 / max(t.tokens_out[0] - 1, 1))
      drafted, accepted = drafted + t.drafted, accepted + t.accepted
    return (float(np.mean(pre)) if pre else 0.0), (float(np.mean(ms)) if ms else 0.0), drafted, accepted

  total, done = (1 + len(timed)) * (1 + settings.speculative_reps), 0
  runs: dict[str | None, list[tuple[float, float]]] = {None: [], **{c.path_hash: [] for c in timed}}
  counts = {c.path_hash: [0, 0] for c in spec}
  for rep in range(1 + settings.speculative_reps):  # rep 0 compiles (not kept); then plain and each other
    for c in (None, *timed):
      pre, ms, drafted, accepted = per_token(c, warm if rep == 0 else prompts, compile_only=rep == 0)
      done += 1
      what = "plain" if c is None else ("speculative " + c.draft.label if c.draft is not None else "variant " + c.path)
      progress("latency", done, total, what)
      if rep == 0:
        continue
      runs[None if c is None else c.path_hash].append((pre, ms))
      if c is not None and c.draft is not None:
        counts[c.path_hash][0] += drafted
        counts[c.path_hash][1] += accepted
  lo, hi = FACTOR_BOUNDS

  def ratio(mine: float, plain: float) -> float:
    return min(hi, max(lo, mine / plain)) if plain > 0 else 1.0

  def medians(key) -> tuple[float, float]:
    return float(np.median([r[0] for r in runs[key]])), float(np.median([r[1] for r in runs[key]]))

  plain_pre, plain_ms = medians(None)
  factors: dict[str, dict[str, float]] = {}
  for c in timed:
    pre, mine = medians(c.path_hash)
    factors[c.path_hash] = {"decode": ratio(mine, plain_ms)}
    if c.draft is None:  # a variant's prefill runs its own weights too
      factors[c.path_hash]["prefill"] = ratio(pre, plain_pre)
    if report is None:
      continue
    if c.draft is not None:
      drafted, accepted = counts[c.path_hash]
      report.speculative.append(
        {
          "path_hash": c.path_hash,
          "draft": c.draft.label,
          "plain_ms_per_token": plain_ms,
          "speculative_ms_per_token": mine,
          "factor": factors[c.path_hash]["decode"],
          "acceptance": accepted / drafted if drafted else 0.0,
        }
      )
    else:
      report.variants.append(
        {
          "path_hash": c.path_hash,
          "path": c.path,
          "plain_prefill_ms": plain_pre,
          "variant_prefill_ms": pre,
          "plain_ms_per_token": plain_ms,
          "variant_ms_per_token": mine,
          "factors": dict(factors[c.path_hash]),
        }
      )
  return factors


def measure_hint_factors(
  registry,
  candidates: Sequence[Candidate],
  hints: Sequence[str],
  settings: LatencySettings = LatencySettings(),
  *,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
  """``{hint: {path hash: {"decode": factor}}}`` of the candidates that draft from the text itself (n-gram lookup),
  per hint of ``hints`` that the shipped router prompts cover: each candidate's decode ms per token over the plain
  full path's on ``settings.hint_prompts`` of the hint's prompts as chat requests (``settings.hint_tokens`` greedy
  tokens; one compiling run of each program per prompt bucket, then plain and drafted interleaved). Empty when
  ``settings.hint_prompts`` is 0 or no such candidate exists. Clipped to the latency model's factor bounds."""
  from thoughtjax.compose import compose
  from thoughtjax.synthesis.router_data import load_router_prompts

  progress = progress or no_progress
  ngram = [c for c in candidates if c.draft is not None and ngram_order(c.draft.path) is not None]
  if not ngram or settings.hint_prompts == 0:
    return {}
  by_hint: dict[str, list[str]] = {h: [] for h in hints}
  for r in load_router_prompts("train"):
    if r.hint in by_hint and len(by_hint[r.hint]) < settings.hint_prompts:
      by_hint[r.hint].append(r.prompt)
  by_hint = {h: texts for h, texts in by_hint.items() if texts}
  if not by_hint:
    return {}
  full = next(c for c in candidates if c.kind is CandidateKind.FULL)
  model = compose(", ".join(u.ref for u in full.units), registry, kernels=kernels)
  n = settings.hint_tokens
  room = model.config.max_context - n - max(c.draft.draft_tokens for c in ngram) - 1
  chat = model.codec.chat_template is not None

  def ms_per_token(ids, c: Candidate | None) -> tuple[float, int, int]:
    kw = {} if c is None else {"draft": Draft(c.draft.path, vocab=c.draft.vocab), "draft_tokens": c.draft.draft_tokens}
    g = model.stream(ids, max_tokens=n, ignore_eos=True, **kw)
    for _ in g:
      pass
    t = g.trace
    return (t.decode_s or 0.0) * 1e3 / max(t.tokens_out[0] - 1, 1), t.drafted, t.accepted

  lo, hi = FACTOR_BOUNDS
  out: dict[str, dict[str, dict[str, float]]] = {}
  total = sum(len(v) for v in by_hint.values())
  done, compiled = 0, set()
  for hint, texts in by_hint.items():
    plain, mine = [], {c.path_hash: [] for c in ngram}
    counts = {c.path_hash: [0, 0] for c in ngram}
    for text in texts:
      ids = model.prompt_ids(text, chat=chat)[:room]
      if bucket(len(ids)) not in compiled:  # its first call compiles: not timed
        for c in (None, *ngram):
          ms_per_token(ids, c)
        compiled.add(bucket(len(ids)))
      plain.append(ms_per_token(ids, None)[0])
      for c in ngram:
        ms, drafted, accepted = ms_per_token(ids, c)
        mine[c.path_hash].append(ms)
        counts[c.path_hash][0] += drafted
        counts[c.path_hash][1] += accepted
      done += 1
      progress("latency", done, total, f"drafts from the text on {hint} requests")
    base = float(np.mean(plain))
    out[hint] = {
      h: {"decode": min(hi, max(lo, float(np.mean(v)) / base)) if base > 0 else 1.0} for h, v in mine.items()
    }
    if report is not None:
      for c in ngram:
        drafted, accepted = counts[c.path_hash]
        report.speculative.append(
          {
            "path_hash": c.path_hash,
            "draft": c.draft.label,
            "hint": hint,
            "plain_ms_per_token": base,
            "speculative_ms_per_token": float(np.mean(mine[c.path_hash])),
            "factor": out[hint][c.path_hash]["decode"],
            "acceptance": accepted / drafted if drafted else 0.0,
          }
        )
  return out


def measure_rows(
  registry,
  candidates: Sequence[Candidate],
  texts: Sequence[Sequence[int]],
  settings: LatencySettings = LatencySettings(),
  *,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
) -> dict[str, LinearCost]:
  """``{path hash: rows fit}`` for the full path and each weight variant (and the full path's again under
  :data:`~thoughtjax.synthesis.latency_params.ROWS_DEFAULT`, for the paths not measured; a speculative plan decodes
  alone): a decode step of W rows over one row's, ``fit(W)``, through (1, 1) and
  (``rows_width``, the measured ratio). Each path decodes ``speculative_tokens`` greedy steps from a calibration
  prompt alone and as ``rows_width`` copies in one batch (the plain program at that batch; a slot engine computes
  the same rows), interleaved, the medians of ``speculative_reps`` rounds after one that compiles."""
  from thoughtjax.compose import compose

  W = settings.rows_width
  paths = [c for c in candidates if c.kind in (CandidateKind.FULL, CandidateKind.VARIANT)]
  if not W or not paths:
    return {}
  progress = progress or no_progress
  models = {c.path_hash: compose(c.path, registry, kernels=kernels) for c in paths}
  n = settings.speculative_tokens
  # Step time does not depend on the text (greedy, no draft): calibration text when there is some, else one token.
  P = max(1, min(settings.speculative_prompt_tokens, min(m.config.max_context for m in models.values()) - n - 1))
  prompt = next((list(t)[:P] for t in texts if len(t) >= 2), [1] * P)

  def step_ms(model, rows: int) -> float:
    g = model.stream_batch([prompt] * rows, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in g:
      pass
    return (g.trace.decode_s or 0.0) * 1e3 / max(max(g.trace.tokens_out) - 1, 1)

  runs: dict[tuple[str, int], list[float]] = {(h, r): [] for h in models for r in (1, W)}
  total, done = (1 + settings.speculative_reps) * len(runs), 0
  for rep in range(1 + settings.speculative_reps):  # rep 0 compiles both widths (not kept)
    for h, rows in runs:
      ms = step_ms(models[h], rows)
      done += 1
      progress("latency", done, total, f"batching of {next(c.path for c in paths if c.path_hash == h)} at {rows}")
      if rep:
        runs[(h, rows)].append(ms)
  fits = {}
  for c in paths:
    one, wide = (float(np.median(runs[(c.path_hash, r)])) for r in (1, W))
    ratio = wide / one if one > 0 else float(W)
    # Between 1 (rows for free) and W (no cheaper than W steps of one row): a measured ratio past W is other
    # work on the same cores during the wide steps, and would bend the fit off its point (1, 1).
    fits[c.path_hash] = fit_linear([(1, 1.0), (W, min(max(ratio, 1.0), float(W)))], f"rows[{c.path_hash}]")
    if c.kind is CandidateKind.FULL:  # a cut path's layers are the full path's: it batches as they do
      fits[ROWS_DEFAULT] = fits[c.path_hash]
    if report is not None:
      report.rows.append(
        {
          "path_hash": c.path_hash,
          "path": c.path,
          "width": W,
          "ms_per_step_1": one,
          f"ms_per_step_{W}": wide,
          "ratio": ratio,
        }
      )
  return fits

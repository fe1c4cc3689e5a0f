"""``registry calibrate``: measure every candidate path's quality per hint and this machine's latency model.

>>> from thoughtjax.registry import Registry
>>> from thoughtjax.synthesis.calibrate import calibrate, store
>>> reg = Registry.open("build/registry")
>>> cal = calibrate(reg)                        # candidates, quality per hint, latency, ~minutes on 2 cores
>>> store(reg, cal, sign_key="keys/registry.key")   # DIR/calibration/<sequence>.json + .sig

This module runs the steps in order and stores and loads the result; the steps live beside it:
:mod:`~thoughtjax.synthesis.calibrate_settings` (settings, report, progress),
:mod:`~thoughtjax.synthesis.derived_candidates` (speculative and weight-variant candidates),
:mod:`~thoughtjax.synthesis.calibrate_latency` (the fitted layer costs, the machine fingerprint) and
:mod:`~thoughtjax.synthesis.calibrate_ratios` (factors over the plain full path, batching).

Steps (each reported to ``progress(stage, done, total, item)``):

1. **load**: the full path composed from the registry (every current block thoughtlet), so quality is
   measured on exactly the weights synthesis will run.
2. **candidates**: :func:`~thoughtjax.synthesis.candidates.propose` on the first hint's calibration split
   with the registry's own block spans, then :func:`~thoughtjax.synthesis.candidates.pin` to the current
   versions (a proposal that does not compose is dropped with its reason in ``report.refused``).
3. **quality**: :func:`~thoughtjax.synthesis.quality.measure_candidates` on every hint's calibration and
   held-out split, each cut to ``max_windows`` windows of ``window`` tokens (the full path's logits once
   per window, shared by all candidates).
4. **latency**: :func:`~thoughtjax.synthesis.calibrate_latency.measure_latency`: the real program (prefill +
   decode loop, as synthesis runs it) of the full path and of the shortest candidate, at two prompt buckets and
   two decode lengths, ``ignore_eos`` so every step runs; per-layer and fixed (embed + head + loop) costs are
   fitted by non-negative least squares to the same stage times a synthesis trace reports, so predictions and
   traces compare like with like. Warm runs only: the first run of each program (which compiles it) gives the
   compile cost alone. Restore cost: every unit restored as a later process restores it, from its mapped form
   (bytes, ms). Compile cost: the first run of each program (layers run, ms) per prompt bucket. Synthesis
   overhead: planning time on the new calibration.

5. **speculative**: :func:`~thoughtjax.synthesis.derived_candidates.speculative_candidates` adds the full path
   verifying the best prefix drafts and, when the registry holds a weight variant of every block (``registry build
   --variants int8``), the full path in those weights, and drafts from the text itself (``ngram:N:M``: no weights,
   what followed the latest earlier match of the last N..M tokens) (kind ``speculative``, the full path's
   quality); :func:`~thoughtjax.synthesis.calibrate_ratios.measure_factors` times each against the plain full path
   on the first hint's calibration text and stores its decode factor in ``latency.corrections``.

:func:`recalibrate_latency` (``--latency-only``) keeps a stored calibration's candidates and quality and
re-measures steps 4 and 5 on this machine (another fingerprint), well under two minutes for the default
model. A stored calibration without speculative candidates (one made before they existed, like the
shipped default table) gets them there: the drafts are chosen from its stored quality as step 5 does.

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``,
``scipy.optimize``, ``synthesis.calibration_store``, ``synthesis.dictionary``, ``synthesis.planner``; the functions
that need them do.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from thoughtjax.assembly import full_path
from thoughtjax.decode.speculative import ngram_order
from thoughtjax.path_syntax import VARIANTS
from thoughtjax.synthesis.calibrate_latency import machine_fingerprint, measure_latency, planning_ms, with_cost_keys
from thoughtjax.synthesis.calibrate_ratios import measure_factors, measure_hint_factors, measure_rows
from thoughtjax.synthesis.calibrate_settings import (
  CalibrateError,
  CalibrateProgress,
  CalibrateReport,
  CalibrateSettings,
  LatencySettings,
  SpeculativeSettings,
  no_progress,
)
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.candidate import Candidate, CandidateKind
from thoughtjax.synthesis.candidates import bridge_slots, bridged_proposals, pin, propose
from thoughtjax.synthesis.derived_candidates import (
  missing_speculative,
  missing_variants,
  speculative_candidates,
  variant_candidates,
  variant_quality,
)
from thoughtjax.synthesis.latency_params import ROWS_DEFAULT, LinearCost
from thoughtjax.synthesis.quality import corpora_of, measure_candidates, windows


def _token_docs(codec, documents: Sequence[str], window: int, max_windows: int | None) -> list[list[int]]:
  """The first ``max_windows`` windows of ``documents``, as token-id documents (one per window)."""
  wins = windows(codec, documents, window)
  return [w.tolist() for w in (wins if max_windows is None else wins[:max_windows])]


def full_model(registry, *, kernels: str | None = None):
  """The registry's full path, composed (restores every current block thoughtlet)."""
  from thoughtjax.compose import compose

  return compose(full_path(registry), registry, kernels=kernels)


def calibrate(
  registry,
  dictionary=None,
  settings: CalibrateSettings = CalibrateSettings(),
  *,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
) -> Calibration:
  """A new :class:`Calibration` of ``registry`` at its current sequence (see the module docstring)."""
  from thoughtjax.synthesis.dictionary import load_dictionary

  progress = progress or no_progress
  report = report if report is not None else CalibrateReport()
  dictionary = dictionary if dictionary is not None else load_dictionary()
  hints = tuple(settings.hints or dictionary.names)
  unknown = [h for h in hints if h not in dictionary]
  if unknown:
    raise CalibrateError(
      f"calibrate hints {unknown} are not in the dictionary {dictionary.source}; known: {', '.join(dictionary.names)}"
    )
  t0 = time.perf_counter()
  progress("load", 0, 1, "full path")
  model = full_model(registry, kernels=kernels)
  progress("load", 1, 1, "full path")
  report.seconds["load"] = time.perf_counter() - t0

  t0 = time.perf_counter()
  corpora = {}
  for h, (cal, held) in corpora_of(dictionary, hints).items():
    corpora[h] = (
      _token_docs(model.codec, cal, settings.window, settings.max_windows),
      _token_docs(model.codec, held, settings.window, settings.max_windows),
    )
  cand_settings = dataclasses.replace(settings.candidates, window=settings.window)
  proposals = propose(
    model,
    corpora[hints[0]][0],
    cand_settings,
    spans=list(registry.block_spans()),
    manual=settings.manual,
    progress=lambda d, n, what: progress("candidates", d, n, what),
  )
  # Paths healed by the registry's bridges (thoughtjax registry heal), measured like any other.
  known = {p.path for p in proposals}
  proposals += [p for p in bridged_proposals(registry, model.config.num_layers) if p.path not in known]
  pinned, refused = pin(proposals, registry)
  report.refused = [(p.path, why) for p, why in refused]
  # pin() keeps proposal order: the full path first. Paths that compose to the same units are kept once.
  candidates, seen = [], set()
  for c in pinned:
    if c.path_hash not in seen:
      seen.add(c.path_hash)
      candidates.append(with_cost_keys(c))
  progress("candidates", 1, 1, f"{len(candidates)} candidates, {len(refused)} refused")
  report.seconds["candidates"] = time.perf_counter() - t0

  t0 = time.perf_counter()
  used = {u.name for c in candidates for u in c.units}
  bridges = {n: registry.restore(n) for n in bridge_slots(registry) if n in used}
  quality = measure_candidates(
    model,
    candidates,
    corpora,
    window=settings.window,
    progress=lambda d, n, what: progress("quality", d, n, what),
    bridges=bridges,
  )
  variants = variant_candidates(registry, candidates, settings.variants)
  quality.update(variant_quality(registry, model, variants, corpora, settings.window, progress, kernels))
  candidates += variants
  report.seconds["quality"] = time.perf_counter() - t0
  del model
  spec = speculative_candidates(candidates, quality, hints[0], settings.speculative, registry=registry)
  candidates += spec  # no quality entries of their own: Calibration.hint_quality gives them the full path's
  return _with_latency(registry, candidates, quality, settings.latency, progress, report, kernels, corpora[hints[0]][0])


def recalibrate_latency(
  registry,
  stored: Calibration,
  settings: LatencySettings = LatencySettings(),
  *,
  speculative: SpeculativeSettings = SpeculativeSettings(),
  variants: Sequence[str] = VARIANTS,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
  keep_ratios: bool = False,
) -> Calibration:
  """``stored``'s candidates and quality with latency re-measured on this machine (``--latency-only``).

  ``keep_ratios``: the times (restore, compile, prefill, decode) are measured here, and the ratios ``stored``
  holds are kept for the candidates it holds them for: a speculative or variant path's factor over the full path,
  the per-hint factors of the drafts from the text, and how a path batches (a ratio of two times on one machine,
  which moves far less between machines than the times do). Only the ratios it lacks are measured. The default
  registry's first use does this with the shipped table; ``registry calibrate --latency-only`` measures all.

  The speculative candidates ``speculative`` chooses as :func:`calibrate` does (the drafts from the stored
  quality on the first calibrated hint of the dictionary) that ``stored`` lacks (one made before
  speculative candidates, or before n-gram drafts, existed) are added and measured here;
  ``SpeculativeSettings(drafts=0, variants=(), ngram=())`` keeps the stored candidates only. So are the whole-path
  weight variants of ``variants`` the registry holds and ``stored`` lacks (:func:`variant_candidates`), their
  quality measured here on the stored hints' corpora (``variants=()``: none)."""
  progress = progress or no_progress
  report = report if report is not None else CalibrateReport()
  if stored.sequence != registry.sequence:
    raise CalibrateError(
      f"the stored calibration is of registry sequence {stored.sequence}, the registry is at "
      f"{registry.sequence}; its candidates may name old versions. Run a full calibration "
      f"(thoughtjax registry calibrate {registry.root}) instead of --latency-only"
    )
  candidates = [with_cost_keys(c) for c in stored.candidates]
  quality = {
    with_cost_keys(c).path_hash: stored.quality[c.path_hash] for c in stored.candidates if c.path_hash in stored.quality
  }
  hint = first_hint(stored.hints)
  if hint is not None:  # without a calibrated hint of the dictionary there is no text to time a draft on
    candidates += missing_speculative(candidates, quality, hint, speculative, registry=registry)
  added = missing_variants(registry, candidates, variants)
  if added and hint is not None:  # their quality on every stored hint's corpora, against the full path
    t0 = time.perf_counter()
    corpora = _corpora(registry.codec, stored.hints, CalibrateSettings())
    reference = full_model(registry, kernels=kernels)
    quality.update(variant_quality(registry, reference, added, corpora, CalibrateSettings().window, progress, kernels))
    del reference
    candidates += added
    report.seconds["quality"] = time.perf_counter() - t0
  texts = None
  if any(c.draft is not None or c.kind is CandidateKind.VARIANT for c in candidates):
    texts = _calibration_text(registry, stored.hints, settings)  # factors are measured on calibration text
  kept = _kept_ratios(stored, candidates) if keep_ratios else None
  return _with_latency(registry, candidates, quality, settings, progress, report, kernels, texts, kept)


@dataclasses.dataclass(frozen=True)
class _Ratios:
  """Latency ratios a stored calibration already holds (see :func:`recalibrate_latency`'s ``keep_ratios``)."""

  paths: dict[str, dict[str, float]]  # path hash -> {stage: factor over the full path}
  hints: dict[str, dict[str, dict[str, float]]]  # hint -> path hash -> {stage: factor}
  rows: dict[str, LinearCost]  # path hash (or ROWS_DEFAULT) -> batching fit


def _kept_ratios(stored: Calibration, candidates: Sequence[Candidate]) -> _Ratios:
  """``stored``'s ratios re-keyed to ``candidates`` (their cost keys may have changed the path hashes); a hint's
  factors are kept only when they cover every draft from the text."""
  renamed = {c.path_hash: with_cost_keys(c).path_hash for c in stored.candidates}
  corrections = stored.latency.corrections
  paths = {renamed[h]: dict(f) for h, f in corrections.get("paths", {}).items() if h in renamed}
  ngram = {c.path_hash for c in candidates if c.draft is not None and ngram_order(c.draft.path) is not None}
  hints = {}
  for hint, per in corrections.get("hints", {}).items():
    mine = {renamed[h]: dict(f) for h, f in per.items() if h in renamed}
    if ngram <= set(mine):
      hints[hint] = mine
  rows = {
    (h if h == ROWS_DEFAULT else renamed[h]): c
    for h, c in stored.latency.rows.items()
    if h == ROWS_DEFAULT or h in renamed
  }
  return _Ratios(paths, hints, rows)


def first_hint(hints: Sequence[str]) -> str | None:
  """The first hint of the shipped dictionary's order among ``hints`` (what :func:`calibrate` calls the first
  hint when it calibrates every hint), or None."""
  from thoughtjax.synthesis.dictionary import load_dictionary

  return next((h for h in load_dictionary().names if h in set(hints)), None)


def _calibration_text(registry, hints: Sequence[str], settings: LatencySettings) -> list[list[int]]:
  """Token windows of the first calibrated hint's calibration split (the shipped dictionary's corpora)."""
  from thoughtjax.synthesis.dictionary import load_dictionary

  dictionary = load_dictionary()
  hint = first_hint(hints)
  if hint is None:
    raise CalibrateError(
      f"the stored calibration's hints {list(hints)} are not in the dictionary {dictionary.source}, so its "
      f"speculative candidates cannot be timed on calibration text; run a full calibration instead"
    )
  cal, _ = corpora_of(dictionary, (hint,))[hint]
  return _token_docs(registry.codec, cal, settings.speculative_prompt_tokens, settings.speculative_prompts)


def _corpora(codec, hints: Sequence[str], settings: CalibrateSettings) -> dict:
  """``{hint: (calibration, held-out) token windows}`` of the shipped dictionary, as :func:`calibrate` cuts them."""
  from thoughtjax.synthesis.dictionary import load_dictionary

  dictionary = load_dictionary()
  return {
    h: (
      _token_docs(codec, cal, settings.window, settings.max_windows),
      _token_docs(codec, held, settings.window, settings.max_windows),
    )
    for h, (cal, held) in corpora_of(dictionary, [h for h in hints if h in dictionary]).items()
  }


def _with_latency(
  registry, candidates, quality, settings: LatencySettings, progress, report, kernels, texts=None, kept=None
):
  """Latency measured here for ``candidates``; the ratios ``kept`` (a :class:`_Ratios`) holds are not re-measured."""
  t0 = time.perf_counter()
  kept = kept or _Ratios({}, {}, {})
  params = measure_latency(registry, candidates, settings, progress=progress, report=report, kernels=kernels)
  full = [c for c in candidates if c.kind is CandidateKind.FULL]
  lacking = full + [c for c in candidates if c.kind is not CandidateKind.FULL and c.path_hash not in kept.paths]
  factors = {h: f for h, f in kept.paths.items() if any(c.path_hash == h for c in candidates)}
  factors |= measure_factors(
    registry, lacking, texts or [], settings, progress=progress, report=report, kernels=kernels
  )
  hints = sorted({h for per_hint in quality.values() for h in per_hint})
  per_hint = {h: kept.hints[h] for h in hints if h in kept.hints}
  per_hint |= measure_hint_factors(
    registry,
    candidates,
    [h for h in hints if h not in kept.hints],
    settings,
    progress=progress,
    report=report,
    kernels=kernels,
  )
  if factors or per_hint:  # a speculative or variant candidate's stage: the full path's times its measured factor
    params = dataclasses.replace(params, corrections={"paths": factors, **({"hints": per_hint} if per_hint else {})})
  rows = {h: c for h, c in kept.rows.items() if h == ROWS_DEFAULT or any(x.path_hash == h for x in candidates)}
  unbatched = [c for c in candidates if c.path_hash not in rows]
  rows |= measure_rows(registry, unbatched, texts or [], settings, progress=progress, report=report, kernels=kernels)
  if rows:
    params = dataclasses.replace(params, rows=rows)
  draft = Calibration(registry.sequence, machine_fingerprint(), candidates, quality, params, registry.current)
  params = dataclasses.replace(params, synthesis_ms=planning_ms(draft, settings.plan_reps))
  cal = Calibration(registry.sequence, draft.fingerprint, candidates, quality, params, registry.current)
  report.seconds["latency"] = time.perf_counter() - t0
  progress("done", 1, 1, "")
  return cal


def store(registry, calibration: Calibration, *, sign_key=None):
  """Write ``calibration`` into ``registry`` (hashed, signed with ``sign_key`` when given)."""
  from thoughtjax.synthesis.calibration_store import write_calibration

  return write_calibration(registry, calibration, sign_key=sign_key)


def load(registry, sequence: int | None = None) -> Calibration:
  """The stored calibration of ``registry`` at ``sequence`` (default: current), verified."""
  from thoughtjax.synthesis.calibration_store import read_calibration

  return read_calibration(registry, sequence)

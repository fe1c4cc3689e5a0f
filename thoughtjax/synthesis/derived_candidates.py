"""Candidates calibration derives from the full path instead of proposing them: speculative and weight variants.

:func:`speculative_candidates`: the full path verifying drafts (the best prefix candidates, the full path in a
weight variant, n-gram lookups in the text itself), kind ``speculative``, priced as the full path's quality.
:func:`variant_candidates`: the full path in each weight variant the registry holds for every block, kind
``variant``, a lossy candidate whose quality :func:`variant_quality` measures against the full path.
``missing_*``: those a stored calibration lacks. None of these time anything (:mod:`calibrate_ratios` does).

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from thoughtjax.path_syntax import Ref, parse_path
from thoughtjax.synthesis.calibrate_latency import cost_key
from thoughtjax.synthesis.calibrate_settings import CalibrateError, SpeculativeSettings
from thoughtjax.synthesis.candidate import Candidate, CandidateKind, DraftPlan, Unit
from thoughtjax.synthesis.candidates import is_bridge
from thoughtjax.synthesis.quality import measure_models


def _is_prefix_draft(c: Candidate, full: Candidate) -> bool:
  """``c`` runs embed, the full path's first blocks, then only bridges, then head: a draft that shares
  the full path's leading blocks (and their KV cache)."""
  if c.path_hash == full.path_hash or len(c.units) < 2 or c.units[0] != full.units[0] or c.units[-1] != full.units[-1]:
    return False
  mid, fmid = c.units[1:-1], full.units[1:-1]
  k = 0
  while k < len(mid) and not is_bridge(mid[k].name):
    k += 1
  return list(mid[:k]) == list(fmid[:k]) and all(is_bridge(u.name) for u in mid[k:]) and k < len(fmid)


def missing_speculative(
  candidates: Sequence[Candidate],
  quality: dict,
  hint: str,
  settings: SpeculativeSettings = SpeculativeSettings(),
  *,
  registry=None,
) -> list[Candidate]:
  """The :func:`speculative_candidates` of the non-speculative ``candidates`` that ``candidates`` lacks."""
  have = {c.path_hash for c in candidates}
  plain = [c for c in candidates if c.draft is None]
  return [
    c for c in speculative_candidates(plain, quality, hint, settings, registry=registry) if c.path_hash not in have
  ]


def variant_units(registry, full: Candidate, variant: str) -> tuple[Unit, ...] | None:
  """``full``'s units with every block in ``variant`` weights (the registry's current ``<block>@<variant>``
  thoughtlets, covering the same layers), embed and head its own; None when the registry lacks one."""
  names = set(registry.names)
  out = []
  for u in full.units:
    if not u.layers:
      out.append(u)
      continue
    name = f"{u.name}@{variant}"
    if name not in names:
      return None
    m = registry.manifest(name)
    layers = 0 if m.layers is None else m.layers[1] - m.layers[0]
    if layers != u.layers:
      raise CalibrateError(
        f"{name} ({registry.root}) runs {layers} layers, but {u.ref} runs {u.layers}; a weight variant covers its "
        f"block's layers exactly. Rebuild the registry (thoughtjax registry build ... --variants {variant})"
      )
    unit = Unit(name, m.version, m.param_bytes, layers)
    out.append(dataclasses.replace(unit, cost_key=cost_key(unit)))
  return tuple(out)


def variant_candidates(registry, candidates: Sequence[Candidate], variants: Sequence[str]) -> list[Candidate]:
  """The full path in each of ``variants`` whose every block the registry holds in that variant (kind
  ``variant``: lossy, its quality measured by :func:`variant_quality`, its latency by :func:`measure_factors`)."""
  full = next(c for c in candidates if c.kind is CandidateKind.FULL)
  out = []
  for variant in variants:
    units = variant_units(registry, full, variant)
    if units is not None:
      refs = [Ref(r.name, None, variant if r.span is not None else None) for r in parse_path(full.path)]
      out.append(Candidate.build(", ".join(map(str, refs)), CandidateKind.VARIANT, units))
  return out


def missing_variants(registry, candidates: Sequence[Candidate], variants: Sequence[str]) -> list[Candidate]:
  """The :func:`variant_candidates` that ``candidates`` lacks."""
  have = {c.path_hash for c in candidates}
  return [c for c in variant_candidates(registry, candidates, variants) if c.path_hash not in have]


def variant_quality(registry, reference, variants: Sequence[Candidate], corpora, window: int, progress, kernels):
  """``{path hash: {hint: HintQuality}}`` of the ``variants`` candidates against ``reference`` (the full path,
  composed) on ``corpora`` (:func:`~thoughtjax.synthesis.quality.measure_models`: each window runs whole
  through both, as a variant shares no residual with the full path)."""
  from thoughtjax.compose import compose

  if not variants:
    return {}
  models = [compose(c.path, registry, kernels=kernels) for c in variants]
  got = measure_models(
    reference, models, corpora, window=window, progress=lambda d, n, what: progress("quality", d, n, "variants " + what)
  )
  return {c.path_hash: q for c, q in zip(variants, got, strict=True)}


def speculative_candidates(
  candidates: Sequence[Candidate],
  quality: dict,
  hint: str,
  settings: SpeculativeSettings = SpeculativeSettings(),
  *,
  registry=None,
) -> list[Candidate]:
  """Speculative candidates: the full path verifying each of the ``settings.drafts`` prefix candidates of
  highest top-1 agreement on ``hint``'s calibration split (ties: fewer layers, then path hash), then, given
  ``registry``, the full path in each of ``settings.variants`` that it holds for every block, then the n-gram
  draft of each spec in ``settings.ngram``; see :class:`SpeculativeSettings`. Their quality is the full path's;
  their latency is measured (:func:`measure_factors`)."""
  full = next(c for c in candidates if c.kind is CandidateKind.FULL)
  full_refs = {u.ref for u in full.units}
  scored = []
  for c in candidates:
    q = quality.get(c.path_hash, {}).get(hint)
    if q is not None and _is_prefix_draft(c, full):
      scored.append((-q.calibration.top1_agreement, sum(u.layers for u in c.units), c.path_hash, c.units))
  drafts = [units for *_, units in sorted(scored)[: settings.drafts]]
  for variant in settings.variants if registry is not None else ():
    units = variant_units(registry, full, variant)
    if units is not None:
      drafts.append(units)
  out = []
  for units in drafts:
    draft = DraftPlan(
      ", ".join(u.ref for u in units),
      settings.draft_tokens,
      settings.vocab,
      tuple(dict.fromkeys(u for u in units if u.ref not in full_refs)),
      sum(u.layers for u in units),
    )
    out.append(Candidate.build(full.path, CandidateKind.SPECULATIVE, full.units, draft))
  for n in settings.ngram:  # no weights, no layers: the draft is a lookup in the row's own text
    draft = DraftPlan(f"ngram:{n}", settings.draft_tokens)
    out.append(Candidate.build(full.path, CandidateKind.SPECULATIVE, full.units, draft))
  return out

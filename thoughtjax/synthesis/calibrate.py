"""``registry calibrate``: measure every candidate path's quality per hint and this machine's latency model.

>>> from thoughtjax.registry import Registry
>>> from thoughtjax.synthesis.calibrate import calibrate, store
>>> reg = Registry.open("build/registry")
>>> cal = calibrate(reg)                        # candidates, quality per hint, latency, ~minutes on 2 cores
>>> store(reg, cal, sign_key="keys/registry.key")   # DIR/calibration/<sequence>.json + .sig

Steps (each reported to ``progress(stage, done, total, item)``):

1. **load**: the full path composed from the registry (every current block thoughtlet), so quality is
   measured on exactly the weights synthesis will run.
2. **candidates**: :func:`~thoughtjax.synthesis.candidates.propose` on the first hint's calibration split
   with the registry's own block spans, then :func:`~thoughtjax.synthesis.candidates.pin` to the current
   versions (a proposal that does not compose is dropped with its reason in ``report.refused``).
3. **quality**: :func:`~thoughtjax.synthesis.quality.measure_candidates` on every hint's calibration and
   held-out split, each cut to ``max_windows`` windows of ``window`` tokens (the full path's logits once
   per window, shared by all candidates).
4. **latency**: the real program (prefill + decode loop, as synthesis runs it) of the full path and of
   the shortest candidate, at two prompt buckets and two decode lengths, ``ignore_eos`` so every step
   runs; per-layer and fixed (embed + head + loop) costs are fitted by non-negative least squares to the
   same stage times a synthesis trace reports, so predictions and traces compare like with like. Warm
   runs only: the first run of each program (which compiles it) gives the compile cost alone. Restore
   cost: every unit restored as a later process restores it, from its mapped form (bytes, ms). Compile cost:
   the first run of each program (layers run, ms) per prompt bucket. Synthesis overhead: planning time on the
   new calibration.

5. **speculative**: :func:`speculative_candidates` adds the full path verifying the best prefix drafts
   and, when the registry holds a weight variant of every block (``registry build --variants int8``), the
   full path in those weights, and drafts from the text itself (``ngram:N:M``: no weights, what followed the
   latest earlier match of the last N..M tokens) (kind ``speculative``, the full path's quality); :func:`measure_factors`
   times each against the plain full path on the first hint's calibration text and stores its decode
   factor in ``latency.corrections``.

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
import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from thoughtjax.assembly import full_path
from thoughtjax.decode.program import bucket
from thoughtjax.decode.speculative import Draft, DraftError, ngram_order
from thoughtjax.defaults import DEFAULT_DRAFT_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import VARIANTS, Ref, parse_path
from thoughtjax.sampling import SamplingParams
from thoughtjax.synthesis.calibration import Calibration
from thoughtjax.synthesis.candidate import Candidate, CandidateKind, DraftPlan, Unit
from thoughtjax.synthesis.candidates import CandidateSettings, bridge_slots, bridged_proposals, is_bridge, pin, propose
from thoughtjax.synthesis.latency import (
  FACTOR_BOUNDS,
  ROWS_DEFAULT,
  LatencyModel,
  LatencyParams,
  LinearCost,
  fit_linear,
)
from thoughtjax.synthesis.quality import corpora_of, measure_candidates, measure_models, windows
from thoughtjax.thoughtlet import canonical_json, fingerprint

# (stage, done, total, item): stage is load, candidates, quality, latency or done.
CalibrateProgress = Callable[[str, int, int, str], None]

EMBED_KEY, HEAD_KEY = "embed", "head"


class CalibrateError(UserError, ValueError):
  """Calibration settings or inputs that cannot produce a calibration; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class LatencySettings:
  """What the latency measurement runs: prompt lengths (tokens; two buckets), decode lengths (steps;
  one bucket, so one program per path and prompt bucket) and repetitions of each run after the first.
  The default prompt buckets (16 and 512) span the prompts served, so predictions interpolate."""

  prompt_tokens: tuple[int, ...] = (12, 300)
  max_tokens: tuple[int, ...] = (6, 16)
  reps: int = 2
  plan_reps: int = 200
  # Speculative candidates: greedy decode of this many tokens from each of this many prompts of the
  # calibration text (each cut to speculative_prompt_tokens), plain and speculative interleaved,
  # speculative_reps times after one warm-up run per prompt bucket (a speculative step on the default model
  # costs several plain ones on a CPU: each round adds tens of seconds to the default registry's first use).
  speculative_prompts: int = 2
  speculative_prompt_tokens: int = 32
  speculative_tokens: int = 32
  speculative_reps: int = 1
  # How a path batches (LatencyParams.rows): the full path and each weight variant decode speculative_tokens
  # greedy steps alone and as rows_width rows of one batch, interleaved, speculative_reps rounds after a
  # compiling one (0: not measured; a server's load is then priced as if batching saved nothing).
  rows_width: int = 8
  # Drafts from the text itself (n-gram lookup) per hint: greedy decode of hint_tokens tokens from each of
  # hint_prompts of the hint's shipped router prompts (training split) as chat requests, plain and drafted
  # interleaved; the hint's factor is the drafted over the plain decode ms per token (LatencyParams "hints").
  # Acceptance follows the text: code and structured output repeat themselves, prose does not. 0: not measured.
  hint_prompts: int = 0
  hint_tokens: int = 64

  def __post_init__(self):
    for f in ("prompt_tokens", "max_tokens"):
      v = tuple(getattr(self, f))
      object.__setattr__(self, f, v)
      if len(v) < 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 2 for x in v):
        raise CalibrateError(
          f"LatencySettings.{f}: expected at least two integers >= 2 (a line needs two points), got {v!r}"
        )
    if self.reps < 1 or self.plan_reps < 1:
      raise CalibrateError(f"LatencySettings reps and plan_reps: expected >= 1, got {self.reps}, {self.plan_reps}")
    if (
      isinstance(self.rows_width, bool)
      or not isinstance(self.rows_width, int)
      or self.rows_width in (1,)
      or self.rows_width < 0
    ):
      raise CalibrateError(
        f"LatencySettings.rows_width: expected 0 (not measured) or an integer >= 2, got {self.rows_width!r}"
      )
    if isinstance(self.hint_prompts, bool) or not isinstance(self.hint_prompts, int) or self.hint_prompts < 0:
      raise CalibrateError(
        f"LatencySettings.hint_prompts: expected 0 (not measured) or more, got {self.hint_prompts!r}"
      )
    for f in (
      "speculative_prompts",
      "speculative_prompt_tokens",
      "speculative_tokens",
      "speculative_reps",
      "hint_tokens",
    ):
      v = getattr(self, f)
      least = 2 if f in ("speculative_tokens", "hint_tokens") else 1
      if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise CalibrateError(f"LatencySettings.{f}: expected an integer >= {least}, got {v!r}")


def _variants(v, where: str) -> tuple[str, ...]:
  """``v`` as a tuple of distinct weight variants, or a :class:`CalibrateError` naming ``where``."""
  if isinstance(v, str) or not isinstance(v, (tuple, list)) or any(x not in VARIANTS for x in v):
    raise CalibrateError(f"{where}: expected a tuple of weight variants from {list(VARIANTS)}, got {v!r}; () for none")
  return tuple(dict.fromkeys(v))


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
  """Which speculative candidates calibration adds (:func:`speculative_candidates`).

  ``drafts``: how many drafts, chosen among the measured prefix candidates (early exits, bridged exits) by
  top-1 agreement with the full path on the first hint's calibration split, highest first (a greedy draft
  token is accepted exactly when it agrees); 0: none. ``variants``: weight variants whose full path drafts
  too, each where the registry holds that variant of every block of the full path; () by default: the full path
  in int8 weights agrees far more than any raw exit, but on the default model, batch 1 on this 2-core CPU, it
  measured 1.5-1.8x the plain full path's time per token as a draft, and it is a candidate of its own instead
  (:attr:`CalibrateSettings.variants`).
  ``draft_tokens``: K per verify pass; ``vocab``: the draft head's truncated vocabulary (None: the whole one).
  ``ngram``: the spec of each n-gram draft, ``"N"`` or ``"N:M"`` (:class:`thoughtjax.decode.speculative.Draft`
  ``"ngram:N:M"``: look up the last N tokens down to M, a plain step without such a match): drafts looked up
  in the text itself, which pay where the text repeats; () for none. The default ``"3:2"``: on the default
  model, batch 1 f32 on this 2-core CPU, a verify pass costs about 2x a plain step, and drafting from
  one-token matches too ("3") lost more on text that does not repeat than it gained where it does.
  """

  drafts: int = 1
  draft_tokens: int = DEFAULT_DRAFT_TOKENS
  vocab: int | None = None
  variants: tuple[str, ...] = ()
  ngram: tuple[str, ...] = ("3:2",)

  def __post_init__(self):
    object.__setattr__(self, "variants", _variants(self.variants, "SpeculativeSettings.variants"))
    if isinstance(self.drafts, bool) or not isinstance(self.drafts, int) or self.drafts < 0:
      raise CalibrateError(f"SpeculativeSettings.drafts: expected an integer >= 0, got {self.drafts!r}")
    if (
      isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= 64
    ):
      raise CalibrateError(
        f"SpeculativeSettings.draft_tokens: expected an integer in [1, 64], got {self.draft_tokens!r}"
      )
    if self.vocab is not None and (isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 1):
      raise CalibrateError(f"SpeculativeSettings.vocab: expected None or an integer >= 1, got {self.vocab!r}")

    n = self.ngram
    why = None
    if isinstance(n, (str, int)) or not isinstance(n, (tuple, list)) or not all(isinstance(x, str) for x in n):
      why = f"got {n!r}"
    else:
      for x in n:
        try:
          ngram_order(f"ngram:{x}")
        except DraftError as e:
          why = str(e)
    if why is not None:
      raise CalibrateError(
        f"SpeculativeSettings.ngram: expected a tuple of n-gram specs 'N' or 'N:M' (e.g. ('3:2',)), N in [1, 16], "
        f"M in [1, N]; {why}; () for none"
      )
    object.__setattr__(self, "ngram", tuple(dict.fromkeys(n)))


@dataclasses.dataclass(frozen=True)
class CalibrateSettings:
  """``candidates``: what to propose; ``window``: tokens per quality window; ``max_windows``: windows per
  split per hint (None: all; the default keeps the default model's run within minutes on 2 cores);
  ``hints``: the hints to calibrate (None: every hint of the dictionary); ``manual``: extra paths;
  ``variants``: weight variants whose whole full path is a lossy candidate of its own (kind ``variant``), each
  where the registry holds that variant of every block (``registry build --variants int8,int8a8``); by default
  every variant there is, so a registry's calibration covers whichever it holds."""

  candidates: CandidateSettings = CandidateSettings(single_skips=3, greedy_removals=3, greedy_windows=3)
  window: int = 128
  max_windows: int | None = 6
  hints: tuple[str, ...] | None = None
  manual: tuple[str, ...] = ()
  latency: LatencySettings = LatencySettings()
  speculative: SpeculativeSettings = SpeculativeSettings()
  variants: tuple[str, ...] = VARIANTS

  def __post_init__(self):
    object.__setattr__(self, "variants", _variants(self.variants, "CalibrateSettings.variants"))


@dataclasses.dataclass
class CalibrateReport:
  """What a calibration run did: seconds per stage, proposals refused (path, why), runs measured."""

  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  latency_runs: list[dict] = dataclasses.field(default_factory=list)
  # Per speculative candidate: draft, decode ms per token plain and speculative (medians), factor, acceptance.
  speculative: list[dict] = dataclasses.field(default_factory=list)
  # Per weight-variant candidate: path, prefill ms and decode ms per token, plain and its own (medians), factors.
  variants: list[dict] = dataclasses.field(default_factory=list)
  # Per path measured for batching: path, width, ms per step at one row and at width rows (medians), their ratio.
  rows: list[dict] = dataclasses.field(default_factory=list)

  @property
  def total_seconds(self) -> float:
    return sum(self.seconds.values())


# The form of the latency model's fits (latency module docstring); part of the fingerprint, so latency
# measured for another form is re-measured (the default registry does so on first use).
LATENCY_MODEL = 3


# XLA flags a latency calibration holds across: the scheduler choice the command line and the server make
# (thoughtjax.use_memory_scheduler; a library user, a notebook, does not) and the host device count the tests fake
# (one device's program runs on the same cores either way). Counted, every switch between the command line and
# Python would measure the machine again (20 s and more for the default registry) and undo the other's calibration.
LATENCY_NEUTRAL_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler", "--xla_force_host_platform_device_count")


def machine_fingerprint() -> str:
  """This machine and software, as a short string: ``platform/device kind/cpus/jax version/<hash>/lm<form>``.
  The hash leaves out what latency does not depend on: :data:`LATENCY_NEUTRAL_FLAGS`, and on the CPU the number
  of host devices those flags make."""

  fp = dict(fingerprint())
  fp["xla_flags"] = " ".join(f for f in fp.get("xla_flags", "").split() if not f.startswith(LATENCY_NEUTRAL_FLAGS))
  if fp.get("platform") == "cpu":
    fp.pop("device_count", None)
  digest = hashlib.sha3_256(canonical_json(fp)).hexdigest()[:12]
  return f"{fp['platform']}/{fp['device_kind']}/{fp['cpu_count']}cpu/jax{fp['jax']}/{digest}/lm{LATENCY_MODEL}"


def cost_key(unit: Unit) -> str:
  """Units of equal shape share one measured cost: embed, head, ``blocks:<layers>`` and ``bridge:<bytes>``."""
  if unit.layers:
    return f"blocks:{unit.layers}"
  if is_bridge(unit.name):
    return f"bridge:{unit.nbytes}"
  return HEAD_KEY if unit.name == "head" else EMBED_KEY


def with_cost_keys(c: Candidate) -> Candidate:
  return Candidate.build(c.path, c.kind, [dataclasses.replace(u, cost_key=cost_key(u)) for u in c.units], c.draft)


def _nop(stage, done, total, item):
  pass


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

  progress = progress or _nop
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
  progress = progress or _nop
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


# ------------------------------------------------------------------------------ speculative
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

  progress = progress or _nop
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

  progress = progress or _nop
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
  :data:`~thoughtjax.synthesis.latency.ROWS_DEFAULT`, for the paths not measured; a speculative plan decodes
  alone): a decode step of W rows over one row's, ``fit(W)``, through (1, 1) and
  (``rows_width``, the measured ratio). Each path decodes ``speculative_tokens`` greedy steps from a calibration
  prompt alone and as ``rows_width`` copies in one batch (the plain program at that batch; a slot engine computes
  the same rows), interleaved, the medians of ``speculative_reps`` rounds after one that compiles."""
  from thoughtjax.compose import compose

  W = settings.rows_width
  paths = [c for c in candidates if c.kind in (CandidateKind.FULL, CandidateKind.VARIANT)]
  if not W or not paths:
    return {}
  progress = progress or _nop
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


# ------------------------------------------------------------------------------ latency
def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
  from scipy.optimize import nnls

  return nnls(A, y)[0]


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
  params = dataclasses.replace(params, synthesis_ms=_planning_ms(draft, settings.plan_reps))
  cal = Calibration(registry.sequence, draft.fingerprint, candidates, quality, params, registry.current)
  report.seconds["latency"] = time.perf_counter() - t0
  progress("done", 1, 1, "")
  return cal


def _planning_ms(cal: Calibration, reps: int) -> float:
  """Median time of one warm GetOptimalPath on ``cal`` (ms), floors that every candidate meets."""
  from thoughtjax.synthesis.planner import Floor, Planner, PlanRequest

  hints = cal.hints or ("_",)
  planner = Planner(cal, {h: Floor() for h in hints})
  model = LatencyModel(cal.latency)
  req = PlanRequest(hints[:1], 32, 32, 1e9)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    planner.plan(req, model)
    times.append((time.perf_counter() - t) * 1e3)
  return float(np.median(times))


def _run(model, prompt_tokens: int, max_tokens: int) -> dict:
  """One generation of the real program with every step run; its trace's stage times (ms)."""
  vocab = model.config.vocab_size
  rng = np.random.default_rng(prompt_tokens * 1000 + max_tokens)
  ids = [int(t) for t in rng.integers(3, vocab, prompt_tokens)]
  g = model.stream(ids, max_tokens=max_tokens, ignore_eos=True)
  for _ in g:
    pass
  t = g.trace
  return {
    "prompt_tokens": prompt_tokens,
    "max_tokens": max_tokens,
    "tokens_out": t.tokens_out[0],
    "compile_ms": t.compile_s * 1e3,
    "prefill_ms": t.prefill_s * 1e3,
    "decode_ms": t.decode_s * 1e3,
  }


def _prompt_lengths(settings: LatencySettings, max_context: int) -> list[int]:
  """The distinct prompt lengths measured: each within the context left by the longest decode."""
  cap = max_context - max(settings.max_tokens)
  return sorted({max(1, min(T, cap)) for T in settings.prompt_tokens})


def measure_latency(
  registry,
  candidates: Sequence[Candidate],
  settings: LatencySettings = LatencySettings(),
  *,
  progress: CalibrateProgress | None = None,
  report: CalibrateReport | None = None,
  kernels: str | None = None,
) -> LatencyParams:
  """Fitted :class:`LatencyParams` of this machine for ``candidates`` (see the module docstring)."""
  from thoughtjax.compose import compose

  progress = progress or _nop
  units = {u.ref: u for c in candidates for u in c.units}
  by_layers = sorted(candidates, key=lambda c: (sum(u.layers for u in c.units), c.path_hash))
  full = next(c for c in candidates if c.kind is CandidateKind.FULL)
  timed = [full] + (
    [by_layers[0]] if sum(u.layers for u in by_layers[0].units) < sum(u.layers for u in full.units) else []
  )
  total = len(units) + len(timed) * len(settings.prompt_tokens) * (1 + len(settings.max_tokens) * settings.reps)
  done = 0

  # Restore: every unit as a later process restores it (evicted first), bytes against ms. A unit's first verified
  # restore keeps its mapped form (registry docs, "Restores"), which later processes map instead of reading the
  # checkpoint: that first restore is not the one timed.
  registry.evict_all()
  restore_pts = []
  for ref, u in units.items():
    registry.restore(u.name, u.version)
    registry.evict_all()
    t = time.perf_counter()
    registry.restore(u.name, u.version)
    restore_pts.append((float(u.nbytes), (time.perf_counter() - t) * 1e3))
    registry.evict_all()
    done += 1
    progress("latency", done, total, f"restore {ref}")

  rows, compile_pts = [], {}

  for c in timed:
    layers = sum(u.layers for u in c.units)
    model = compose(", ".join(u.ref for u in c.units), registry, kernels=kernels)
    prompts = _prompt_lengths(settings, model.config.max_context)
    # Fewer runs when the context clamps prompt lengths together.
    total -= (len(settings.prompt_tokens) - len(prompts)) * (1 + len(settings.max_tokens) * settings.reps)
    for T in prompts:
      # The first run of a program key compiles it; later runs are the warm measurements.
      first = _run(model, T, max(settings.max_tokens))
      compile_pts.setdefault(bucket(T), []).append((float(layers), first["compile_ms"]))
      done += 1
      progress("latency", done, total, f"compile {c.path} T={T}")
      for n in settings.max_tokens:
        for _ in range(settings.reps):
          r = _run(model, T, n)
          r["layers"] = layers
          rows.append(r)
          done += 1
          progress("latency", done, total, f"run {c.path} T={T} n={n}")
    del model
  if report is not None:
    report.latency_runs = rows

  # The shapes the program runs (latency module docstring): the prompt padded to P = bucket(T), n - 1
  # decode steps each over the whole cache of S = bucket(T) + bucket(max_tokens) slots.
  # prefill = (P0 + L Pl) + (Q0 + L Ql) P;  decode = (n - 1) ((A0 + L Al) + (B0 + L Bl) S).
  L = np.array([r["layers"] for r in rows], float)
  T = np.array([bucket(r["prompt_tokens"]) for r in rows], float)
  S = T + np.array([bucket(r["max_tokens"]) for r in rows], float)
  n = np.maximum(np.array([r["tokens_out"] for r in rows], float) - 1, 0)
  ctx = n * S
  prefill_ms = np.array([r["prefill_ms"] for r in rows])
  decode_ms = np.array([r["decode_ms"] for r in rows])

  def per_layer_only():  # every cost per layer (the fixed part spread over the layers)
    p, d = _nnls(np.stack([L, L * T], 1), prefill_ms), _nnls(np.stack([n * L, ctx * L], 1), decode_ms)
    return (0.0, 0.0, p[0], p[1]), (0.0, 0.0, d[0], d[1])

  if len(set(L.tolist())) < 2:  # one depth measured: fixed and per-layer costs cannot be told apart
    (P0, Q0, Pl, Ql), (A0, B0, Al, Bl) = per_layer_only()
  else:
    P0, Q0, Pl, Ql = _nnls(np.stack([np.ones_like(L), T, L, L * T], 1), prefill_ms)
    A0, B0, Al, Bl = _nnls(np.stack([n, ctx, n * L, ctx * L], 1), decode_ms)
    # On a noisy machine the depth difference can drown: a fit with no per-layer cost at all would
    # predict every path equally fast. Then spread the cost over the layers; traces correct the rest.
    if Pl + Ql == 0 or Al + Bl == 0:
      (P0, Q0, Pl, Ql), (A0, B0, Al, Bl) = per_layer_only()
  prefill = {EMBED_KEY: LinearCost(0.0), HEAD_KEY: LinearCost(float(P0), float(Q0))}
  decode = {EMBED_KEY: LinearCost(0.0), HEAD_KEY: LinearCost(float(A0), float(B0))}
  for k in sorted({u.layers for u in units.values() if u.layers}):
    prefill[f"blocks:{k}"] = LinearCost(float(k * Pl), float(k * Ql))
    decode[f"blocks:{k}"] = LinearCost(float(k * Al), float(k * Bl))
  # A bridge (a position-wise adapter) is too small to time apart from its path: it costs the per-layer
  # cost scaled by the weights it reads per token against a layer's. It attends to nothing: no cache term.
  blocks = [u for u in units.values() if u.layers]
  layer_bytes = sum(u.nbytes for u in blocks) / max(1, sum(u.layers for u in blocks))
  for u in units.values():
    if is_bridge(u.name):
      frac = u.nbytes / layer_bytes if layer_bytes else 0.0
      prefill[cost_key(u)] = LinearCost(float(frac * Pl), float(frac * Ql))
      decode[cost_key(u)] = LinearCost(float(frac * Al), 0.0)

  return LatencyParams(
    prefill=prefill,
    decode=decode,
    restore=fit_linear(restore_pts, "restore"),
    compile={b: fit_linear(pts, f"compile[{b}]") for b, pts in compile_pts.items()},
  )


def store(registry, calibration: Calibration, *, sign_key=None):
  """Write ``calibration`` into ``registry`` (hashed, signed with ``sign_key`` when given)."""
  from thoughtjax.synthesis.calibration_store import write_calibration

  return write_calibration(registry, calibration, sign_key=sign_key)


def load(registry, sequence: int | None = None) -> Calibration:
  """The stored calibration of ``registry`` at ``sequence`` (default: current), verified."""
  from thoughtjax.synthesis.calibration_store import read_calibration

  return read_calibration(registry, sequence)

"""What a calibration runs and what it reports: the settings of ``registry calibrate`` and its report.

:class:`CalibrateSettings` (candidates, quality windows, hints) holds a :class:`LatencySettings` (what the latency
and ratio measurements run) and a :class:`SpeculativeSettings` (which speculative candidates are added); each
checks its fields on construction and raises :class:`CalibrateError`, naming the field, the expected and the
received value. :class:`CalibrateReport` collects what a run did; :data:`CalibrateProgress` is the
``progress(stage, done, total, item)`` callback every step reports to (:func:`no_progress`: none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from thoughtjax.decode.speculative import DraftError, ngram_order
from thoughtjax.defaults import DEFAULT_DRAFT_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import VARIANTS
from thoughtjax.synthesis.candidates import CandidateSettings

# (stage, done, total, item): stage is load, candidates, quality, latency or done.
CalibrateProgress = Callable[[str, int, int, str], None]


def no_progress(stage: str, done: int, total: int, item: str) -> None:
  """A :data:`CalibrateProgress` that reports nothing (the default wherever ``progress`` is None)."""


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

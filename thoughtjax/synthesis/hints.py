"""Hints of a request: normalized, corrected when a misspelling is unambiguous, at most three.

Contract of :func:`normalize_hints`:

- Each hint is normalized: surrounding whitespace trimmed, lower-cased, every run of spaces,
  hyphens and underscores inside it turned into one ``_``, leading and trailing ``_`` dropped
  (``" Code-Generation "`` -> ``code_generation``). Normalization is not a correction.
- A normalized hint that is not in the dictionary is corrected to an entry when exactly one entry
  lies within the correction bound: optimal-string-alignment distance (Damerau-Levenshtein with
  adjacent transpositions, each edit counted once) at most ``min(2, len(entry) // 3)``. Each
  correction is reported back. No entry within the bound, or several, is :class:`UnknownHintError`
  listing the valid hints (and the several near ones).
- Duplicates are dropped after correction, keeping the first position; order is priority.
- More than :data:`MAX_HINTS` distinct hints is :class:`TooManyHintsError`; an empty hint is
  :class:`EmptyHintError`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from thoughtjax.defaults import MAX_HINTS
from thoughtjax.errors import UserError
from thoughtjax.synthesis.dictionary import SynthesisDictionary

MAX_DISTANCE = 2
_SEPARATORS = re.compile(r"[\s\-_]+")


class HintError(UserError, ValueError):
  """A request's hints cannot be used as given; the message says which and how to fix it."""


class EmptyHintError(HintError):
  pass


class UnknownHintError(HintError):
  def __init__(self, message: str, *, given: str, valid: tuple[str, ...], candidates: tuple[str, ...] = ()):
    super().__init__(message)
    self.given, self.valid, self.candidates = given, valid, candidates


class TooManyHintsError(HintError):
  pass


@dataclasses.dataclass(frozen=True)
class Correction:
  given: str  # as the caller wrote it
  corrected: str  # the dictionary entry it was taken for


@dataclasses.dataclass(frozen=True)
class HintResolution:
  hints: tuple[str, ...]  # dictionary names, priority order, distinct, at most MAX_HINTS
  corrections: tuple[Correction, ...] = ()


def normalize(hint: str) -> str:
  """Normalized form of one hint (see the module docstring); idempotent."""
  return _SEPARATORS.sub("_", hint.strip().lower()).strip("_")


def edit_distance(a: str, b: str) -> int:
  """Optimal-string-alignment distance: insertions, deletions, substitutions and transpositions of
  adjacent characters, each costing 1, no substring edited twice."""
  if a == b:
    return 0
  prev2: list[int] | None = None
  prev = list(range(len(b) + 1))
  for i in range(1, len(a) + 1):
    cur = [i] + [0] * len(b)
    for j in range(1, len(b) + 1):
      cost = 0 if a[i - 1] == b[j - 1] else 1
      cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
      if prev2 is not None and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
        cur[j] = min(cur[j], prev2[j - 2] + 1)
    prev2, prev = prev, cur
  return prev[-1]


def correction_bound(entry: str) -> int:
  """Largest distance at which a misspelling may be taken for ``entry``: 2, and at most a third of
  the entry's length, so short names are not reached from unrelated words."""
  return min(MAX_DISTANCE, len(entry) // 3)


def near_entries(hint: str, names: Iterable[str]) -> tuple[str, ...]:
  """Entries within their correction bound of the normalized ``hint``, closest first (ties in dictionary
  order)."""
  scored = []
  for k, name in enumerate(names):
    bound = correction_bound(name)
    if abs(len(name) - len(hint)) > bound:
      continue  # the distance is at least the length difference
    d = edit_distance(hint, name)
    if d <= bound:
      scored.append((d, k, name))
  return tuple(name for _, _, name in sorted(scored))


def _shown(text: str, limit: int = 60) -> str:
  """``repr`` of a caller's string, cut so that an error message stays one readable line."""
  return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def normalize_hints(raw: Iterable[str], dictionary: SynthesisDictionary | Iterable[str]) -> HintResolution:
  """Resolve a request's hints against ``dictionary`` (a ``SynthesisDictionary`` or its names).

  Returns the dictionary names in priority order with the corrections made; raises a
  :class:`HintError` subclass naming the offending hint, the valid hints and the fix.
  """
  names = tuple(getattr(dictionary, "names", dictionary))
  valid = ", ".join(names)
  if isinstance(raw, (str, bytes)):
    raise HintError(
      f"hints must be a sequence of strings, got the single string {_shown(raw)}; pass a list such as [{_shown(raw)}]"
    )
  known = set(names)
  raw = list(raw)
  out: list[str] = []
  corrections: list[Correction] = []
  for pos, given in enumerate(raw):
    if not isinstance(given, str):
      shown = repr(given) if len(repr(given)) <= 60 else repr(given)[:60] + "..."
      raise HintError(f"hint {pos} must be a string, got {type(given).__name__} {shown}; valid hints: {valid}")
    hint = normalize(given)
    if not hint:
      raise EmptyHintError(
        f"hint {pos} is empty ({_shown(given)}); give a hint name or leave the hint out. Valid hints: {valid}"
      )
    if hint not in known:
      near = near_entries(hint, names)
      if len(near) != 1:
        why = (
          f"it is near {len(near)} hints ({', '.join(near)}), so no correction is safe; write the one you mean"
          if near
          else "no hint is near it"
        )
        raise UnknownHintError(
          f"unknown hint {_shown(given)}: {why}. Valid hints: {valid}", given=given, valid=names, candidates=near
        )
      corrections.append(Correction(given, near[0]))
      hint = near[0]
    if hint in out:
      continue
    out.append(hint)
    if len(out) > MAX_HINTS:
      more = ", ..." if pos + 1 < len(raw) else ""
      raise TooManyHintsError(
        f"more than {MAX_HINTS} distinct hints given ({', '.join(out)}{more}); at most"
        f" {MAX_HINTS} are allowed, in priority order: keep the {MAX_HINTS} that matter most"
      )
  return HintResolution(tuple(out), tuple(corrections))

"""The host side of one generation call: its deltas, trace, completions and cancellation.

Every way of decoding (plain chunks or a host callback, self-speculative, a slot of continuous batching)
hands its tokens to the same objects: :class:`Rows` turns each row's new token ids into :class:`Delta` pieces
(incremental detokenising, stop strings, finish reasons), :class:`Trace` records what the call did and
when, and :class:`Generation` is what the caller iterates, cancels and closes. Nothing here runs device
work: a Generation pulls deltas from the runner it was given.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Iterator, Sequence

import numpy as np

from thoughtjax.errors import UserError
from thoughtjax.sampling import SamplingParams


class RequestError(UserError, ValueError):
  """A generation or scoring request this model cannot serve as given; the message says the fix."""


@dataclasses.dataclass
class Delta:
  """One streamed piece of a row's output."""

  row: int
  token_ids: list[int]
  text: str
  finished: bool = False
  finish_reason: str | None = None  # "stop", "length", "stop_string", "cancelled"


@dataclasses.dataclass
class Trace:
  """What one generation call did and when (``time.perf_counter`` seconds).

  Phases: queue (call -> first device call: prompt preparation, program lookup), compile
  (tracing, lowering and compiling this call had to do; 0 with a warm program), prefill (first
  device call -> first tokens on the host, less compile), decode (first -> last tokens).
  """

  program: Hashable  # the key of the program that ran (plain, speculative or slot)
  prompt_ids: list[list[int]]  # per row, as the program saw them (template parts included)
  start: float
  device_start: float | None = None
  first_token: float | None = None
  end: float | None = None
  compile_s: float = 0.0
  compile_misses: int = 0  # programs of compile_s compiled anew (not loaded from the persistent compilation cache)
  decode_chunks: int = 0  # decode calls run on the device (callback streaming: decode steps)
  tokens_out: list[int] = dataclasses.field(default_factory=list)  # per row
  cancelled: bool = False
  # Speculative decoding (draft=): tokens drafted, drafts accepted, verify passes (sums over rows).
  drafted: int = 0
  accepted: int = 0
  verify_passes: int = 0
  # A slot engine with a prefix cache: prompt tokens whose keys came from it (0: a miss); None: no cache looked.
  prefix_cache_tokens: int | None = None

  @property
  def tokens_in(self) -> list[int]:
    return [len(i) for i in self.prompt_ids]

  @property
  def queue_s(self) -> float | None:
    return None if self.device_start is None else self.device_start - self.start

  @property
  def prefill_s(self) -> float | None:
    if self.first_token is None or self.device_start is None:
      return None
    return self.first_token - self.device_start - self.compile_s

  @property
  def decode_s(self) -> float | None:
    return None if self.end is None or self.first_token is None else self.end - self.first_token

  def as_dict(self) -> dict:
    """The timings as a flat dict (``start``, ``first_token``, ``end``, ...; benchmarks, JSON)."""
    return {
      "start": self.start,
      "first_token": self.first_token,
      "end": self.end,
      "program": self.program,
      "prompt_ids": self.prompt_ids,
      "generated": list(self.tokens_out),
      "queue_s": self.queue_s,
      "compile_s": self.compile_s,
      "compile_misses": self.compile_misses,
      "prefill_s": self.prefill_s,
      "decode_s": self.decode_s,
      "decode_chunks": self.decode_chunks,
      "cancelled": self.cancelled,
      "drafted": self.drafted,
      "accepted": self.accepted,
      "verify_passes": self.verify_passes,
      "prefix_cache_tokens": self.prefix_cache_tokens,
    }


@dataclasses.dataclass
class Completion:
  prompt_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: str
  trace: Trace  # of the whole call (shared by the rows of a batch)

  @property
  def timings(self) -> dict:
    return self.trace.as_dict()


class RowText:
  """Incremental detokenization and stop-string detection for one row.

  Each push searches for stop strings only in what is new since the last push plus the ``len(stop) - 1``
  characters before it (a match wholly in the older text would have stopped the row), and finds the tail
  to hold back with a KMP automaton over at most ``len(stop) - 1`` characters: per chunk the work grows with
  the new text and the stop strings' total length, not with the whole text or a stop string's square."""

  def __init__(self, codec, stop_strings: Sequence[str]):
    self.codec, self.stop_strings = codec, tuple(s for s in stop_strings if s)
    self.ids: list[int] = []
    self.emitted = ""
    self.stopped = False
    self._searched = ""  # the text of the last push, searched whole (no stop string in it)
    self._fail: dict[int, list[int]] = {}  # stop string index -> its KMP failure table (made when first needed)

  def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
    self.ids.extend(new_ids)
    text = self.codec.decode(self.ids)
    # Decoding the longer id list may rewrite the end of the old text (a completed UTF-8 sequence
    # replaces its replacement characters): search from where the two first differ.
    prev = self._searched
    same = len(prev) if text.startswith(prev) else _common_prefix(prev, text)
    for s in self.stop_strings:
      at = text.find(s, max(0, same - len(s) + 1))
      if at >= 0:
        self.stopped = True
        text = text[:at]
        break
    self._searched = text
    # Hold back an incomplete UTF-8 sequence and any tail that may start a stop string.
    hold = 0
    if not (final or self.stopped):
      if text.endswith("\ufffd"):
        return "", False
      for i, s in enumerate(self.stop_strings):
        if len(s) > 1 and len(text) > hold:
          hold = max(hold, self._overlap(i, text[-(len(s) - 1) :]))
    visible = text[: len(text) - hold]
    delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else visible
    self.emitted = visible if visible.startswith(self.emitted) else self.emitted + delta
    return delta, self.stopped

  def _overlap(self, i: int, tail: str) -> int:
    """The length of the longest suffix of ``tail`` (shorter than stop string ``i``) that begins it."""
    s = self.stop_strings[i]
    first = tail.find(s[0])
    if first < 0:
      return 0
    fail = self._fail.get(i)
    if fail is None:
      fail = self._fail[i] = _kmp_failure(s)
    k = 0
    for ch in tail[first:]:
      while k and s[k] != ch:
        k = fail[k - 1]
      if s[k] == ch:
        k += 1
    return k


def _kmp_failure(s: str) -> list[int]:
  """``fail[j]``: the length of the longest proper prefix of ``s[: j + 1]`` that is also its suffix."""
  fail, k = [0] * len(s), 0
  for j in range(1, len(s)):
    while k and s[k] != s[j]:
      k = fail[k - 1]
    if s[k] == s[j]:
      k += 1
    fail[j] = k
  return fail


def _common_prefix(a: str, b: str) -> int:
  """The length of the common prefix of ``a`` and ``b`` (a binary search over C-speed comparisons)."""
  lo, hi = 0, min(len(a), len(b))
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if a[:mid] == b[:mid]:
      lo = mid
    else:
      hi = mid - 1
  return lo


class Rows:
  """Per-row bookkeeping of one call: detokenization, stop strings, finish reasons."""

  def __init__(self, codec, params: Sequence[SamplingParams], stops: Sequence[Sequence[int]]):
    self.params, self.stops = list(params), [list(s) for s in stops]
    self.text = [RowText(codec, p.stop_strings) for p in params]
    self.finished = [False] * len(params)
    self.counts = [0] * len(params)

  @property
  def all_finished(self) -> bool:
    return all(self.finished)

  def emit(self, r: int, new: list[int], done_on_device: bool, count: int) -> Delta | None:
    if self.finished[r]:
      return None
    self.counts[r] = count
    text, hit = self.text[r].push(new, done_on_device)
    if hit or done_on_device:
      self.finished[r] = True
      reason = (
        "stop_string"
        if hit
        else ("length" if count >= self.params[r].max_tokens and not (new and new[-1] in self.stops[r]) else "stop")
      )
      return Delta(r, new, text, True, reason)
    return Delta(r, new, text) if (new or text) else None

  def chunk(self, out: np.ndarray, done: np.ndarray, count: np.ndarray, seen: int, step: int) -> Iterator[Delta]:
    """Deltas of the tokens ``out[:, seen:step]`` one device call produced."""
    for r in range(len(self.finished)):
      d = self.emit(r, [int(t) for t in out[r, seen:step] if t >= 0], bool(done[r]), int(count[r]))
      if d is not None:
        yield d

  def cancel(self) -> Iterator[Delta]:
    """A last delta for every unfinished row, finish_reason ``cancelled``."""
    for r, done in enumerate(self.finished):
      if not done:
        self.finished[r] = True
        text, _ = self.text[r].push([], True)
        yield Delta(r, [], text, True, "cancelled")


class Generation:
  """One generation call: iterate for :class:`Delta`s as tokens are produced.

  ``trace`` holds its timings and sizes (filled in as it runs); ``cancel()`` (from any thread)
  ends it at the next chunk with finish_reason ``cancelled`` for unfinished rows; ``close()``
  (from the consuming thread; also run when the Generation is garbage-collected) abandons it:
  no further device work. One consumer iterates a Generation; the Model it came from serves
  any number of Generations at once.
  ``completions()`` runs it to the end and returns one :class:`Completion` per prompt.
  """

  def __init__(self, run: Iterator[Delta], trace: Trace, cancelled: threading.Event):
    # The runner must not refer back to this object, so dropping it finalizes the runner.
    self._run, self.trace, self._cancelled = run, trace, cancelled
    n = len(trace.prompt_ids)
    self._tokens: list[list[int]] = [[] for _ in range(n)]
    self._texts = [""] * n
    self._reasons = ["length"] * n

  def __iter__(self) -> Generation:
    return self

  def __next__(self) -> Delta:
    d = next(self._run)
    self._tokens[d.row].extend(d.token_ids)
    self._texts[d.row] += d.text
    if d.finished:
      self._reasons[d.row] = d.finish_reason
    return d

  def cancel(self) -> None:
    self._cancelled.set()

  def close(self) -> None:
    self._run.close()

  def __enter__(self) -> Generation:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def completions(self) -> list[Completion]:
    for _ in self:
      pass
    return [
      Completion(i, t, x, r, self.trace)
      for i, t, x, r in zip(self.trace.prompt_ids, self._tokens, self._texts, self._reasons, strict=True)
    ]

  def result(self) -> Completion:
    """The one completion of a single-prompt call."""
    if len(self._tokens) != 1:
      raise RequestError(
        f"result() gives the one completion of a single prompt, but this generation has "
        f"{len(self._tokens)} prompts; use completions() for a batch"
      )
    return self.completions()[0]

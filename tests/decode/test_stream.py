"""The host-side stop-string check searches only the new text (plus a stop string's length of history) and is
linear per chunk, with the same results as the former whole-text search: the same deltas, the same truncation,
the same held-back tail, for stop strings that span chunks and text rewritten by a completed UTF-8 sequence."""

from __future__ import annotations

import random

import pytest

from thoughtjax.decode.stream import RequestError, RowText


class WholeText:
  """The former check, kept as the reference: every push searches the whole text and tests each prefix of
  each stop string against its end."""

  def __init__(self, codec, stop_strings):
    self.codec, self.stop_strings = codec, tuple(s for s in stop_strings if s)
    self.ids, self.emitted, self.stopped = [], "", False

  def push(self, new_ids, final):
    self.ids.extend(new_ids)
    text = self.codec.decode(self.ids)
    for s in self.stop_strings:
      at = text.find(s)
      if at >= 0:
        self.stopped, text = True, text[:at]
        break
    hold = 0
    if not (final or self.stopped):
      if text.endswith("\ufffd"):
        return "", False
      for s in self.stop_strings:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
          if text.endswith(s[:n]):
            hold = max(hold, n)
            break
    visible = text[: len(text) - hold]
    delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else visible
    self.emitted = visible if visible.startswith(self.emitted) else self.emitted + delta
    return delta, self.stopped


class Codec:
  """Tokens 0-3 are the characters of "ab\\nc"; token 4 is the first byte of "é" (a replacement character
  until token 5, its second byte, follows: the decoded text's end is then rewritten)."""

  def __init__(self):
    self.decoded = 0  # characters decoded over the row's life

  def decode(self, ids):
    out = []
    for j, t in enumerate(ids):
      if t == 4:
        out.append("é" if j + 1 < len(ids) and ids[j + 1] == 5 else "\ufffd")
      elif t != 5:
        out.append("ab\nc"[t])
    self.decoded += len(out)
    return "".join(out)


def run(row, ids, cuts):
  out, at = [], 0
  for i, cut in enumerate([*cuts, len(ids)]):
    chunk, at = ids[at:cut], cut
    out.append(row.push(chunk, i == len(cuts)))
    if out[-1][1]:
      break
  return out


def test_a_stop_string_spanning_two_chunks_stops_where_the_whole_text_search_did():
  ids = [0, 1, 2, 0, 1, 3, 3, 0]  # "ab\nabcca"
  for stops in (["\nab"], ["bcc", "\na"], ["zz", "cca"], ["b\na"]):
    for cuts in ([2], [3], [4], [1, 5], [2, 3, 4, 5, 6, 7]):
      got, want = run(RowText(Codec(), stops), ids, cuts), run(WholeText(Codec(), stops), ids, cuts)
      assert got == want and got[-1][1], (stops, cuts, got, want)
  # the text before the stop string is all sent, the stop string and what follows never
  got = run(RowText(Codec(), ["\nab"]), ids, [2, 3])
  assert "".join(d for d, _ in got) == "ab" and got[-1] == ("", True)


def test_random_chunks_and_stop_sets_give_the_same_deltas_as_the_whole_text_search():
  rng = random.Random(0)
  for _ in range(3000):
    stops = ["".join(rng.choice("ab\né") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 4))]
    ids = [rng.randrange(6) for _ in range(rng.randint(1, 40))]
    cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(0, 8)))) if len(ids) > 1 else []
    assert run(RowText(Codec(), stops), ids, cuts) == run(WholeText(Codec(), stops), ids, cuts), (stops, ids, cuts)


def test_hundreds_of_long_stop_strings_cost_their_length_per_chunk_not_its_square():
  """64 stop strings of 2048 characters that never complete, over text that always looks like their start:
  the whole-text check sliced and compared ~130 million characters a chunk; the windowed automaton steps
  through at most each stop string's length."""
  stops = ["a" * 2047 + chr(0x100 + i) for i in range(64)]
  row = RowText(Codec(), stops)
  steps = []
  real = row._overlap

  def counted(i, tail):
    steps.append(len(tail))
    return real(i, tail)

  row._overlap = counted
  ids, sent = [0] * 6000, ""
  for start in range(0, len(ids), 500):
    delta, stopped = row.push(ids[start : start + 500], False)
    sent += delta
    assert not stopped and len(sent) == max(0, start + 500 - 2047)  # the last 2047 may start a stop string
  assert row._overlap(0, "a" * 2047) == 2047
  assert max(steps) <= 2047 and len(row._fail) == 64  # one table per stop string, made once
  delta, stopped = row.push([], True)
  assert sent + delta == "a" * 6000 and not stopped


def test_a_plain_one_prompt_request_offers_its_row_to_a_slot_engine():
  """A slot engine may run a plain one-prompt request (the server's continuous batching); a batch and a
  self-speculative request only run alone."""
  from tests.tiny import tiny_engine
  from thoughtjax.sampling import SamplingParams

  engine = tiny_engine("llama_gqa", seed=2)
  params = SamplingParams(max_tokens=4, ignore_eos=True)
  one = engine.request([[5, 6, 7]], params)
  ids, got = one.slot()
  assert one.model is engine and ids == (5, 6, 7) and got.max_tokens == 4
  assert engine.request([[5, 6, 7], [8, 9]], params).slot() is None
  assert engine.request([[5, 6, 7]], params, draft="ngram:2", draft_tokens=2).slot() is None


def test_a_request_runs_alone_or_in_a_slot_engine_with_the_same_tokens():
  """What ``Model.request`` checks is refused before any device work; the same request run alone
  (``RequestRun``, started by its first ``next()``) and in a slot engine (``run_in``) gives the same greedy
  tokens; a request cancelled or closed before it starts ends at once without running."""
  from tests.tiny import tiny_engine
  from thoughtjax.decode.request import RequestRun
  from thoughtjax.sampling import SamplingParams
  from thoughtjax.serving import SlotEngine

  engine = tiny_engine("llama_gqa", seed=2)
  params = SamplingParams(max_tokens=6, ignore_eos=True)
  with pytest.raises(RequestError, match="outside the vocabulary"):
    engine.request([[5, 10**6]], params)
  alone = RequestRun(engine.request([[5, 6, 7]], params))
  assert alone.generation is None  # nothing runs until it is started
  tokens = [t for d in alone for t in d.token_ids]
  assert len(tokens) == 6 and alone.generation.trace.tokens_out == [6]

  slots = SlotEngine(engine, 2, cache_len=64)
  pooled = RequestRun(engine.request([[5, 6, 7]], params))
  pooled.run_in(slots.insert(*pooled.request.slot()))
  while slots.active:
    slots.step()
  assert [t for d in pooled for t in d.token_ids] == tokens
  with pytest.raises(RuntimeError, match="already runs"):
    pooled.run_in(slots.insert(*pooled.request.slot()))

  cancelled = RequestRun(engine.request([[5, 6, 7]], params))
  cancelled.cancel()
  deltas = list(cancelled)
  assert [d.finish_reason for d in deltas] == ["cancelled"] and not any(d.token_ids for d in deltas)
  closed = RequestRun(engine.request([[5, 6, 7]], params))
  closed.close()
  assert list(closed) == [] and closed.generation is None

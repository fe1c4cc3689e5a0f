"""Hints: normalization, unambiguous correction, at most three; property tests over random strings and
plain tests for each error and its message."""

from __future__ import annotations

import itertools
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from thoughtjax.errors import UserError
from thoughtjax.synthesis.dictionary import load_dictionary
from thoughtjax.synthesis.hints import (
  MAX_HINTS,
  Correction,
  EmptyHintError,
  HintError,
  TooManyHintsError,
  UnknownHintError,
  correction_bound,
  edit_distance,
  near_entries,
  normalize,
  normalize_hints,
)

REPO = Path(__file__).resolve().parents[2]
DICT = load_dictionary(REPO / "registry" / "synthesis_dict.yaml")
NAMES = DICT.names
ALPHABET = string.ascii_lowercase + string.digits + "_"
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _reference_distance(a: str, b: str) -> int:
  """Optimal string alignment by the textbook full table (independent of the two-row version)."""
  d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
  for i in range(len(a) + 1):
    d[i][0] = i
  for j in range(len(b) + 1):
    d[0][j] = j
  for i in range(1, len(a) + 1):
    for j in range(1, len(b) + 1):
      cost = a[i - 1] != b[j - 1]
      d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
        d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
  return d[-1][-1]


# --- the distance -------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "a, b, want",
  [
    ("", "", 0),
    ("abc", "", 3),
    ("", "ab", 2),
    ("kitten", "sitting", 3),
    ("flaw", "lawn", 2),
    ("ab", "ba", 1),
    ("abcd", "acbd", 1),
    ("ca", "abc", 3),  # OSA, not unrestricted Damerau (2)
    ("legal_analysis", "legal_anlaysis", 1),
    ("fast_draft", "fsat_drfat", 2),
  ],
)
def test_edit_distance_known_values(a, b, want):
  assert edit_distance(a, b) == want == edit_distance(b, a)


@PROPS
@given(st.text(ALPHABET[:5], max_size=9), st.text(ALPHABET[:5], max_size=9))
def test_edit_distance_matches_the_reference(a, b):
  assert edit_distance(a, b) == _reference_distance(a, b)


def test_correction_bound_is_two_and_at_most_a_third():
  assert [correction_bound("x" * n) for n in (2, 3, 5, 6, 15)] == [0, 1, 1, 2, 2]
  assert all(correction_bound(n) == 2 for n in NAMES)


# --- properties over random strings -------------------------------------------------------------


def _decorate(name: str, data) -> str:
  """The same hint as a person might type it: any case, spaces or hyphens for '_', padding."""
  parts = name.split("_")
  seps = [data.draw(st.sampled_from(["_", " ", "-", " - ", "__"])) for _ in parts[1:]]
  text = parts[0] + "".join(s + p for s, p in zip(seps, parts[1:]))
  text = "".join(c.upper() if data.draw(st.booleans()) else c for c in text)
  return data.draw(st.sampled_from(["", " ", "\t"])) + text + data.draw(st.sampled_from(["", "  ", "\n"]))


@PROPS
@given(st.text(max_size=30))
def test_normalize_is_idempotent(s):
  once = normalize(s)
  assert normalize(once) == once
  assert once == once.strip("_") and "__" not in once and " " not in once and "-" not in once


@PROPS
@given(st.data())
def test_valid_hints_keep_their_order_and_normalize_idempotently(data):
  chosen = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=6))
  raw = [_decorate(n, data) for n in chosen]
  distinct = list(dict.fromkeys(chosen))
  if len(distinct) > MAX_HINTS:
    with pytest.raises(TooManyHintsError):
      normalize_hints(raw, DICT)
    return
  res = normalize_hints(raw, DICT)
  assert res.hints == tuple(distinct)  # priority order, first occurrence kept
  assert res.corrections == ()  # case, spaces and hyphens are normalization, not correction
  again = normalize_hints(list(res.hints), DICT)
  assert again.hints == res.hints and again.corrections == ()


_EDITS = ("substitute", "delete", "insert", "transpose")


def _typo(name: str, data) -> str:
  edit = data.draw(st.sampled_from(_EDITS))
  i = data.draw(st.integers(0, len(name) - (2 if edit == "transpose" else 1)))
  c = data.draw(st.sampled_from(ALPHABET))
  if edit == "substitute":
    return name[:i] + c + name[i + 1 :]
  if edit == "delete":
    return name[:i] + name[i + 1 :]
  if edit == "insert":
    return name[:i] + c + name[i:]
  return name[:i] + name[i + 1] + name[i] + name[i + 2 :]


@PROPS
@given(st.data())
def test_single_typo_is_corrected_to_its_hint(data):
  name = data.draw(st.sampled_from(NAMES))
  typo = _typo(name, data)
  typed = normalize(typo)
  if typed in NAMES:  # e.g. a transposition of two equal letters
    assert normalize_hints([typo], DICT).hints == (typed,)
    return
  others = [n for n in NAMES if n != name and edit_distance(typed, n) <= correction_bound(n)]
  if others:  # another hint is as close: no safe correction
    with pytest.raises(UnknownHintError) as info:
      normalize_hints([typo], DICT)
    assert set(info.value.candidates) == {name, *others}
    return
  res = normalize_hints([typo], DICT)
  assert res.hints == (name,)
  assert res.corrections == (Correction(typo, name),)


def _six_typo_pairs():
  # In the shipped dictionary no single typo reaches two hints: the property above always corrects.
  return [(a, b, edit_distance(a, b)) for a, b in itertools.combinations(NAMES, 2)]


def test_shipped_hints_are_far_apart():
  assert min(d for _, _, d in _six_typo_pairs()) > 2 * max(correction_bound(n) for n in NAMES)


@PROPS
@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=5))
def test_random_garbage_is_corrected_within_the_bound_or_refused_with_the_list(raw):
  try:
    res = normalize_hints(raw, DICT)
  except UnknownHintError as e:
    msg = str(e)
    assert all(n in msg for n in NAMES), msg
    assert e.valid == NAMES and repr(e.given) in msg
    return
  except EmptyHintError as e:
    assert any(not normalize(r) for r in raw)
    assert "is empty" in str(e) and all(n in str(e) for n in NAMES)
    return
  except TooManyHintsError:
    return
  assert len(res.hints) <= MAX_HINTS
  assert len(set(res.hints)) == len(res.hints)
  assert all(h in NAMES for h in res.hints)
  for c in res.corrections:
    assert c.given in raw and c.corrected in NAMES
    assert edit_distance(normalize(c.given), c.corrected) <= correction_bound(c.corrected)
    assert normalize(c.given) not in NAMES
  # Every input is accounted for: exact after normalization, or corrected.
  corrected = {c.given for c in res.corrections}
  assert all(normalize(r) in NAMES or r in corrected for r in raw)


@PROPS
@given(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8))
def test_result_never_exceeds_three(chosen):
  try:
    res = normalize_hints(chosen, DICT)
  except TooManyHintsError:
    assert len(set(chosen)) > MAX_HINTS
  else:
    assert len(res.hints) <= MAX_HINTS and len(set(chosen)) <= MAX_HINTS


@PROPS
@given(st.data())
def test_random_dictionary_typos(data):
  """The same rule on random dictionaries, where entries may be close to each other."""
  names = tuple(
    data.draw(
      st.lists(
        st.text(ALPHABET[:4], min_size=3, max_size=8).map(normalize).filter(bool), min_size=1, max_size=6, unique=True
      )
    )
  )
  name = data.draw(st.sampled_from(names))
  typo = normalize(_typo(name, data))
  assume(typo and typo not in names)
  near = [n for n in names if edit_distance(typo, n) <= correction_bound(n)]
  if near == [name]:
    assert normalize_hints([typo], names).hints == (name,)
  else:
    with pytest.raises(UnknownHintError):
      normalize_hints([typo], names)


# --- each error, with its message ---------------------------------------------------------------


def test_correction_is_reported_and_duplicates_collapse_after_it():
  res = normalize_hints(["Legal Analysis", "legal_anlaysis", " code-generation", "fast_drfat"], DICT)
  assert res.hints == ("legal_analysis", "code_generation", "fast_draft")
  assert res.corrections == (Correction("legal_anlaysis", "legal_analysis"), Correction("fast_drfat", "fast_draft"))


def test_unknown_hint_lists_every_valid_hint():
  with pytest.raises(UnknownHintError) as info:
    normalize_hints(["general_purpose", "poetry"], DICT)
  msg = str(info.value)
  assert "unknown hint 'poetry': no hint is near it. Valid hints: " + ", ".join(NAMES) == msg
  assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
  assert info.value.candidates == ()


def test_ambiguous_hint_names_the_near_candidates():
  names = ("code_review", "code_reviews", "legal")
  with pytest.raises(UnknownHintError) as info:
    normalize_hints(["code_revie"], names)
  msg = str(info.value)
  assert "near 2 hints (code_review, code_reviews)" in msg and "write the one you mean" in msg
  assert "Valid hints: code_review, code_reviews, legal" in msg
  assert near_entries("code_revie", names) == ("code_review", "code_reviews")


def test_too_far_is_not_corrected():
  with pytest.raises(UnknownHintError, match="no hint is near it"):
    normalize_hints(["fst_drf"], DICT)  # 3 edits from fast_draft


def test_more_than_three_hints():
  raw = ["general_purpose", "fast_draft", "code_generation", "legal_analysis", "structured_output"]
  with pytest.raises(TooManyHintsError) as info:
    normalize_hints(raw, DICT)
  msg = str(info.value)
  assert msg == (
    "more than 3 distinct hints given (general_purpose, fast_draft, code_generation, legal_analysis, "
    "...); at most 3 are allowed, in priority order: keep the 3 that matter most"
  )
  # Duplicates (also after correction) do not count.
  assert len(normalize_hints(raw[:3] + ["FAST DRAFT", "genral_purpose"], DICT).hints) == 3


@pytest.mark.parametrize("blank", ["", "   ", "-", " _ - ", "\n"])
def test_empty_hint_is_rejected(blank):
  with pytest.raises(EmptyHintError) as info:
    normalize_hints(["code_generation", blank], DICT)
  assert str(info.value).startswith(f"hint 1 is empty ({blank!r}); give a hint name or leave the hint out.")


def test_a_single_string_or_a_non_string_is_refused():
  with pytest.raises(
    HintError, match=r"got the single string 'code_generation'; pass a list such as \['code_generation'\]"
  ):
    normalize_hints("code_generation", DICT)
  with pytest.raises(HintError, match="hint 0 must be a string, got int 3"):
    normalize_hints([3], DICT)


def test_no_hints_is_an_empty_resolution():
  res = normalize_hints([], DICT)
  assert res.hints == () and res.corrections == ()


def test_long_input_is_cut_in_the_message_and_any_iterable_is_taken():
  with pytest.raises(UnknownHintError) as info:
    normalize_hints(iter(["code_generation", "x" * 5000]), DICT)
  msg = str(info.value)
  assert len(msg) < 400 and "(5000 characters)" in msg and msg.endswith(", ".join(NAMES))
  assert normalize_hints(iter(["fast draft", "Fast-Draft"]), DICT).hints == ("fast_draft",)

"""The router's labeled prompts: enough per hint and split, labels from the dictionary, splits disjoint
(no exact or near copies across them), and every malformed line refused with its file and line."""

from __future__ import annotations

import collections
import itertools
import json
import re
from pathlib import Path

import pytest

from thoughtjax.synthesis.dictionary import load_dictionary
from thoughtjax.synthesis.router_data import (
  ROUTER_SPLITS,
  RouterDataError,
  default_router_prompts_dir,
  load_router_prompts,
)

REPO = Path(__file__).resolve().parents[2]
DICT = load_dictionary(REPO / "registry" / "synthesis_dict.yaml")


@pytest.fixture(scope="module")
def splits():
  return {s: load_router_prompts(s, dictionary=DICT) for s in ROUTER_SPLITS}


def _words(text: str) -> set[str]:
  return set(re.findall(r"[a-z0-9]+", text.lower()))


def test_default_directory_is_the_checkouts():
  assert default_router_prompts_dir().resolve() == REPO / "registry" / "router_prompts"


def test_counts_per_hint_and_split(splits):
  counts = {s: collections.Counter(p.hint for p in rows) for s, rows in splits.items()}
  assert set(counts["train"]) == set(counts["heldout"]) == set(DICT.names)
  for hint in DICT.names:
    assert counts["train"][hint] + counts["heldout"][hint] >= 100, hint
    assert counts["train"][hint] >= 80 and counts["heldout"][hint] >= 20, (hint, counts)


def test_no_duplicates_and_no_near_copies_across_splits(splits):
  everything = [p.prompt.strip().lower() for rows in splits.values() for p in rows]
  assert len(everything) == len(set(everything))
  train = [(p, _words(p.prompt)) for p in splits["train"]]
  for held in splits["heldout"]:
    hw = _words(held.prompt)
    for p, pw in train:
      jaccard = len(hw & pw) / len(hw | pw)
      assert jaccard < 0.6, (held.prompt, p.prompt, jaccard)


def test_prompts_vary_in_length(splits):
  for hint in DICT.names:
    lengths = [len(p.prompt.split()) for rows in splits.values() for p in rows if p.hint == hint]
    assert min(lengths) <= 10 and max(lengths) >= 20, (hint, min(lengths), max(lengths))


def test_no_prompt_repeats_another_hints_prompt(splits):
  by_hint = collections.defaultdict(list)
  for rows in splits.values():
    for p in rows:
      by_hint[p.hint].append(_words(p.prompt))
  for a, b in itertools.combinations(DICT.names, 2):
    for wa in by_hint[a]:
      assert all(len(wa & wb) / len(wa | wb) < 0.6 for wb in by_hint[b]), (a, b, wa)


def _dir_with(tmp_path: Path, lines: list[str]) -> Path:
  (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
  return tmp_path


GOOD = json.dumps({"prompt": "Compare tea and coffee.", "hint": "comparative_reasoning"})


@pytest.mark.parametrize(
  "bad, pieces",
  [
    ("{not json", ["train.jsonl:2: not a JSON object"]),
    (
      json.dumps({"prompt": "Write a poem.", "hint": "poetry"}),
      ["train.jsonl:2: hint 'poetry' is not in the synthesis dictionary", "valid hints: general_purpose"],
    ),
    (
      json.dumps({"prompt": "x", "hint": "fast_draft", "split": "train"}),
      ["train.jsonl:2: expected exactly the keys ['hint', 'prompt'], got ['hint', 'prompt', 'split']"],
    ),
    (json.dumps({"prompt": "  ", "hint": "fast_draft"}), ["train.jsonl:2: prompt must be a non-empty string"]),
    (json.dumps(["Write code", "code_generation"]), ["train.jsonl:2: expected exactly the keys", "got list"]),
  ],
)
def test_bad_line_names_file_and_line(tmp_path, bad, pieces):
  d = _dir_with(tmp_path, [GOOD, bad])
  with pytest.raises(RouterDataError) as info:
    load_router_prompts("train", d, dictionary=DICT)
  for piece in pieces:
    assert piece in str(info.value), str(info.value)


def test_good_file_and_missing_file_and_bad_split(tmp_path):
  d = _dir_with(tmp_path, [GOOD, "", GOOD.replace("tea", "milk")])
  rows = load_router_prompts("train", d, dictionary=DICT)
  assert [(r.hint, r.line) for r in rows] == [("comparative_reasoning", 1), ("comparative_reasoning", 3)]
  with pytest.raises(RouterDataError, match="heldout.jsonl: no such file"):
    load_router_prompts("heldout", d, dictionary=DICT)
  with pytest.raises(RouterDataError, match="split must be one of train, heldout, got 'test'"):
    load_router_prompts("test", d, dictionary=DICT)

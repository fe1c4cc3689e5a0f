"""synthesis_dict.yaml: the shipped dictionary and corpora are valid and hashed; each kind of bad
dictionary is rejected with the file, the line and the hint named; a changed corpus is refused."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from thoughtjax.errors import UserError
from thoughtjax.synthesis.dictionary import (
  DOC_SEPARATOR,
  DictionaryError,
  default_dictionary_path,
  load_dictionary,
  split_documents,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "registry" / "synthesis_dict.yaml"
REQUIRED = (
  "general_purpose",
  "fast_draft",
  "code_generation",
  "structured_output",
  "legal_analysis",
  "comparative_reasoning",
)


@pytest.fixture(scope="module")
def shipped():
  return load_dictionary(SHIPPED)


def test_shipped_dictionary_has_the_required_hints(shipped):
  assert set(REQUIRED) <= set(shipped.names)
  assert len(set(shipped.names)) == len(shipped.names)
  for h in shipped:
    assert h.description and "\n" not in h.description
    assert h.source.kind in ("written_for_project", "public_domain")
    assert h.source.kind != "public_domain" or h.source.work


def test_floors_order_fast_draft_loose_general_between_legal_strict(shipped):
  fast, general, legal = (
    shipped["fast_draft"].floors,
    shipped["general_purpose"].floors,
    shipped["legal_analysis"].floors,
  )
  assert fast.top1_agreement < general.top1_agreement < legal.top1_agreement
  assert fast.mean_kl > general.mean_kl > legal.mean_kl
  for h in shipped:
    assert 0 <= h.floors.top1_agreement <= 1 and h.floors.mean_kl >= 0
  assert legal.met_by(top1_agreement=1.0, mean_kl=0.0, delta_nll=0.0)
  assert not legal.met_by(top1_agreement=0.97, mean_kl=0.0, delta_nll=0.0)
  assert not legal.met_by(top1_agreement=1.0, mean_kl=0.0)  # a ΔNLL floor needs a measured ΔNLL
  assert fast.met_by(top1_agreement=0.8, mean_kl=0.3)


def test_shipped_corpora_are_large_disjoint_and_hashed(shipped):
  for h in shipped:
    cal, held = h.documents("calibration"), h.documents("heldout")
    words = {split: sum(len(d.split()) for d in docs) for split, docs in (("calibration", cal), ("heldout", held))}
    least = 2000 if h.name == "general_purpose" else 1500
    assert min(words.values()) >= least, (h.name, words)
    assert len(cal) >= 15 and len(held) >= 15, h.name
    assert not set(cal) & set(held), f"{h.name}: a document is in both splits"
    # No shared paragraph either: the held-out split must be other text.
    paras = lambda docs: {p.strip() for d in docs for p in d.split("\n\n") if len(p.split()) >= 8}
    assert not paras(cal) & paras(held), h.name
    for split in ("calibration", "heldout"):
      path = h.corpus.path(split)
      assert path.is_relative_to(REPO / "registry" / "evals")
      assert hashlib.sha3_256(path.read_bytes()).hexdigest() == h.corpus.sha3_256(split)
      path.read_bytes().decode("utf-8")


def test_default_path_is_the_checkouts_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert default_dictionary_path().resolve() == SHIPPED
  assert load_dictionary().names == load_dictionary(SHIPPED).names


def test_split_documents():
  text = (
    f"first\nline\n{DOC_SEPARATOR}\n\n{DOC_SEPARATOR}\n  {DOC_SEPARATOR}  \nsecond\n\n  indented\n{DOC_SEPARATOR}\n"
  )
  assert split_documents(text) == ["first\nline", "second\n\n  indented"]
  assert split_documents("") == []
  assert split_documents("just one") == ["just one"]


# A small valid dictionary in a temporary folder, edited by each bad case.
def _write_corpus(root: Path, rel: str, docs: list[str]) -> str:
  path = root / rel
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(f"{DOC_SEPARATOR}\n{d}\n" for d in docs), encoding="utf-8")
  return hashlib.sha3_256(path.read_bytes()).hexdigest()


def _good(root: Path) -> str:
  h = {}
  for hint in ("alpha", "beta_two"):
    for split in ("calibration", "heldout"):
      h[hint, split] = _write_corpus(
        root, f"evals/{hint}/{split}.txt", [f"{hint} {split} document {i}." for i in range(3)]
      )
  return f"""format: 1
hints:
  - name: alpha
    description: the first hint
    source: {{kind: written_for_project}}
    floors: {{top1_agreement: 0.9, mean_kl: 0.1, delta_nll: 0.05}}
    corpus:
      calibration: {{path: evals/alpha/calibration.txt, sha3_256: {h['alpha', 'calibration']}}}
      heldout: {{path: evals/alpha/heldout.txt, sha3_256: {h['alpha', 'heldout']}}}
  - name: beta_two
    description: the second hint
    source: {{kind: public_domain, work: "Pride and Prejudice, Jane Austen (1813)"}}
    floors:
      top1_agreement: 0.75
      mean_kl: 0.5
    corpus:
      calibration: {{path: evals/beta_two/calibration.txt, sha3_256: {h['beta_two', 'calibration']}}}
      heldout: {{path: evals/beta_two/heldout.txt, sha3_256: {h['beta_two', 'heldout']}}}
"""


def test_good_dictionary_loads(tmp_path):
  path = tmp_path / "dict.yaml"
  path.write_text(_good(tmp_path))
  d = load_dictionary(path)
  assert d.names == ("alpha", "beta_two")
  assert d["beta_two"].floors.delta_nll is None and d["alpha"].floors.delta_nll == 0.05
  assert d["beta_two"].source.work.startswith("Pride and Prejudice")
  assert d["alpha"].documents("heldout") == [f"alpha heldout document {i}." for i in range(3)]
  assert d["alpha"].line == 3 and d["beta_two"].line == 10
  with pytest.raises(KeyError, match="alpha, beta_two"):
    d["gamma"]


def _line_of(text: str, needle: str, occurrence: int = 1) -> int:
  return [i + 1 for i, line in enumerate(text.splitlines()) if needle in line][occurrence - 1]


def _hash_case(text: str, root: Path) -> str:
  (root / "evals/alpha/heldout.txt").write_text(f"{DOC_SEPARATOR}\nchanged\n")
  return text


# case: (edit of the good text (and folder), pieces the message must contain, line locator)
CASES = {
  "unknown_top_key": (
    lambda t, r: t.replace("format: 1", "format: 1\nhint: []"),
    ["unknown top-level key 'hint'"],
    "hint: []",
  ),
  "unknown_hint_key": (
    lambda t, r: t.replace("    description: the first hint", "    descripton: typo"),
    ["hint 0 (alpha)", "unknown key 'descripton'"],
    "descripton",
  ),
  "missing_field": (
    lambda t, r: t.replace("    description: the second hint\n", ""),
    ["hint 1 (beta_two)", "missing field 'description'"],
    "name: beta_two",
  ),
  "unknown_floor": (
    lambda t, r: t.replace("mean_kl: 0.5", "mean_kl: 0.5\n      top5_agreement: 0.9"),
    ["hint 1 (beta_two)", "unknown key 'floors.top5_agreement'"],
    "top5_agreement",
  ),
  "missing_floor": (
    lambda t, r: t.replace("      mean_kl: 0.5\n", ""),
    ["hint 1 (beta_two)", "'floors' is missing 'mean_kl'"],
    ("    floors:", 2),
  ),
  "agreement_above_one": (
    lambda t, r: t.replace("top1_agreement: 0.75", "top1_agreement: 75"),
    ["hint 1 (beta_two)", "floors.top1_agreement", "in [0, 1]; got 75"],
    "top1_agreement: 75",
  ),
  "negative_kl": (
    lambda t, r: t.replace("mean_kl: 0.5", "mean_kl: -0.5"),
    ["floors.mean_kl", "must be >= 0; got -0.5"],
    "mean_kl: -0.5",
  ),
  "nan_delta_nll": (
    lambda t, r: t.replace("delta_nll: 0.05", "delta_nll: .nan"),
    ["hint 0 (alpha)", "floors.delta_nll must be a finite number"],
    "delta_nll",
  ),
  "string_floor": (
    lambda t, r: t.replace("mean_kl: 0.1", "mean_kl: low"),
    ["floors.mean_kl must be a finite number, got 'low'"],
    "mean_kl: low",
  ),
  "duplicate": (
    lambda t, r: t.replace("name: beta_two", "name: alpha"),
    ["hint 1 (alpha)", "already used by hint 0 (line 3)"],
    ("name: alpha", 2),
  ),
  "not_normalized": (
    lambda t, r: t.replace("name: beta_two", "name: Beta-Two"),
    ["hint 1 (Beta-Two)", "normalized form", "'code_generation'"],
    "name: Beta-Two",
  ),
  "hash_mismatch": (
    _hash_case,
    ["hint 0 (alpha)", "evals/alpha/heldout.txt has sha3-256", "set corpus.heldout.sha3_256 to"],
    "path: evals/alpha/heldout.txt",
  ),
  "missing_hash": (
    lambda t, r: t.replace("heldout.txt, sha3_256: ", "heldout.txt, sha3: ", 1),
    ["unknown key 'corpus.heldout.sha3'"],
    "sha3: ",
  ),
  "missing_file": (
    lambda t, r: t.replace("evals/beta_two/calibration.txt", "evals/beta_two/calib.txt"),
    ["hint 1 (beta_two)", "calib.txt does not exist"],
    "calib.txt",
  ),
  "escaping_path": (
    lambda t, r: t.replace("evals/beta_two/heldout.txt", "../outside.txt"),
    ["corpus.heldout.path '../outside.txt' leaves the dictionary's folder"],
    "../outside.txt",
  ),
  "same_split_file": (
    lambda t, r: t.replace("evals/alpha/heldout.txt", "evals/alpha/calibration.txt").replace(
      t.split("evals/alpha/heldout.txt, sha3_256: ")[1][:64], t.split("evals/alpha/calibration.txt, sha3_256: ")[1][:64]
    ),
    ["hint 0 (alpha)", "hold the same text"],
    "    corpus:",
  ),
  "public_domain_unnamed": (
    lambda t, r: t.replace(', work: "Pride and Prejudice, Jane Austen (1813)"', ""),
    ["hint 1 (beta_two)", "must name the work"],
    "kind: public_domain",
  ),
  "unknown_source_kind": (
    lambda t, r: t.replace("kind: written_for_project", "kind: scraped"),
    ["hint 0 (alpha)", "source.kind must be one of written_for_project, public_domain"],
    "kind: scraped",
  ),
  "two_line_description": (
    lambda t, r: t.replace("description: the first hint", "description: |\n      one\n      two"),
    ["description must be one non-empty line"],
    "description: |",
  ),
  "empty_hints": (lambda t, r: "format: 1\nhints: []\n", ["'hints' must be a non-empty list"], "hints: []"),
  "bad_format": (lambda t, r: t.replace("format: 1", "format: 2"), ["format 2 is not supported"], "format: 2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_dictionary_names_file_line_and_hint(case, tmp_path):
  edit, pieces, locator = CASES[case]
  text = edit(_good(tmp_path), tmp_path)
  path = tmp_path / "dict.yaml"
  path.write_text(text)
  needle, occ = locator if isinstance(locator, tuple) else (locator, 1)
  line = _line_of(text, needle, occ)
  with pytest.raises(DictionaryError) as info:
    load_dictionary(path)
  msg = str(info.value)
  assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
  assert msg.startswith(f"{path}:{line}: "), msg
  assert info.value.line == line
  for piece in pieces:
    assert piece in msg, msg


def test_hash_mismatch_message_gives_the_actual_hash(tmp_path):
  path = tmp_path / "dict.yaml"
  path.write_text(_good(tmp_path))
  corpus = tmp_path / "evals/beta_two/calibration.txt"
  corpus.write_bytes(corpus.read_bytes() + b"one more line\n")
  actual = hashlib.sha3_256(corpus.read_bytes()).hexdigest()
  with pytest.raises(DictionaryError, match=f"set corpus.calibration.sha3_256 to {actual}"):
    load_dictionary(path)


def test_corpus_changed_after_load_is_refused_on_read(tmp_path):
  path = tmp_path / "dict.yaml"
  path.write_text(_good(tmp_path))
  d = load_dictionary(path)
  corpus = tmp_path / "evals/alpha/calibration.txt"
  corpus.write_text(corpus.read_text().replace("document 1", "document one"))
  with pytest.raises(DictionaryError, match="changed since the dictionary was loaded") as info:
    d["alpha"].documents("calibration")
  assert str(corpus) in str(info.value)
  assert d["alpha"].documents("heldout")  # the untouched split still reads


def test_shipped_corpus_tamper_is_refused(tmp_path):
  """A copy of the shipped registry folder with one flipped byte in one corpus does not load."""
  shutil.copytree(REPO / "registry" / "evals", tmp_path / "evals")
  shutil.copy(SHIPPED, tmp_path / "synthesis_dict.yaml")
  target = tmp_path / "evals/legal_analysis/heldout.txt"
  data = bytearray(target.read_bytes())
  data[len(data) // 2] ^= 0x20
  target.write_bytes(bytes(data))
  with pytest.raises(DictionaryError, match=r"legal_analysis\).*evals/legal_analysis/heldout.txt has sha3-256"):
    load_dictionary(tmp_path / "synthesis_dict.yaml")


def test_invalid_yaml_and_missing_file(tmp_path):
  with pytest.raises(DictionaryError, match=r"^bad.yaml:\d+: not valid YAML"):
    load_dictionary("bad.yaml", text="hints:\n  - name: a\n    description: a: b\n")
  with pytest.raises(DictionaryError, match="no such file"):
    load_dictionary(tmp_path / "absent.yaml")


def test_non_utf8_corpus_is_rejected(tmp_path):
  text = _good(tmp_path)
  corpus = tmp_path / "evals/alpha/calibration.txt"
  corpus.write_bytes(b"\xff\xfe not utf-8")
  digest = hashlib.sha3_256(corpus.read_bytes()).hexdigest()
  old = text.split("evals/alpha/calibration.txt, sha3_256: ")[1][:64]
  path = tmp_path / "dict.yaml"
  path.write_text(text.replace(old, digest))
  with pytest.raises(DictionaryError, match="is not UTF-8 text"):
    load_dictionary(path)


@pytest.mark.slow
def test_corpora_give_enough_positions_and_fit_the_default_model(shipped, default_model):
  """Calibration measures next-token agreement per position: every split must give a few thousand
  positions on the default model's tokenizer, and every document must fit its context."""
  codec, max_context = default_model.codec, default_model.config.max_context
  for h in shipped:
    for split in ("calibration", "heldout"):
      lengths = [len(codec.encode(d)) for d in h.documents(split)]
      assert sum(lengths) >= 2000, (h.name, split, sum(lengths))
      assert max(lengths) <= max_context, (h.name, split, max(lengths), max_context)
      assert min(lengths) >= 16, (h.name, split, min(lengths))  # a document gives real context

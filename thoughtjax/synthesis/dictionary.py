"""``synthesis_dict.yaml``: the hints a request may name, their evaluation corpora and quality floors.

Format (``registry/synthesis_dict.yaml`` is the shipped one)::

    format: 1
    hints:
      - name: general_purpose              # normalized form: [a-z0-9_]+, unique
        description: one line
        source: {kind: written_for_project}    # or {kind: public_domain, work: "Title, Author (year)"}
        floors: {top1_agreement: 0.90, mean_kl: 0.10, delta_nll: 0.10}   # delta_nll optional
        corpus:
          calibration: {path: evals/general_purpose/calibration.txt, sha3_256: <64 hex>}
          heldout: {path: evals/general_purpose/heldout.txt, sha3_256: <64 hex>}

Floors bound a candidate path against the full path on the hint's corpus: ``top1_agreement`` is
the least fraction (0..1) of positions whose next-token argmax agrees, ``mean_kl`` the largest mean
KL(full || candidate) in nats per token, ``delta_nll`` the largest rise in mean NLL (nats/token).

Corpus paths are relative to the dictionary's folder and must stay inside it. A corpus file is
plain UTF-8: documents separated by a line that is exactly ``%%% document %%%`` (text before the
first separator is a document too; blank documents are dropped). Every file's SHA3-256 is checked
on load and again on every read, so calibration never measures text the dictionary did not name.
Every error names the file, the line and the entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml

from thoughtjax import yamlnodes
from thoughtjax.errors import UserError
from thoughtjax.shipped import shipped_file

DOC_SEPARATOR = "%%% document %%%"
SPLITS = ("calibration", "heldout")
Split = Literal["calibration", "heldout"]
SOURCE_KINDS = ("written_for_project", "public_domain")
NAME_RE = re.compile(r"[a-z0-9_]+")

_TOP_KEYS = {"format", "hints"}
_HINT_KEYS = {"name", "description", "source", "floors", "corpus"}
_SOURCE_KEYS = {"kind", "work", "note"}
_FLOOR_KEYS = {"top1_agreement", "mean_kl", "delta_nll"}
_REQUIRED_FLOORS = ("top1_agreement", "mean_kl")
_SPLIT_KEYS = {"path", "sha3_256"}


class DictionaryError(UserError, ValueError):
  """A synthesis dictionary or one of its corpora is invalid; names the file, line and entry."""

  def __init__(self, message: str, *, source: str, line: int | None, entry: int | None = None, name: str | None = None):
    where = f"{source}:{line}" if line is not None else source
    who = "" if entry is None else f"hint {entry}" + (f" ({name})" if name else "") + ": "
    super().__init__(f"{where}: {who}{message}")
    self.source, self.line, self.entry, self.name = source, line, entry, name


@dataclasses.dataclass(frozen=True)
class Floors:
  """Quality a path must reach against the full path: agreement at least, KL and ΔNLL at most."""

  top1_agreement: float
  mean_kl: float
  delta_nll: float | None = None

  def met_by(self, *, top1_agreement: float, mean_kl: float, delta_nll: float | None = None) -> bool:
    """Whether measured quality meets every floor (a floor on ΔNLL needs a measured ΔNLL)."""
    if top1_agreement < self.top1_agreement or mean_kl > self.mean_kl:
      return False
    return self.delta_nll is None or (delta_nll is not None and delta_nll <= self.delta_nll)


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a corpus's text comes from: written for the project, or a named public-domain work."""

  kind: Literal["written_for_project", "public_domain"]
  work: str | None = None
  note: str | None = None


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A hint's evaluation text: a calibration split (to choose paths) and a held-out split (to check
  that a floor generalizes). Paths are absolute; hashes are the recorded SHA3-256 hex digests."""

  calibration: Path
  heldout: Path
  calibration_sha3_256: str
  heldout_sha3_256: str

  def path(self, split: Split) -> Path:
    _check_split(split)
    return self.calibration if split == "calibration" else self.heldout

  def sha3_256(self, split: Split) -> str:
    _check_split(split)
    return self.calibration_sha3_256 if split == "calibration" else self.heldout_sha3_256

  def documents(self, split: Split) -> list[str]:
    """The split's documents, in file order, after checking the file's hash again."""
    path, want = self.path(split), self.sha3_256(split)
    data = path.read_bytes()
    got = hashlib.sha3_256(data).hexdigest()
    if got != want:
      raise DictionaryError(
        f"corpus {split} file changed since the dictionary was loaded: sha3-256 is "
        f"{got}, the dictionary records {want}; reload the dictionary (and update "
        f"its sha3_256 if the change is intended)",
        source=str(path),
        line=None,
      )
    return split_documents(data.decode("utf-8"))


@dataclasses.dataclass(frozen=True)
class HintSpec:
  name: str
  description: str
  floors: Floors
  corpus: Corpus
  source: Source
  line: int = 0  # of the entry in the dictionary file

  def documents(self, split: Split) -> list[str]:
    return self.corpus.documents(split)


@dataclasses.dataclass(frozen=True)
class SynthesisDictionary:
  hints: tuple[HintSpec, ...]
  source: str  # the file it was read from

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(h.name for h in self.hints)

  def __getitem__(self, name: str) -> HintSpec:
    for h in self.hints:
      if h.name == name:
        return h
    raise KeyError(f"no hint {name!r} in {self.source}; hints: {', '.join(self.names)}")

  def __contains__(self, name: object) -> bool:
    return name in self.names

  def __iter__(self) -> Iterator[HintSpec]:
    return iter(self.hints)

  def __len__(self) -> int:
    return len(self.hints)


def default_dictionary_path() -> Path:
  """The package's ``synthesis_dict.yaml`` (:mod:`thoughtjax.shipped`), never one of the working directory:
  another dictionary is used only when named (an argument, ``--dictionary``)."""
  return shipped_file("synthesis_dict.yaml")


def split_documents(text: str) -> list[str]:
  """Documents of a corpus file: split on separator lines, stripped, blank ones dropped."""
  docs, cur = [], []
  for line in text.splitlines():
    if line.strip() == DOC_SEPARATOR:
      docs.append("\n".join(cur))
      cur = []
    else:
      cur.append(line)
  docs.append("\n".join(cur))
  return [d.strip("\n") for d in docs if d.strip()]


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


_line, _field_nodes = yamlnodes.line, yamlnodes.field_nodes


def load_dictionary(path: str | os.PathLike | None = None, *, text: str | None = None) -> SynthesisDictionary:
  """Parse and validate a synthesis dictionary and check every corpus file's hash.

  ``path`` defaults to :func:`default_dictionary_path`. With ``text``, ``path`` is only the display
  name and the folder corpus paths are relative to.
  """
  path = Path(path) if path is not None else default_dictionary_path()
  name = str(path)
  if text is None:
    try:
      text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
      raise DictionaryError(
        "no such file; pass the path of a synthesis dictionary (the shipped one is registry/synthesis_dict.yaml)",
        source=name,
        line=None,
      ) from None
  data, top = yamlnodes.load_document(text, name, DictionaryError, top_keys=_TOP_KEYS, expected="a 'hints' list")
  items = data.get("hints")
  if "hints" not in top or not isinstance(items, list) or not items:
    raise DictionaryError(
      "'hints' must be a non-empty list of entries", source=name, line=_line(top["hints"][1]) if "hints" in top else 1
    )
  base = path.resolve().parent
  hints = [_hint(i, raw, node, name, base) for i, (raw, node) in enumerate(zip(items, top["hints"][1].value))]
  seen: dict[str, tuple[int, HintSpec]] = {}
  for i, h in enumerate(hints):
    if h.name in seen:
      j, first = seen[h.name]
      raise DictionaryError(
        f"name {h.name!r} is already used by hint {j} (line {first.line}); hint names must be unique",
        source=name,
        line=h.line,
        entry=i,
        name=h.name,
      )
    seen[h.name] = (i, h)
  return SynthesisDictionary(tuple(hints), name)


def _hint(i: int, raw: Any, node: yaml.Node, source: str, base: Path) -> HintSpec:
  line = _line(node)
  if not isinstance(raw, dict) or not isinstance(node, yaml.MappingNode):
    raise DictionaryError(
      f"expected a mapping with {sorted(_HINT_KEYS)}, got {raw!r}", source=source, line=line, entry=i
    )
  fields = _field_nodes(node)
  given = raw.get("name") if isinstance(raw.get("name"), str) else None

  def fail(msg: str, key: str | None = None, at: yaml.Node | None = None):
    # A key's own line: for a block mapping its value starts on the next one.
    ln = _line(at) if at is not None else _line(fields[key][0]) if key in fields else line
    raise DictionaryError(msg, source=source, line=ln, entry=i, name=given)

  def sub(key: str, allowed: set[str], required: tuple[str, ...]) -> tuple[dict, dict]:
    value, vnode = raw[key], fields[key][1]
    if not isinstance(value, dict) or not isinstance(vnode, yaml.MappingNode):
      fail(f"'{key}' must be a mapping with keys {sorted(allowed)}, got {value!r}", key)
    f = _field_nodes(vnode)
    bad = sorted(set(value) - allowed)
    if bad:
      fail(f"unknown key '{key}.{bad[0]}'; allowed: {sorted(allowed)}", at=f[bad[0]][0])
    missing = [k for k in required if k not in value]
    if missing:
      fail(f"'{key}' is missing {missing[0]!r}; required: {list(required)}", key)
    return value, f

  unknown = sorted(set(raw) - _HINT_KEYS)
  if unknown:
    fail(f"unknown key {unknown[0]!r}; allowed: {sorted(_HINT_KEYS)}", at=fields[unknown[0]][0])
  missing = [k for k in ("name", "description", "source", "floors", "corpus") if k not in raw]
  if missing:
    fail(f"missing field {missing[0]!r}; every hint needs {sorted(_HINT_KEYS)}")
  hint_name = raw["name"]
  if not isinstance(hint_name, str) or not NAME_RE.fullmatch(hint_name):
    fail(
      f"name must be in normalized form (lower-case letters, digits and '_', e.g. "
      f"'code_generation'), got {hint_name!r}",
      "name",
    )
  desc = raw["description"]
  if not isinstance(desc, str) or not desc.strip() or "\n" in desc.strip():
    fail(f"description must be one non-empty line, got {desc!r}", "description")

  src, _ = sub("source", _SOURCE_KEYS, ("kind",))
  if src["kind"] not in SOURCE_KINDS:
    fail(f"source.kind must be one of {', '.join(SOURCE_KINDS)}, got {src['kind']!r}", "source")
  if src["kind"] == "public_domain" and not (isinstance(src.get("work"), str) and src["work"].strip()):
    fail("a public_domain source must name the work: source.work: 'Title, Author (year)'", "source")
  for k in ("work", "note"):
    if src.get(k) is not None and not isinstance(src[k], str):
      fail(f"source.{k} must be a string, got {src[k]!r}", "source")

  fl, fnodes = sub("floors", _FLOOR_KEYS, _REQUIRED_FLOORS)
  for k, v in fl.items():
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      fail(f"floors.{k} must be a finite number, got {v!r}", at=fnodes[k][1])
  if not 0.0 <= fl["top1_agreement"] <= 1.0:
    fail(
      f"floors.top1_agreement is a fraction of positions, in [0, 1]; got {fl['top1_agreement']!r}",
      at=fnodes["top1_agreement"][1],
    )
  for k in ("mean_kl", "delta_nll"):
    if k in fl and fl[k] < 0:
      fail(f"floors.{k} is a maximum in nats per token and must be >= 0; got {fl[k]!r}", at=fnodes[k][1])
  floors = Floors(
    float(fl["top1_agreement"]), float(fl["mean_kl"]), None if fl.get("delta_nll") is None else float(fl["delta_nll"])
  )

  corp, cnodes = sub("corpus", set(SPLITS), SPLITS)
  paths, hashes = {}, {}
  for split in SPLITS:
    spec, snode = corp[split], cnodes[split][1]
    if not isinstance(spec, dict) or not isinstance(snode, yaml.MappingNode):
      fail(f"corpus.{split} must be a mapping {{path: ..., sha3_256: ...}}, got {spec!r}", at=snode)
    snodes = _field_nodes(snode)
    bad = sorted(set(spec) - _SPLIT_KEYS)
    if bad:
      fail(f"unknown key 'corpus.{split}.{bad[0]}'; allowed: {sorted(_SPLIT_KEYS)}", at=snodes[bad[0]][0])
    if not isinstance(spec.get("path"), str) or not spec["path"]:
      fail(f"corpus.{split}.path must be a file path relative to the dictionary's folder", at=snode)
    rel = Path(spec["path"])
    full = (base / rel).resolve()
    if rel.is_absolute() or not full.is_relative_to(base):
      fail(
        f"corpus.{split}.path {spec['path']!r} leaves the dictionary's folder {base}; corpora live "
        f"beside the dictionary (e.g. evals/<hint>/{split}.txt)",
        at=snodes["path"][1],
      )
    if not full.is_file():
      fail(f"corpus.{split} file {full} does not exist; write it or fix the path", at=snodes["path"][1])
    digest = hashlib.sha3_256(full.read_bytes()).hexdigest()
    want = spec.get("sha3_256")
    if want is None:
      fail(f"corpus.{split}.sha3_256 is missing; record the file's hash: sha3_256: {digest}", at=snode)
    if not isinstance(want, str) or not re.fullmatch(r"[0-9a-f]{64}", want):
      fail(f"corpus.{split}.sha3_256 must be 64 lower-case hex digits, got {want!r}", at=snodes["sha3_256"][1])
    if want != digest:
      fail(
        f"corpus {split} file {spec['path']} has sha3-256 {digest}, but the dictionary records {want}. "
        f"If the corpus was changed on purpose, set corpus.{split}.sha3_256 to {digest}; otherwise "
        f"restore the file",
        at=snodes["sha3_256"][1],
      )
    paths[split], hashes[split] = full, want
    try:
      docs = split_documents(full.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
      fail(f"corpus {split} file {spec['path']} is not UTF-8 text ({e.reason} at byte {e.start})", at=snodes["path"][1])
    if not docs:
      fail(f"corpus {split} file {spec['path']} holds no document", at=snodes["path"][1])
  if paths["calibration"] == paths["heldout"] or hashes["calibration"] == hashes["heldout"]:
    fail("corpus.calibration and corpus.heldout hold the same text; the held-out split must be other text", "corpus")
  corpus = Corpus(paths["calibration"], paths["heldout"], hashes["calibration"], hashes["heldout"])
  source_ = Source(src["kind"], src.get("work"), src.get("note"))
  return HintSpec(hint_name, desc.strip(), floors, corpus, source_, line)

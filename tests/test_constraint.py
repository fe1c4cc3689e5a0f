"""Constraints -> per-row allowed-token bitmasks (thoughtjax.constraint).

Walks drive a matcher the way the sampler will: fill the mask, pick an allowed id (the lowest, or a seeded random
one), consume it, until eos. What comes out must parse and validate (JSON Schema), fully match (regex), or be a
sentence of the grammar. Most tests use the tiny byte-level codec (one token per byte); the ``slow`` ones use the
real model's tokenizer, built from the GGUF the way thoughtjax builds it.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from tests.tiny import CHAT_TEMPLATE, tiny_tokenizer
from thoughtjax.constraint import MAX_SOURCE_BYTES, Constraint, ConstraintError, Grammars
from thoughtjax.errors import UserError
from thoughtjax.tokenizer import TextCodec

EOS = 2
PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "score": {"type": "number", "minimum": -1, "maximum": 1},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "address": {
      "type": "object",
      "properties": {"city": {"type": "string", "maxLength": 4}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["city", "zip"],
      "additionalProperties": False,
    },
  },
  "required": ["name", "age", "role", "active", "address"],
  "additionalProperties": False,
}


def tiny_codec(eos_ids=()) -> TextCodec:
  return TextCodec(tiny_tokenizer(), CHAT_TEMPLATE, 1, EOS, eos_ids=eos_ids)


@pytest.fixture(scope="module")
def grammars() -> Grammars:
  # Wider than the tokenizer (259 ids), as a model's logits may be: ids 259..299 must never be allowed.
  return Grammars(tiny_codec(), 300)


def allowed(mask: np.ndarray) -> np.ndarray:
  return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


def walk(grammars: Grammars, c: Constraint, pick, max_steps: int = 400):
  """Fill/consume until eos; checks the mask's contract at every step. Returns (text, ids without eos)."""
  m = grammars.matcher(c)
  mask = np.zeros(grammars.words, np.uint32)
  ids = []
  for _ in range(max_steps):
    mask.fill(0xFFFFFFFF)  # fill overwrites every word
    m.fill(mask)
    ok = allowed(mask)
    assert ok.size and ok.max() < 259, "ids the tokenizer does not have are never allowed"
    assert (EOS in ok) == m.accepting, "eos is allowed exactly when the output is accepting"
    if m.stopped:
      assert ok.tolist() == [EOS]
    token = pick(ok)
    m.consume(token)
    if token == EOS:
      assert m.stopped
      return grammars.codec.decode(ids), ids
    ids.append(token)
  raise AssertionError(f"no eos after {max_steps} steps: {grammars.codec.decode(ids)!r}")


def lowest(ok):
  return int(ok[0])


def seeded(seed):
  r = np.random.default_rng(seed)
  # Eos half the time it is allowed, so walks also run on past accepting states (a number's next digit).
  return lambda ok: EOS if EOS in ok and r.random() < 0.5 else int(r.choice(ok[ok != EOS] if ok.size > 1 else ok))


# ---- Constraint.of ---------------------------------------------------------------------------------------------


def test_none_given_is_no_constraint_and_empty_strings_count_as_not_given():
  assert Constraint.of() is None
  assert Constraint.of(json_schema="", regex="", grammar="") is None
  assert Constraint.of(json_schema="", regex="[ab]+") == Constraint("regex", "[ab]+")


@pytest.mark.parametrize(
  "kw, named",
  [
    (dict(json_schema="{}", regex="a"), "json_schema and regex"),
    (dict(regex="a", grammar='start: "a"'), "regex and grammar"),
    (dict(json_schema={"type": "string"}, grammar='root ::= "a"'), "json_schema and grammar"),
  ],
)
def test_at_most_one_kind_and_the_error_names_both(kw, named):
  with pytest.raises(ConstraintError, match=f"at most one .*got {named}"):
    Constraint.of(**kw)


def test_a_schema_dict_keeps_its_property_order_and_text_is_kept_as_written():
  c = Constraint.of(json_schema={"type": "object", "properties": {"z": {}, "a": {}}})
  assert json.loads(c.source) == {"type": "object", "properties": {"z": {}, "a": {}}}
  assert list(json.loads(c.source)["properties"]) == ["z", "a"], "properties are generated in the schema's order"
  text = '{ "type" : "string" }'
  assert Constraint.of(json_schema=text).source == text
  assert Constraint.of(json_schema=text).describe() == f"JSON schema ({len(text)} characters)"
  assert Constraint.of(regex="a+").describe() == "regular expression (2 characters)"
  assert Constraint.of(grammar='start: "a"').describe() == "grammar (Lark, 10 characters)"
  assert Constraint.of(grammar='root ::= "a"').describe() == "grammar (GBNF, 12 characters)"


def test_a_lark_grammar_without_a_start_rule_is_read_as_gbnf_and_the_error_says_so(grammars):
  with pytest.raises(
    ConstraintError, match=r"^grammar: cannot be compiled \(read as GBNF: a Lark grammar needs a line"
  ):
    grammars.check(Constraint.of(grammar='root: "a"'))


@pytest.mark.parametrize(
  "kw, message",
  [
    (dict(json_schema="{"), r"^json_schema: not valid JSON"),
    (dict(json_schema="[1, 2]"), r"^json_schema: expected a JSON object, got list"),
    (dict(json_schema='"object"'), r"^json_schema: expected a JSON object, got str"),
    (dict(json_schema=42), r"^json_schema: expected JSON text or a dict, got int"),
    (dict(json_schema={"x": {1, 2}}), r"^json_schema: the dict is not JSON-serializable"),
    (dict(regex=b"ab"), r"^regex: expected a string, got bytes"),
    (dict(grammar=["start: x"]), r"^grammar: expected a string, got list"),
  ],
)
def test_bad_inputs_are_refused_by_name_in_one_line(kw, message):
  with pytest.raises(ConstraintError, match=message) as e:
    Constraint.of(**kw)
  assert "\n" not in str(e.value)
  assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kind", ["json_schema", "regex", "grammar"])
def test_a_huge_constraint_is_refused_before_it_is_parsed(kind):
  # Not valid JSON past the limit: the size check must come first (the message names the limit, not JSON).
  huge = '{"description": "' + "x" * MAX_SOURCE_BYTES + '"'
  with pytest.raises(ConstraintError, match=rf"^{kind}: {len(huge)} bytes is over the 64 KiB limit"):
    Constraint.of(**{kind: huge})
  with pytest.raises(ConstraintError, match="64 KiB limit"):
    Constraint(kind, huge)
  with pytest.raises(ConstraintError, match="64 KiB limit"):  # a dict that dumps too large
    Constraint.of(json_schema={"description": "é" * MAX_SOURCE_BYTES})


@pytest.mark.parametrize(
  "kind, source, message",
  [
    ("json_schema", '{"type":"object","properties":{"a":' * 200 + "{}" + "}}" * 200, "recursion limit"),
    ("json_schema", "[" * 20000 + "]" * 20000, "nested too deeply to parse"),
    ("regex", "(" * 5000 + "a" + ")" * 5000, "regex"),
    ("grammar", "start: " + "(" * 5000 + '"a"' + ")" * 5000, "grammar"),
    ("grammar", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "GBNF"),
  ],
  ids=["schema", "json-text", "regex", "lark", "gbnf"],
)
def test_deep_nesting_within_the_size_limit_is_a_named_refusal_not_a_crash(grammars, kind, source, message):
  """Deep nesting overflows recursive parsers (Python's json, the GBNF converter, Rust's stack): each is refused
  in one line, and the grammars object keeps working."""
  assert len(source.encode()) <= MAX_SOURCE_BYTES
  with pytest.raises(ConstraintError, match=f"^{kind}: ") as e:
    grammars.check(Constraint.of(**{kind: source}))
  assert message in str(e.value) and "\n" not in str(e.value)
  deep = {}
  for _ in range(5000):
    deep = {"not": deep}
  with pytest.raises(ConstraintError, match="^json_schema: the dict is nested too deeply"):
    Constraint.of(json_schema=deep)
  text, _ = walk(grammars, Constraint.of(regex="ok"), lowest)
  assert text == "ok"


def test_a_constraint_built_directly_is_checked_too():
  with pytest.raises(ConstraintError, match="kind must be one of json_schema, regex, grammar, got 'lark'"):
    Constraint("lark", 'start: "a"')
  with pytest.raises(ConstraintError, match="regex: expected a non-empty string"):
    Constraint("regex", "")


# ---- compiling -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kind, source, message",
  [
    ("json_schema", '{"type": "frobnicate"}', "frobnicate"),
    ("json_schema", '{"type": "string", "format": "ipv9"}', "format: ipv9"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "unclosed group"),
    ("regex", "a(", "unclosed group"),
    ("regex", "[z-a]", "regex"),
    ("grammar", 'start: "a" | b', 'unknown name: "b"'),
    ("grammar", "root ::= x", "Rule 'x' not found"),
    ("grammar", "root ::= (", "GBNF"),
  ],
)
def test_what_cannot_be_compiled_is_a_one_line_error_naming_the_kind(grammars, kind, source, message):
  c = Constraint(kind, source)
  for call in (grammars.check, grammars.matcher):
    with pytest.raises(ConstraintError) as e:
      call(c)
    text = str(e.value)
    assert text.startswith(f"{kind}: cannot be compiled") and message in text and "\n" not in text, text


def test_the_compiled_cache_is_bounded_and_shared_by_threads():
  g = Grammars(tiny_codec(), 259, cache_size=3)
  patterns = [f"[a-c]{{{n}}}" for n in range(1, 7)]
  errors, texts = [], {}

  def work(i):
    try:
      for k in range(20):
        p = patterns[(i + k) % len(patterns)]
        g.check(Constraint("regex", p))
        text, _ = walk(g, Constraint("regex", p), lowest)
        texts.setdefault(p, set()).add(text)
      with pytest.raises(ConstraintError):
        g.check(Constraint("regex", "a("))
    except BaseException as e:  # noqa: BLE001 - reported on the main thread
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert {p: s for p, s in texts.items()} == {p: {"a" * int(p[-2])} for p in patterns}
  assert len(g._compiled) <= 3


# ---- walks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pick", ["lowest"] + [f"seed{s}" for s in range(6)])
def test_a_walk_under_a_schema_gives_json_that_validates(grammars, pick):
  c = Constraint.of(json_schema=PERSON)
  text, _ = walk(grammars, c, lowest if pick == "lowest" else seeded(int(pick[4:])))
  value = json.loads(text)
  jsonschema.validate(value, PERSON)
  assert list(value) == [k for k in PERSON["properties"] if k in value], "properties come in the schema's order"


@pytest.mark.parametrize("seed", range(4))
def test_a_walk_under_a_regex_fully_matches_it(grammars, seed):
  pattern = r"(ab|c)[0-9]{2,4}-[xyz]+"
  text, _ = walk(grammars, Constraint.of(regex=pattern), seeded(seed))
  assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(
  "grammar",
  [
    'start: answer " " unit\nanswer: "yes" | "no" | /[0-9]{1,3}/\nunit: "kg" | "m"',  # Lark
    'root ::= answer " " unit\nanswer ::= "yes" | "no" | [0-9] [0-9]? [0-9]?\nunit ::= "kg" | "m"',  # GBNF
  ],
  ids=["lark", "gbnf"],
)
@pytest.mark.parametrize("seed", range(3))
def test_a_walk_under_a_grammar_is_a_sentence_of_it_in_both_dialects(grammars, grammar, seed):
  text, _ = walk(grammars, Constraint.of(grammar=grammar), seeded(seed))
  assert re.fullmatch(r"(yes|no|[0-9]{1,3}) (kg|m)", text), text


@pytest.mark.parametrize(
  "pattern",
  [r"(a|b)*a(a|b){12}", r"((ab){1,50}){1,50}c", r"[a-c]{0,3}x{1000}|y"],
  ids=["dfa-blowup", "nested-repeats", "long"],
)
def test_constraints_that_explode_when_compiled_eagerly_still_walk(grammars, pattern):
  """An eager DFA of the first has 2**13 states and the second a million paths: the lexer builds what a walk
  reaches, so they compile and every step's mask is exact."""
  text, _ = walk(grammars, Constraint.of(regex=pattern), seeded(5), max_steps=1200)
  assert re.fullmatch(pattern, text), text


def test_whitespace_in_json_is_one_space_or_a_newline_and_indent(grammars):
  schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
  codec = grammars.codec
  flexible = Constraint.of(json_schema=schema)

  def takes(text, c=flexible):
    m = grammars.matcher(c)
    try:
      for t in codec.encode(text):
        m.consume(t)
    except ConstraintError:
      return False
    return m.accepting

  assert takes('{"a":1}') and takes('{"a": 1}') and takes('{\n  "a": 1\n}') and takes('{"a":\n' + " " * 20 + "1}")
  assert not takes('{"a":  1}') and not takes('{"a":\n\n1}') and not takes('{"a":\n' + " " * 21 + "1}")
  compact = Constraint.of(json_schema=schema | {"x-guidance": {"whitespace_pattern": ""}})
  assert takes('{"a":1}', compact) and not takes('{"a": 1}', compact), "a schema's x-guidance overrides the default"


# ---- state: eos, rollback, refusals ------------------------------------------------------------------------------


def test_eos_is_allowed_exactly_when_accepting_for_every_eos_id():
  # Two end ids (an end-of-turn beside eos): both follow the grammar, not only llguidance's first.
  g = Grammars(tiny_codec(eos_ids=(0,)), 259)
  m = g.matcher(Constraint.of(regex="[0-9]+"))
  mask = np.zeros(g.words, np.uint32)
  m.fill(mask)
  assert not ({0, 2} & set(allowed(mask).tolist())) and not m.accepting
  with pytest.raises(ConstraintError, match="end of sequence \\(token 0\\) before the output is complete"):
    m.consume(0)
  m.consume(g.codec.encode("7")[0])
  m.fill(mask)
  assert {0, 2} <= set(allowed(mask).tolist()) and m.accepting and not m.stopped
  m.consume(0)  # the second end id ends it as well as the first
  assert m.stopped
  m.fill(mask)
  assert allowed(mask).tolist() == [0, 2]


def test_a_finished_language_allows_only_eos():
  g = Grammars(tiny_codec(), 259)
  m = g.matcher(Constraint.of(regex="ab"))
  for t in g.codec.encode("ab"):
    m.consume(t)
  assert m.stopped and m.accepting
  mask = np.zeros(g.words, np.uint32)
  m.fill(mask)
  assert allowed(mask).tolist() == [EOS]
  with pytest.raises(ConstraintError, match="token .* is not allowed here"):
    m.consume(g.codec.encode("a")[0])
  m.consume(EOS)
  with pytest.raises(ConstraintError, match="after the end of sequence"):
    m.consume(EOS)
  m.rollback(1)  # only the eos: still after "ab"
  assert m.stopped and m.accepting
  m.rollback(1)  # and the "b"
  assert not m.stopped and not m.accepting
  m.fill(mask)
  assert allowed(mask).tolist() == g.codec.encode("b")


def test_rollback_restores_the_same_mask_and_state(grammars):
  c = Constraint.of(json_schema=PERSON)
  pick = seeded(11)
  m = grammars.matcher(c)
  masks, states, ids = [], [], []
  mask = np.zeros(grammars.words, np.uint32)
  while True:
    m.fill(mask)
    masks.append(mask.copy())
    states.append((m.accepting, m.stopped))
    token = pick(allowed(mask))
    if token == EOS:
      break
    m.consume(token)
    ids.append(token)
  for n in (1, 3, len(ids) // 2, len(ids)):
    m.rollback(n)
    k = len(ids) - n
    m.fill(mask)
    np.testing.assert_array_equal(mask, masks[k])
    assert (m.accepting, m.stopped) == states[k]
    for t in ids[k:]:  # the same tokens are accepted again after the rollback
      m.consume(t)
  m.consume(EOS)
  m.rollback(1)  # a consumed eos rolls back too (a rejected draft may end in one)
  m.fill(mask)
  np.testing.assert_array_equal(mask, masks[-1])
  assert (m.accepting, m.stopped) == states[-1]
  with pytest.raises(ValueError, match=f"rollback: expected 0 <= n <= {len(ids)}"):
    m.rollback(len(ids) + 1)


def test_a_rejected_token_raises_and_leaves_the_state_unchanged(grammars):
  m = grammars.matcher(Constraint.of(regex="[0-9]+"))
  mask, after = np.zeros(grammars.words, np.uint32), np.zeros(grammars.words, np.uint32)
  m.fill(mask)
  for bad in (grammars.codec.encode("a")[0], 259, 299, -1, 10**9):
    with pytest.raises(ConstraintError, match="^regex: token"):
      m.consume(bad)
  m.fill(after)
  np.testing.assert_array_equal(mask, after)
  m.consume(grammars.codec.encode("4")[0])
  assert m.accepting


def test_a_model_vocabulary_narrower_than_the_tokenizer_cuts_the_mask():
  g = Grammars(tiny_codec(), 200)  # the logits stop at id 199; the tokenizer has 259 ids
  assert g.words == 7
  m = g.matcher(Constraint.of(regex=".+"))
  mask = np.zeros(7, np.uint32)
  m.fill(mask)
  ok = allowed(mask)
  assert ok.max() < 200 and ok.size > 100
  with pytest.raises(ConstraintError, match=r"outside the vocabulary \[0, 200\)"):
    m.consume(250)


@pytest.mark.parametrize("vocab", [300, 259, 200])
def test_a_batch_fill_equals_filling_row_by_row(vocab):
  """Rows of one batch carry different constraints or none; some are finished, one has ended with eos."""
  g = Grammars(tiny_codec(eos_ids=(0,)), vocab)
  constraints = [Constraint.of(json_schema=PERSON), Constraint.of(regex="[0-9]+"), Constraint.of(regex="ab")]
  rows = [g.matcher(c) for c in constraints + constraints[:2]]
  for t in g.codec.encode('{"name":"x'):
    rows[0].consume(t)
  for t in g.codec.encode("12"):
    rows[1].consume(t)
  for t in g.codec.encode("ab"):  # finished: only eos may follow
    rows[2].consume(t)
  rows[4].consume(g.codec.encode("7")[0])
  rows[4].consume(0)  # ended
  batch = rows[:2] + [None] + rows[2:]
  out = np.full((len(batch) + 1, g.words), 0x5A5A5A5A, np.uint32)  # one spare row, left as it was
  g.fill_rows(batch, out)
  one = np.zeros(g.words, np.uint32)
  for i, m in enumerate(batch):
    if m is None:
      assert allowed(out[i]).tolist() == list(range(vocab)), "an unconstrained row allows every id of the logits"
    else:
      m.fill(one)
      np.testing.assert_array_equal(out[i], one, err_msg=f"row {i}")
  assert (out[-1] == 0x5A5A5A5A).all()
  with pytest.raises(ValueError, match="rows do not fit"):
    g.fill_rows(batch, out[:2])
  with pytest.raises(ValueError, match=f"shape \\(B, {g.words}\\)"):
    g.fill_rows(batch, np.zeros((8, g.words + 1), np.uint32))


def test_the_mask_buffer_must_have_the_model_width(grammars):
  m = grammars.matcher(Constraint.of(regex="a"))
  for bad in (np.zeros(grammars.words - 1, np.uint32), np.zeros(grammars.words, np.int64)):
    with pytest.raises(ValueError, match=f"expected a C-contiguous uint32 array of shape \\({grammars.words},\\)"):
      m.fill(bad)


def test_a_tokenizer_without_eos_cannot_be_constrained():
  g = Grammars(TextCodec(tiny_tokenizer(), None, None, None), 259)
  with pytest.raises(ConstraintError, match="needs an end-of-sequence token"):
    g.check(Constraint.of(regex="a"))


# ---- the real tokenizer ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_grammars():
  import gguf

  from thoughtjax.fetch import fetch
  from thoughtjax.sources.gguf_file import read_config, read_tokenizer

  reader = gguf.GGUFReader(fetch())
  return Grammars(TextCodec.from_gguf(read_tokenizer(reader)), read_config(reader).vocab_size)


@pytest.mark.slow
def test_every_answer_of_the_extraction_set_is_accepted_token_by_token(real_grammars):
  """The set's reference answers, tokenized as the model would write them, pass the mask at every step: the
  constraint does not forbid a right answer."""
  from thoughtjax.bench.structured import load_extraction_set

  codec = real_grammars.codec
  mask = np.zeros(real_grammars.words, np.uint32)
  for item in load_extraction_set():
    m = real_grammars.matcher(Constraint.of(json_schema=item.schema))
    for text in (json.dumps(item.answer), json.dumps(item.answer, indent=2)):
      for t in codec.encode(text):
        m.fill(mask)
        assert mask[t >> 5] >> (t & 31) & 1, (item.id, text, codec.decode([t]))
        m.consume(t)
      assert m.accepting, item.id
      m.rollback(len(codec.encode(text)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_walks_with_the_real_tokenizer_validate(real_grammars, seed):
  eos = real_grammars.eos_ids[0]
  r = np.random.default_rng(seed)
  schema = {k: v for k, v in PERSON.items()}
  m = real_grammars.matcher(Constraint.of(json_schema=schema))
  mask = np.zeros(real_grammars.words, np.uint32)
  ids = []
  for _ in range(400):
    m.fill(mask)
    ok = allowed(mask)
    assert ok.max() < real_grammars.allowed_size and (eos in ok) == m.accepting
    token = eos if eos in ok else int(r.choice(ok))
    m.consume(token)
    if token == eos:
      break
    ids.append(token)
  jsonschema.validate(json.loads(real_grammars.codec.decode(ids)), PERSON)

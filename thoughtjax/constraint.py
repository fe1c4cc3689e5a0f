"""Constrained decoding: a JSON Schema, a regular expression or a grammar -> the allowed-token mask per step.

The masks come from llguidance (``llguidance`` on PyPI): it compiles the constraint against the model's
tokenizer and, at each step, writes one bit per vocabulary id into a numpy buffer — the packed layout the fused
sampler reads (``bit (v & 31) of word (v >> 5)``). Chosen over xgrammar (``scripts/compare_grammar_libraries.py``
on the default model's tokenizer): no torch (7 MiB installed against 4.4 GiB with xgrammar's dependencies),
imported in 0.05 s (4.3 s), a schema compiled in under 1 ms (6-16 ms) and both Lark and GBNF grammars; xgrammar's
per-token mask is faster (median 3 us against 13 us), both far below a decode step; both roll back and handle eos.

Layers:
- :class:`Constraint` is the request's value: which kind and its source text. Building one checks only what
  needs no tokenizer (one kind at most, a size cap, a schema that is a JSON object).
- :class:`Grammars` belongs to one model (its codec and its logits width). It compiles constraints against the
  tokenizer, keeps the compiled ones in a bounded LRU and hands out :class:`Matcher` s. One is shared by every
  thread of an engine.
- :class:`Matcher` follows one row's output: ``fill`` writes the mask for the next token, ``consume`` advances by
  the sampled token, ``rollback`` undoes rejected speculative drafts. It belongs to one row (one thread at a time).

What each kind accepts:
- ``json_schema``: a JSON Schema (draft 2020-12 subset that llguidance implements: objects with properties and
  required, arrays with items/minItems/maxItems, enum/const, string length/pattern, integer and number ranges,
  anyOf/oneOf/allOf, local ``$ref``). Properties come out in the schema's order. Between JSON tokens at most one
  space, or a newline and up to 20 spaces or tabs (llama.cpp's rule), so a model cannot stall in blank space; a
  schema's own ``x-guidance`` options override this (``{"whitespace_pattern": ""}``: compact JSON only).
- ``regex``: a Rust ``regex`` crate pattern; the whole output must match it (implicitly anchored).
- ``grammar``: either a Lark-style grammar in llguidance's dialect (``start: ...`` rules, ``"literals"``,
  ``/regex/`` terminals, ``%json {...}``), or a GBNF grammar as llama.cpp's server takes (``root ::= ...``).
  The text is read as Lark when a line begins with ``start:`` or ``%llguidance`` and as GBNF otherwise (llguidance's
  own converter turns GBNF into Lark).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import is_lark_syntax

from thoughtjax.errors import UserError

Kind = Literal["json_schema", "regex", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "regex", "grammar")
# A constraint's text is held per request and compiled on the request path: refuse a huge one before parsing it.
MAX_SOURCE_BYTES = 64 * 1024
_DESCRIPTION = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}
# Between JSON tokens: one space, or a newline and up to 20 spaces or tabs of indent (llama.cpp's json_schema rule).
# Pretty-printed output stays possible; a weak model cannot fill max_tokens with blank lines.
_JSON_DEFAULTS = {"whitespace_pattern": r"(\x20|\x0A[\x20\x09]{0,20})"}
_CACHE_SIZE = 64
# llguidance's resource limits for every matcher. Its defaults allow 250 000 lexer states (1-2 kB each: up to
# ~500 MB for one hostile pattern); a fifth of that still holds the largest schemas and grammars we test. Errors
# leave out the parser's state and the grammar (verbose_errors): a message says what failed, not what it read.
# The fuel limits (per-token work) keep llguidance's defaults. A row whose output runs past a limit ends with a
# ConstraintError of its own (Matcher); other rows go on.
_LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, verbose_errors=False)
_QUIET = re.compile(r"\s*<non-verbose/>\s*")


class ConstraintError(UserError, ValueError):
  """A json_schema, regex or grammar that cannot be used, or a token that breaks one; the message names which."""


@dataclasses.dataclass(frozen=True)
class Constraint:
  """One output constraint of a request. ``source``: the schema as JSON text, the pattern, or the grammar text."""

  kind: Kind
  source: str

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
    if not isinstance(self.source, str) or not self.source:
      raise ConstraintError(f"{self.kind}: expected a non-empty string, got {self.source!r:.60}")
    _check_size(self.kind, self.source)

  @staticmethod
  def of(
    json_schema: str | Mapping | None = None, regex: str | None = None, grammar: str | None = None
  ) -> Constraint | None:
    """The constraint among the three (``None`` and ``""`` count as not given), or ``None`` when none is given.

    A dict schema is dumped to JSON text in its own key order (the order properties are generated in); a text
    schema is kept as written once it parses to a JSON object.
    """
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if _given(v)}
    if len(given) > 1:
      raise ConstraintError(f"give at most one of json_schema, regex and grammar; got {' and '.join(given)}")
    if not given:
      return None
    ((kind, value),) = given.items()
    if kind == "json_schema":
      return Constraint(kind, _schema_text(value))
    if not isinstance(value, str):
      raise ConstraintError(f"{kind}: expected a string, got {type(value).__name__}")
    return Constraint(kind, value)

  def describe(self) -> str:
    """Short, for plans and logs: e.g. ``JSON schema (412 characters)``, ``grammar (GBNF, 80 characters)``."""
    if self.kind == "grammar":
      return f"grammar ({'Lark' if is_lark(self.source) else 'GBNF'}, {len(self.source)} characters)"
    return f"{_DESCRIPTION[self.kind]} ({len(self.source)} characters)"


def _given(value) -> bool:
  return value is not None and not (isinstance(value, str) and value == "")


def _check_size(kind: str, text: str) -> None:
  size = len(text.encode("utf-8", "surrogatepass"))
  if size > MAX_SOURCE_BYTES:
    raise ConstraintError(
      f"{kind}: {size} bytes is over the {MAX_SOURCE_BYTES // 1024} KiB limit on a constraint; send a smaller one"
    )


def _schema_text(value) -> str:
  if isinstance(value, Mapping):
    try:
      text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
      raise ConstraintError(f"json_schema: the dict is not JSON-serializable ({e})") from None
    except RecursionError:
      raise ConstraintError("json_schema: the dict is nested too deeply to serialize; flatten it") from None
    _check_size("json_schema", text)
    return text
  if not isinstance(value, str):
    raise ConstraintError(f"json_schema: expected JSON text or a dict, got {type(value).__name__}")
  _check_size("json_schema", value)
  try:
    parsed = json.loads(value)
  except ValueError as e:
    raise ConstraintError(f"json_schema: not valid JSON ({e})") from None
  except RecursionError:
    raise ConstraintError("json_schema: nested too deeply to parse; flatten it") from None
  if not isinstance(parsed, dict):
    raise ConstraintError(
      f"json_schema: expected a JSON object, got {type(parsed).__name__} (e.g. {{\"type\": \"object\"}})"
    )
  return value


# Caret lines and echoed source lines of llguidance's messages carry no information on one line.
_NOISE = re.compile(r"^\s*(\^+|\d+\s*\|.*)\s*$")
_LOCATION = re.compile(r"^at \d+\(\d+\): ")


def _short(kind: str, message: str, limit: int = 300) -> str:
  lines = [ln.strip() for ln in _QUIET.sub(" ", message).splitlines() if ln.strip() and not _NOISE.match(ln)]
  text = " ".join(lines)
  if kind != "grammar":  # a position in the Lark text llguidance built from a schema or pattern means nothing here
    text = _LOCATION.sub("", text)
  return text if len(text) <= limit else text[: limit - 1] + "…"


class Grammars:
  """Compiles constraints for one model and hands out per-row matchers. Thread-safe.

  ``codec``: the model's :class:`thoughtjax.tokenizer.TextCodec`. ``vocab_size``: the model's logits width; ids
  at or above the tokenizer's own size are never allowed.
  """

  def __init__(self, codec, vocab_size: int, *, cache_size: int = _CACHE_SIZE):
    self.codec, self.vocab_size = codec, int(vocab_size)
    self.words = -(-self.vocab_size // 32)
    self.tokenizer_size = int(codec.tokenizer.get_vocab_size())
    # Ids the sampler can produce and the tokenizer knows.
    self.allowed_size = min(self.vocab_size, self.tokenizer_size)
    self.eos_ids = tuple(i for i in codec.eos_ids if 0 <= i < self.allowed_size)
    self._cache_size = cache_size
    self._lock = threading.Lock()
    self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
    self._ll_tokenizer: llguidance.LLTokenizer | None = None
    self._executor: llguidance.LLExecutor | None = None

  def _tokenizer(self) -> llguidance.LLTokenizer:
    # Built on first use: about a second for a 49k vocabulary, paid only by models that get a constraint.
    with self._lock:
      if self._ll_tokenizer is None:
        if not self.eos_ids:
          raise ConstraintError(
            "constrained decoding needs an end-of-sequence token, and this model's tokenizer names none "
            f"within its {self.allowed_size} ids; use a model whose tokenizer has one"
          )
        self._ll_tokenizer = llguidance.LLTokenizer(
          self.codec.tokenizer.to_str(), n_vocab=self.tokenizer_size, eos_token=list(self.eos_ids)
        )
      return self._ll_tokenizer

  def check(self, c: Constraint) -> None:
    """Compile ``c`` (or find it compiled); raise :class:`ConstraintError` when it cannot be."""
    self._template(c)

  def matcher(self, c: Constraint) -> Matcher:
    """A fresh matcher at the start of the output, for one row."""
    template = self._template(c)
    with self._lock:  # the template is shared; copies are made one at a time (microseconds)
      ll = template.deep_copy()
    return Matcher(self, c, ll)

  def _template(self, c: Constraint) -> llguidance.LLMatcher:
    key = (c.kind, c.source)
    with self._lock:
      found = self._compiled.get(key)
      if found is not None:
        self._compiled.move_to_end(key)
        return found
    tokenizer = self._tokenizer()
    # Compiled outside the lock (llguidance drops the GIL): one slow grammar does not hold up other requests.
    compiled = llguidance.LLMatcher(tokenizer, _grammar_text(c), log_level=0, limits=_LIMITS)
    if compiled.is_error():
      raise ConstraintError(f"{c.kind}: cannot be compiled: {_short(c.kind, compiled.get_error())}")
    with self._lock:
      self._compiled[key] = compiled
      self._compiled.move_to_end(key)
      while len(self._compiled) > self._cache_size:
        self._compiled.popitem(last=False)
    return compiled

  def fill_rows(self, rows: Sequence[Matcher | None], out: np.ndarray) -> None:
    """Masks of a batch at once: row ``i`` of ``out`` (uint32 [B, words], C-contiguous) gets ``rows[i].fill``'s
    mask, or every id below ``vocab_size`` when ``rows[i]`` is None (an unconstrained row). The rows' masks are
    computed in parallel on llguidance's thread pool (the same bits as filling them one by one)."""
    if out.dtype != np.uint32 or out.ndim != 2 or out.shape[1] != self.words or not out.flags.c_contiguous:
      raise ValueError(
        f"mask buffer: expected a C-contiguous uint32 array of shape (B, {self.words}), got {out.dtype} {out.shape}"
      )
    if len(rows) > out.shape[0]:
      raise ValueError(f"mask buffer: {len(rows)} rows do not fit its {out.shape[0]}")
    live = [(m, i) for i, m in enumerate(rows) if m is not None and not m.stopped]
    if live:
      lib_words = live[0][0]._lib_words
      target = out if lib_words == self.words else np.zeros((len(rows), lib_words), np.uint32)
      with self._lock:
        if self._executor is None:
          self._executor = llguidance.LLExecutor()
        executor = self._executor
      executor.unsafe_compute_mask_ptr([(m._ll, i) for m, i in live], target.ctypes.data, lib_words * 4, len(rows))
    for i, m in enumerate(rows):
      if m is None:
        out[i] = 0xFFFFFFFF
        if self.vocab_size % 32:
          out[i, -1] = (1 << (self.vocab_size % 32)) - 1
      elif m.stopped:
        m.fill(out[i])
      else:
        if target is not out:
          n = min(lib_words, self.words)
          out[i, :n] = target[i, :n]
          out[i, n:] = 0
        m._finish(out[i])


def _grammar_text(c: Constraint) -> str:
  try:
    if c.kind == "json_schema":
      return llguidance.LLMatcher.grammar_from_json_schema(c.source, defaults=_JSON_DEFAULTS)
    if c.kind == "regex":
      return llguidance.LLMatcher.grammar_from_regex(c.source)
    if is_lark(c.source):
      return llguidance.LLMatcher.grammar_from_lark(c.source)
    return llguidance.grammar_from("grammar", c.source)  # GBNF, converted to Lark
  except Exception as e:  # the GBNF converter raises plain Exceptions
    hint = " (read as GBNF: a Lark grammar needs a line 'start: ...')" if c.kind == "grammar" else ""
    raise ConstraintError(f"{c.kind}: cannot be compiled{hint}: {_short(c.kind, str(e))}") from None


def is_lark(grammar: str) -> bool:
  """Whether a ``grammar`` text is read as Lark (a line ``start: ...`` or ``%llguidance``) rather than GBNF."""
  return is_lark_syntax(grammar)


class Matcher:
  """The constraint's state along one row's output. Not thread-safe: one row, one thread at a time."""

  def __init__(self, grammars: Grammars, constraint: Constraint, ll: llguidance.LLMatcher):
    self.constraint = constraint
    self._ll = ll
    self._eos = grammars.eos_ids
    self._words, self._limit = grammars.words, grammars.allowed_size
    self._eos_set = frozenset(self._eos)
    self._lib_words = -(-grammars.tokenizer_size // 32)
    # llguidance writes one word per 32 tokenizer ids; when that is wider than the logits, write it aside.
    self._scratch = np.zeros(self._lib_words, np.uint32) if self._lib_words > self._words else None
    self._consumed = 0
    # Eos is tracked here, not given to llguidance: once its language has no longer member, llguidance takes eos
    # without recording it, so a rollback over that eos would undo a real token instead.
    self._ended = False

  @property
  def accepting(self) -> bool:
    """The output so far is a complete member of the language (eos may come next)."""
    return self._ll.is_accepting()

  @property
  def stopped(self) -> bool:
    """Nothing but eos may follow (the language has no longer member, or eos was consumed)."""
    return self._ended or self._ll.is_stopped()

  def fill(self, out: np.ndarray) -> None:
    """Write the next token's allowed set into ``out`` (uint32 [words], C-contiguous): bit ``v & 31`` of word
    ``v >> 5`` is set when id ``v`` is allowed. Eos ids are allowed exactly when the output is accepting."""
    if out.dtype != np.uint32 or out.shape != (self._words,) or not out.flags.c_contiguous:
      raise ValueError(
        f"mask buffer: expected a C-contiguous uint32 array of shape ({self._words},), got {out.dtype} {out.shape}"
      )
    if self._ended or self._ll.is_stopped():
      out[:] = 0
    elif self._scratch is None:
      self._ll.unsafe_compute_mask_ptr(out.ctypes.data, self._lib_words * 4)
      out[self._lib_words :] = 0
    else:
      self._ll.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
      out[:] = self._scratch[: self._words]
    self._finish(out)

  def _finish(self, out: np.ndarray) -> None:
    """Clear ids past the tokenizer and the logits, set or clear the eos ids by ``accepting``; a matcher that ran
    past llguidance's limits (it allows nothing but eos from then on) raises :class:`ConstraintError` instead."""
    if self._ll.is_error():
      kind = self.constraint.kind
      raise ConstraintError(
        f"{kind}: after {self._consumed} output tokens the {_DESCRIPTION[kind]} needs more than the matcher's "
        f"limits allow ({_short(kind, self._ll.get_error())}); send a simpler one"
      )
    if self._limit % 32 and self._limit // 32 < self._words:  # ids past the tokenizer or the logits, same word
      out[self._limit // 32] &= np.uint32((1 << (self._limit % 32)) - 1)
    accepting = self._ll.is_accepting()
    for i in self._eos:
      if accepting:
        out[i >> 5] |= np.uint32(1 << (i & 31))
      else:
        out[i >> 5] &= np.uint32(~(1 << (i & 31)) & 0xFFFFFFFF)

  def consume(self, token: int) -> None:
    """Advance by one sampled token. An eos id while accepting ends the output; a token the constraint does not
    allow here raises :class:`ConstraintError` and leaves the state as it was."""
    token = int(token)
    kind = self.constraint.kind
    if not 0 <= token < self._limit:
      raise ConstraintError(f"{kind}: token id {token} is outside the vocabulary [0, {self._limit})")
    if self._ended:
      raise ConstraintError(f"{kind}: token {token} after the end of sequence")
    if token in self._eos_set:
      if not self._ll.is_accepting():
        raise ConstraintError(f"{kind}: end of sequence (token {token}) before the output is complete")
      self._ended = True
    elif self._ll.try_consume_tokens([token]) != 1:
      raise ConstraintError(f"{kind}: token {token} is not allowed here (the sampler must apply fill()'s mask)")
    self._consumed += 1

  def rollback(self, n: int) -> None:
    """Undo the last ``n`` consumed tokens (rejected speculative drafts); 0 <= n <= tokens consumed."""
    if not 0 <= n <= self._consumed:
      raise ValueError(f"rollback: expected 0 <= n <= {self._consumed} (tokens consumed), got {n}")
    self._consumed -= n
    if n and self._ended:
      self._ended, n = False, n - 1
    if n and not self._ll.rollback(n):
      raise RuntimeError(f"llguidance refused to roll back {n} tokens: {self._ll.get_error()}")

"""A SynthesizeRequest checked field by field before any model work, and what it is checked against.

:class:`Serving` is everything one registry sequence serves with (registry, synthesizer, composed explicit
paths); :func:`validate` turns the wire message into a :class:`Request` on one :class:`Serving`, or raises
:class:`Refused` with the status and a message that names the field, the limit and the fix. Validation
(parsing, tokenization, checks) runs on a worker thread and costs well under a millisecond, so a malformed
request never reaches the scheduler. The servicer hands the raw bytes to :func:`parse`, so a message that is
not a valid protobuf (including a string field that is not UTF-8) is INVALID_ARGUMENT, not INTERNAL.

Request fields: ``prompt`` is plain text; ``messages`` go through the registry tokenizer's chat template.
``max_latency_ms`` unset: the call's remaining deadline is the budget (no deadline: no budget).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import uuid
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from thoughtjax.decode.masks import grammars_for
from thoughtjax.decode.program import bucket
from thoughtjax.decode.request import ContextError, check_request
from thoughtjax.defaults import DEFAULT_MAX_TOKENS
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import parse_path
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.sampling import SamplingParams
from thoughtjax.server.config import ServerConfig
from thoughtjax.synthesis.hints import normalize_hints

MAX_REQUEST_ID = 128
MAX_CACHE_SALT = 256  # characters of a cache_salt
ROLES = ("system", "user", "assistant")
UNTIL_EOS_MIN_NEW = 64  # new tokens the room of a request without max_tokens holds at least (context permitting)


class Refused(Exception):
  """A request refused with ``code``; ``message`` says what to fix."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


@dataclasses.dataclass(eq=False)
class Serving:
  """Everything one registry sequence serves with; ``ReloadRegistry`` swaps the whole object at once and a
  request keeps the one it arrived under. ``owned``: opened by the server (a reload), closed by it."""

  syn: Any
  registry: Any
  max_context: int
  vocab: int
  num_layers: int
  owned: bool = False
  paths: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)  # path -> Model
  paths_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  @classmethod
  def of(cls, syn, owned: bool = False) -> Serving:
    reg = syn.registry
    cfg = reg.config
    return cls(syn, reg, int(cfg.max_context), int(cfg.vocab_size), int(cfg.num_layers), owned)

  @property
  def sequence(self) -> int:
    return int(self.syn.calibration.sequence)


@dataclasses.dataclass(frozen=True)
class Request:
  """A validated SynthesizeRequest, in the library's terms."""

  request_id: str
  prompt_ids: tuple[int, ...]
  hints: tuple[str, ...]  # as given (the synthesizer normalizes and reports corrections)
  max_latency_ms: float
  max_tokens: int
  sampling: dict
  path: str | None
  pin_sequence: int | None
  cache_salt: str = ""  # prefix-cache scope: keys are reused only between requests with the same salt
  serving: Serving | None = dataclasses.field(default=None, compare=False, repr=False)  # what it runs on


def parse(raw: bytes, cls):
  """``raw`` parsed as a ``cls`` message, or :class:`Refused` (INVALID_ARGUMENT) saying what a valid one is."""
  msg = cls()
  try:
    msg.ParseFromString(raw)
  except DecodeError as e:
    raise Refused(
      grpc.StatusCode.INVALID_ARGUMENT,
      f"the request is not a valid {cls.DESCRIPTOR.full_name} ({e}): malformed protobuf, or a "
      f"string field that is not valid UTF-8; send UTF-8 text in a message built from "
      f"thoughtjax/proto/v1/synthesis.proto",
    ) from None
  return msg


def validate(
  m: pb.SynthesizeRequest, deadline_s: float | None, s: Serving, config: ServerConfig, *, until_eos: bool = False
) -> Request:
  """A :class:`Request` on ``s`` under ``config``'s limits, or :class:`Refused` naming the field (no model
  work; tokenization only). ``deadline_s``: the call's remaining deadline in seconds (None: none).
  ``max_tokens`` unset: :data:`DEFAULT_MAX_TOKENS`, or with ``until_eos`` (OpenAI's meaning, the HTTP endpoint)
  as many as fit: ``max_tokens_limit``, the context left after the prompt, or what is left of ``until_eos_tokens``
  (doubled until the prompt and :data:`UNTIL_EOS_MIN_NEW` tokens fit) after it, whichever is smallest."""
  bad = lambda msg: Refused(grpc.StatusCode.INVALID_ARGUMENT, msg)
  rid = m.request_id or uuid.uuid4().hex
  if len(rid) > MAX_REQUEST_ID or not rid.isprintable() or not rid.isascii():
    raise bad(
      f"request_id: expected at most {MAX_REQUEST_ID} printable ASCII characters, got {len(rid)} "
      f"characters {rid[:40]!r}; send a shorter id or none (one is generated)"
    )
  codec = s.registry.codec
  if bool(m.prompt) == bool(m.messages):
    raise bad(
      "give exactly one of prompt (plain text) and messages (chat), got "
      + ("both" if m.prompt else "neither (an empty prompt)")
    )
  if m.prompt:
    text = m.prompt
  else:
    for i, msg in enumerate(m.messages):
      if msg.role not in ROLES:
        raise bad(f"messages[{i}].role: expected one of {list(ROLES)}, got {msg.role!r}")
      if not msg.content:
        raise bad(f"messages[{i}].content is empty; give text or drop the message")
    if getattr(codec, "chat_template", None) is None:
      raise bad("this registry's tokenizer has no chat template; send prompt (plain text) instead of messages")
    text = codec.render_chat([{"role": x.role, "content": x.content} for x in m.messages])
  ids = codec.encode(text)
  if not ids:
    raise bad("the prompt is empty after tokenization; give at least one token of text")
  try:
    normalize_hints(list(m.hints), s.syn.dictionary)
  except UserError as e:
    raise bad(f"hints: {e}") from None
  if m.HasField("max_tokens"):
    n = int(m.max_tokens)
  elif until_eos:
    room = s.max_context
    if config.until_eos_tokens:
      room = min(room, bucket(len(ids) + UNTIL_EOS_MIN_NEW, config.until_eos_tokens))
    n = min(config.max_tokens_limit, room - len(ids))
    if n < 1:
      raise Refused(
        grpc.StatusCode.OUT_OF_RANGE,
        f"the prompt's {len(ids)} tokens fill the model's context of {s.max_context}; shorten the prompt",
      )
  else:
    n = DEFAULT_MAX_TOKENS
  if not 1 <= n <= config.max_tokens_limit:
    raise bad(f"max_tokens: expected 1..{config.max_tokens_limit} (the server's max_tokens_limit), got {n}")
  if m.HasField("max_latency_ms"):
    budget = m.max_latency_ms
    if not math.isfinite(budget) or budget <= 0:
      raise bad(
        f"max_latency_ms: expected a finite number of milliseconds > 0, got {budget}; leave it unset for the "
        f"call's deadline"
      )
  else:
    budget = math.inf if deadline_s is None else max(deadline_s * 1e3, 1e-3)
  stops = list(m.stop_strings)
  if len(stops) > config.max_stop_strings:
    raise bad(
      f"stop_strings: {len(stops)} given, the server takes at most {config.max_stop_strings} (max_stop_strings); "
      f"send fewer"
    )
  for i, stop in enumerate(stops):
    if len(stop) > config.max_stop_chars:
      raise bad(
        f"stop_strings[{i}]: {len(stop)} characters, the server takes at most {config.max_stop_chars} per stop "
        f"string (max_stop_chars); send a shorter one"
      )
  sampling = dict(
    temperature=float(m.temperature) if m.HasField("temperature") else 0.0,
    top_k=int(m.top_k),
    top_p=float(m.top_p) if m.HasField("top_p") else 1.0,
    seed=int(m.seed),
    logit_bias={int(k): float(v) for k, v in m.logit_bias.items()} or None,
    stop_token_ids=tuple(m.stop_token_ids),
    stop_strings=tuple(stops),
  )
  for field in ("json_schema", "regex", "grammar"):
    if getattr(m, field):
      sampling[field] = getattr(m, field)
  try:
    # The library's one check of a request's fields (types' ranges, finiteness, the vocabulary, the context).
    params = SamplingParams(max_tokens=n, **sampling)
    check_request([ids], [params], vocab_size=s.vocab, max_context=s.max_context)
  except ContextError as e:
    raise Refused(grpc.StatusCode.OUT_OF_RANGE, str(e)) from None
  except UserError as e:
    raise bad(f"sampling: {e}") from None
  if params.constraint is not None:
    try:  # compiled against the tokenizer now (then cached), so a bad one is refused before any model work
      grammars_for(codec, s.vocab).check(params.constraint)
    except UserError as e:
      raise bad(str(e)) from None
  path = m.path or None
  if path is not None:
    check_path(path, s, config)
  pin = int(m.registry_sequence) if m.HasField("registry_sequence") else None
  served = s.sequence
  if pin is not None and pin != served:
    raise Refused(
      grpc.StatusCode.FAILED_PRECONDITION,
      f"registry_sequence: the request pins {pin}, this server plans at sequence {served}; pin "
      f"{served}, or send it to a server of sequence {pin}",
    )
  salt = m.cache_salt
  if len(salt) > MAX_CACHE_SALT or not salt.isprintable():
    raise bad(
      f"cache_salt: expected at most {MAX_CACHE_SALT} printable characters, got {len(salt)} characters; send a "
      "shorter salt (e.g. a hash of the tenant's id)"
    )
  return Request(rid, tuple(ids), tuple(m.hints), float(budget), n, sampling, path, pin, cache_salt=salt, serving=s)


def check_path(path: str, s: Serving, config: ServerConfig) -> None:
  """An explicit path's syntax and size: at most ``max_path_layers`` pieces and layers (default twice the
  model's layers), counted before anything is parsed or read, so a huge path costs no manifest reads."""
  limit = config.max_path_layers or 2 * s.num_layers
  why = f"the server's limit is {limit} (max_path_layers; default twice the model's {s.num_layers} layers)"
  pieces = path.count(",") + 1
  if pieces > limit:
    raise Refused(
      grpc.StatusCode.INVALID_ARGUMENT, f"path: {pieces} pieces; {why}. Send a shorter path or let the server plan"
    )
  try:
    refs = parse_path(path)
  except UserError as e:
    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"path: {e}") from None
  layers = sum(b - a for a, b in (r.span for r in refs if r.span is not None))
  if layers > limit:
    raise Refused(
      grpc.StatusCode.INVALID_ARGUMENT,
      f"path: runs {layers} layers; {why}. Send a shorter path or let the server plan",
    )

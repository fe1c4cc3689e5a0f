"""What the server answers: the status of each failure, the text a client may read, and the pb messages
built from a run (plan, final, trailing metadata).

Status of each failure (:func:`status_of`; the servicer's module docstring lists which check gives which):
:class:`~thoughtjax.server.validation.Refused` carries its own; a full queue is RESOURCE_EXHAUSTED, an expired deadline
DEADLINE_EXCEEDED, a pinned sequence that is not served or no path left FAILED_PRECONDITION, an unknown
thoughtlet INVALID_ARGUMENT, any other registry error FAILED_PRECONDITION and any other user error
INVALID_ARGUMENT. Anything else is a bug (None: it propagates and is answered INTERNAL).

Messages name the field, the limit and the fix, and carry no filesystem path (:func:`public_message`
replaces it by ``<path>``), exception class name or traceback.

Trace and billing travel twice: in the final message (:func:`final_message`) and in the trailing metadata
(:func:`trailer`; gRPC conventions: lowercase keys, ``-bin`` for binary): ``thoughtjax-trace-bin`` and
``thoughtjax-usage-bin`` (the serialized ``Trace`` and ``Usage``), and text keys ``x-thoughtjax-*`` (request
id, path hash, registry sequence, tokens, compute seconds, degraded, finish reason, program cache) that
proxies and access logs can read without the proto. :func:`thoughtjax.client.read_trailer` reads them back.

A run is a :class:`~thoughtjax.synthesis.synthesize.Synthesizer`'s result, or a :class:`PathRun` (an explicit
path from the request, shaped like one).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

import grpc

from thoughtjax.client import TEXT_PREFIX, TRACE_KEY, USAGE_KEY
from thoughtjax.decode.request import RequestRun
from thoughtjax.errors import UserError
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.registry import (
  IntegrityError,
  RegistryError,
  RestoreError,
  RollbackError,
  ScratchSpaceError,
  SignatureDowngradeError,
  SignatureError,
  UnknownThoughtletError,
)
from thoughtjax.sampling import SamplingParams
from thoughtjax.server.metrics import FAILURE_FIELDS
from thoughtjax.server.scheduling import DeadlineExpired, QueueFull
from thoughtjax.server.validation import Refused, Request
from thoughtjax.synthesis.planner import NoPathError, SequenceMismatchError


def status_of(e: BaseException) -> grpc.StatusCode | None:
  """The status of a library or scheduler error (None: not a user error, a bug: it propagates)."""
  if isinstance(e, Refused):
    return e.code
  if isinstance(e, QueueFull):
    return grpc.StatusCode.RESOURCE_EXHAUSTED
  if isinstance(e, DeadlineExpired):
    return grpc.StatusCode.DEADLINE_EXCEEDED
  if isinstance(e, (SequenceMismatchError, NoPathError)):
    return grpc.StatusCode.FAILED_PRECONDITION
  if isinstance(e, UnknownThoughtletError):
    return grpc.StatusCode.INVALID_ARGUMENT
  if isinstance(e, ScratchSpaceError):  # the server's disk, not the client's request: retry later
    return grpc.StatusCode.RESOURCE_EXHAUSTED
  if isinstance(e, RegistryError):
    return grpc.StatusCode.FAILED_PRECONDITION
  if isinstance(e, UserError):
    return grpc.StatusCode.INVALID_ARGUMENT
  return None


def failure_field(e: BaseException) -> str | None:
  """The registry failure counter (:data:`thoughtjax.server.metrics.FAILURE_FIELDS`) ``e`` counts in, or None."""
  for cls, kind in (
    (SignatureDowngradeError, "downgrade"),
    (SignatureError, "signature"),
    (IntegrityError, "integrity"),
    (RollbackError, "rollback"),
    (RestoreError, "restore"),
  ):
    if isinstance(e, cls):
      return FAILURE_FIELDS[kind]
  return None


# An absolute or home-relative filesystem path (not a URL's path, not blocks[a:b) or a/b words).
_ABS_PATH = re.compile(r"(?<![\w:/.~-])~?/[^\s'\"`,;()\[\]{}<>]+")


_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def log_safe(text: object, limit: int = 4000) -> str:
  """``text`` for one log line: control characters (a client's newline could forge a log line) escaped."""
  text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
  return text if len(text) <= limit else text[: limit - 3] + "..."


# An exception class's name (RestoreError, KeyError, ...): what failed is said in words, never by the class.
_CLASS_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b")


def public_note(text: str, limit: int = 2000) -> str:
  """A plan's or trace's text (reason, note, rejection) as a client may read it: :func:`public_message`, and no
  exception class name."""
  return public_message(_CLASS_NAME.sub("failure", text), limit)


def public_message(text: str, limit: int = 2000) -> str:
  """``text`` as a client may read it: filesystem paths replaced by ``<path>``, at most ``limit`` characters."""
  text = _ABS_PATH.sub("<path>", text)
  return text if len(text) <= limit else text[: limit - 3] + "..."


class PathRun(RequestRun):
  """An explicit path's request, run like a SynthesisResult by the scheduler and summed up by the final message."""

  def __init__(self, model, r: Request, sequence: int):
    self.t0 = time.perf_counter()
    super().__init__(model.request([list(r.prompt_ids)], SamplingParams(max_tokens=r.max_tokens, **r.sampling)))
    self.wire, self.sequence = r, sequence
    self.text = ""

  def __next__(self):
    d = super().__next__()
    self.text += d.text
    return d


def plan_message(plan, request_id: str) -> pb.Plan:
  """A synthesizer's plan as the wire ``Plan``."""
  j = plan.to_json()
  out = pb.Plan(
    path=plan.path,
    refs=list(plan.refs),
    path_hash=plan.path_hash,
    kind=plan.kind,
    hints=list(plan.hints),
    predicted_ms={k: float(v) for k, v in j["predicted_ms"].items()},
    degraded=plan.degraded,
    reason=public_note(plan.reason),
    notes=[public_note(n) for n in plan.notes],
    registry_sequence=plan.sequence,
    max_tokens=plan.max_tokens,
    quality_json=json.dumps(j["quality"]),
    request_id=request_id,
    corrected_hints=[pb.HintCorrection(given=a, corrected=b) for a, b in plan.corrected_hints],
    rejected=[
      pb.Rejection(path=x.path, path_hash=x.path_hash, why=x.why, detail=public_note(x.detail)) for x in plan.rejected
    ],
  )
  if plan.tokens_that_fit is not None:
    out.tokens_that_fit = plan.tokens_that_fit
  return out


@dataclasses.dataclass(frozen=True)
class PathShape:
  """What a plan says of an explicit path (a composed Model has the same three attributes)."""

  path: str
  refs: tuple[str, ...]
  path_hash: str


def explicit_plan(model, r: Request, sequence: int) -> pb.Plan:
  """The ``Plan`` of an explicit path (``model``: a composed Model or a :class:`PathShape`), not planned."""
  return pb.Plan(
    path=model.path,
    refs=list(model.refs),
    path_hash=model.path_hash,
    kind="explicit",
    reason="explicit path from the request (not planned)",
    registry_sequence=sequence,
    max_tokens=r.max_tokens,
    request_id=r.request_id,
  )


def run_plan(run, r: Request) -> pb.Plan:
  """The ``Plan`` a stream starts with: the run's own, or its explicit path's."""
  if isinstance(run, PathRun):
    return explicit_plan(run.model, r, run.sequence)
  return plan_message(run.plan, r.request_id)


def final_message(run, last, queue_ms: float | None = None) -> pb.Final:
  """The final message of ``run`` (on the sequence it started with); ``queue_ms``: its wait for a turn."""
  out = _final_of(run, last)
  if queue_ms is not None:
    out.trace.actual_ms["queue"] = queue_ms
  gt = run.generation.trace
  out.trace.program_cache_hit = gt.first_token is not None and gt.compile_s == 0.0
  reused = gt.prefix_cache_tokens  # set by a slot engine that has a prefix cache
  if reused is not None:
    out.trace.prefix_cache_tokens = reused
  return out


def trailer(final: pb.Final, request_id: str) -> tuple[tuple[str, str | bytes], ...]:
  """The trailing metadata of a finished stream: the final message's trace and usage (see the module
  docstring; :func:`thoughtjax.client.read_trailer` is the reader)."""
  t, u = final.trace, final.usage
  text = {
    "request-id": request_id,
    "finish-reason": final.finish_reason,
    "path-hash": t.path_hash,
    "registry-sequence": str(t.registry_sequence),
    "degraded": "true" if t.degraded else "false",
    "program-cache": "hit" if t.program_cache_hit else "miss",
    **({"prefix-cache-tokens": str(t.prefix_cache_tokens)} if t.HasField("prefix_cache_tokens") else {}),
    "tokens-in": str(u.tokens_in),
    "tokens-out": str(u.tokens_out),
    "compute-seconds": f"{u.compute_seconds:.6f}",
    "predicted-ms": f"{t.predicted_ms.get('total', 0.0):.3f}",
    "actual-ms": f"{t.actual_ms.get('total', 0.0):.3f}",
  }
  if t.degraded:  # metadata text must be printable ASCII
    text["degraded-reason"] = "".join(ch if " " <= ch <= "~" else "?" for ch in t.reason)[:512]
  return (
    (TRACE_KEY, t.SerializeToString()),
    (USAGE_KEY, u.SerializeToString()),
    *((TEXT_PREFIX + k, v) for k, v in text.items()),
  )


def _final_of(run, last) -> pb.Final:
  reason = (last.finish_reason if last is not None and last.finished else None) or "length"
  gt = run.generation.trace
  if isinstance(run, PathRun):
    sequence = run.sequence
    actual = {
      "compile": gt.compile_s * 1e3,
      "prefill": (gt.prefill_s or 0.0) * 1e3,
      "decode": (gt.decode_s or 0.0) * 1e3,
      "total": ((gt.end or time.perf_counter()) - run.t0) * 1e3,
    }
    tokens_in, tokens_out = len(run.wire.prompt_ids), sum(gt.tokens_out)
    trace = pb.Trace(
      path=run.model.path,
      path_hash=run.model.path_hash,
      refs=run.model.refs,
      actual_ms=actual,
      registry_sequence=sequence,
      reason="explicit path",
      decode_chunks=gt.decode_chunks,
    )
    compute = sum(actual.get(s, 0.0) for s in ("compile", "prefill", "decode")) / 1e3
    return pb.Final(
      finish_reason=reason,
      text=run.text,
      trace=trace,
      usage=pb.Usage(tokens_in=tokens_in, tokens_out=tokens_out, compute_seconds=compute),
    )
  t = run.trace
  trace = pb.Trace(
    path=t.path,
    path_hash=t.path_hash,
    refs=list(t.refs),
    hints=list(t.hints),
    degraded=t.degraded,
    reason=public_note(t.reason),
    predicted_ms={k: float(v) for k, v in t.predicted_ms.items()},
    actual_ms={k: float(v) for k, v in t.actual_ms.items()},
    registry_sequence=run.plan.sequence,
    corrected_hints=[pb.HintCorrection(given=a, corrected=b) for a, b in run.plan.corrected_hints],
    decode_chunks=gt.decode_chunks,
  )
  return pb.Final(
    finish_reason=t.finish_reason or reason,
    text=run.text,
    trace=trace,
    usage=pb.Usage(tokens_in=t.tokens_in, tokens_out=t.tokens_out, compute_seconds=t.compute_seconds),
  )

"""A decode request's fields checked against a model, once, for the CLI, the Python API and the server.

:class:`~thoughtjax.sampling.SamplingParams` checks what needs no model (ranges, finiteness, one constraint);
:func:`check_request` checks the rest against the model that will run it: prompts of in-vocabulary ids, ids
and counts that fit the vocabulary, prompt plus new tokens within the context. ``Model.stream_batch`` (so
``generate``, ``stream``, the CLI, synthesis and the slot engine's request) calls it before any device work; the
server calls it while validating, mapping :class:`ContextError` to OUT_OF_RANGE and the rest to
INVALID_ARGUMENT. Each error names the field, the limit and the fix.

:class:`DecodeRequest` is what a checked request hands the programs: the prompt ids, the sampling parameters and
the stop ids of each row, and the program-key fields they ask for (batch, prompt and output buckets, stop-set width,
sampling mode, bias). The plain and the self-speculative programs build their keys and their left-padded prompts
from it.

:class:`ModelRequest` is a checked request bound to the model (and draft) that will run it, before any device
work: ``Model.request`` makes one, and its caller either runs it alone (``Model.run``, a
:class:`~thoughtjax.decode.stream.Generation`) or hands its one row to a slot engine of continuous batching
(:meth:`ModelRequest.slot`). ``Model.stream_batch`` is the two in one call. :class:`RequestRun` is a request
with the stream it takes deltas from once one of the two is chosen (a synthesized request, a server's run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from thoughtjax.decode.program import bucket
from thoughtjax.decode.stream import RequestError
from thoughtjax.defaults import DEFAULT_DRAFT_TOKENS
from thoughtjax.sampling import SamplingParams, program_mode, stop_ids_for


class ContextError(RequestError):
  """A prompt plus its new tokens past the model's context (the server's OUT_OF_RANGE)."""


def check_request(
  prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], *, vocab_size: int, max_context: int
) -> None:
  """Raise a :class:`~thoughtjax.errors.UserError` naming the field unless every row of a request fits a model of
  ``vocab_size`` tokens and ``max_context`` positions: at least one prompt, one ``params`` per prompt, each
  prompt at least one id in ``[0, vocab_size)``, each ``params`` within the vocabulary
  (:meth:`SamplingParams.check_model`), and each prompt plus its ``max_tokens`` within the context. Rows of one
  call share one program, so the longest prompt plus the largest ``max_tokens`` must fit as well."""
  if not prompts:
    raise RequestError("the request has no prompts; give at least one")
  if len(params) != len(prompts):
    raise RequestError(
      f"got {len(prompts)} prompts but {len(params)} sampling settings; give one per prompt "
      f"or a single SamplingParams for all"
    )
  for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
    where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
    if len(ids) == 0:
      raise RequestError(f"{where} has no tokens; give at least one")
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
      raise RequestError(
        f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size}); send ids the model's tokenizer produces"
      )
    p.check_model(vocab_size)
    _fits(where, len(ids), p.max_tokens, max_context, "")
  longest, most = max(len(ids) for ids in prompts), max(p.max_tokens for p in params)
  _fits("the longest prompt", longest, most, max_context, " (the rows of one call share one program)")


def _fits(what: str, prompt_tokens: int, max_tokens: int, max_context: int, why: str) -> None:
  total = prompt_tokens + max_tokens
  if total > max_context:
    raise ContextError(
      f"{what} ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the model's context of "
      f"{max_context} tokens{why}; shorten the prompt or lower max_tokens"
    )


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
  """Rows of one decode call: each row's prompt ids, :class:`~thoughtjax.sampling.SamplingParams` and stop ids.

  Build it with :meth:`checked` (fields checked against the model, stop ids from the params and the model's
  end-of-sequence ids); the constructor takes rows as given, for callers that choose the stop ids themselves."""

  ids: tuple[tuple[int, ...], ...]
  params: tuple[SamplingParams, ...]
  stops: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    object.__setattr__(self, "ids", tuple(tuple(int(t) for t in row) for row in self.ids))
    object.__setattr__(self, "params", tuple(self.params))
    object.__setattr__(self, "stops", tuple(tuple(int(t) for t in row) for row in self.stops))
    if not len(self.ids) == len(self.params) == len(self.stops):
      raise RequestError(
        f"a decode request needs one params and one stop set per prompt; got {len(self.ids)} prompts, "
        f"{len(self.params)} params, {len(self.stops)} stop sets"
      )

  @classmethod
  def checked(
    cls,
    ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    vocab_size: int,
    max_context: int,
    eos_ids: int | Sequence[int] | None,
  ) -> DecodeRequest:
    """The request after :func:`check_request`; each row stops on its ``stop_token_ids`` and, unless it ignores
    them, on ``eos_ids``."""
    check_request(ids, params, vocab_size=vocab_size, max_context=max_context)
    return cls(tuple(ids), tuple(params), tuple(stop_ids_for(p, eos_ids) for p in params))

  def key_fields(self) -> dict:
    """The :class:`~thoughtjax.decode.program.ProgramKey` fields this request asks for, bucketed so that requests
    of nearby sizes share a program: ``batch``, ``prompt_len``, ``max_new``, ``stop_width``, ``mode``,
    ``has_bias``."""
    return dict(
      batch=bucket(len(self.ids), 1),
      prompt_len=bucket(max(len(row) for row in self.ids)),
      max_new=bucket(max(p.max_tokens for p in self.params)),
      stop_width=bucket(max(len(s) for s in self.stops), 4),
      mode=program_mode(self.params),
      has_bias=any(p.logit_bias for p in self.params),
    )

  def left_padded(self, batch: int, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts as ``tokens`` [batch, prompt_len] i32, each row's ids at its end, and ``pad`` [batch], the
    padding before each row; rows past the prompts hold one inert token (pad ``prompt_len - 1``)."""
    tokens = np.zeros((batch, prompt_len), np.int32)
    pad = np.full(batch, prompt_len - 1, np.int32)
    for r, row in enumerate(self.ids):
      pad[r] = prompt_len - len(row)
      tokens[r, pad[r] :] = row
    return tokens, pad


@dataclasses.dataclass(frozen=True)
class ModelRequest:
  """A :class:`DecodeRequest` bound to the ``model`` that runs it (``Model.request`` makes it, checked).

  ``template``/``user``: the prompt template and each row's user ids when the prompts go in through one (the
  program embeds the template's rows itself), else None; ``draft``/``draft_tokens``: self-speculative decoding
  (None: plain); ``start``: when the call began (``time.perf_counter``), the trace's zero."""

  model: Any
  decode: DecodeRequest
  start: float
  template: Any = None
  user: tuple[tuple[int, ...], ...] | None = None
  draft: Any = None
  draft_tokens: int = DEFAULT_DRAFT_TOKENS

  def slot(self) -> tuple[tuple[int, ...], SamplingParams] | None:
    """``(prompt ids, SamplingParams)`` of a plain one-prompt request, which a slot engine may run (the server's
    continuous batching); None for a batch or a self-speculative request, which only ``Model.run`` runs."""
    if self.draft is not None or len(self.decode.ids) != 1:
      return None
    return self.decode.ids[0], self.decode.params[0]


class RequestRun:
  """A :class:`ModelRequest` and, once started, the stream it takes deltas from (``generation``): its own
  :class:`~thoughtjax.decode.stream.Generation` (:meth:`start`: run alone; the first ``next()`` starts it) or a
  slot engine's run of ``request.slot()`` (:meth:`run_in`). ``cancel()`` and ``close()`` hold before it starts
  too: a cancelled request starts and ends at once with finish_reason ``cancelled``, a closed one never starts."""

  plan = None  # a synthesized run's plan (SynthesisResult)
  reservation = None  # the row its plan reserved in a server's engine pool, if any

  def __init__(self, request: ModelRequest):
    self.request = request
    self.generation = None
    self._cancelled = self._closed = False

  @property
  def model(self):
    return self.request.model

  def start(self) -> None:
    """Run the request alone on its model (no-op once started or closed)."""
    if self.generation is None and not self._closed:
      self.generation = self.request.model.run(self.request)
      if self._cancelled:
        self.generation.cancel()

  def run_in(self, stream) -> None:
    """Take deltas from ``stream`` (a slot engine's run of ``request.slot()``) instead of running alone."""
    if self.generation is not None:
      raise RuntimeError("this request already runs; hand a request to a slot engine before it starts")
    self.generation = stream
    if self._cancelled:
      stream.cancel()

  def __iter__(self):
    return self

  def __next__(self):
    self.start()
    if self.generation is None:  # closed before it started
      raise StopIteration
    return next(self.generation)

  def cancel(self) -> None:
    """End it at the next chunk (from any thread); unfinished rows end with finish_reason ``cancelled``."""
    self._cancelled = True
    if self.generation is not None:
      self.generation.cancel()

  def close(self) -> None:
    """Abandon it: no further device work (a request not started never starts)."""
    self._closed = True
    if self.generation is not None:
      self.generation.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

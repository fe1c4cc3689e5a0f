"""A decode request's fields checked against a model, once, for the CLI, the Python API and the server.

:class:`~thoughtjax.sampling.SamplingParams` checks what needs no model (ranges, finiteness, one constraint);
:func:`check_request` checks the rest against the model that will run it: prompts of in-vocabulary ids, ids
and counts that fit the vocabulary, prompt plus new tokens within the context. ``Model.stream_batch`` (so
``generate``, ``stream``, the CLI, synthesis and the slot engine's request) calls it before any device work; the
server calls it while validating, mapping :class:`ContextError` to OUT_OF_RANGE and the rest to
INVALID_ARGUMENT. Each error names the field, the limit and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from thoughtjax.decode.stream import RequestError
from thoughtjax.sampling import SamplingParams


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

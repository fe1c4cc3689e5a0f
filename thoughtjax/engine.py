"""The user-facing model: ``generate``, ``stream`` and ``score`` over a layer path.

>>> import thoughtjax
>>> m = thoughtjax.load()                      # the default model, fetched on first use
>>> m.generate("What is the capital of France?", chat=True).text
>>> for delta in m.stream("Once upon a time", max_tokens=20): print(delta.text, end="")
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax import program as program_lib
from thoughtjax.loading import LoadedModel
from thoughtjax.loading import load as load_model
from thoughtjax.program import GraphDefs, PathParts, ProgramKey, TemplatePrompt, bucket
from thoughtjax.sampling import SamplingParams, program_mode, sampling_arrays, stop_ids_for


@dataclasses.dataclass
class Delta:
  """One streamed piece of a row's output."""

  row: int
  token_ids: list[int]
  text: str
  finished: bool = False
  finish_reason: str | None = None  # "stop", "length", "stop_string"


@dataclasses.dataclass
class Completion:
  prompt_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: str
  timings: dict


@dataclasses.dataclass
class Score:
  token_ids: list[int]
  top_ids: list[list[int]]  # per position t: top-K ids of the next-token distribution
  top_logits: list[list[float]]
  token_logprobs: list[float]  # log p(token[t+1] | tokens[:t+1]), t = 0..n-2
  nll: float  # mean negative log-likelihood per predicted token
  perplexity: float


class _RowText:
  """Incremental detokenization and stop-string detection for one row."""

  def __init__(self, codec, stop_strings: Sequence[str]):
    self.codec, self.stop_strings = codec, tuple(s for s in stop_strings if s)
    self.ids: list[int] = []
    self.emitted = ""
    self.stopped = False

  def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
    self.ids.extend(new_ids)
    text = self.codec.decode(self.ids)
    for s in self.stop_strings:
      at = text.find(s)
      if at >= 0:
        self.stopped = True
        text = text[:at]
        break
    # Hold back an incomplete UTF-8 sequence and any tail that may start a stop string.
    hold = 0
    if not (final or self.stopped):
      if text.endswith("\ufffd"):
        return "", False
      for s in self.stop_strings:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
          if text.endswith(s[:n]):
            hold = max(hold, n)
            break
    visible = text[: len(text) - hold]
    delta = visible[len(self.emitted):] if visible.startswith(self.emitted) else visible
    self.emitted = visible if visible.startswith(self.emitted) else self.emitted + delta
    return delta, self.stopped


class Model:
  """A loaded model plus the path it runs (default: every layer once)."""

  def __init__(self, loaded: LoadedModel, layers: Sequence[int] | None = None,
               sampler: str | None = None, chunk: int = program_lib.DEFAULT_CHUNK,
               parts: PathParts | None = None):
    self.loaded = loaded
    self.config = loaded.config
    self.codec = loaded.codec
    self.module = loaded.model
    self.layers = tuple(range(self.config.num_layers)) if layers is None else tuple(layers)
    self.sampler, self.chunk = sampler, chunk
    self._defs = GraphDefs.from_model(self.module)
    # The parameters this path reads: taken from the module, or handed in (e.g. restored
    # thoughtlets), holding only the blocks the path uses.
    self._parts = PathParts.from_model(self.module, self.layers) if parts is None else parts
    missing = set(self.layers) - set(self._parts.blocks)
    if missing:
      raise ValueError(f"path uses layers {sorted(missing)} that the given parts do not hold")
    self.last_timings: dict = {}

  @property
  def parts(self) -> PathParts:
    return self._parts

  def with_chunk(self, chunk: int) -> "Model":
    """The same model streaming in decode chunks of ``chunk`` steps."""
    if chunk < 1:
      raise ValueError(f"chunk must be >= 1, got {chunk}")
    return Model(self.loaded, self.layers, self.sampler, chunk, self._parts)

  def with_path(self, layers: Sequence[int], parts: PathParts | None = None) -> "Model":
    """The same weights (shared, not copied) running another layer path."""
    return Model(self.loaded, layers, self.sampler, self.chunk, parts)

  # ---- prompts ------------------------------------------------------------------
  def prompt_ids(self, prompt: str | Sequence[int], chat: bool = False, system: str | None = None) -> list[int]:
    if not isinstance(prompt, str):
      return [int(t) for t in prompt]
    if chat:
      messages = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": prompt}]
      prompt = self.codec.render_chat(messages)
    ids = self.codec.encode(prompt)
    if not ids:
      raise ValueError("the prompt is empty after tokenization; give at least one token")
    return ids

  def _template_split(self, prompts, chat: bool, system: str | None):
    """(template, user token ids per prompt) for chat prompts, else (None, None)."""
    if not all(isinstance(p, str) for p in prompts):
      return None, None
    template = getattr(self, "template", None)
    if template is None:
      if not chat or self.codec.chat_template is None:
        return None, None
      template = self._chat_template(system)
    user = [self.codec.tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    if not all(user):
      raise ValueError("the prompt is empty after tokenization; give at least one token")
    if template is not getattr(self, "template", None):
      # Tokenizing the parts apart must give what tokenizing the whole prompt gives.
      for p, u in zip(prompts, user):
        if template["prefix_ids"] + u + template["suffix_ids"] != self.prompt_ids(p, True, system):
          return None, None
    return template, user

  def _chat_template(self, system: str | None) -> dict:
    cache = self.__dict__.setdefault("_templates", {})
    if system not in cache:
      prefix, suffix = self.codec.chat_template_parts(system)
      table = self._parts.embed["table"][...]
      cache[system] = {"system": system, "prefix_ids": prefix, "suffix_ids": suffix,
                       "prefix_rows": jnp.take(table, jnp.asarray(prefix, jnp.int32), axis=0),
                       "suffix_rows": jnp.take(table, jnp.asarray(suffix, jnp.int32), axis=0)}
    return cache[system]

  # ---- generation -------------------------------------------------------------------
  def stream_batch(self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams] | SamplingParams | None = None,
                   chat: bool = False, system: str | None = None, stream_mode: str = "chunks") -> Iterator[Delta]:
    """Generate for several prompts at once, yielding deltas as tokens are produced.

    Chat prompts (``chat=True``, or any string prompt on a model with a template) go in as
    the template's fixed rows around the user tokens, embedded by the fused template
    kernel inside the program; other prompts go in as token ids.
    """
    template, user = self._template_split(prompts, chat, system)
    if template is None:
      ids = [self.prompt_ids(p, chat, system) for p in prompts]
    else:
      ids = [template["prefix_ids"] + u + template["suffix_ids"] for u in user]
    if params is None:
      params = SamplingParams()
    if isinstance(params, SamplingParams):
      params = [params] * len(ids)
    if len(params) != len(ids):
      raise ValueError(f"got {len(ids)} prompts but {len(params)} sampling settings")
    longest = max(len(i) for i in ids)
    max_new = max(p.max_tokens for p in params)
    limit = self.config.max_context
    if longest + max_new > limit:
      raise ValueError(f"prompt ({longest} tokens) + max_tokens ({max_new}) exceeds the model's context of {limit}")
    stops = [stop_ids_for(p, self.config.eos_id) for p in params]
    key = ProgramKey(
        layers=self.layers, batch=bucket(len(ids), 1), prompt_len=bucket(longest),
        max_new=bucket(max_new), stop_width=bucket(max(len(s) for s in stops), 4),
        mode=program_mode(params), has_bias=any(p.logit_bias for p in params),
        chunk=self.chunk, sampler=self.sampler,
        template=None if template is None else (len(template["prefix_ids"]), len(template["suffix_ids"])))
    prog = program_lib.PROGRAMS.get(key, self._defs, self.config)
    B, T = key.batch, key.prompt_len
    pad = np.full(B, T - 1, np.int32)
    for r, row in enumerate(ids):
      pad[r] = T - len(row)
    if template is None:
      tokens = np.zeros((B, T), np.int32)
      for r, row in enumerate(ids):
        tokens[r, T - len(row):] = row
      prompt = jnp.asarray(tokens)
    else:
      P1, P2 = key.template
      user_ids = np.zeros((B, T - P1 - P2), np.int32)
      lengths = np.ones(B, np.int32)  # batch-bucket rows beyond the prompts: one token, inert
      pad[len(user):] = T - (P1 + 1 + P2)
      for r, u in enumerate(user):
        user_ids[r, : len(u)] = u
        lengths[r] = len(u)
      prompt = TemplatePrompt(template["prefix_rows"], template["suffix_rows"], jnp.asarray(user_ids),
                              jnp.asarray(lengths))
    samp = sampling_arrays(params, B, self.config.vocab_size, key.stop_width, self.config.eos_id, key.has_bias)
    rows = [_RowText(self.codec, p.stop_strings) for p in params]
    finished = [False] * len(ids)
    timings = {"start": time.perf_counter(), "prompt_ids": ids, "program": key}
    self.last_timings = timings

    def emit(r: int, new: list[int], done_on_device: bool, count: int):
      if finished[r]:
        return None
      final = done_on_device
      text, hit = rows[r].push(new, final)
      if hit or final:
        finished[r] = True
        reason = "stop_string" if hit else ("length" if count >= params[r].max_tokens and not (
            new and new[-1] in stops[r]) else "stop")
        return Delta(r, new, text, True, reason)
      return Delta(r, new, text) if (new or text) else None

    if stream_mode == "callback":
      yield from self._stream_callback(prog, prompt, jnp.asarray(pad), samp, len(ids), emit, finished, timings)
      return
    if stream_mode != "chunks":
      raise ValueError(f"stream_mode must be 'chunks' or 'callback', got {stream_mode!r}")
    state = prog.init_state()
    seen = 0
    pad_d = jnp.asarray(pad)
    while True:
      state = prog.advance(self._parts, prompt, pad_d, samp, state)
      step, done, out, count = jax.device_get((state.step, state.done, state.out, state.count))
      if seen == 0:
        timings["first_token"] = time.perf_counter()
      for r in range(len(ids)):
        new = [int(t) for t in out[r, seen:step] if t >= 0]
        d = emit(r, new, bool(done[r]), int(count[r]))
        if d is not None:
          yield d
      seen = int(step)
      if all(finished) or seen >= key.max_new:
        break
    timings["end"] = time.perf_counter()
    timings["generated"] = [len(r.ids) for r in rows]

  def _stream_callback(self, prog, prompt, pad, samp, n, emit, finished, timings):
    import queue
    import threading

    q: queue.Queue = queue.Queue()

    def on_token(step, tokens, done):
      if step == 1:
        timings["first_token"] = time.perf_counter()
      q.put((step, tokens, done))
      return all(finished)

    def run():
      try:
        prog.run_with_callback(self._parts, prompt, pad, samp, on_token)
      finally:
        q.put(None)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    counts = [0] * n
    while (item := q.get()) is not None:
      step, tokens, done = item
      for r in range(n):
        tok = int(tokens[r])
        new = [tok] if tok >= 0 else []
        counts[r] += len(new)
        d = emit(r, new, bool(done[r]), counts[r])
        if d is not None:
          yield d
    worker.join()
    for r in range(n):  # rows cut by the bucket's end
      if not finished[r]:
        d = emit(r, [], True, counts[r])
        if d is not None:
          yield d
    timings["end"] = time.perf_counter()
    timings["generated"] = counts

  def stream(self, prompt: str | Sequence[int], *, chat: bool = False, system: str | None = None,
             stream_mode: str = "chunks", **sampling) -> Iterator[Delta]:
    """Deltas of one prompt's continuation as they are produced."""
    return self.stream_batch([prompt], SamplingParams(**sampling), chat, system, stream_mode)

  def generate_batch(self, prompts, params=None, chat=False, system=None, stream_mode="chunks") -> list[Completion]:
    if isinstance(prompts, (str,)):
      raise TypeError("generate_batch takes a list of prompts; use generate() for one")
    toks: list[list[int]] = [[] for _ in prompts]
    texts = [""] * len(prompts)
    reasons = ["length"] * len(prompts)
    for d in self.stream_batch(prompts, params, chat, system, stream_mode):
      toks[d.row].extend(d.token_ids)
      texts[d.row] += d.text
      if d.finished:
        reasons[d.row] = d.finish_reason
    t = self.last_timings
    ids = t["prompt_ids"]
    return [Completion(i, tk, tx, rs, t) for i, tk, tx, rs in zip(ids, toks, texts, reasons)]

  def generate(self, prompt: str | Sequence[int], *, chat: bool = False, system: str | None = None,
               stream_mode: str = "chunks", **sampling) -> Completion:
    """The whole continuation of one prompt."""
    return self.generate_batch([prompt], SamplingParams(**sampling), chat, system, stream_mode)[0]

  # ---- scoring ---------------------------------------------------------------------
  def logits(self, token_ids: Sequence[int]) -> np.ndarray:
    """Raw next-token logits [T, V] (f32) at every position of one sequence."""
    ids = np.asarray(token_ids, np.int32)[None, :]
    if ids.shape[1] == 0:
      raise ValueError("need at least one token to score")
    T = bucket(ids.shape[1])
    padded = np.zeros((1, T), np.int32)
    padded[0, : ids.shape[1]] = ids
    out = program_lib.score_logits(self._defs, self.layers, self._parts, jnp.asarray(padded))
    return np.asarray(out[0, : ids.shape[1]])

  def score(self, token_ids: Sequence[int] | str, top_k: int = 5) -> Score:
    ids = self.codec.encode(token_ids) if isinstance(token_ids, str) else [int(t) for t in token_ids]
    if len(ids) < 2:
      raise ValueError(f"scoring needs at least 2 tokens to predict one; got {len(ids)}")
    logits = self.logits(ids)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    lse = np.logaddexp.reduce(logits.astype(np.float64), axis=-1)
    lp = [float(logits[t, ids[t + 1]] - lse[t]) for t in range(len(ids) - 1)]
    nll = -float(np.mean(lp))
    return Score(ids, top.tolist(), np.take_along_axis(logits, top, -1).tolist(), lp, nll, float(np.exp(nll)))


def load(name_or_path: str | os.PathLike | None = None, *, path: Sequence[int] | None = None,
         sampler: str | None = None, compile_cache: bool = True) -> Model:
  """Load a model by known name (default: SmolLM2-135M-Instruct) or by path."""
  if compile_cache:
    program_lib.configure_compilation_cache()
  from thoughtjax.fetch import DEFAULT_MODEL

  return Model(load_model(name_or_path or DEFAULT_MODEL), path, sampler)

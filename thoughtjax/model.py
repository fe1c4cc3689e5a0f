"""The user-facing model and its per-call generation.

>>> import thoughtjax
>>> m = thoughtjax.load()                      # the default model, fetched on first use
>>> m.generate("What is the capital of France?", chat=True).text
>>> g = m.stream("Once upon a time", max_tokens=20)
>>> for delta in g: print(delta.text, end="")
>>> g.trace.decode_s, g.trace.tokens_out

One :class:`Model` serves loaded and composed paths (:func:`thoughtjax.compose.compose` returns
one carrying its resolved path: links, refs, path hash and template). A Model does not change
after construction and is safe to share between threads: everything about one call (prompt
ids, timings, cancellation) lives on the :class:`Generation` that call returns. A Generation
runs device work only when asked for its next delta, one decode chunk at a time, so cancelling
or abandoning it stops the work at the next chunk.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from thoughtjax import assembly
from thoughtjax import fetch as fetch_lib
from thoughtjax.decode import indexed, speculative
from thoughtjax.decode import program as program_lib
from thoughtjax.decode.interface import COMPILE_CLOCK, DecodeInputs, run_chunks
from thoughtjax.decode.masks import RowMasks, grammars_for
from thoughtjax.decode.program import Program, ProgramKey, TemplatePrompt, bucket
from thoughtjax.decode.request import DecodeRequest, ModelRequest
from thoughtjax.decode.stream import Completion, Delta, Generation, RequestError, Rows, Trace
from thoughtjax.defaults import DEFAULT_DRAFT_TOKENS
from thoughtjax.kernels.dispatch import resolve as resolve_kernels
from thoughtjax.loading import LoadedModel
from thoughtjax.loading import load as load_model
from thoughtjax.path_syntax import format_path, hash_refs, parse_path
from thoughtjax.sampling import SamplingParams, sampling_arrays
from thoughtjax.template import Template
from thoughtjax.transformer import GraphDefs, PathParts


def _to_device(a: np.ndarray) -> jax.Array:
  """A host array on the default device. ``jnp.asarray`` of a numpy array traces, lowers and compiles (or
  fetches from the persistent cache) a small ``stage`` program per shape and dtype in every new process;
  ``jax.device_put`` copies without one."""
  return jax.device_put(a)


# Callback streaming: how many steps the device may run ahead of a consumer that is not reading.
CALLBACK_QUEUE_STEPS = 16
# The layout plain generation compiles by default, per weight form: the one that won `thoughtjax bench layers`
# (BENCHMARKS.md). In float32 the unrolled form decodes a row faster (the indexed loop copies each layer's float32
# weights out of the stack); in native weights the two decode level and the indexed form compiles five times
# faster into a sixth of the executable and starts in half the time.
DEFAULT_LAYOUT = {"f32": "unrolled", "native": "indexed"}


@dataclasses.dataclass
class Score:
  token_ids: list[int]
  top_ids: list[list[int]]  # per position t: top-K ids of the next-token distribution
  top_logits: list[list[float]]
  token_logprobs: list[float]  # log p(token[t+1] | tokens[:t+1]), t = 0..n-2
  nll: float  # mean negative log-likelihood per predicted token
  perplexity: float


def _run_callback(
  program: Program, inputs: DecodeInputs, rows: Rows, trace: Trace, cancelled: threading.Event
) -> Iterator[Delta]:
  """The whole loop in one device call on a worker thread; each step's tokens come back through a
  host callback into a bounded queue. The callback tells the loop to stop once every row has
  finished, the call is cancelled or the consumer has gone; a full queue holds the device back."""
  n = len(rows.finished)
  q: queue.Queue = queue.Queue(maxsize=CALLBACK_QUEUE_STEPS)
  halt = threading.Event()  # the consumer stopped reading
  failure: list[BaseException] = []

  def on_token(step, tokens, done) -> bool:
    if step == 1:
      trace.first_token = time.perf_counter()
    else:
      trace.decode_chunks += 1
    if not (halt.is_set() or cancelled.is_set()):
      q.put((step, tokens, done))  # blocks while the consumer is CALLBACK_QUEUE_STEPS behind
    return rows.all_finished or halt.is_set() or cancelled.is_set()

  def work():
    try:
      with COMPILE_CLOCK.measure() as compiled:
        program.run_with_callback(inputs.parts, inputs.prompt, inputs.pad, inputs.samp, on_token)
      trace.compile_s, trace.compile_misses = compiled.seconds, compiled.cache_misses
    except BaseException as e:  # handed to the consumer, raised there
      failure.append(e)
    finally:
      q.put(None)

  trace.device_start = time.perf_counter()
  worker = threading.Thread(target=work, name="thoughtjax-callback-stream", daemon=True)
  worker.start()
  ended = False  # the worker's sentinel was taken
  try:
    counts = [0] * n
    while not (ended := (item := q.get()) is None):
      _, tokens, done = item
      for r in range(n):
        new = [int(tokens[r])] if tokens[r] >= 0 else []
        counts[r] += len(new)
        d = rows.emit(r, new, bool(done[r]), counts[r])
        if d is not None:
          yield d
      if cancelled.is_set():
        break
    if failure:
      raise failure[0]
    if cancelled.is_set() and not rows.all_finished:
      trace.cancelled = True
      yield from rows.cancel()
    for r in range(n):  # rows cut by the bucket's end
      d = rows.emit(r, [], True, counts[r])
      if d is not None:
        yield d
  finally:
    halt.set()
    while not ended:  # unblock a callback waiting on the full queue, up to the worker's sentinel
      ended = q.get() is None
    worker.join()
    trace.end = time.perf_counter()
    trace.tokens_out = list(rows.counts)


class Model:
  """A path over a model's weights: generation and scoring run it as one compiled program.

  ``layers`` is the path as layer indices (repeats allowed; default: every layer once),
  ``kernels`` picks the implementation of both kernels (``"xla"``, ``"pallas"``; None: the
  default of :func:`thoughtjax.kernels.dispatch.resolve`),
  ``chunk`` the decode steps per device call. ``parts`` hands in the weights the path reads
  (e.g. restored thoughtlets); by default they are taken, not copied, from ``loaded``.
  A composed model also carries its resolved path (``links``), the ``source`` it was composed
  from and, when the path starts with one, its ``template``.
  """

  def __init__(
    self,
    loaded: LoadedModel,
    layers: Sequence[int] | None = None,
    kernels: str | None = None,
    chunk: int = program_lib.DEFAULT_CHUNK,
    parts: PathParts | None = None,
    *,
    links: Sequence | None = None,
    source=None,
    template: Template | None = None,
    mesh=None,
    dtype=None,
    layout: str = "unrolled",
  ):
    if chunk < 1:
      raise RequestError(f"chunk must be >= 1 decode step per device call, got {chunk}")
    if layout not in indexed.LAYOUTS:
      raise RequestError(f"layout is one of {', '.join(indexed.LAYOUTS)}; got {layout!r}")
    if layout == "indexed" and any(i < 0 for i in (layers or ())):
      raise RequestError("a path with a bridge has no layer-indexed form; use layout='unrolled'")
    self.layout = layout
    self.loaded = loaded
    self.config = loaded.config
    self.codec = loaded.codec
    self.module = loaded.model
    self.layers = tuple(range(self.config.num_layers)) if layers is None else tuple(int(i) for i in layers)
    self.kernels, self.chunk = resolve_kernels(kernels), chunk
    self.links = None if links is None else tuple(links)
    self.source, self.template, self.mesh, self.dtype = source, template, mesh, dtype
    self._defs = GraphDefs.from_model(self.module)
    # The parameters this path reads: taken from the module, or handed in (e.g. restored
    # thoughtlets), holding only the blocks the path uses.
    if parts is None:
      bad = [i for i in self.layers if not 0 <= i < self.config.num_layers]
      if bad:
        raise RequestError(
          f"path uses layers {bad}, but the model has layers 0..{self.config.num_layers - 1}; "
          f"give layer indices in that range"
        )
      parts = PathParts.from_model(self.module, self.layers)
    self._parts = parts
    missing = set(self.layers) - set(self._parts.blocks)
    if missing:
      raise RequestError(
        f"path uses layers {sorted(missing)} that the given parts do not hold (they hold "
        f"{sorted(self._parts.blocks)}); pass parts with those blocks or a path over the held ones"
      )
    self._templates: dict[str | None, Template] = {}
    self._templates_lock = threading.Lock()
    self._stacked: indexed.Stack | None = None  # held blocks stacked for the indexed layout (made on first use)

  @property
  def parts(self) -> PathParts:
    return self._parts

  @property
  def defs(self) -> GraphDefs:
    """The module's graph definitions: with :attr:`parts`, what a program (``program.Program``, ``score_logits``)
    is built from."""
    return self._defs

  def __repr__(self) -> str:
    return (
      f"Model({self.loaded.source!r}, path={self.path!r}, kernels={self.kernels!r}, chunk={self.chunk}"
      f"{'' if self.template is None else f', template system={self.template.system!r}'})"
    )

  # ---- the path ----------------------------------------------------------------------
  @property
  def path(self) -> str:
    if self.links is not None:
      return ", ".join(str(link.ref) for link in self.links)
    return format_path(self.layers, template=self.template is not None)

  @property
  def refs(self) -> list[str]:
    """The resolved units, ``name@version`` (bare names for a loaded model's parts), in path order."""
    if self.links is not None:
      return [n if v is None else f"{n}@{v}" for link in self.links for n, v in link.units]
    return [str(r) for r in parse_path(self.path)]

  @property
  def path_hash(self) -> str:
    return hash_refs(self.refs)

  @property
  def resident_bytes(self) -> int:
    """Bytes of the distinct weight buffers this model holds (shared buffers counted once)."""
    seen, total = set(), 0
    for leaf in jax.tree.leaves(self._parts):
      if id(leaf) not in seen:
        seen.add(id(leaf))
        total += leaf.nbytes
    return total + (0 if self.template is None else self.template.nbytes)

  def _replace(self, **changes) -> Model:
    fields = dict(
      loaded=self.loaded,
      layers=self.layers,
      kernels=self.kernels,
      chunk=self.chunk,
      parts=self._parts,
      links=self.links,
      source=self.source,
      template=self.template,
      mesh=self.mesh,
      dtype=self.dtype,
      layout=self.layout,
    )
    model = Model(**(fields | changes))
    if model._parts is self._parts:
      model._stacked = self._stacked  # the same held blocks: stacked once
    return model

  @classmethod
  def composed(
    cls,
    path: str | Sequence,
    source,
    *,
    mesh=None,
    dtype=None,
    kernels: str | None = None,
    chunk: int = program_lib.DEFAULT_CHUNK,
  ) -> Model:
    """The model of ``path`` resolved, type-checked and assembled over ``source`` (a Registry or a Model; see
    :func:`thoughtjax.assembly.assemble`), carrying its ``links``, ``source`` and template. The compilation
    cache is the caller's: :func:`thoughtjax.compose.compose` turns it on."""
    a = assembly.assemble(path, source, mesh=mesh, dtype=dtype)
    return cls(
      a.loaded,
      a.layers,
      kernels,
      chunk,
      a.parts,
      links=a.links,
      source=a.source,
      template=a.template,
      mesh=mesh,
      dtype=dtype,
    )

  def with_layout(self, layout: str) -> Model:
    """The same model and path compiled ``"unrolled"`` (every block traced into the program) or ``"indexed"``
    (one loop over the held blocks stacked, :mod:`thoughtjax.decode.indexed`; the stack is a copy of the held
    weights). :func:`load` picks per weight form (:data:`DEFAULT_LAYOUT`); a Model made otherwise is unrolled.
    Plain generation and the slot engines (:class:`~thoughtjax.serving.slots.SlotEngine`) take this layout;
    speculative programs run the blocks unrolled."""
    return self._replace(layout=layout)

  def with_chunk(self, chunk: int) -> Model:
    """The same model and path streaming in decode chunks of ``chunk`` steps."""
    return self._replace(chunk=chunk)

  def with_path(self, layers_or_path: str | Sequence[int], parts: PathParts | None = None) -> Model:
    """The same weights (shared, not copied) running another path; a template, the layout and the chunk stay.

    A path string is composed and type-checked over the same source (for a loaded model: its
    own weights). A layer sequence uses the weights this model holds (a loaded model holds
    every layer)."""
    if isinstance(layers_or_path, str):
      source = self if self.source is None else self.source
      other = Model.composed(
        layers_or_path, source, mesh=self.mesh, dtype=self.dtype, kernels=self.kernels, chunk=self.chunk
      )
      if self.layout == "indexed" and any(i < 0 for i in other.layers):
        return other  # a path with a bridge has no indexed form: it runs unrolled
      return self._share_stack(other if other.layout == self.layout else other.with_layout(self.layout))
    layers = tuple(int(i) for i in layers_or_path)
    if parts is None:
      missing = sorted(set(layers) - set(self._parts.blocks))
      if not missing:
        parts = PathParts(self._parts.embed, {i: self._parts.blocks[i] for i in sorted(set(layers))}, self._parts.head)
      elif self.source is not None:  # a composed model holds only its path's blocks
        raise RequestError(
          f"layers {missing} are not held by this composed model; compose a path "
          f"string that includes them, e.g. model.with_path('embed, blocks[0:30), head')"
        )
    return self._share_stack(self._replace(layers=layers, parts=parts, links=None))

  def _share_stack(self, other: Model) -> Model:
    """``other`` (a path over this model's weights) running on this model's stacked blocks when they hold every
    block it runs, the same arrays: its indexed program then takes arguments of the same shapes as this one's, so
    every such path shares one executable (a stack of only its own blocks would differ in its leading axis). This
    model's stack is made for it if this model holds its own weights (a loaded model) or has run indexed."""
    if self.layout != "indexed" or other.layout != "indexed" or other._parts is None:
      return other
    if self._stacked is None and self.source is not None:
      return other
    stacked = self._stack()
    if indexed.covers(stacked, self._parts, other._parts):
      other._stacked = stacked
    return other

  def program_parts(self, layout: str | None = None):
    """What this path's programs take in ``layout`` (default: this model's): its parts by position (unrolled), or
    the held blocks stacked and the path as an index vector over :func:`~thoughtjax.decode.indexed.max_layers`
    positions (indexed; the stack is made on first use and shared, see :meth:`with_path`)."""
    if (layout or self.layout) == "unrolled":
      return self._parts.by_position(self.layers)
    if any(i < 0 for i in self.layers):
      raise RequestError("a path with a bridge has no layer-indexed form; use layout='unrolled'")
    positions = indexed.max_layers(len(self.layers), self.config.num_layers)
    return indexed.stacked_parts(self._parts, self._stack(), self.layers, positions)

  def _stack(self) -> indexed.Stack:
    """The held blocks stacked for the indexed layout (made once, on first use)."""
    with self._templates_lock:
      if self._stacked is None:
        self._stacked = indexed.stack(self._parts)
      return self._stacked

  # ---- prompts ------------------------------------------------------------------
  def _check_system(self, system: str | None) -> None:
    if system is not None and system != self.template.system:
      raise RequestError(
        f"this path's template was cut with system={self.template.system!r}, got "
        f"system={system!r}; a different system message needs its own template thoughtlet"
      )

  def prompt_ids(self, prompt: str | Sequence[int], chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids of one prompt: ids as given; text through the path's template if it has one,
    else through the chat template when ``chat``, else plain."""
    if not isinstance(prompt, str):
      return [int(t) for t in prompt]
    if self.template is not None:
      self._check_system(system)
      return self.template.wrap(self._user_ids(prompt))
    if chat:
      messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
      prompt = self.codec.render_chat(messages)
    ids = self.codec.encode(prompt)
    if not ids:
      raise RequestError("the prompt is empty after tokenization; give at least one token")
    return ids

  def _user_ids(self, message: str) -> list[int]:
    ids = self.codec.tokenizer.encode(message, add_special_tokens=False).ids
    if not ids:
      raise RequestError("the prompt is empty after tokenization; give at least one token")
    return ids

  def _template_split(self, prompts, chat: bool, system: str | None):
    """(template, user token ids per prompt) for prompts that go through a template, else (None, None)."""
    if not all(isinstance(p, str) for p in prompts):
      return None, None
    template = self.template
    if template is None:
      if not chat or self.codec.chat_template is None:
        return None, None
      template = self.chat_template(system)
    else:
      self._check_system(system)
    user = [self._user_ids(p) for p in prompts]
    if template is not self.template:
      # Tokenizing the parts apart must give what tokenizing the whole prompt gives.
      for p, u in zip(prompts, user, strict=True):
        if template.wrap(u) != self.prompt_ids(p, True, system):
          return None, None
    return template, user

  def chat_template(self, system: str | None = None) -> Template:
    """The codec's chat template for ``system``, its rows from this path's embed table (cached)."""
    with self._templates_lock:
      if system not in self._templates:
        self._templates[system] = Template.build(self.codec, self._parts.embed["table"][...], system)
      return self._templates[system]

  # ---- generation -------------------------------------------------------------------
  def request(
    self,
    prompts: Sequence[str | Sequence[int]],
    params: Sequence[SamplingParams] | SamplingParams | None = None,
    chat: bool = False,
    system: str | None = None,
    *,
    draft=None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
  ) -> ModelRequest:
    """The checked decode request of ``prompts`` on this path, before any device work: run it alone with
    :meth:`run`, or hand its one row to a slot engine (:meth:`ModelRequest.slot
    <thoughtjax.decode.request.ModelRequest.slot>`). Arguments as for :meth:`stream_batch`; every field is
    checked here (:func:`~thoughtjax.decode.request.check_request`), and a constraint is compiled or refused."""
    start = time.perf_counter()
    if isinstance(prompts, str):
      raise TypeError("stream_batch takes a list of prompts; use stream() for one")
    template, user = self._template_split(prompts, chat, system)
    if template is None:
      ids = [self.prompt_ids(p, chat, system) for p in prompts]
    else:
      ids = [template.wrap(u) for u in user]
    if params is None:
      params = SamplingParams()
    if isinstance(params, SamplingParams):
      params = [params] * len(ids)
    decode = DecodeRequest.checked(
      ids, params, vocab_size=self.config.vocab_size, max_context=self.config.max_context, eos_ids=self.codec.eos_ids
    )
    constraints = [p.constraint for p in params if p.constraint is not None]
    if constraints:
      if draft is not None:
        raise RequestError(
          "json_schema / regex / grammar decode one step per call in chunks; drop draft= or drop the constraint"
        )
      grammars = grammars_for(self.codec, self.config.vocab_size)
      for c in constraints:
        grammars.check(c)  # compiled (or refused with a ConstraintError) before any device work
    return ModelRequest(
      self,
      decode,
      start,
      template,
      None if user is None else tuple(tuple(u) for u in user),
      draft,
      draft_tokens,
    )

  def program_key(self, request: ModelRequest) -> ProgramKey:
    """The key of the plain program ``request`` runs alone in (its shape buckets, sampling mode, template widths,
    masked when a row is constrained); no device work. A slot engine records it in the request's trace."""
    masked = RowMasks.needed([p.constraint for p in request.decode.params])
    return ProgramKey(
      layers=self.layers,
      **request.decode.key_fields(),
      chunk=1 if masked else self.chunk,  # each step's mask depends on the token before it
      kernels=self.kernels,
      template=None if request.template is None else request.template.widths,
      masked=masked,
    )

  def run(self, request: ModelRequest, stream_mode: str = "chunks") -> Generation:
    """Start ``request`` (from :meth:`request`) alone on this path; the :class:`Generation` yields deltas as
    tokens are produced (``stream_mode``: ``"chunks"``, or ``"callback"`` for comparison)."""
    if request.model is not self:
      raise RequestError("this request was made by another path's Model; run it with request.model.run()")
    if stream_mode not in ("chunks", "callback"):
      raise RequestError(f"stream_mode must be 'chunks' or 'callback', got {stream_mode!r}")
    decode, template, user = request.decode, request.template, request.user
    ids, params, start = decode.ids, decode.params, request.start
    constraints = [p.constraint for p in params]
    masks = None
    if RowMasks.needed(constraints):
      if stream_mode != "chunks":
        raise RequestError(
          "json_schema / regex / grammar decode one step per call in chunks; drop stream_mode='callback', "
          "or drop the constraint"
        )
      masks = RowMasks(grammars_for(self.codec, self.config.vocab_size), constraints, bucket(len(ids), 1))
    if request.draft is not None:
      if stream_mode != "chunks":
        raise RequestError(f"draft= streams in chunks; got stream_mode={stream_mode!r}, drop it or drop draft=")
      return speculative.stream_batch(self, decode, start, request.draft, request.draft_tokens)
    key = self.program_key(request)
    if self.layout == "indexed":  # the program holds max_layers positions; the trace keeps the path
      positions = tuple(range(indexed.max_layers(len(self.layers), self.config.num_layers)))
      shape = dataclasses.replace(key, layers=positions, layout="indexed")
      prog = program_lib.PROGRAMS.get(shape, self._defs, self.config, indexed.IndexedProgram)
    else:
      prog = program_lib.PROGRAMS.get(key, self._defs, self.config)
    B, T = key.batch, key.prompt_len
    tokens, pad = decode.left_padded(B, T)
    if template is None:
      prompt = _to_device(tokens)
    else:
      P1, P2 = key.template
      user_ids = np.zeros((B, T - P1 - P2), np.int32)
      lengths = np.ones(B, np.int32)  # batch-bucket rows beyond the prompts: one token, inert
      pad[len(user) :] = T - (P1 + 1 + P2)
      for r, u in enumerate(user):
        user_ids[r, : len(u)] = u
        lengths[r] = len(u)
      prompt = TemplatePrompt(template.prefix_rows, template.suffix_rows, _to_device(user_ids), _to_device(lengths))
    samp = sampling_arrays(params, B, self.config.vocab_size, key.stop_width, self.codec.eos_ids, key.has_bias)
    inputs = DecodeInputs(self.program_parts(), prompt, _to_device(pad), samp)
    trace = Trace(key, [list(i) for i in ids], start, tokens_out=[0] * len(ids))
    cancelled = threading.Event()
    rows = Rows(self.codec, params, decode.stops)
    if stream_mode == "callback":
      run = _run_callback(prog, inputs, rows, trace, cancelled)
    elif masks is None:
      run = run_chunks(prog, inputs, rows, trace, cancelled)
    else:  # each call's masks from the matchers; the matchers consume each call's tokens
      run = run_chunks(
        prog,
        inputs,
        rows,
        trace,
        cancelled,
        before=lambda i: i._replace(samp=i.samp._replace(allowed=masks.device())),
        after=lambda tokens, seen: masks.advance(tokens.out, tokens.done, seen, tokens.count),
      )
    return Generation(run, trace, cancelled)

  def stream_batch(
    self,
    prompts: Sequence[str | Sequence[int]],
    params: Sequence[SamplingParams] | SamplingParams | None = None,
    chat: bool = False,
    system: str | None = None,
    stream_mode: str = "chunks",
    *,
    draft=None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
  ) -> Generation:
    """Generate for several prompts at once (:meth:`request` then :meth:`run`); the returned
    :class:`Generation` yields deltas as tokens are produced (``stream_mode``: ``"chunks"``, or ``"callback"``
    for comparison).

    ``draft`` (a path string, e.g. ``"embed, blocks[0:10), head"``, ``"ngram:3"`` for drafts looked up in
    the text itself, or a :class:`thoughtjax.decode.speculative.Draft`): self-speculative decoding, ``draft_tokens`` drafted per
    verify pass of this path; the same tokens (greedy) or the same distribution (sampling).

    Template prompts (``chat=True``, or any string prompt on a path with a template) go in as
    the template's fixed rows around the user tokens, embedded by the fused template kernel
    inside the program; other prompts go in as token ids.
    """
    return self.run(self.request(prompts, params, chat, system, draft=draft, draft_tokens=draft_tokens), stream_mode)

  def stream(
    self,
    prompt: str | Sequence[int],
    *,
    chat: bool = False,
    system: str | None = None,
    stream_mode: str = "chunks",
    draft=None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    **sampling,
  ) -> Generation:
    """Deltas of one prompt's continuation as they are produced."""
    return self.stream_batch(
      [prompt], SamplingParams(**sampling), chat, system, stream_mode, draft=draft, draft_tokens=draft_tokens
    )

  def generate_batch(
    self,
    prompts,
    params=None,
    chat=False,
    system=None,
    stream_mode="chunks",
    *,
    draft=None,
    draft_tokens=DEFAULT_DRAFT_TOKENS,
  ) -> list[Completion]:
    """Whole continuations of several prompts, generated as one batch."""
    if isinstance(prompts, str):
      raise TypeError("generate_batch takes a list of prompts; use generate() for one")
    return self.stream_batch(
      prompts, params, chat, system, stream_mode, draft=draft, draft_tokens=draft_tokens
    ).completions()

  def generate(
    self,
    prompt: str | Sequence[int],
    *,
    chat: bool = False,
    system: str | None = None,
    stream_mode: str = "chunks",
    draft=None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    **sampling,
  ) -> Completion:
    """The whole continuation of one prompt (``draft``: see :meth:`stream_batch`)."""
    return self.stream(
      prompt, chat=chat, system=system, stream_mode=stream_mode, draft=draft, draft_tokens=draft_tokens, **sampling
    ).result()

  # ---- scoring ---------------------------------------------------------------------
  def logits(self, token_ids: Sequence[int]) -> np.ndarray:
    """Raw next-token logits [T, V] (f32) at every position of one sequence."""
    ids = np.asarray(token_ids, np.int32)[None, :]
    if ids.shape[1] == 0:
      raise RequestError("need at least one token to score, got none")
    T = bucket(ids.shape[1])
    padded = np.zeros((1, T), np.int32)
    padded[0, : ids.shape[1]] = ids
    out = program_lib.score_logits(self._defs, self.layers, self._parts, _to_device(padded))
    return np.asarray(out[0, : ids.shape[1]])

  def score(self, token_ids: Sequence[int] | str, top_k: int = 5) -> Score:
    ids = self.codec.encode(token_ids) if isinstance(token_ids, str) else [int(t) for t in token_ids]
    if len(ids) < 2:
      raise RequestError(f"scoring needs at least 2 tokens to predict one; got {len(ids)}")
    logits = self.logits(ids)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    lse = np.logaddexp.reduce(logits.astype(np.float64), axis=-1)
    lp = [float(logits[t, ids[t + 1]] - lse[t]) for t in range(len(ids) - 1)]
    nll = -float(np.mean(lp))
    return Score(ids, top.tolist(), np.take_along_axis(logits, top, -1).tolist(), lp, nll, float(np.exp(nll)))


def load(
  name_or_path: str | os.PathLike | None = None,
  *,
  path: str | Sequence[int] | None = None,
  kernels: str | None = None,
  compile_cache: bool = True,
  weights: str = "f32",
  layout: str | None = None,
) -> Model:
  """Load a model by known name (default: SmolLM2-135M-Instruct) or by path.

  ``path``: the layer path to run, as layer indices or a path string
  (``"embed, blocks[0:12), head"``); ``kernels``: ``"xla"``, ``"pallas"`` or None (the default of
  :func:`thoughtjax.kernels.dispatch.resolve`); ``weights``: ``"f32"`` or ``"native"`` (a GGUF's
  quantized blocks, computed in float32); ``layout``: how plain generation compiles the path (see
  :meth:`Model.with_layout`), None: the measured winner for ``weights`` (:data:`DEFAULT_LAYOUT`).
  """
  if compile_cache:
    program_lib.configure_compilation_cache()

  if layout is None:
    layout = DEFAULT_LAYOUT.get(weights, "unrolled")
  model = Model(load_model(name_or_path or fetch_lib.DEFAULT_MODEL, weights=weights), kernels=kernels, layout=layout)
  return model if path is None else model.with_path(path)

"""Candidate quality against the full path: next-token agreement, KL and ΔNLL on a hint's corpus.

>>> import thoughtjax
>>> from thoughtjax.synthesis.quality import measure
>>> model = thoughtjax.load()
>>> exit12, full = measure(model, ["embed, blocks[0:12), head", "embed, blocks[0:30), head"], docs)
>>> exit12.top1_agreement, exit12.mean_kl, exit12.delta_nll, exit12.tokens
>>> full                                  # PathQuality(1.0, 0.0, 0.0, n): lossless by construction

Documents are tokenized with the model's codec (or given as token ids) and cut into windows of at
most ``window`` tokens; a window of n tokens predicts its n - 1 next tokens, and every path sees the
same windows. Per position t of a window, with p the full path's and q the candidate's next-token
distribution and y the text's actual next token:

* ``top1_agreement``: argmax q == argmax p, averaged over positions;
* ``mean_kl``: KL(p || q) = sum_v p_v (log p_v - log q_v) in nats, averaged;
* ``delta_nll``: -log q_y - (-log p_y) in nats per predicted token, averaged (negative: the
  candidate predicts the text better than the full path does).

Work is shared: per window, one forward pass of the full path keeps the residual after every layer
and the full path's log-probabilities; an early exit is the head applied to one of those residuals,
and any other layer sequence starts from the residual after its longest prefix ``0, 1, ..., k-1``
(a skip of layer 8 reuses layers 0..7). Windows are processed one at a time; per-position values
come back to the host and are summed in float64.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from thoughtjax.decode.program import bucket
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import PathSyntaxError, layers_of_path, parse_path
from thoughtjax.synthesis.calibration import HintQuality, PathQuality
from thoughtjax.thoughtlet.run import run_blocks, run_embed, run_head
from thoughtjax.transformer import GraphDefs, PathParts, Transformer, apply_bridge

DEFAULT_WINDOW = 128

# (done, total, what): called after each unit of work; ``what`` names it, e.g. "general_purpose/heldout".
Progress = Callable[[int, int, str], None]
Document = str | Sequence[int]
Corpora = Mapping[str, tuple[Sequence[Document], Sequence[Document]]]  # hint -> (calibration, held-out) documents


class QualityError(UserError, ValueError):
  """A quality measurement was asked of something it cannot measure (no tokens, an unrunnable path)."""


# ------------------------------------------------------------------------------ windows
def windows(codec, documents: Sequence[Document], size: int = DEFAULT_WINDOW) -> list[np.ndarray]:
  """Token windows [n] i32, 2 <= n <= ``size``: each document's tokens cut in consecutive pieces.

  A text document is encoded with ``codec`` (a BOS is added when the codec adds one); a document
  given as token ids is taken as is. A last piece of one token predicts nothing and is dropped.
  """
  if isinstance(size, bool) or not isinstance(size, int) or size < 2:
    raise QualityError(f"window size: expected an integer >= 2 tokens, got {size!r}")
  out = []
  for i, doc in enumerate(documents):
    if isinstance(doc, str):
      if codec is None:
        raise QualityError(
          f"document {i} is text, but no codec was given to tokenize it; pass a loaded "
          f"Model (it carries its codec) or give documents as token ids"
        )
      ids = codec.encode(doc)
    else:
      ids = [int(t) for t in doc]
    for at in range(0, len(ids), size):
      piece = ids[at : at + size]
      if len(piece) >= 2:
        out.append(np.asarray(piece, np.int32))
  return out


# ------------------------------------------------------------------------------ the model's parts
@dataclasses.dataclass(frozen=True, eq=False)
class Weights:
  """What measurement runs: graph definitions, config and the states of embed, every block, head."""

  defs: GraphDefs
  cfg: object  # ModelConfig
  parts: PathParts  # holds every layer 0..L-1
  codec: object | None

  @property
  def num_layers(self) -> int:
    return self.cfg.num_layers

  @classmethod
  def of(cls, model) -> Weights:
    """From a loaded :class:`~thoughtjax.model.Model` (its full weights) or a bare Transformer."""
    if isinstance(model, Weights):
      return model
    if isinstance(model, Transformer):
      module, codec = model, None
      parts = PathParts.from_model(module, range(module.cfg.num_layers))
    else:
      module, codec = getattr(model, "module", None), getattr(model, "codec", None)
      parts = getattr(model, "parts", None)
      if module is None or parts is None:
        raise QualityError(
          f"quality is measured on a loaded Model (thoughtjax.load()) or a Transformer; got {type(model).__name__}"
        )
    cfg = module.cfg
    missing = sorted(set(range(cfg.num_layers)) - set(parts.blocks))
    if missing:
      raise QualityError(
        f"quality is measured against the full path, but this model holds no weights for "
        f"layers {missing}; measure on the loaded source model (thoughtjax.load(...)), "
        f"not on a composed path"
      )
    return cls(GraphDefs.from_model(module), cfg, parts, codec)


# Calibration is a measurement, like thoughtlet profiling (thoughtlet/profile.py): it runs pieces no
# serving program composes (the head after any layer, one block at a time from a cached residual),
# so it owns its jit boundary here; the model code it calls stays un-jitted. One block function
# serves every layer and every path: it compiles once per window bucket.
@functools.partial(jax.jit, static_argnums=(0,))
def _embed(defs: GraphDefs, state, tokens):  # [1, T] -> [1, T, D]
  return run_embed(defs, state, tokens)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _block(defs: GraphDefs, cfg, state, x):  # [1, T, D] -> [1, T, D], causal from position 0
  return run_blocks(defs, cfg, [state], x)[0]


def _log_probs(defs: GraphDefs, embed_state, head_state, x):  # [1, T, D] -> [T, V] f32
  table = nnx.merge(defs.embed, embed_state).table[...]
  return jax.nn.log_softmax(run_head(defs, head_state, x, table)[0].astype(jnp.float32), axis=-1)


@functools.partial(jax.jit, static_argnums=(0,))
def _full(defs: GraphDefs, embed_state, head_state, x, targets):
  """The reference at one window: log p [T, V], argmax [T], NLL of the actual next tokens [T]."""
  logp = _log_probs(defs, embed_state, head_state, x)
  nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
  return logp, jnp.argmax(logp, axis=-1), nll


@functools.partial(jax.jit, static_argnums=(0,))
def _compare(defs: GraphDefs, embed_state, head_state, x, full_logp, full_top, targets):
  """A candidate's residual x [1, T, D] against the full path: agreement, KL(full || q), NLL, each [T]."""
  logq = _log_probs(defs, embed_state, head_state, x)
  agree = jnp.argmax(logq, axis=-1) == full_top
  kl = jnp.sum(jnp.exp(full_logp) * (full_logp - logq), axis=-1)
  nll = -jnp.take_along_axis(logq, targets[:, None], axis=-1)[:, 0]
  return agree, kl, nll


@jax.jit
def _compare_logits(p, q, targets):
  """Two paths' raw logits [T, V] at the same positions: agreement, KL(p || q) and NLL_q - NLL_p, each [T]."""
  logp = jax.nn.log_softmax(p.astype(jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(q.astype(jnp.float32), axis=-1)
  agree = jnp.argmax(logq, axis=-1) == jnp.argmax(logp, axis=-1)
  kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
  y = targets[:, None]
  dnll = jnp.take_along_axis(logp, y, axis=-1)[:, 0] - jnp.take_along_axis(logq, y, axis=-1)[:, 0]
  return agree, kl, dnll


@jax.jit
def _bridge(params, x):  # [1, T, D] -> [1, T, D], position-wise
  return apply_bridge(params, x)


@jax.jit
def _one_minus_cos(a, b):  # [1, T, D] x2 -> [T]
  a, b = a[0].astype(jnp.float32), b[0].astype(jnp.float32)
  dot = jnp.sum(a * b, axis=-1)
  norms = jnp.sqrt(jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1))
  return 1.0 - dot / jnp.maximum(norms, 1e-30)


@dataclasses.dataclass(eq=False)
class Window:
  """One window after the full path's pass: the residual after every depth and the reference.

  ``residuals[k]`` [1, T, D] is the residual after layers 0..k-1 (``residuals[0]``: the embedding);
  T is the bucket the n real tokens are padded to (right padding: causal attention keeps it out of
  every real position); positions 0..n-2 are measured.
  """

  n: int
  residuals: list
  targets: jax.Array  # [T] i32: the next token at each position (padding past n - 1)
  full_logp: jax.Array  # [T, V]
  full_top: jax.Array  # [T]
  full_nll: np.ndarray  # [n - 1] f64

  @property
  def predicted(self) -> int:
    return self.n - 1


class Runner:
  """Runs windows through the full path once and candidate layer sequences from its residuals.

  ``bridges``: ``{name: params}`` of bridge thoughtlets candidates may run; in a layer sequence bridge k
  (in that order) is slot -(k + 1), as in :func:`~thoughtjax.synthesis.candidates.bridge_slots`."""

  def __init__(self, model, bridges: Mapping[str, Mapping] | None = None):
    self.w = Weights.of(model)
    self.slots = {name: -(i + 1) for i, name in enumerate(bridges or {})}
    self.bridges = {self.slots[n]: jax.tree.map(jnp.asarray, p) for n, p in (bridges or {}).items()}

  @property
  def num_layers(self) -> int:
    return self.w.num_layers

  def layers_of(self, path: str | Sequence[int]) -> tuple[int, ...]:
    """A path string (``embed, blocks[..), ..., head``) or a layer sequence, checked against the model."""
    L = self.num_layers
    if isinstance(path, str):
      try:
        refs = parse_path(path)
        named = [r for r in refs[1:-1] if r.span is None and r.name in self.slots]
        if not named:
          return layers_of_path(path, L)
        layers = []  # the path with its bridges: each block range's layers, each bridge's slot
        for r in refs[1:-1]:
          layers.extend(r.layers(L) if r.span is not None or r.name not in self.slots else [self.slots[r.name]])
        layers_of_path(", ".join(str(r) for r in refs if r.name not in self.slots), L)  # the rest is checked
        return tuple(layers)
      except PathSyntaxError as e:
        raise QualityError(f"path {path!r} cannot be measured from the model's own layers: {e}") from None
    layers = tuple(int(i) for i in path)
    bad = [i for i in layers if not (0 <= i < L or i in self.bridges)]
    if bad:
      raise QualityError(
        f"layer sequence {layers}: layers {bad} are outside 0..{L - 1} and are not bridge slots given to the "
        f"runner ({sorted(self.bridges)})"
      )
    return layers

  def full_pass(self, ids: np.ndarray) -> Window:
    """Embed and every layer over one window [n] (n >= 2), keeping each residual; the reference logits."""
    w, n = self.w, int(ids.shape[0])
    T = bucket(n)
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :n] = ids
    targets = np.zeros((T,), np.int32)
    targets[: n - 1] = ids[1:]
    targets = jnp.asarray(targets)
    x = _embed(w.defs, w.parts.embed, jnp.asarray(tokens))
    residuals = [x]
    for i in range(self.num_layers):
      x = _block(w.defs, w.cfg, w.parts.blocks[i], x)
      residuals.append(x)
    logp, top, nll = _full(w.defs, w.parts.embed, w.parts.head, x, targets)
    return Window(n, residuals, targets, logp, top, np.asarray(nll, np.float64)[: n - 1])

  @staticmethod
  def shared_prefix(layers: Sequence[int]) -> int:
    """k: the sequence starts with layers 0..k-1, so it can start from the full pass's residual k."""
    k = 0
    while k < len(layers) and layers[k] == k:
      k += 1
    return k

  def run(self, win: Window, layers: Sequence[int], start=None, skip: int = 0):
    """The residual after ``layers``: from ``start`` (a residual that already ran ``skip`` of them)
    or from the full pass's residual after the sequence's shared prefix."""
    if start is None:
      skip = self.shared_prefix(layers)
      start = win.residuals[skip]
    x = start
    for i in layers[skip:]:
      x = _bridge(self.bridges[i], x) if i < 0 else _block(self.w.defs, self.w.cfg, self.w.parts.blocks[i], x)
    return x

  def compare(self, win: Window, x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(agreement, KL, ΔNLL) per measured position [n - 1], float64, of a candidate's final residual."""
    w = self.w
    agree, kl, nll = _compare(w.defs, w.parts.embed, w.parts.head, x, win.full_logp, win.full_top, win.targets)
    m = win.predicted
    return (
      np.asarray(agree, np.float64)[:m],
      np.asarray(kl, np.float64)[:m],
      np.asarray(nll, np.float64)[:m] - win.full_nll,
    )

  @staticmethod
  def one_minus_cos(a, b, n: int) -> np.ndarray:
    """1 - cos between two residuals at each of the n real positions [n], float64."""
    return np.asarray(_one_minus_cos(a, b), np.float64)[:n]


# ------------------------------------------------------------------------------ sums
@dataclasses.dataclass
class Sums:
  """Float64 running sums over measured positions; ``quality()`` is their mean."""

  agree: float = 0.0
  kl: float = 0.0
  delta_nll: float = 0.0
  tokens: int = 0

  def add(self, agree: np.ndarray, kl: np.ndarray, dnll: np.ndarray) -> None:
    # Rounding can leave KL a hair below 0 where the two distributions are equal.
    self.agree += float(np.sum(agree))
    self.kl += float(np.sum(np.maximum(kl, 0.0)))
    self.delta_nll += float(np.sum(dnll))
    self.tokens += int(agree.shape[0])

  def quality(self) -> PathQuality:
    if self.tokens == 0:
      raise QualityError("no positions were measured: every document is shorter than 2 tokens; give longer text")
    n = self.tokens
    return PathQuality(min(1.0, self.agree / n), max(0.0, self.kl / n), self.delta_nll / n, n)


# ------------------------------------------------------------------------------ measuring
def _measure_windows(
  runner: Runner,
  layer_seqs: Sequence[tuple[int, ...]],
  wins: Sequence[np.ndarray],
  progress: Progress | None,
  what: str,
  done: int,
  total: int,
) -> list[PathQuality]:
  full = tuple(range(runner.num_layers))
  sums = [Sums() for _ in layer_seqs]
  for ids in wins:
    win = runner.full_pass(ids)
    for layers, s in zip(layer_seqs, sums):
      if layers == full:  # the reference itself: exactly lossless, no rounding from a second head call
        m = win.predicted
        s.add(np.ones(m), np.zeros(m), np.zeros(m))
      else:
        s.add(*runner.compare(win, runner.run(win, layers)))
    done += 1
    if progress is not None:
      progress(done, total, what)
  return [s.quality() for s in sums]


def measure(
  model,
  paths: Sequence[str | Sequence[int]],
  documents: Sequence[Document],
  *,
  window: int = DEFAULT_WINDOW,
  progress: Progress | None = None,
) -> list[PathQuality]:
  """Quality of each path (a path string or a layer sequence) against the full path on ``documents``.

  The full path runs once per window and every path reuses it (see the module docstring).
  """
  runner = Runner(model)
  seqs = [runner.layers_of(p) for p in paths]
  wins = windows(runner.w.codec, documents, window)
  if not wins:
    raise QualityError(
      f"no document has 2 or more tokens; quality needs at least one predicted token (got {len(documents)} documents)"
    )
  return _measure_windows(runner, seqs, wins, progress, "quality", 0, len(wins))


def _candidate_path(c) -> str | Sequence[int]:
  """The layer path of a Candidate or Proposal (anything with ``path``), or a path string."""
  return getattr(c, "layers", None) or getattr(c, "path", c)


def measure_candidates(
  model,
  candidates: Sequence,
  corpora: Corpora,
  *,
  window: int = DEFAULT_WINDOW,
  progress: Progress | None = None,
  bridges: Mapping[str, Mapping] | None = None,
) -> dict[str, dict[str, HintQuality]]:
  """``quality[path_hash][hint]`` of every candidate on every hint's (calibration, held-out) documents.

  ``candidates``: :class:`~thoughtjax.synthesis.candidate.Candidate`\\ s or
  :class:`~thoughtjax.synthesis.candidates.Proposal`\\ s (anything with ``path`` and ``path_hash``);
  the result is what :class:`~thoughtjax.synthesis.calibration.Calibration` takes as ``quality``.
  The full path's logits are computed once per window of each corpus split and shared by all.
  ``bridges``: ``{name: params}`` of the bridges bridged candidates run (see :class:`Runner`).
  """
  runner = Runner(model, bridges)
  hashes = [c.path_hash for c in candidates]
  dup = sorted({h for h in hashes if hashes.count(h) > 1})
  if dup:
    raise QualityError(
      f"candidates: path hashes {dup} appear more than once; deduplicate the candidates (candidates.propose does)"
    )
  seqs = [runner.layers_of(_candidate_path(c)) for c in candidates]
  splits = _splits(runner.w.codec, corpora, window)
  total = sum(len(w) for w in splits.values())
  done = 0
  measured: dict[tuple[str, str], list[PathQuality]] = {}
  for (hint, split), wins in splits.items():
    measured[(hint, split)] = _measure_windows(runner, seqs, wins, progress, f"{hint}/{split}", done, total)
    done += len(wins)
  return {
    h: {hint: HintQuality(measured[(hint, "calibration")][i], measured[(hint, "heldout")][i]) for hint in corpora}
    for i, h in enumerate(hashes)
  }


def _splits(codec, corpora: Corpora, window: int) -> dict[tuple[str, str], list[np.ndarray]]:
  """``{(hint, "calibration" | "heldout"): windows}`` of every hint's two document splits."""
  splits = {}
  for hint, pair in corpora.items():
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise QualityError(
        f"corpus of hint {hint!r}: expected (calibration documents, held-out documents), got {type(pair).__name__}"
      )
    for split, docs in zip(("calibration", "heldout"), pair):
      wins = windows(codec, docs, window)
      if not wins:
        raise QualityError(
          f"hint {hint!r} {split} split: no document has 2 or more tokens; quality needs at least one predicted token"
        )
      splits[(hint, split)] = wins
  return splits


def measure_models(
  reference,
  models: Sequence,
  corpora: Corpora,
  *,
  window: int = DEFAULT_WINDOW,
  progress: Progress | None = None,
) -> list[dict[str, HintQuality]]:
  """Per model, ``{hint: HintQuality}`` against ``reference`` on every hint's (calibration, held-out) documents.

  For paths over weights of their own, which share no residual with the reference: the full path in a weight
  variant (``embed, blocks[0:30)@int8, head``). Each window runs whole through the reference once and through
  each model once (``Model.logits``); the measures are those of :func:`measure_candidates`."""
  splits = _splits(reference.codec, corpora, window)
  total, done = sum(len(w) for w in splits.values()), 0
  measured: dict[tuple[str, str], list[PathQuality]] = {}
  for key, wins in splits.items():
    sums = [Sums() for _ in models]
    for ids in wins:
      n = int(ids.shape[0]) - 1  # positions 0..n-1 predict ids[1:]
      T = bucket(n)  # padded to the bucket, so windows of nearby lengths share the comparison's program
      targets = np.zeros(T, np.int32)
      targets[:n] = ids[1:]
      p = np.zeros((T, reference.config.vocab_size), np.float32)
      p[:n] = reference.logits(ids[:-1])
      for m, s in zip(models, sums):
        q = np.zeros_like(p)
        q[:n] = m.logits(ids[:-1])
        s.add(*(np.asarray(a, np.float64)[:n] for a in _compare_logits(p, q, targets)))
      done += 1
      if progress is not None:
        progress(done, total, f"{key[0]}/{key[1]}")
    measured[key] = [s.quality() for s in sums]
  hints = dict.fromkeys(h for h, _ in splits)
  return [
    {h: HintQuality(measured[(h, "calibration")][i], measured[(h, "heldout")][i]) for h in hints}
    for i in range(len(models))
  ]


def corpora_of(dictionary, hints: Sequence[str] | None = None) -> dict[str, tuple[list[str], list[str]]]:
  """``{hint: (calibration documents, held-out documents)}`` of a synthesis dictionary (all hints by default)."""
  names = dictionary.names if hints is None else tuple(hints)
  return {h: (dictionary[h].documents("calibration"), dictionary[h].documents("heldout")) for h in names}

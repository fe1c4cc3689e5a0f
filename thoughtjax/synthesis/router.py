"""The hint router: with no hints in a request, a small classifier picks one from the prompt.

>>> import thoughtjax
>>> from thoughtjax.synthesis.router import Router, train_router
>>> from thoughtjax.synthesis.router_data import load_router_prompts
>>> model = thoughtjax.load()
>>> router, report = train_router(model, load_router_prompts("train"), load_router_prompts("heldout"))
>>> router.predict("Return the three largest cities as a JSON list")   # ('structured_output', {hint: p, ...})
>>> report.accuracy, report.confusion, report.predict_ms             # held-out numbers
>>> params, meta = router.to_params()                                # flat float32 arrays + JSON meta
>>> same = Router.from_params(params, meta, model)                   # identical predictions

Features (:class:`FeatureSettings`) come from the model's own parts, never from its head: the
prompt is tokenized with the model's codec and cut to its first ``max_tokens`` tokens; the embed
thoughtlet's rows are pooled over the tokens (mean, or mean and max); optionally a bag of token
ids hashed into ``hash_buckets`` buckets (log(1 + count)); optionally the residual after the first
``layers`` blocks (each token's residual scaled to unit RMS, then pooled like the embed rows).
The default is the mean of the embed rows only: the cheapest features. On the default model and the
project's prompts, max pooling, hashed token bags, a hidden layer or the residual after 1-4 blocks did
not raise held-out accuracy by more than two prompts in 134, while each block multiplied the time
per prediction by tens on CPU.

The classifier is logistic regression (``hidden=0``) or a one-hidden-layer MLP over standardized
features, trained full-batch with optax AdamW from a seeded initialization: the same data, settings
and seed give bit-identical parameters on the same backend.

Parameters are a flat dict of float32 numpy arrays with stable names (``standardize.mean``,
``standardize.scale``, ``dense_0.kernel``, ``dense_0.bias``, ...); the meta is JSON: format, hint
labels, feature settings, the codec digest and a weights fingerprint of the parts the features read
(a router only runs on the model it was trained on), training settings and held-out metrics. That
pair is what a registry stores as a router thoughtlet.

An empty prompt (nothing but whitespace, or no tokens) is refused with :class:`RouterError`: there
is nothing to route, and the caller should ask for a prompt or pass a hint.

Imports inside functions here are deferred for start-up: importing this module does not load ``registry.codec``,
``synthesis.dictionary``; the functions that need them do.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from thoughtjax.decode.program import bucket
from thoughtjax.errors import UserError
from thoughtjax.thoughtlet.run import run_blocks
from thoughtjax.transformer import GraphDefs

FORMAT = "thoughtjax.router/1"
Pooling = Literal["mean", "mean_max"]
POOLINGS: tuple[str, ...] = ("mean", "mean_max")
# (done, total, what), as in synthesis.quality: called after each unit of work.
Progress = Callable[[int, int, str], None]
_FEATURE_BATCH = 32  # prompts per feature pass while training: bounds memory when layers > 0
_HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash: spreads consecutive token ids over buckets
_FINGERPRINT_SAMPLES = 4096  # elements sampled per weight array for the fingerprint


class RouterError(UserError, ValueError):
  """The router was given something it cannot route or train on; the message says what and the fix."""


@dataclasses.dataclass(frozen=True)
class FeatureSettings:
  """What the classifier sees of a prompt.

  ``max_tokens``: prompts are cut to their first max_tokens tokens; ``pooling`` of the rows over the
  tokens; ``hash_buckets``: size of the hashed bag of token ids (0: none); ``layers``: also the
  residual after blocks 0..layers-1 (0: embed rows only).
  """

  max_tokens: int = 256
  pooling: Pooling = "mean"
  hash_buckets: int = 0
  layers: int = 0

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise RouterError(f"router pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
    for name, low in (("max_tokens", 1), ("hash_buckets", 0), ("layers", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RouterError(f"router feature setting {name} must be an integer >= {low}, got {value!r}")

  def width(self, d_model: int) -> int:
    """F, the number of features per prompt."""
    rows = d_model * (2 if self.pooling == "mean_max" else 1)
    return rows * (2 if self.layers else 1) + self.hash_buckets


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """How the classifier is trained (full batch AdamW on cross-entropy)."""

  steps: int = 300
  learning_rate: float = 3e-3
  weight_decay: float = 1e-2
  hidden: int = 0  # 0: logistic regression; else the width of one hidden GELU layer
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.steps, int) or self.steps < 1:
      raise RouterError(f"router training steps must be an integer >= 1, got {self.steps!r}")
    if not isinstance(self.hidden, int) or self.hidden < 0:
      raise RouterError(f"router hidden width must be an integer >= 0, got {self.hidden!r}")
    if not self.learning_rate > 0 or not self.weight_decay >= 0:
      raise RouterError(
        f"router learning_rate must be > 0 and weight_decay >= 0, got {self.learning_rate!r} and {self.weight_decay!r}"
      )


@dataclasses.dataclass(frozen=True)
class RouterReport:
  """Held-out evaluation of a trained router.

  ``confusion`` [C, C] int: row = true hint, column = predicted hint, both in ``labels`` order;
  ``precision``/``recall`` [C] (0 where a hint was never predicted / never present);
  ``predict_ms``: median wall time of one warm ``predict`` (tokenize, features, classify);
  ``train_s``: feature extraction plus optimization, compile included.
  """

  labels: tuple[str, ...]
  accuracy: float
  precision: np.ndarray
  recall: np.ndarray
  confusion: np.ndarray
  train_accuracy: float
  final_loss: float
  n_train: int
  n_heldout: int
  predict_ms: float
  predict_ms_p90: float
  train_s: float
  features: FeatureSettings
  training: TrainSettings

  def as_dict(self) -> dict:
    """JSON-serializable."""
    return {
      "labels": list(self.labels),
      "accuracy": self.accuracy,
      "precision": self.precision.tolist(),
      "recall": self.recall.tolist(),
      "confusion": self.confusion.tolist(),
      "train_accuracy": self.train_accuracy,
      "final_loss": self.final_loss,
      "n_train": self.n_train,
      "n_heldout": self.n_heldout,
      "predict_ms": self.predict_ms,
      "predict_ms_p90": self.predict_ms_p90,
      "train_s": self.train_s,
      "features": dataclasses.asdict(self.features),
      "training": dataclasses.asdict(self.training),
    }

  def table(self) -> str:
    """The confusion matrix and per-hint precision/recall as text."""
    w = max(len(h) for h in self.labels)
    lines = [
      (
        f"held-out accuracy {self.accuracy:.3f} over {self.n_heldout} prompts; "
        f"predict {self.predict_ms:.3f} ms median (p90 {self.predict_ms_p90:.3f})"
      ),
      " " * w + "  " + " ".join(f"{i:>4d}" for i in range(len(self.labels))) + "  precision recall",
    ]
    for i, h in enumerate(self.labels):
      row = " ".join(f"{int(c):>4d}" for c in self.confusion[i])
      lines.append(f"{h:>{w}}  {row}  {self.precision[i]:9.3f} {self.recall[i]:6.3f}   ({i})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ features
def _pool(x, valid, pooling: str):  # x [B, T, D], valid [B, T] bool -> [B, D] or [B, 2D]
  m = valid[..., None].astype(jnp.float32)
  x = x.astype(jnp.float32)
  mean = jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
  if pooling == "mean":
    return mean
  return jnp.concatenate([mean, jnp.max(jnp.where(valid[..., None], x, -jnp.inf), axis=1)], axis=-1)


def _features(defs: GraphDefs, cfg, settings: FeatureSettings, table, blocks, ids, lengths):
  """ids [B, T] i32 (padded at the end), lengths [B] i32 -> features [B, F] f32."""
  T = ids.shape[1]
  valid = jnp.arange(T)[None, :] < lengths[:, None]
  x = jnp.take(table, ids, axis=0)  # [B, T, D]: the embed thoughtlet's rows
  parts = [_pool(x, valid, settings.pooling)]
  if settings.layers:
    # Causal blocks from position 0: end padding never reaches a real token.
    h = run_blocks(defs, cfg, blocks, x)[0].astype(jnp.float32)
    # Unit RMS per token: a few positions (the first, attention sinks) carry residual norms far
    # above the rest and would otherwise dominate the pooled mean and max.
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    parts.append(_pool(h, valid, settings.pooling))
  if settings.hash_buckets:
    b = (ids.astype(jnp.uint32) * jnp.uint32(_HASH_MULTIPLIER)) % jnp.uint32(settings.hash_buckets)
    onehot = jax.nn.one_hot(b, settings.hash_buckets, dtype=jnp.float32) * valid[..., None].astype(jnp.float32)
    parts.append(jnp.log1p(jnp.sum(onehot, axis=1)))
  return jnp.concatenate(parts, axis=-1)


def router_logits(params: Mapping[str, Any], f):  # f [B, F] -> [B, C]
  h = (f - params["standardize.mean"][None, :]) / params["standardize.scale"][None, :]
  n = sum(1 for k in params if k.endswith(".kernel"))
  for i in range(n):
    h = h @ params[f"dense_{i}.kernel"] + params[f"dense_{i}.bias"][None, :]
    if i < n - 1:
      h = jax.nn.gelu(h)
  return h


_logits_jit = jax.jit(router_logits)


# The router owns its jit boundary like calibration does (synthesis/quality.py): it runs pieces no
# serving program composes. Each router (and each training run) jits a closure over its static parts
# (graph defs, config, settings): hashing those as static arguments on every call would cost a
# measurable share of a sub-millisecond prediction. One compile per padded length (and batch).
@functools.lru_cache(maxsize=16)
def _jit_features(defs: GraphDefs, cfg, settings: FeatureSettings):
  return jax.jit(functools.partial(_features, defs, cfg, settings))


@functools.lru_cache(maxsize=16)  # routers over the same model and settings share compiled programs
def _jit_probs(defs: GraphDefs, cfg, settings: FeatureSettings):
  def probs(params, table, blocks, ids, lengths):  # -> [B, C] f32
    return jax.nn.softmax(router_logits(params, _features(defs, cfg, settings, table, blocks, ids, lengths)), axis=-1)

  return jax.jit(probs)


def feature_parts(model, settings: FeatureSettings):
  """(graph defs, config, embed table [V, D], block states 0..layers-1) read from ``model.parts``."""
  cfg = model.config
  if settings.layers > cfg.num_layers:
    raise RouterError(
      f"router features ask for the residual after {settings.layers} blocks, but the model has "
      f"{cfg.num_layers}; use layers <= {cfg.num_layers}"
    )
  parts = model.parts
  missing = [i for i in range(settings.layers) if i not in parts.blocks]
  if missing:
    raise RouterError(
      f"router features need blocks {missing} for layers={settings.layers}, but this model's "
      f"path holds only {sorted(parts.blocks)}; pass a model whose path includes blocks[0:"
      f"{settings.layers}) or use layers=0"
    )
  blocks = [parts.blocks[i] for i in range(settings.layers)]
  return GraphDefs.from_model(model.module), cfg, parts.embed["table"][...], blocks


def weights_fingerprint(table, blocks) -> str:
  """SHA3-256 over the shapes and a fixed strided sample of every array the features read: cheap
  (no full pass over a 100 MB float32 table; a packed one is dequantized first) and enough to tell another
  model's weights apart."""
  from thoughtjax.quantized import dequantize, is_packed

  h = hashlib.sha3_256()
  # A packed weight (native or int8 restores) counts as the float32 it computes as, so the same model restored
  # packed or dequantized has one fingerprint.
  for leaf in [table] + jax.tree.leaves(blocks, is_leaf=is_packed):
    flat = (dequantize(leaf) if is_packed(leaf) else np.asarray(leaf, np.float32)).reshape(-1)
    stride = max(1, flat.size // _FINGERPRINT_SAMPLES)
    h.update(repr(tuple(leaf.shape)).encode())
    h.update(np.ascontiguousarray(flat[::stride]).tobytes())
  return h.hexdigest()[:32]


def _codec_digest(codec) -> str:
  from thoughtjax.registry.codec import codec_digest

  return codec_digest(codec)


def _token_ids(codec, prompt: str, max_tokens: int, where: str = "") -> list[int]:
  if not isinstance(prompt, str):
    raise RouterError(f"router prompt{where} must be text, got {type(prompt).__name__}")
  ids = codec.encode(prompt) if prompt.strip() else []
  if not ids:
    raise RouterError(
      f"router prompt{where} is empty (no text after trimming whitespace); the router needs "
      f"at least one token: give a prompt, or pass a hint instead of routing"
    )
  return ids[:max_tokens]


def _padded(rows: Sequence[Sequence[int]], batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """ids [B, T] i32 padded at the end with 0 to a power-of-two T (>= 8), lengths [B] i32.
  ``batch``: pad with 1-token rows to that many rows (one compile per length bucket)."""
  T = bucket(max(len(r) for r in rows), minimum=8)
  B = len(rows) if batch is None else batch
  ids = np.zeros((B, T), np.int32)
  lengths = np.ones((B,), np.int32)
  for i, r in enumerate(rows):
    ids[i, : len(r)] = r
    lengths[i] = len(r)
  return ids, lengths


# ------------------------------------------------------------------------------ the router
class Router:
  """A trained router bound to the model whose parts it reads.

  ``predict(prompt) -> (hint, {hint: probability})`` in ``labels`` order.
  """

  def __init__(
    self,
    model,
    params: Mapping[str, np.ndarray],
    labels: Sequence[str],
    features: FeatureSettings,
    meta: Mapping[str, Any],
  ):
    self.model, self.labels, self.features = model, tuple(labels), features
    self._meta = dict(meta)
    self._params = {k: np.asarray(v, np.float32) for k, v in params.items()}
    self._device_params = {k: jnp.asarray(v) for k, v in self._params.items()}
    defs, cfg, self._table, self._blocks = feature_parts(model, features)
    self._probs = _jit_probs(defs, cfg, features)

  @property
  def meta(self) -> dict:
    return json.loads(json.dumps(self._meta))  # a deep copy the caller may edit

  def probabilities(self, prompts: Sequence[str]) -> np.ndarray:
    """[N, C] f32 hint probabilities of each prompt (padded together to one length bucket)."""
    if not prompts:
      return np.zeros((0, len(self.labels)), np.float32)
    rows = [_token_ids(self.model.codec, p, self.features.max_tokens, f" {i}") for i, p in enumerate(prompts)]
    ids, lengths = _padded(rows)
    return np.asarray(self._probs(self._device_params, self._table, self._blocks, ids, lengths))

  def warm(self) -> None:
    """Compile the prediction of every prompt length bucket (8, 16, ... up to the features' ``max_tokens``), so that
    routing a request compiles nothing."""
    T = 8
    while True:
      ids, lengths = _padded([[0] * T])
      self._probs(self._device_params, self._table, self._blocks, ids, lengths)
      if T >= self.features.max_tokens:
        return
      T *= 2

  def predict(self, prompt: str) -> tuple[str, dict[str, float]]:
    """The most probable hint for ``prompt`` and every hint's probability."""
    ids, lengths = _padded([_token_ids(self.model.codec, prompt, self.features.max_tokens)])
    p = np.asarray(self._probs(self._device_params, self._table, self._blocks, ids, lengths))[0]
    return self.labels[int(np.argmax(p))], {h: float(v) for h, v in zip(self.labels, p, strict=True)}

  def to_params(self) -> tuple[dict[str, np.ndarray], dict]:
    """(flat dict name -> float32 array, JSON-serializable meta); see the module docstring."""
    return {k: v.copy() for k, v in self._params.items()}, self.meta

  @classmethod
  def from_params(cls, params: Mapping[str, np.ndarray], meta: Mapping[str, Any], model) -> Router:
    """The router ``to_params`` gave, bound to ``model``; refuses a model other than the one it was
    trained on (codec digest, weights fingerprint) and parameters that do not match the meta."""
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
      got = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
      raise RouterError(f"router meta format must be {FORMAT!r}, got {got!r}; pass the meta that to_params returned")
    try:
      features = FeatureSettings(**meta["features"])
      labels = tuple(meta["labels"])
      shapes = {k: tuple(v) for k, v in meta["params"].items()}
      codec, fingerprint = meta["codec_digest"], meta["weights_fingerprint"]
    except (KeyError, TypeError) as e:
      raise RouterError(
        f"router meta is missing or mangles a field ({e}); pass the meta that to_params returned"
      ) from None
    got = {k: tuple(np.shape(v)) for k, v in params.items()}
    if got != shapes:
      raise RouterError(f"router params do not match the meta: expected {shapes}, got {got}")
    width, n = features.width(model.config.d_model), sum(1 for k in shapes if k.endswith(".kernel"))
    if shapes.get("standardize.mean") != (width,) or shapes.get(f"dense_{n - 1}.bias") != (len(labels),):
      raise RouterError(
        f"router params do not fit the meta: {meta['features']} on d_model={model.config.d_model} "
        f"gives {width} features and {len(labels)} hints need {len(labels)} outputs, got "
        f"standardize.mean {shapes.get('standardize.mean')} and dense_{n - 1}.bias "
        f"{shapes.get(f'dense_{n - 1}.bias')}"
      )
    bad = [k for k, v in params.items() if np.asarray(v).dtype != np.float32]
    if bad:
      raise RouterError(f"router params must be float32; {bad} are not")
    have = _codec_digest(model.codec)
    if have != codec:
      raise RouterError(
        f"this router was trained on a model whose tokenizer has digest {codec}; the given "
        f"model's has {have}; train a router for this model with train_router"
      )
    _, _, table, blocks = feature_parts(model, features)
    have = weights_fingerprint(table, blocks)
    if have != fingerprint:
      raise RouterError(
        f"this router was trained on other weights (fingerprint {fingerprint}); the given "
        f"model's embed/blocks have {have}; train a router for this model with train_router"
      )
    return cls(model, params, labels, features, meta)


# ------------------------------------------------------------------------------ training
def _labeled(data, labels: Sequence[str], split: str) -> tuple[list[str], np.ndarray]:
  """(prompts, label indices [N]) from RouterPrompt-like rows (``.prompt``, ``.hint``) or (prompt, hint) pairs."""
  index = {h: i for i, h in enumerate(labels)}
  prompts, ys = [], []
  for n, row in enumerate(data):
    prompt, hint = (row.prompt, row.hint) if hasattr(row, "hint") else tuple(row)
    if hint not in index:
      where = f"line {row.line}" if hasattr(row, "line") else f"row {n}"
      raise RouterError(
        f"{split} prompt {where} ({prompt[:60]!r}) is labeled {hint!r}, which is not a router "
        f"hint; valid hints: {', '.join(labels)}; fix the label or pass labels= with it"
      )
    prompts.append(prompt)
    ys.append(index[hint])
  if not prompts:
    raise RouterError(f"the router's {split} set holds no prompt; give at least one labeled prompt")
  return prompts, np.asarray(ys, np.int32)


def _feature_matrix(
  model, features: FeatureSettings, prompts: Sequence[str], split: str, progress: Progress | None
) -> np.ndarray:
  defs, cfg, table, blocks = feature_parts(model, features)
  run = _jit_features(defs, cfg, features)
  rows = [_token_ids(model.codec, p, features.max_tokens, f" {i} of the {split} set") for i, p in enumerate(prompts)]
  out = []
  for start in range(0, len(rows), _FEATURE_BATCH):
    chunk = rows[start : start + _FEATURE_BATCH]
    ids, lengths = _padded(chunk, batch=_FEATURE_BATCH)
    out.append(np.asarray(run(table, blocks, ids, lengths))[: len(chunk)])
    if progress is not None:
      progress(min(start + _FEATURE_BATCH, len(rows)), len(rows), f"router features/{split}")
  return np.concatenate(out, axis=0)


def _init(key, sizes: Sequence[int]) -> dict[str, jax.Array]:
  """Glorot-normal kernels, zero biases, for dense layers sizes[0] -> sizes[1] -> ..."""
  params = {}
  for i, (a, b) in enumerate(itertools.pairwise(sizes)):
    params[f"dense_{i}.kernel"] = (
      jax.random.normal(jax.random.fold_in(key, i), (a, b), jnp.float32) * (2.0 / (a + b)) ** 0.5
    )
    params[f"dense_{i}.bias"] = jnp.zeros((b,), jnp.float32)
  return params


@functools.lru_cache(maxsize=8)
def _train_programs(sizes: tuple[int, ...], learning_rate: float, weight_decay: float):
  """(start(key) -> (params, opt state), step(params, state, fixed, x, y) -> (params, state)), compiled.

  Everything runs compiled: op-by-op dispatch of the same work would compile dozens of tiny
  programs, which dominates a small training run; cached so repeated fits reuse the programs."""
  opt = optax.adamw(learning_rate, weight_decay=weight_decay)

  @jax.jit
  def start(key):
    p = _init(key, sizes)
    return p, opt.init(p)

  @jax.jit
  def step(p, s, fixed, xs, ys):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(router_logits(p | fixed, xs), ys).mean()

    updates, s = opt.update(jax.grad(loss_fn)(p), s, p)
    return optax.apply_updates(p, updates), s

  return start, step


def fit(
  x: np.ndarray, y: np.ndarray, classes: int, training: TrainSettings, progress: Progress | None = None
) -> tuple[dict[str, np.ndarray], float, float]:
  """Standardize features x [N, F] and train the classifier on labels y [N] in 0..classes-1.

  Returns (params, final training loss, training accuracy); deterministic for ``training.seed``.
  """
  mean = x.mean(axis=0)
  std = x.std(axis=0)
  # Features constant over the training set (an unused hash bucket) keep scale 1: they carry nothing.
  scale = np.where(std > 1e-6, std, 1.0).astype(np.float32)
  sizes = [x.shape[1]] + ([training.hidden] if training.hidden else []) + [classes]
  fixed = {"standardize.mean": jnp.asarray(mean, jnp.float32), "standardize.scale": jnp.asarray(scale)}
  xs, ys = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)
  start, step = _train_programs(tuple(sizes), training.learning_rate, training.weight_decay)
  trainable, state = start(jax.random.key(training.seed))
  every = max(1, training.steps // 20)
  for i in range(training.steps):
    trainable, state = step(trainable, state, fixed, xs, ys)
    if progress is not None and ((i + 1) % every == 0 or i + 1 == training.steps):
      progress(i + 1, training.steps, "router training")
  params = {k: np.asarray(v, np.float32) for k, v in (trainable | fixed).items()}
  logits = np.asarray(_logits_jit(params, xs), np.float64)
  logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
  final_loss = float(-np.mean(logp[np.arange(len(y)), y]))
  train_acc = float(np.mean(np.argmax(logits, axis=-1) == y))
  return params, final_loss, train_acc


def confusion_metrics(confusion: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
  tp = np.diag(confusion).astype(np.float64)
  predicted, actual = confusion.sum(axis=0), confusion.sum(axis=1)
  precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
  recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
  return float(tp.sum() / max(confusion.sum(), 1)), precision, recall


def train_router(
  model,
  train,
  heldout,
  *,
  seed: int = 0,
  steps: int = 300,
  features: FeatureSettings | None = None,
  training: TrainSettings | None = None,
  labels: Sequence[str] | None = None,
  progress: Progress | None = None,
) -> tuple[Router, RouterReport]:
  """Train a router on ``train`` and evaluate it on ``heldout``.

  ``train``/``heldout``: :class:`~thoughtjax.synthesis.router_data.RouterPrompt` rows or (prompt, hint)
  pairs. ``labels``: the hints it chooses among, in output order (default: the default synthesis
  dictionary's hints); a row labeled with anything else, or a label with no training prompt, is a
  :class:`RouterError`. ``training`` gives the optimizer settings; ``seed`` and ``steps`` override its own.
  """
  features = FeatureSettings() if features is None else features
  training = dataclasses.replace(TrainSettings() if training is None else training, seed=seed, steps=steps)
  if labels is None:
    from thoughtjax.synthesis.dictionary import load_dictionary

    labels = load_dictionary().names
  labels = tuple(labels)
  if len(labels) < 2 or len(set(labels)) != len(labels):
    raise RouterError(f"a router chooses among at least 2 distinct hints, got {list(labels)}")
  t0 = time.perf_counter()
  train_prompts, y = _labeled(train, labels, "train")
  held_prompts, y_held = _labeled(heldout, labels, "heldout")
  absent = [h for i, h in enumerate(labels) if not np.any(y == i)]
  if absent:
    raise RouterError(
      f"hints {absent} have no training prompt; add labeled prompts for them or leave them out of labels="
    )
  x = _feature_matrix(model, features, train_prompts, "train", progress)
  params, final_loss, train_acc = fit(x, y, len(labels), training, progress)

  _, _, table, blocks = feature_parts(model, features)
  meta = {
    "format": FORMAT,
    "labels": list(labels),
    "features": dataclasses.asdict(features),
    "codec_digest": _codec_digest(model.codec),
    "weights_fingerprint": weights_fingerprint(table, blocks),
    "d_model": model.config.d_model,
    "params": {k: list(v.shape) for k, v in sorted(params.items())},
    "training": dataclasses.asdict(training)
    | {"n_train": len(train_prompts), "final_loss": final_loss, "train_accuracy": train_acc},
  }
  train_s = time.perf_counter() - t0
  router = Router(model, params, labels, features, meta)

  x_held = _feature_matrix(model, features, held_prompts, "heldout", progress)
  pred = np.argmax(np.asarray(_logits_jit(params, x_held)), axis=-1)
  confusion = np.zeros((len(labels), len(labels)), np.int64)
  np.add.at(confusion, (y_held, pred), 1)
  accuracy, precision, recall = confusion_metrics(confusion)
  times = predict_times(router, held_prompts)
  report = RouterReport(
    labels,
    accuracy,
    precision,
    recall,
    confusion,
    train_acc,
    final_loss,
    len(train_prompts),
    len(held_prompts),
    statistics.median(times),
    float(np.percentile(times, 90)),
    train_s,
    features,
    training,
  )
  router._meta["heldout"] = {
    "n": len(held_prompts),
    "accuracy": accuracy,
    "precision": precision.tolist(),
    "recall": recall.tolist(),
    "confusion": confusion.tolist(),
    "predict_ms": report.predict_ms,
  }
  return router, report


def predict_times(router: Router, prompts: Sequence[str]) -> list[float]:
  """Warm wall time (ms) of one ``predict`` per prompt: a first pass compiles every length bucket."""
  for p in prompts:
    router.predict(p)
  times = []
  for p in prompts:
    t = time.perf_counter()
    router.predict(p)
    times.append((time.perf_counter() - t) * 1e3)
  return times

"""Healing a cut path: train a bridge thoughtlet by distillation against the full path.

>>> reg = Registry.open("build/registry")
>>> params, report = heal(reg, "embed, blocks[0:10), head", HealSettings(rank=64, steps=300))
>>> report.before.mean_kl, report.after.mean_kl     # held-out KL(full || cut) without / with the bridge
>>> publish_bridge(reg, params, report, sign_key="keys/registry.key")

The bridge (:mod:`thoughtjax.thoughtlet.bridge`) goes at the path's cut (:func:`~thoughtjax.thoughtlet.bridge.
cut_point`) and minimises the mean over positions of KL(p_full || q_cut+bridge) between next-token
distributions, with optax AdamW, on:

* text the model generates itself: greedy and sampled continuations of short prompts (the starts of the
  given documents, or a few fixed openings when none are given), so no dataset is needed;
* the given documents themselves (the calibration splits of the hint corpora).

All token streams are packed into windows [N, T]; one window in ``heldout_every`` is held out (or the
given held-out documents are used). Held-out quality before (the untrained bridge is the identity, so
"before" is the cut path itself) and after training: top-1 agreement with the full path, mean KL in nats
and ΔNLL in nats per token, as in :mod:`thoughtjax.synthesis.quality`. Everything is seeded: the same
settings, model and text give the same bridge.

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``,
``registry``; the functions that need them do.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from thoughtjax.assembly import full_path
from thoughtjax.decode.program import sequence_logits
from thoughtjax.errors import UserError
from thoughtjax.model import Model
from thoughtjax.sampling import SamplingParams
from thoughtjax.thoughtlet import ProfileSettings
from thoughtjax.thoughtlet import bridge as bridge_lib
from thoughtjax.transformer import GraphDefs

# (step, steps, loss) after each training step.
Progress = Callable[[int, int, float], None]
OPENINGS = (
  "The",
  "In the beginning",
  "Here is a short story about",
  "def main():",
  "Question: What is",
  "Once upon a time",
  "The following list",
  "Dear",
)


class HealError(UserError, ValueError):
  """A heal was asked of something it cannot heal (no cut, too little text, bad settings)."""


@dataclasses.dataclass(frozen=True)
class HealSettings:
  rank: int = bridge_lib.DEFAULT_RANK
  steps: int = 300
  learning_rate: float = 2e-3
  weight_decay: float = 1e-4
  batch: int = 8  # windows per step
  window: int = 64  # T, tokens per window
  seed: int = 0
  generated: int = 32  # self-generated continuations (half greedy, half sampled)
  generated_tokens: int = 64
  heldout_every: int = 5  # one window in this many is held out (when no held-out documents are given)

  def __post_init__(self):
    least = {"rank": 1, "steps": 1, "batch": 1, "window": 2, "generated": 0, "generated_tokens": 1, "heldout_every": 2}
    for name, low in least.items():
      if getattr(self, name) < low:
        raise HealError(f"HealSettings.{name} must be >= {low}, got {getattr(self, name)}")
    if self.learning_rate <= 0:
      raise HealError(f"HealSettings.learning_rate must be > 0, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class HealQuality:
  """Held-out quality of a path against the full path (per predicted token)."""

  top1_agreement: float
  mean_kl: float  # nats
  delta_nll: float  # nats per token; negative: predicts the text better than the full path
  tokens: int

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    return (
      f"agreement {self.top1_agreement:.1%}  KL {self.mean_kl:.4f}  ΔNLL {self.delta_nll:+.4f}  ({self.tokens} tokens)"
    )


@dataclasses.dataclass(frozen=True)
class HealReport:
  path: str  # the cut path
  bridged_path: str  # the path with the bridge at its cut
  name: str
  heals: tuple[int, int]  # the layers [a, b) it stands in for
  rank: int
  param_bytes: int
  steps: int
  seed: int
  train_windows: int
  heldout_windows: int
  window: int
  train_seconds: float
  before: HealQuality
  after: HealQuality
  losses: tuple[float, ...]

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["before"], d["after"] = self.before.to_json(), self.after.to_json()
    d["heals"], d["losses"] = list(self.heals), [round(x, 6) for x in self.losses[:: max(1, len(self.losses) // 50)]]
    return d


# ------------------------------------------------------------------------------ models and text
def _models(source, path: str):
  """(full model, cut model) over the same weights: composed from a registry, or a loaded model's own."""
  from thoughtjax.compose import compose
  from thoughtjax.registry import Registry

  if isinstance(source, Registry):
    full = compose(full_path(source), source, compile_cache=False)
  elif isinstance(source, Model):
    full = source.with_path(list(range(source.config.num_layers)))
  else:
    raise TypeError(f"heal: source must be a Registry or a loaded Model, got {type(source).__name__}")
  return full, compose(path, source, compile_cache=False)


def _self_text(full, settings: HealSettings, documents: Sequence[str]) -> list[list[int]]:
  """Greedy and sampled continuations of short prompts, generated by the full path itself."""

  codec = full.codec
  starts = [" ".join(d.split()[:6]) for d in documents if d.split()] or list(OPENINGS)
  rng = np.random.default_rng(settings.seed)
  prompts = [starts[int(i)] for i in rng.integers(0, len(starts), settings.generated)]
  params = [
    SamplingParams(
      max_tokens=settings.generated_tokens,
      ignore_eos=True,
      temperature=0.0 if i % 2 == 0 else 0.8,
      seed=settings.seed * 1000 + i,
    )
    for i in range(len(prompts))
  ]
  out = []
  for lo in range(0, len(prompts), 8):  # batches of 8: one program bucket
    done = full.generate_batch(prompts[lo : lo + 8], params[lo : lo + 8])
    for p, c in zip(prompts[lo : lo + 8], done, strict=True):
      out.append(codec.encode(p) + [int(t) for t in c.token_ids])
  return out


def _pack(streams: Sequence[Sequence[int]], window: int) -> np.ndarray:
  """Token streams concatenated and cut into windows [N, window] i32 (the tail that does not fill one is dropped)."""
  flat = np.asarray([t for s in streams for t in s], np.int32)
  n = len(flat) // window
  return flat[: n * window].reshape(n, window)


def training_windows(
  full, settings: HealSettings, documents: Sequence[str] = (), heldout_documents: Sequence[str] = ()
) -> tuple[np.ndarray, np.ndarray]:
  """(train [N, T], held-out [M, T]) windows: self-generated text plus ``documents``; held out are the
  ``heldout_documents`` if given, else one window in ``heldout_every`` (seeded)."""
  codec = full.codec
  streams = _self_text(full, settings, documents) + [codec.encode(d) for d in documents]
  windows = _pack(streams, settings.window)
  rng = np.random.default_rng(settings.seed + 1)
  windows = windows[rng.permutation(len(windows))]
  if heldout_documents:
    held = _pack([codec.encode(d) for d in heldout_documents], settings.window)
    train = windows
  else:
    is_held = np.arange(len(windows)) % settings.heldout_every == 0
    train, held = windows[~is_held], windows[is_held]
  if len(train) < 1 or len(held) < 1:
    raise HealError(
      f"too little text to heal: {len(train)} training and {len(held)} held-out windows of "
      f"{settings.window} tokens; raise HealSettings.generated or pass more documents"
    )
  return train, held


# ------------------------------------------------------------------------------ the jitted pieces
@dataclasses.dataclass(frozen=True)
class _Plan:
  defs: GraphDefs
  full_layers: tuple[int, ...]
  bridged_layers: tuple[int, ...]  # the cut path's slots with the bridge at slot -1


def _plan(full, cut, path: str) -> tuple[_Plan, int, tuple[int, int]]:
  L = full.config.num_layers
  at, span = bridge_lib.cut_point(path, L)
  if any(i < 0 for i in cut.layers):
    raise HealError(f"{path!r} already holds a bridge; heal the path without it")
  layers = tuple(cut.layers)
  return _Plan(GraphDefs.from_model(cut.module), tuple(full.layers), layers[:at] + (-1,) + layers[at:]), at, span


def _bridged_parts(cut_parts, bparams):
  return cut_parts._replace(blocks={**cut_parts.blocks, -1: bparams})


def _logps(plan: _Plan, full_parts, cut_parts, bparams, tokens):
  p = jax.nn.log_softmax(sequence_logits(plan.defs, plan.full_layers, full_parts, tokens), axis=-1)
  q = jax.nn.log_softmax(
    sequence_logits(plan.defs, plan.bridged_layers, _bridged_parts(cut_parts, bparams), tokens), axis=-1
  )
  return jax.lax.stop_gradient(p), q


def _kl(p, q):  # [B, T, V] log-probs -> [B, T] KL(p || q)
  return jnp.sum(jnp.exp(p) * (p - q), axis=-1)


@functools.partial(jax.jit, static_argnums=(0,))
def _metrics(plan: _Plan, full_parts, cut_parts, bparams, tokens):
  """Per-window sums over the T-1 predicted positions: (agreements, KL, ΔNLL)."""
  p, q = _logps(plan, full_parts, cut_parts, bparams, tokens)
  p, q, y = p[:, :-1], q[:, :-1], tokens[:, 1:]
  agree = (jnp.argmax(p, -1) == jnp.argmax(q, -1)).astype(jnp.float32)
  nll_p = -jnp.take_along_axis(p, y[..., None], -1)[..., 0]
  nll_q = -jnp.take_along_axis(q, y[..., None], -1)[..., 0]
  return agree.sum(), _kl(p, q).sum(), (nll_q - nll_p).sum()


def evaluate(plan: _Plan, full_parts, cut_parts, bparams, windows: np.ndarray, batch: int) -> HealQuality:
  """Held-out quality of the bridged cut path against the full path (sums in float64 on the host)."""
  agree = kl = dnll = 0.0
  for lo in range(0, len(windows), batch):
    a, k, d = _metrics(plan, full_parts, cut_parts, bparams, jnp.asarray(windows[lo : lo + batch]))
    agree, kl, dnll = agree + float(a), kl + float(k), dnll + float(d)
  n = len(windows) * (windows.shape[1] - 1)
  return HealQuality(agree / n, kl / n, dnll / n, n)


def _train_step(plan: _Plan, optimizer):

  def loss_fn(bparams, full_parts, cut_parts, tokens):
    p, q = _logps(plan, full_parts, cut_parts, bparams, tokens)
    return jnp.mean(_kl(p, q))

  @jax.jit
  def step(bparams, opt_state, full_parts, cut_parts, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(bparams, full_parts, cut_parts, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, bparams)
    return optax.apply_updates(bparams, updates), opt_state, loss

  return step


# ------------------------------------------------------------------------------ heal
def heal(
  source,
  path: str,
  settings: HealSettings = HealSettings(),
  *,
  documents: Sequence[str] = (),
  heldout_documents: Sequence[str] = (),
  progress: Progress | None = None,
) -> tuple[dict, HealReport]:
  """Train a bridge for the cut ``path`` of ``source`` (a Registry or a loaded Model); returns its params
  and a :class:`HealReport` (held-out quality before and after, training time, size)."""

  full, cut = _models(source, path)
  plan, _, span = _plan(full, cut, path)
  train, held = training_windows(full, settings, documents, heldout_documents)
  bparams = bridge_lib.init_params(full.config, settings.rank, settings.seed)
  before = evaluate(plan, full.parts, cut.parts, bparams, held, settings.batch)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, settings.learning_rate, max(1, settings.steps // 20), settings.steps, settings.learning_rate * 0.05
  )
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=settings.weight_decay))
  opt_state = optimizer.init(bparams)
  step = _train_step(plan, optimizer)
  rng = np.random.default_rng(settings.seed + 2)
  order, at, losses = rng.permutation(len(train)), 0, []
  t0 = time.perf_counter()
  for i in range(settings.steps):
    if at + settings.batch > len(order):
      order, at = rng.permutation(len(train)), 0
    idx = order[at : at + settings.batch] if len(order) >= settings.batch else order
    at += settings.batch
    bparams, opt_state, loss = step(bparams, opt_state, full.parts, cut.parts, jnp.asarray(train[idx]))
    losses.append(float(loss))
    if progress is not None:
      progress(i + 1, settings.steps, losses[-1])
  seconds = time.perf_counter() - t0
  after = evaluate(plan, full.parts, cut.parts, bparams, held, settings.batch)
  L = full.config.num_layers
  name = bridge_lib.bridge_name(span)
  report = HealReport(
    path=path,
    bridged_path=bridge_lib.bridged_path(path, name, L),
    name=name,
    heals=span,
    rank=settings.rank,
    param_bytes=int(sum(x.nbytes for x in jax.tree.leaves(bparams))),
    steps=settings.steps,
    seed=settings.seed,
    train_windows=len(train),
    heldout_windows=len(held),
    window=settings.window,
    train_seconds=seconds,
    before=before,
    after=after,
    losses=tuple(losses),
  )
  return jax.tree.map(np.asarray, bparams), report


def publish_bridge(reg, params, report: HealReport, *, sign_key=None, settings=None) -> str:
  """Publish the bridge as a new version of ``report.name`` through :meth:`Registry.publish` (hashed,
  signed under the registry's trust rules, profiled); returns the version. Its constraints record the
  cut path and the report (held-out quality before and after, training time, size)."""

  t = bridge_lib.bridge_thoughtlet(
    reg.config, reg.tokenizer_hash, params, cut_path=report.path, span=report.heals, report=report.to_json()
  )
  versions = reg.publish([t], sign_key=sign_key, settings=settings if settings is not None else ProfileSettings())
  return versions[t.name]

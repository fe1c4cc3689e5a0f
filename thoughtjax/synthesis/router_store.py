"""The hint router stored in a registry: a signed thoughtlet of kind ``router``.

>>> from thoughtjax.registry import Registry
>>> from thoughtjax.synthesis.router_store import load_router, train_registry_router
>>> reg = Registry.open("build/registry")
>>> router, report, version = train_registry_router(reg, sign_key="keys/registry.key")  # a new sequence
>>> load_router(reg).predict("Return the three largest cities as a JSON list")          # verified restore

Layout: the classifier's float32 arrays are the checkpoint, nested as ``{"standardize": {"mean", "scale"},
"dense_<i>": {"kernel", "bias"}}``; the router's JSON meta (hint labels, feature settings, codec digest,
weights fingerprint of the parts its features read, training settings, held-out metrics) is the
signature's ``constraints["router"]``. Both are covered by the versioned hash and the signed manifest, so
a router is versioned, hashed, signed, listed, shown and verified like any thoughtlet. Its signature
types it ``tokens[B,T] i32 -> hint_probs[B,C] f32``; it is never a link of a path (composing one is a
``PathTypeError``). Its resource profile times the classifier alone: its features are the embed
thoughtlet's rows, which that thoughtlet's own profile covers.

A router only runs on the model it was trained on: publishing and restoring both refuse a router whose
codec digest is not the registry's tokenizer or whose weights fingerprint is not the registry's current
embed (and blocks, for features that read them) with :class:`RouterMismatchError`; the fix is to train
one for this registry (``thoughtjax registry train-router DIR``). A tampered checkpoint or manifest is
refused by the registry's own checks (:class:`~thoughtjax.registry.IntegrityError` and friends, counted
in ``Registry.stats()``), never replaced by another version.

Publishing a router changes none of the thoughtlets a calibration measured, so the calibration stored at
the registry's previous sequence is carried to the new one (checked, then re-signed with the publish's
key) when every version it pins is still current; otherwise the registry needs ``registry calibrate``.

:func:`route_hint` is what synthesis calls for a request without hints: the stored router's choice (the
router restored once per registry sequence), or the default hint with a note saying why not.

Imports inside functions here are deferred for start-up: importing this module does not load ``compose``,
``registry``, ``registry.publish``, ``synthesis.calibration_store``, ``synthesis.router_data``; the functions that
need them do.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.synthesis.router import (
  FORMAT,
  FeatureSettings,
  Progress,
  Router,
  RouterError,
  RouterReport,
  TrainSettings,
  feature_parts,
  router_logits,
  train_router,
  weights_fingerprint,
)
from thoughtjax.thoughtlet import Kind, ProfileSettings, Thoughtlet, measure_profile, signature_for
from thoughtjax.thoughtlet.profile import register_step

ROUTER_NAME = "router"


class RouterMismatchError(RouterError):
  """A stored router was trained on another tokenizer or other weights than this registry's."""


# ------------------------------------------------------------------------------ params <-> checkpoint
def nest_params(flat: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
  """``{"dense_0.kernel": a}`` -> ``{"dense_0": {"kernel": a}}``: checkpoint paths use ``/``, not dots."""
  out: dict[str, dict[str, np.ndarray]] = {}
  for key, value in flat.items():
    group, _, leaf = key.partition(".")
    if not leaf:
      raise RouterError(f"router parameter name {key!r} is not '<group>.<leaf>'; pass the params to_params returned")
    out.setdefault(group, {})[leaf] = np.asarray(value, np.float32)
  return out


def flatten_params(nested: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """The inverse of :func:`nest_params` (arrays brought to the host as float32 numpy)."""
  return {f"{g}.{leaf}": np.asarray(v, np.float32) for g, leaves in nested.items() for leaf, v in leaves.items()}


def profile_step(t: Thoughtlet, settings):
  """One profiled step of a router thoughtlet (:mod:`thoughtjax.thoughtlet.profile`): standardize and
  classify ``settings.batch`` pooled feature rows [B, F] into hint probabilities [B, C]."""

  params = flatten_params(t.params)
  f = jnp.zeros((settings.batch, params["standardize.mean"].shape[0]), jnp.float32)
  return (lambda p, x: jax.nn.softmax(router_logits(p, x), axis=-1)), (params, f), settings.batch


register_step(Kind.ROUTER, profile_step)


# ------------------------------------------------------------------------------ the model features read
def registry_model(registry, features: FeatureSettings | None = None):
  """The model whose parts a router reads, composed from ``registry``: embed and head (a tied head reads
  only the embed table), plus ``blocks[0:layers)`` when the features read the residual after them."""
  from thoughtjax.compose import compose

  layers = (features or FeatureSettings()).layers
  path = "embed, head" if not layers else f"embed, blocks[0:{layers}), head"
  return compose(path, registry)


def _check_model(meta: Mapping[str, Any], registry, model, what: str) -> None:
  """Refuse a router (meta) trained on another tokenizer or other weights than ``registry``'s."""
  features = FeatureSettings(**meta["features"])
  if meta.get("codec_digest") != registry.tokenizer_hash:
    raise RouterMismatchError(
      f"{what} was trained on a model whose tokenizer has digest {meta.get('codec_digest')}; the registry "
      f"{registry.root} has tokenizer {registry.tokenizer_hash}. Train a router for this registry: "
      f"thoughtjax registry train-router {registry.root}"
    )
  _, _, table, blocks = feature_parts(model, features)
  have = weights_fingerprint(table, blocks)
  if meta.get("weights_fingerprint") != have:
    raise RouterMismatchError(
      f"{what} was trained on other weights (fingerprint {meta.get('weights_fingerprint')}); the current "
      f"embed{' and blocks' if features.layers else ''} of {registry.root} have {have}. Train a router for "
      f"this registry: thoughtjax registry train-router {registry.root}"
    )


def router_thoughtlet(router: Router, registry, name: str = ROUTER_NAME) -> Thoughtlet:
  """``router`` as an unprofiled thoughtlet of kind ``router`` for ``registry``'s model and tokenizer."""
  meta = router.meta
  if meta.get("format") != FORMAT:
    raise RouterError(f"router meta format must be {FORMAT!r}, got {meta.get('format')!r}")
  params, _ = router.to_params()
  sig = signature_for(
    Kind.ROUTER,
    registry.config,
    registry.tokenizer_hash,
    max_context=router.features.max_tokens,
    tags=("router", *router.labels),
    description=f"picks one of {len(router.labels)} hints from the prompt's embed rows",
  )
  sig = dataclasses.replace(sig, constraints={**sig.constraints, "router": meta})
  return Thoughtlet(name, Kind.ROUTER, sig, nest_params(params), registry.config)


# ------------------------------------------------------------------------------ publish / restore
def publish_router(
  registry, router: Router, *, sign_key=None, name: str = ROUTER_NAME, carry_calibration: bool = True, settings=None
) -> str:
  """Publish ``router`` into ``registry`` as the current version of ``name``; returns the version.

  ``sign_key``: required when the registry is signed (a signed registry stays signed). ``settings``:
  the :class:`~thoughtjax.thoughtlet.ProfileSettings` of its profile (default batch 1). With
  ``carry_calibration``, the calibration of the previous sequence moves to the new one (module docstring).
  """
  from thoughtjax.registry import RegistryError
  from thoughtjax.registry.publish import publish_version
  from thoughtjax.synthesis.calibration_store import MissingCalibrationError, read_calibration, write_calibration

  if name in registry.names and registry.manifest(name).kind is not Kind.ROUTER:
    raise RegistryError(
      f"{registry.root} already has a {registry.manifest(name).kind.value} thoughtlet named "
      f"{name!r}; publish the router under another name"
    )
  _check_model(router.meta, registry, registry_model(registry, router.features), "the router being published")
  t = router_thoughtlet(router, registry, name)
  t = dataclasses.replace(t, profile=measure_profile(t, settings or ProfileSettings(batch=1, reps=20)))
  calibration = None
  if carry_calibration:
    try:
      calibration = read_calibration(registry)
    except MissingCalibrationError:
      calibration = None
  versions = publish_version(
    registry.root,
    [t],
    sign_key=sign_key,
    on_step=None,
    model=None,
    codec=None,
    trust=registry.trust,
    on_failure=registry.record_failure,
  )
  registry.refresh()
  if calibration is not None:
    # No candidate path uses a router, so a calibration pinned to the previous router version stays valid.
    current = registry.current
    if all(current.get(n) == v for n, v in calibration.current.items() if n != name):
      pinned = {n: current[name] if n == name else v for n, v in calibration.current.items()}
      write_calibration(
        registry, dataclasses.replace(calibration, sequence=registry.sequence, current=pinned), sign_key=sign_key
      )
  return versions[name]


def load_router(registry, name: str = ROUTER_NAME, version: str | None = None, *, model=None) -> Router:
  """The stored router ``name`` (current version, or ``version``), its files checked against the signed
  manifest, bound to ``model`` (default: :func:`registry_model` of ``registry``)."""
  m = registry.manifest(name, version)
  if m.kind is not Kind.ROUTER:
    raise RouterError(
      f"{m.ref} is a {m.kind.value} thoughtlet, not a router; pass the name of a router "
      f"(thoughtjax registry list {registry.root} shows the kinds)"
    )
  meta = m.signature.constraints.get("router")
  if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
    raise RouterError(
      f"{m.ref}: its signature carries no router meta of format {FORMAT!r}; publish it with publish_router"
    )
  params = flatten_params(registry.restore(m.name, m.version))
  features = FeatureSettings(**meta["features"])
  model = model if model is not None else registry_model(registry, features)
  _check_model(meta, registry, model, f"router {m.ref}")
  return Router.from_params(params, meta, model)


# ------------------------------------------------------------------------------ training into a registry
def train_registry_router(
  registry,
  train=None,
  heldout=None,
  *,
  sign_key=None,
  name: str = ROUTER_NAME,
  seed: int = 0,
  steps: int = 300,
  features: FeatureSettings | None = None,
  training: TrainSettings | None = None,
  labels: Sequence[str] | None = None,
  progress: Progress | None = None,
  publish: bool = True,
) -> tuple[Router, RouterReport, str | None]:
  """Train a router on ``registry``'s own embed (``train``/``heldout``: default the project's prompt
  splits), evaluate it on the held-out split and, with ``publish``, store it; returns (router, report,
  version or None)."""
  from thoughtjax.synthesis.router_data import load_router_prompts

  train = load_router_prompts("train") if train is None else train
  heldout = load_router_prompts("heldout") if heldout is None else heldout
  model = registry_model(registry, features)
  router, report = train_router(
    model,
    train,
    heldout,
    seed=seed,
    steps=steps,
    features=features,
    training=training,
    labels=labels,
    progress=progress,
  )
  version = publish_router(registry, router, sign_key=sign_key, name=name) if publish else None
  return router, report, version


# ------------------------------------------------------------------------------ routing a request
_ROUTERS: weakref.WeakKeyDictionary[Any, tuple[int, Router | None, str | None]] = weakref.WeakKeyDictionary()
_ROUTERS_LOCK = threading.Lock()


def stored_router(registry, name: str = ROUTER_NAME) -> tuple[Router | None, str | None]:
  """(router, None) when ``registry`` holds a usable router, else (None, why not); restored once per
  registry sequence. A router that fails its checks is counted by the registry and reported as why not."""
  from thoughtjax.registry import RegistryError

  with _ROUTERS_LOCK:
    seq = registry.sequence
    got = _ROUTERS.get(registry)
    if got is not None and got[0] == seq:
      return got[1], got[2]
    router, why = None, None
    if name not in registry.names:
      why = "no router in this registry (train one: thoughtjax registry train-router --registry DIR)"
    else:
      try:
        router = load_router(registry, name)
      except (RegistryError, RouterError) as e:
        why = f"the stored router was refused ({e})"
    _ROUTERS[registry] = (seq, router, why)
    return router, why


def route_hint(
  registry, prompt: str | Sequence[int], default: str, decode: Callable[[Sequence[int]], str] | None = None
) -> tuple[str, str]:
  """(hint, note) for a request without hints: the stored router's pick for ``prompt`` (token ids are
  decoded with ``decode``, default the registry's codec), or ``default`` with the reason in the note."""
  router, why = stored_router(registry)
  if router is None:
    return default, f"no hints given: used {default}; {why}"
  text = prompt if isinstance(prompt, str) else (decode or registry.codec.decode)(list(prompt))
  try:
    hint, probs = router.predict(text)
  except RouterError as e:
    return default, f"no hints given: used {default}; the router could not route this prompt ({e})"
  return hint, f"no hints given: the router picked {hint} (p={probs[hint]:.2f})"


def loaded_router(registry) -> Router | None:
  """The router :func:`stored_router` restored for ``registry``, if any (no restore here)."""
  with _ROUTERS_LOCK:
    got = _ROUTERS.get(registry)
  return None if got is None else got[1]


def forget_router(registry) -> bool:
  """Drop the router restored for ``registry`` (its model's weights with it); the next hint-less request
  restores it again. True when there was one."""
  with _ROUTERS_LOCK:
    return _ROUTERS.pop(registry, None) is not None


def clear_cache() -> None:
  """Forget the routers restored by :func:`stored_router` (e.g. after files changed under a registry)."""
  with _ROUTERS_LOCK:
    _ROUTERS.clear()


__all__ = [
  "ROUTER_NAME",
  "RouterMismatchError",
  "clear_cache",
  "flatten_params",
  "forget_router",
  "load_router",
  "loaded_router",
  "nest_params",
  "profile_step",
  "publish_router",
  "registry_model",
  "route_hint",
  "router_thoughtlet",
  "stored_router",
  "train_registry_router",
]

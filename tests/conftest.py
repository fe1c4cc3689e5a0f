"""Shared test set-up: a strict JAX, visible warnings, seeded randomness, several fake CPU devices,
seeded tiny models and the real default model, and a cache of the run's own (tests/isolation.py): no test
reads or writes the user's cache, trust state, learned corrections, exported programs or compilation cache.

Strictness (equinox/lineax style): an implicit rank promotion (``x[B, T] + y[T]``) raises instead
of broadcasting silently, and pyproject's ``filterwarnings`` turns warnings into errors (third-party
deprecations are shown in the summary instead). The settings live here, not in the library: user
code keeps JAX's defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

# The device count is fixed when JAX starts, so this precedes every JAX import. Eight host devices
# match the sharding tests' mesh; tests that do not ask for a mesh still run on device 0. An
# explicit device count in XLA_FLAGS wins.
_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

# Tests never touch the user's files (issue 21 item 2): the whole run, every xdist worker included, uses one
# cache directory of its own outside the home directory (tests.isolation). Set before any thoughtjax import.
from tests import isolation  # noqa: E402

RUN = isolation.enter_run()

import thoughtjax  # noqa: E402

thoughtjax.use_memory_scheduler()  # the XLA:CPU scheduler the commands and the server run with

import hypothesis  # noqa: E402
import jax  # noqa: E402  (after XLA_FLAGS: the device count is read at import)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# Hypothesis profiles: "dev" (the default: hypothesis' own, with its example database) and "ci" (what .ci/run
# selects: derandomized, so a run is reproducible from its log, and no database written into the clone).
# THOUGHTJAX_HYPOTHESIS_PROFILE picks one. Tests that set max_examples keep their own counts in both.
hypothesis.settings.register_profile("dev")
hypothesis.settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("THOUGHTJAX_HYPOTHESIS_PROFILE", "dev"))

SEED = 20240611

# Text prompts for the real default model, (label, text); None: a chat prompt ("What is the capital of France?").
# The exactness tests compare them with transformers, the speculative ones with plain greedy decoding.
DEFAULT_MODEL_PROMPTS = [
  ("plain", "The capital of France is"),
  ("code", "def fibonacci(n):\n    "),
  ("non_ascii", "Größe, 日本語 und café ✓ — "),
  ("chat", None),
]


@pytest.fixture
def rng() -> np.random.Generator:
  """A numpy generator with a fixed seed, fresh for every test."""
  return np.random.default_rng(SEED)


@pytest.fixture
def getkey():
  """A function returning a new JAX key on every call, from a fixed seed fresh for every test:
  ``k1, k2 = getkey(), getkey()``."""
  base, count = jax.random.key(SEED), iter(range(2**31))
  return lambda: jax.random.fold_in(base, next(count))


@pytest.fixture(scope="session")
def default_model():
  """The real default model (SmolLM2-135M-Instruct), fetched on first use."""
  import thoughtjax

  return thoughtjax.load()


@pytest.fixture(scope="session")
def hf_default_model():
  """Hugging Face transformers' own float32 load of the same GGUF: an independent reference
  (its own dequantization, Q/K un-permutation and Llama implementation in PyTorch)."""
  import torch
  import transformers

  from thoughtjax.fetch import fetch

  gguf = fetch()
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
  return model.eval(), tok


class RealModelInFastTier(Exception):
  """A test outside the integration tier reached the real default model or its registry."""


@pytest.fixture(autouse=True)
def _fast_tier_stays_small(request, monkeypatch):
  """Only the tests on the real default model may load it or build its registry: anywhere else that fails the test
  by name, so the fast tier stays minutes long. Tests that point ``thoughtjax.fetch.DEFAULT_MODEL`` at a tiny GGUF
  (or add a tiny known model) build and load their own and pass."""
  if uses_real_model(request.node):
    return
  from thoughtjax import fetch as fetch_lib
  from thoughtjax import loading
  from thoughtjax import registry as registry_lib

  real = _REAL_MODELS.setdefault("names", frozenset(fetch_lib.KNOWN_MODELS))  # as shipped, before any test adds one

  def refuse(what: str):
    raise RealModelInFastTier(
      f"{request.node.nodeid} {what}, which only the tests on the real default model may: use a tiny model "
      "(tests/tiny.py) or mark the test @pytest.mark.slow"
    )

  real_resolve, real_build = loading.resolve_source, registry_lib.build

  def resolve_source(name_or_path):
    if str(name_or_path) in real:
      refuse(f"loads the real model {name_or_path!r}")
    return real_resolve(name_or_path)

  def build(root, mapping, model, *args, **kwargs):
    if isinstance(model, str) and model in real:
      refuse(f"builds a registry of the real model {model!r}")
    return real_build(root, mapping, model, *args, **kwargs)

  monkeypatch.setattr(loading, "resolve_source", resolve_source)
  monkeypatch.setattr(registry_lib, "build", build)


_REAL_MODELS: dict = {}


INTEGRATION_TIER = Path(__file__).with_name("integration_tier.txt")
MOVED = pytest.StashKey[bool]()  # a tiny-model test the integration tier runs (tests/integration_tier.txt)
OPTIMIZATIONS_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
USER_SET_OPTIMIZATIONS = OPTIMIZATIONS_ENV in os.environ  # read before pytest_configure sets it


def uses_real_model(item) -> bool:
  """Marked slow in its own file: a test on the real default model (not one moved to the integration tier)."""
  return item.get_closest_marker("slow") is not None and not item.stash.get(MOVED, False)


def pytest_configure(config):
  """Tests on tiny models compile with most of XLA's optimizations off (``jax_disable_most_optimizations``): the
  same programs, compiled in a fraction of the time that is most of what those tests spend (tests/decode/
  test_speculative.py and tests/test_native_weights.py: 163 s against 267 s). Processes the tests start inherit it
  through the environment. Tests on the real default model keep them (``_real_model_compiles_as_users_do``); a
  value the user set for the variable is left alone."""
  if not USER_SET_OPTIMIZATIONS:
    os.environ[OPTIMIZATIONS_ENV] = "1"
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True)
def _real_model_compiles_as_users_do(request, monkeypatch):
  """The real default model's tests compile with XLA's optimizations on: their timings, and the plans made from
  them, are the ones a user gets."""
  if USER_SET_OPTIMIZATIONS or not uses_real_model(request.node):
    yield
    return
  monkeypatch.setenv(OPTIMIZATIONS_ENV, "0")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the marks it reads are set here
def pytest_collection_modifyitems(config, items):
  """The tests listed in tests/integration_tier.txt are marked slow (the integration tier). The integration tests
  run before the fast ones, so the many short tests fill both xdist workers at the end instead of one worker
  finishing a long test alone. The order is deterministic, as xdist needs."""
  listed = [
    line.strip() for line in INTEGRATION_TIER.read_text().splitlines() if line.strip() and not line.startswith("#")
  ]
  for item in items:
    if any(item.nodeid == ref or item.nodeid.startswith(ref + "[") for ref in listed):
      item.add_marker(pytest.mark.slow)
      item.stash[MOVED] = True
  # The real model's tests first (minutes each); the first of them to need its registry builds it and measures its
  # latency, with the other worker on a real-model test or waiting for the registry, not on the many short tests.
  items.sort(key=lambda item: (item.get_closest_marker("slow") is None, not uses_real_model(item)))  # stable


def pytest_unconfigure(config):
  """The process that made the run's cache removes it at the end (xdist workers end before it)."""
  isolation.leave_run(RUN)


@pytest.fixture
def recorded(monkeypatch):
  """Durable writes, observed: events in call order, ``("fsync", path)`` / ``("rename", src, dst)``; an fsync's
  path is read back from its fd."""
  events: list = []
  real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)

  def rename(src, dst, *a, **kw):
    events.append(("rename", str(src), str(dst)))
    return real_rename(src, dst, *a, **kw)

  def replace(src, dst, *a, **kw):
    events.append(("rename", str(src), str(dst)))
    return real_replace(src, dst, *a, **kw)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  monkeypatch.setattr(os, "replace", replace)
  return events

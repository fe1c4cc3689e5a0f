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

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read at import)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

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


def pytest_collection_modifyitems(config, items):
  """The default-model tests (minutes each) run first, so the suite's many short tests fill both xdist workers
  at the end instead of one worker finishing a long test alone. The order is deterministic, as xdist needs."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: otherwise in file order


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

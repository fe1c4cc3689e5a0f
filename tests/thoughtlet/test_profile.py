"""Resource profiles are measured by XLA on the machine they run on."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.registry.helpers import FAST
from thoughtjax.thoughtlet import (
  Kind,
  ResourceProfile,
  Thoughtlet,
  ThoughtletError,
  cut,
  fingerprint,
  measure_profile,
  signature_for,
)


def _unit(tiny, name):
  cfg, model, codec = tiny
  kind, layers = (Kind.BLOCKS, (0, 2)) if name.startswith("blocks") else (Kind(name), None)
  sig = signature_for(kind, cfg, "tok", layers=layers)
  return Thoughtlet(name, kind, sig, cut(model, kind, layers=layers, codec=codec), cfg, layers)


def test_profile_is_measured_by_xla(tiny):
  t = _unit(tiny, "blocks[0:2)")
  p = measure_profile(t, FAST)
  assert p.param_bytes == t.param_bytes == 2 * sum(np.asarray(x).nbytes for x in jax.tree.leaves(t.params["0"]))
  # A decode step of 2 layers does at least the 2 * params multiply-adds of its matmuls.
  assert p.flops_per_token >= 2 * (t.param_bytes / 4) * 0.9
  assert p.peak_memory_bytes >= t.param_bytes
  assert p.samples == FAST.reps and p.latency_mean_s > 0 and p.latency_p99_s >= p.latency_mean_s - 1e-12
  assert (p.batch, p.context) == (FAST.batch, FAST.context)
  # Measured where JAX runs: cpu here, gpu on a GPU machine.
  assert p.fingerprint["platform"] == jax.default_backend()
  assert p.fingerprint["jax"] == jax.__version__ and p.fingerprint["device_count"] == jax.device_count()
  assert ResourceProfile.from_json(p.to_json()) == p


@pytest.mark.parametrize("name", ["embed", "head", "template"])
def test_every_kind_has_a_profile(tiny, name):
  _, model, _ = tiny
  t = _unit(tiny, name)
  table = model.embed.table[...]
  p = measure_profile(t, FAST, table)
  assert p.param_bytes == t.param_bytes and p.samples == FAST.reps and p.peak_memory_bytes > 0
  if name == "head":  # the LM head's matmul: 2 * D * V FLOPs per token at least
    assert p.flops_per_token >= 2 * t.config.d_model * t.config.vocab_size * 0.9


@pytest.mark.parametrize("name", ["head", "template"])
def test_a_unit_that_reads_the_embed_table_needs_it(tiny, name):
  with pytest.raises(ThoughtletError, match="needs the embedding table; pass table="):
    measure_profile(_unit(tiny, name), FAST)


def test_fingerprint_names_the_machine_and_software():
  f = fingerprint()
  assert f["platform"] == jax.devices()[0].platform and f["cpu"] and f["cpu_count"] >= 1
  assert {"jaxlib", "flax", "orbax", "python", "xla_flags"} <= set(f)

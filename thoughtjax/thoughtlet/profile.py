"""Resource profiles: what one thoughtlet costs, measured alone, not guessed.

:func:`measure_profile` compiles one decode step of a thoughtlet by itself and reads FLOPs per
token from XLA's cost analysis and peak memory from XLA's memory analysis, then times the step
(mean, std, p99 per token) at the batch and context of :class:`ProfileSettings`. The profile
records the hardware and software :func:`fingerprint` it was measured on.

Imports inside functions here are deferred for start-up: importing this module does not load ``orbax.checkpoint``;
the functions that need them do.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Callable

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from thoughtjax.decode.layout import empty_caches, step_at
from thoughtjax.quantized import from_stored, int8_activations
from thoughtjax.thoughtlet.errors import ThoughtletError
from thoughtjax.thoughtlet.resource_profile import ResourceProfile
from thoughtjax.thoughtlet.run import run_blocks, run_embed, run_head, run_template
from thoughtjax.thoughtlet.slicing import as_state
from thoughtjax.thoughtlet.types import Kind, Thoughtlet
from thoughtjax.transformer import GraphDefs, abstract_model, apply_bridge


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
  """Where a resource profile is measured: one decode step of ``batch`` rows over a KV
  cache of ``context`` slots, timed ``reps`` times after ``warmup`` runs."""

  batch: int = 1
  context: int = 256
  reps: int = 20
  warmup: int = 2


def _cpu_name() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return cpu


def fingerprint() -> dict:
  """Hardware and software a profile was measured on."""
  import orbax.checkpoint as ocp

  dev = jax.devices()[0]
  return {
    "platform": dev.platform,
    "device_kind": dev.device_kind,
    "device_count": jax.device_count(),
    "cpu": _cpu_name(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "flax": flax.__version__,
    "orbax": ocp.__version__,
    "python": sys.version.split()[0],
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


# One decode step of a thoughtlet alone: (jittable fn, example args, tokens it handles).
Step = tuple[Callable, tuple, int]


def _embed_step(t: Thoughtlet, abstract, defs: GraphDefs, s: ProfileSettings, table, x) -> Step:
  state = as_state(abstract.embed, t.params)
  return (lambda st, tok: run_embed(defs, st, tok)), (state, jnp.zeros((s.batch, 1), jnp.int32)), s.batch


def _head_step(t: Thoughtlet, abstract, defs: GraphDefs, s: ProfileSettings, table, x) -> Step:
  state = as_state(abstract.head, t.params)
  return (lambda st, tb, h: run_head(defs, st, h, tb)), (state, table, x), s.batch


def _blocks_step(t: Thoughtlet, abstract, defs: GraphDefs, s: ProfileSettings, table, x) -> Step:
  cfg, B, S = t.config, s.batch, s.context
  # A weight variant restored from a registry holds its int8 weights as {"int8", "scale"} arrays.
  variant = t.signature.constraints.get("weights")
  states = [
    as_state(abstract.blocks[int(i)], int8_activations(from_stored(p)) if variant == "int8a8" else from_stored(p))
    for i, p in sorted(t.params.items(), key=lambda kv: int(kv[0]))
  ]
  caches = list(empty_caches(cfg, range(len(states)), B, S))
  positions, mask = step_at(jnp.zeros(B, jnp.int32), jnp.int32(S - 1), S)

  def step(sts, h, cs):  # the last slot of a full cache: the most expensive decode step
    return run_blocks(defs, cfg, sts, h, positions, cs, jnp.int32(S - 1), mask)

  return step, (states, x, caches), B


def _template_step(t: Thoughtlet, abstract, defs: GraphDefs, s: ProfileSettings, table, x) -> Step:
  P1, P2 = (int(np.shape(t.params[k])[0]) for k in ("prefix_ids", "suffix_ids"))
  U = max(1, s.context - P1 - P2)
  total = P1 + U + P2
  ids = jnp.zeros((s.batch, U), jnp.int32)
  lengths = jnp.full((s.batch,), U, jnp.int32)

  def step(p, tb, i, n):
    return run_template(p, tb, i, n, total)

  return step, (dict(t.params), table, ids, lengths), s.batch * total


def _bridge_step(t: Thoughtlet, abstract, defs: GraphDefs, s: ProfileSettings, table, x) -> Step:
  return apply_bridge, (dict(t.params), x), s.batch


_STEPS = {
  Kind.EMBED: _embed_step,
  Kind.HEAD: _head_step,
  Kind.BLOCKS: _blocks_step,
  Kind.TEMPLATE: _template_step,
  Kind.BRIDGE: _bridge_step,
}


def register_step(kind: Kind, step_for: Callable[[Thoughtlet, ProfileSettings], Step]) -> None:
  """Profile thoughtlets of ``kind`` with ``step_for(thoughtlet, settings) -> (fn, args, tokens)``.

  For kinds defined above this package (the hint router lives in :mod:`thoughtjax.synthesis`): the
  module that defines the kind registers its step when imported, so this package imports nothing above it.
  """
  _STEPS[kind] = lambda t, abstract, defs, s, table, x: step_for(t, s)


def _step_setup(t: Thoughtlet, settings: ProfileSettings, table) -> Step:
  abstract = abstract_model(t.config)
  x = jax.random.normal(jax.random.key(0), (settings.batch, 1, t.config.d_model), jnp.float32)
  if t.kind not in _STEPS:
    raise ThoughtletError(
      f"{t.name}: no profile step is registered for kind {t.kind.value!r}; import the module that defines "
      f"the kind first (for 'router': thoughtjax.synthesis.router_store)"
    )
  return _STEPS[t.kind](t, abstract, GraphDefs.from_model(abstract), settings, table, x)


def _xla_costs(compiled) -> tuple[float, int]:
  """(FLOPs, peak bytes) of a compiled step from XLA's own analyses."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float((cost or {}).get("flops", 0.0))
  mem = compiled.memory_analysis()
  peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
  if peak <= 0:  # backends that do not report a peak: live arguments + outputs + temps
    peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
  return flops, peak


def _time_per_token(compiled, args, tokens: int, settings: ProfileSettings) -> list[float]:
  for _ in range(settings.warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(settings.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) / tokens)
  return times


def _needs_table(t: Thoughtlet) -> bool:
  return t.kind is Kind.TEMPLATE or (t.kind is Kind.HEAD and t.config.tie_embeddings)


def measure_profile(t: Thoughtlet, settings: ProfileSettings = ProfileSettings(), table=None) -> ResourceProfile:
  """Compile one step of ``t`` alone; read FLOPs and peak memory from XLA; time it.

  ``table`` is the embedding table [V, D] for a tied head or a template (ignored otherwise).
  """
  if _needs_table(t) and table is None:
    raise ThoughtletError(
      f"{t.name}: measuring a {t.kind.value} thoughtlet needs the embedding table; "
      f"pass table= (the embed thoughtlet's params['table'], [V, D])"
    )
  table = table if _needs_table(t) else None
  fn, args, tokens = _step_setup(t, settings, table)
  compiled = jax.jit(fn).lower(*args).compile()
  flops, peak = _xla_costs(compiled)
  times = _time_per_token(compiled, args, tokens, settings)
  times_a = np.asarray(times or [float("nan")])
  return ResourceProfile(
    param_bytes=t.param_bytes,
    flops_per_token=flops / tokens,
    peak_memory_bytes=peak,
    latency_mean_s=float(times_a.mean()) if times else 0.0,
    latency_std_s=float(times_a.std()) if times else 0.0,
    latency_p99_s=float(np.percentile(times_a, 99)) if times else 0.0,
    samples=len(times),
    batch=settings.batch,
    context=settings.context,
    fingerprint=fingerprint(),
  )

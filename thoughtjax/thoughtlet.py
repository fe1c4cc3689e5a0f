"""Thoughtlets: named, typed, measured, hashable units cut from a model.

A :class:`Thoughtlet` is one of

* ``embed``      tokens[B,T] i32 -> residual[B,T,D] f32 (the embedding table);
* ``blocks[a:b)`` residual -> residual (decoder layers a..b-1, half-open);
* ``head``       residual[B,T,D] -> logits[B,T,V] f32 (final norm + LM head; a tied
  head reads the embed thoughtlet's table);
* ``template``   message[B,U] i32 -> residual[B,T,D] (precomputed embedding rows of a
  chat template's fixed parts around the user's tokens; reads the embed table).

Its :class:`SemanticSignature` types the input and output (role, shape letters, dtype and a
*family*: the model family hash for residuals, the tokenizer hash for token ids and logits),
so a path type-checks link by link. Its :class:`ResourceProfile` is measured, not guessed:
parameter bytes, FLOPs per token from XLA's cost analysis, peak memory from XLA's memory
analysis, and wall-clock latency per token of one decode step at a stated batch and context.
Its ``versioned_hash`` is SHA3-512 over :func:`canonical_json` of the signature followed by
every weight (path, dtype, shape, little-endian bytes) in sorted path order.

Weights are held as a nested dict of arrays (``params``): for embed and head the pure dict
of the NNX module state; for blocks ``{"<layer>": block state}``; for a template
``{"prefix_ids", "suffix_ids", "prefix_rows", "suffix_rows"}``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from thoughtjax.config import ModelConfig
from thoughtjax.model import Transformer, abstract_model, kv_cache_shape, rope_tables
from thoughtjax.program import GraphDefs

HASH_DOMAIN = b"thoughtjax.thoughtlet/1\n"


class Kind(enum.Enum):
  EMBED = "embed"
  BLOCKS = "blocks"
  HEAD = "head"
  TEMPLATE = "template"


def canonical_json(obj: Any) -> bytes:
  """The one byte serialization that is hashed and signed: sorted keys, no spaces, UTF-8."""
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                    allow_nan=False).encode()


# ------------------------------------------------------------------------------- types
@dataclasses.dataclass(frozen=True)
class TensorType:
  """What flows along a link of a path, e.g. ``residual[B,T,576] f32 family=1a2b``."""

  role: str  # tokens | message | residual | logits
  shape: tuple[str | int, ...]
  dtype: str  # i32 | f32
  family: str | None = None

  def __str__(self) -> str:
    dims = ",".join(str(d) for d in self.shape)
    return f"{self.role}[{dims}] {self.dtype}" + (f" family={self.family}" if self.family else "")

  def mismatch(self, received: "TensorType") -> str | None:
    """Why ``received`` cannot feed an input of this type (None if it can)."""
    if received.role != self.role:
      return f"role {received.role!r} is not {self.role!r}"
    if received.dtype != self.dtype:
      return f"dtype {received.dtype} is not {self.dtype}"
    if len(received.shape) != len(self.shape):
      return f"rank {len(received.shape)} is not {len(self.shape)}"
    for i, (want, got) in enumerate(zip(self.shape, received.shape)):
      if isinstance(want, int) and isinstance(got, int) and want != got:
        return f"dimension {i} is {got}, not {want}"
    if self.family and received.family and self.family != received.family:
      return f"family {received.family} is not {self.family} (different model or tokenizer)"
    return None

  def to_json(self) -> dict:
    return {"role": self.role, "shape": list(self.shape), "dtype": self.dtype, "family": self.family}

  @classmethod
  def from_json(cls, d: Mapping) -> "TensorType":
    return cls(d["role"], tuple(d["shape"]), d["dtype"], d.get("family"))


@dataclasses.dataclass(frozen=True)
class SemanticSignature:
  input: TensorType
  output: TensorType
  constraints: Mapping[str, Any]  # max_context, rope, vocab_size, tokenizer_hash, requires, ...
  tags: tuple[str, ...] = ()
  description: str = ""

  def to_json(self) -> dict:
    return {"input": self.input.to_json(), "output": self.output.to_json(),
            "constraints": dict(self.constraints), "tags": list(self.tags),
            "description": self.description}

  @classmethod
  def from_json(cls, d: Mapping) -> "SemanticSignature":
    return cls(TensorType.from_json(d["input"]), TensorType.from_json(d["output"]),
               dict(d["constraints"]), tuple(d.get("tags", ())), d.get("description", ""))


def residual_type(cfg: ModelConfig) -> TensorType:
  return TensorType("residual", ("B", "T", cfg.d_model), "f32", cfg.family_hash)


def signature_for(kind: Kind, cfg: ModelConfig, tokenizer_hash: str, *,
                  layers: tuple[int, int] | None = None, max_context: int | None = None,
                  tags: tuple[str, ...] = (), description: str = "") -> SemanticSignature:
  """The semantic signature of a thoughtlet of ``kind`` cut from a model with ``cfg``."""
  context = min(cfg.max_context, max_context or cfg.max_context)
  resid = residual_type(cfg)
  vocab = {"vocab_size": cfg.vocab_size, "tokenizer_hash": tokenizer_hash}
  rope = {"theta": cfg.rope_theta, "head_dim": cfg.head_dim}
  if kind is Kind.EMBED:
    inp, out = TensorType("tokens", ("B", "T"), "i32", tokenizer_hash), resid
    cons = {"max_context": context, **vocab}
  elif kind is Kind.BLOCKS:
    inp = out = resid
    cons = {"max_context": context, "rope": rope, "layers": list(layers),
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads}
  elif kind is Kind.HEAD:
    inp, out = resid, TensorType("logits", ("B", "T", cfg.vocab_size), "f32", tokenizer_hash)
    cons = {"max_context": context, "tied": cfg.tie_embeddings, **vocab}
    if cfg.tie_embeddings:
      cons["requires"] = ["embed"]
  elif kind is Kind.TEMPLATE:
    inp, out = TensorType("message", ("B", "U"), "i32", tokenizer_hash), resid
    cons = {"max_context": context, "requires": ["embed"], **vocab}
  else:  # pragma: no cover
    raise ValueError(kind)
  return SemanticSignature(inp, out, cons, tuple(tags), description)


# ---------------------------------------------------------------------------- profiles
@dataclasses.dataclass(frozen=True)
class ProfileSettings:
  """Where a resource profile is measured: one decode step of ``batch`` rows over a KV
  cache of ``context`` slots, timed ``reps`` times after ``warmup`` runs."""

  batch: int = 1
  context: int = 256
  reps: int = 20
  warmup: int = 2


@dataclasses.dataclass(frozen=True)
class ResourceProfile:
  param_bytes: int
  flops_per_token: float
  peak_memory_bytes: int
  latency_mean_s: float
  latency_std_s: float
  latency_p99_s: float
  samples: int
  batch: int
  context: int
  fingerprint: Mapping[str, Any]

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["fingerprint"] = dict(self.fingerprint)
    return d

  @classmethod
  def from_json(cls, d: Mapping) -> "ResourceProfile":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def fingerprint() -> dict:
  """Hardware and software a profile was measured on."""
  import flax
  import jaxlib
  import orbax.checkpoint as ocp

  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
          "cpu": cpu, "cpu_count": os.cpu_count(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "flax": flax.__version__, "orbax": ocp.__version__, "python": sys.version.split()[0],
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


# ---------------------------------------------------------------------------- the unit
@dataclasses.dataclass(frozen=True)
class Thoughtlet:
  """A unit of a model: name, kind, signature, weights and (once measured) its profile."""

  name: str
  kind: Kind
  signature: SemanticSignature
  params: Mapping[str, Any]
  config: ModelConfig
  layers: tuple[int, int] | None = None
  profile: ResourceProfile | None = None

  @property
  def param_bytes(self) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(self.params)))

  def identity(self) -> dict:
    """What the versioned hash covers besides the weights."""
    return {"name": self.name, "kind": self.kind.value,
            "layers": None if self.layers is None else list(self.layers),
            "semantic_signature": self.signature.to_json(), "model_config": self.config.to_json()}

  def versioned_hash(self) -> str:
    return versioned_hash(self.identity(), self.params)

  def with_params(self, params: Mapping[str, Any]) -> "Thoughtlet":
    """A new version with other weights (same shapes), e.g. after fine-tuning; unprofiled."""
    spec_old, spec_new = param_spec(self.params), param_spec(params)
    if spec_old != spec_new:
      raise ValueError(f"{self.name}: new weights must keep the parameter tree; expected "
                       f"{spec_old}, got {spec_new}")
    return dataclasses.replace(self, params=params, profile=None)


def flat_params(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
  """(``a/b/c``, leaf) pairs in sorted path order."""
  out = []
  for key in sorted(params, key=str):
    value = params[key]
    path = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.extend(flat_params(value, path + "/"))
    else:
      out.append((path, value))
  return out


def param_spec(params: Mapping[str, Any]) -> dict[str, dict]:
  return {p: {"shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name} for p, x in flat_params(params)}


def versioned_hash(identity: Mapping, params: Mapping[str, Any]) -> str:
  """SHA3-512 over the canonical identity, then each weight's header and little-endian bytes."""
  h = hashlib.sha3_512(HASH_DOMAIN)
  blob = canonical_json(identity)
  h.update(len(blob).to_bytes(8, "little"))
  h.update(blob)
  for path, leaf in flat_params(params):
    a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    header = canonical_json({"path": path, "dtype": a.dtype.str, "shape": list(a.shape)})
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    h.update(a.nbytes.to_bytes(8, "little"))
    h.update(a.reshape(-1).view(np.uint8).data)
  return h.hexdigest()


# ------------------------------------------------------------------------------ cutting
def template_parts(codec, system: str | None) -> tuple[list[int], list[int]]:
  """Token ids of a chat template's fixed text before and after one user message."""
  return codec.chat_template_parts(system)


def cut(model: Transformer, kind: Kind, *, layers: tuple[int, int] | None = None,
        codec=None, system: str | None = None) -> dict:
  """The params of one thoughtlet, taken (not copied) from a model."""
  if kind is Kind.EMBED:
    return nnx.state(model.embed).to_pure_dict()
  if kind is Kind.HEAD:
    return nnx.state(model.head).to_pure_dict()
  if kind is Kind.BLOCKS:
    a, b = layers
    return {str(i): nnx.state(model.blocks[i]).to_pure_dict() for i in range(a, b)}
  if kind is Kind.TEMPLATE:
    prefix, suffix = template_parts(codec, system)
    table = model.embed.table[...]
    ids = lambda x: jnp.asarray(np.asarray(x, np.int32).reshape(-1))
    return {"prefix_ids": ids(prefix), "suffix_ids": ids(suffix),
            "prefix_rows": jnp.take(table, ids(prefix), axis=0),
            "suffix_rows": jnp.take(table, ids(suffix), axis=0)}
  raise ValueError(kind)  # pragma: no cover


# ------------------------------------------------------------------- running one alone
def defs_for(cfg: ModelConfig) -> GraphDefs:
  return GraphDefs.from_model(abstract_model(cfg))


def as_state(abstract_module, pure: Mapping) -> nnx.State:
  """An NNX state for ``abstract_module`` holding the arrays of ``pure`` (no copies)."""
  state = nnx.state(abstract_module)
  nnx.replace_by_pure_dict(state, pure)
  return state


def block_states(abstract: Transformer, params: Mapping) -> dict[int, nnx.State]:
  return {int(i): as_state(abstract.blocks[int(i)], p) for i, p in params.items()}


def run_embed(defs: GraphDefs, state: nnx.State, tokens):  # [B, T] -> [B, T, D]
  return nnx.merge(defs.embed, state)(tokens)


def run_blocks(defs: GraphDefs, cfg: ModelConfig, states: list[nnx.State], x, positions=None,
               caches=None, write_at=None, mask=None):
  """Blocks in order over residual x [B, T, D].

  Without caches this is a causal forward from scratch (fresh caches of T slots);
  returns the residual and the caches.
  """
  B, T = x.shape[:2]
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
  if caches is None:
    shape = kv_cache_shape(cfg, B, T)
    caches = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)) for _ in states]
    write_at = jnp.zeros((), jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))
  cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
  new = []
  for state, (ck, cv) in zip(states, caches):
    x, ck, cv = nnx.merge(defs.block, state)(x, cos, sin, ck, cv, write_at, mask)
    new.append((ck, cv))
  return x, new


def run_head(defs: GraphDefs, state: nnx.State, x, table=None):  # [B, T, D] -> [B, T, V]
  return nnx.merge(defs.head, state)(x, table)


def run_template(params: Mapping, table, user_ids, user_lengths, total_len: int, left_pad: bool = True,
                 implementation: str | None = None):
  """[B, U] user ids -> [B, total_len, D]: template rows around the user rows (one pass)."""
  from thoughtjax.kernels.template_embed import template_embed

  return template_embed(params["prefix_rows"], params["suffix_rows"], table, user_ids, user_lengths,
                        total_len=total_len, left_pad=left_pad, implementation=implementation)


# ------------------------------------------------------------------------------ measuring
def _step_setup(t: Thoughtlet, settings: ProfileSettings, table) -> tuple[Callable, tuple, int]:
  """One decode step of ``t`` alone as (jittable fn, example args, tokens it handles)."""
  cfg = t.config
  abstract = abstract_model(cfg)
  defs = GraphDefs.from_model(abstract)
  B, S = settings.batch, settings.context
  key = jax.random.key(0)
  x = jax.random.normal(key, (B, 1, cfg.d_model), jnp.float32)
  if t.kind is Kind.EMBED:
    state = as_state(abstract.embed, t.params)
    return (lambda st, tok: run_embed(defs, st, tok)), (state, jnp.zeros((B, 1), jnp.int32)), B
  if t.kind is Kind.HEAD:
    state = as_state(abstract.head, t.params)
    return (lambda st, tb, h: run_head(defs, st, h, tb)), (state, table, x), B
  if t.kind is Kind.BLOCKS:
    states = [as_state(abstract.blocks[int(i)], p) for i, p in sorted(t.params.items(), key=lambda kv: int(kv[0]))]
    shape = kv_cache_shape(cfg, B, S)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in states]
    positions = jnp.full((B, 1), S - 1, jnp.int32)
    mask = jnp.ones((B, 1, S), bool)

    def step(sts, h, cs):
      return run_blocks(defs, cfg, sts, h, positions, cs, jnp.int32(S - 1), mask)

    return step, (states, x, caches), B
  if t.kind is Kind.TEMPLATE:
    U = max(1, S - int(np.shape(t.params["prefix_ids"])[0]) - int(np.shape(t.params["suffix_ids"])[0]))
    total = int(np.shape(t.params["prefix_ids"])[0]) + U + int(np.shape(t.params["suffix_ids"])[0])
    ids = jnp.zeros((B, U), jnp.int32)
    lengths = jnp.full((B,), U, jnp.int32)

    def step(p, tb, i, n):
      return run_template(p, tb, i, n, total)

    return step, (dict(t.params), table, ids, lengths), B * total
  raise ValueError(t.kind)  # pragma: no cover


def measure_profile(t: Thoughtlet, settings: ProfileSettings = ProfileSettings(), table=None) -> ResourceProfile:
  """Compile one step of ``t`` alone; read FLOPs and peak memory from XLA; time it.

  ``table`` is the embedding table [V, D] for a tied head or a template.
  """
  if t.kind in (Kind.TEMPLATE,) or (t.kind is Kind.HEAD and t.config.tie_embeddings):
    if table is None:
      raise ValueError(f"{t.name}: measuring a {t.kind.value} thoughtlet needs the embedding table")
  else:
    table = None
  fn, args, tokens = _step_setup(t, settings, table)
  compiled = jax.jit(fn).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float((cost or {}).get("flops", 0.0))
  mem = compiled.memory_analysis()
  peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
  if peak <= 0:  # backends that do not report a peak: live arguments + outputs + temps
    peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)
  for _ in range(settings.warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(settings.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - t0) / tokens)
  times_a = np.asarray(times or [float("nan")])
  return ResourceProfile(
      param_bytes=t.param_bytes, flops_per_token=flops / tokens, peak_memory_bytes=peak,
      latency_mean_s=float(times_a.mean()) if times else 0.0,
      latency_std_s=float(times_a.std()) if times else 0.0,
      latency_p99_s=float(np.percentile(times_a, 99)) if times else 0.0,
      samples=len(times), batch=settings.batch, context=settings.context, fingerprint=fingerprint())

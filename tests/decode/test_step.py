"""The lean decode step: attention reads the cache as it was and writes the new keys last, so the
compiled decode loop updates every KV cache in place (no copy per layer per step), with the same
numbers as attending over the updated cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tiny import TINY_CONFIGS, tiny_engine, tiny_model
from thoughtjax import transformer
from thoughtjax.decode import program as program_lib
from thoughtjax.decode.interface import DecodeInputs
from thoughtjax.sampling import SamplingMode, SamplingParams, sampling_arrays


def _update_first(attn, x, cos, sin, cache_k, cache_v, write_at, mask):
  """The reference: write the new keys into the cache, then attend over the updated cache."""
  cfg = attn.cfg
  B, T, D = x.shape
  H, K, E, G = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
  hi = jax.lax.Precision.HIGHEST
  q = jnp.einsum("btd,dhe->bthe", x, attn.q[...], precision=hi)
  k = jnp.einsum("btd,dke->btke", x, attn.k[...], precision=hi)
  v = jnp.einsum("btd,dke->btke", x, attn.v[...], precision=hi)
  if cfg.qkv_bias:
    q, k, v = q + attn.q_bias[...][None, None], k + attn.k_bias[...][None, None], v + attn.v_bias[...][None, None]
  q, k = transformer.apply_rope(q, cos, sin), transformer.apply_rope(k, cos, sin)
  at = (0, 0, write_at, 0)
  cache_k = jax.lax.dynamic_update_slice(cache_k, k.transpose(0, 2, 1, 3), at)
  cache_v = jax.lax.dynamic_update_slice(cache_v, v.transpose(0, 2, 1, 3), at)
  qg = q.reshape(B, T, K, G, E)
  scores = jnp.einsum("btkge,bkse->btkgs", qg, cache_k, precision=hi) * E**-0.5
  scores = jnp.where(mask[:, :, None, None, :], scores, -jnp.inf)
  ctx = jnp.einsum("btkgs,bkse->btkge", jax.nn.softmax(scores, axis=-1), cache_v, precision=hi)
  return (
    jnp.einsum("btf,fd->btd", ctx.reshape(B, T, H * E), attn.o[...].reshape(H * E, D), precision=hi),
    cache_k,
    cache_v,
  )


def _inputs(cfg, rng, B, T, S, write_at):
  x = jnp.asarray(rng.normal(size=(B, T, cfg.d_model)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 200, size=(B, T)), jnp.int32)
  cos, sin = transformer.rope_tables(positions, cfg.head_dim, cfg.rope_theta)
  shape = transformer.kv_cache_shape(cfg, B, S)
  ck = jnp.asarray(rng.normal(size=shape), jnp.float32)
  cv = jnp.asarray(rng.normal(size=shape), jnp.float32)
  mask = rng.random((B, T, S)) < 0.6
  at = min(max(write_at, 0), S - T)  # where dynamic_update_slice puts the new keys
  mask[:, np.arange(T), at + np.arange(T)] = True  # every query sees at least its own key
  return x, cos, sin, ck, cv, jnp.asarray(write_at, jnp.int32), jnp.asarray(mask)


# (config, batch, new tokens T, cache length S, write_at): decode, a ring write in the middle,
# a verify-sized write, a write clamped at the end, and a prefill-sized write (the update-first branch).
CASES = [
  ("llama_gqa", 1, 1, 40, 17),
  ("llama_gqa", 3, 1, 40, 0),
  ("qwen2_bias", 2, 1, 33, 32),
  ("mistral_untied", 2, 5, 48, 20),
  ("llama_gqa", 2, 4, 32, 30),
  ("llama_gqa", 2, 16, 24, 0),
]


@pytest.mark.parametrize("name,B,T,S,write_at", CASES)
def test_attention_equals_attending_over_the_updated_cache(name, B, T, S, write_at, rng):
  cfg, model = tiny_model(name, seed=3)
  attn = model.blocks[0].attn
  args = _inputs(cfg, rng, B, T, S, write_at)
  out, ck, cv = attn(*args)
  ref, rk, rv = _update_first(attn, *args)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(ck), np.asarray(rk))  # the caches are written, not computed
  np.testing.assert_array_equal(np.asarray(cv), np.asarray(rv))


def test_attention_with_a_write_slot_per_row_under_vmap(rng):
  """Speculative verification runs a block per row (vmap) with each row's own write slot."""
  cfg, model = tiny_model("llama_gqa", seed=4)
  attn = model.blocks[1].attn
  B, T, S = 3, 3, 24
  rows = [_inputs(cfg, rng, 1, T, S, w) for w in (0, 9, 21)]
  stacked = [jnp.stack([r[i] for r in rows]) for i in range(7)]
  out, ck, cv = jax.vmap(attn)(*stacked)
  for b, r in enumerate(rows):
    ref, rk, rv = _update_first(attn, *r)
    np.testing.assert_allclose(np.asarray(out[b]), np.asarray(ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ck[b]), np.asarray(rk))
    np.testing.assert_array_equal(np.asarray(cv[b]), np.asarray(rv))
  assert B == len(rows)


@pytest.mark.parametrize("batch", [1, 4])
def test_compiled_decode_loop_updates_every_cache_in_place(batch):
  """The property the lean step exists for: no copy of any layer's KV cache inside the decode loop
  (before it, XLA copied each cache about twice per step: 4 per layer per step)."""
  engine = tiny_engine("llama_gqa")
  key = program_lib.ProgramKey(engine.layers, batch, 16, 32, 4, SamplingMode.GREEDY, False)
  prog = program_lib.Program(key, engine.defs, engine.config)
  samp = sampling_arrays([SamplingParams(max_tokens=32)] * batch, batch, engine.config.vocab_size, 4, None, False)
  tokens, pad = jnp.zeros((batch, 16), jnp.int32), jnp.zeros(batch, jnp.int32)
  hlo = prog.lower(DecodeInputs(engine.parts, tokens, pad, samp)).compile().as_text()
  cache = transformer.kv_cache_shape(engine.config, batch, key.cache_len)
  copies, cache_copies = program_lib.loop_copies(hlo, cache)
  assert "while" in hlo and f"f32[{','.join(map(str, cache))}]" in hlo  # the loop and the caches are there
  assert cache_copies == 0, f"{cache_copies} copies of a KV cache [{cache}] per decode step ({copies} copies in all)"


def test_loop_copies_counts_cache_copies_of_the_update_first_step():
  """The counter sees the copies when they are there: a loop that reads the cache after updating it."""
  cfg = TINY_CONFIGS["llama_gqa"]
  shape = transformer.kv_cache_shape(cfg, 1, 32)

  def step(carry):
    i, cache, seen = carry
    new = jax.lax.dynamic_update_slice(cache, jnp.ones((1, cfg.num_kv_heads, 1, cfg.head_dim)), (0, 0, i, 0))
    return i + 1, new, seen + jnp.sum(cache)  # a read of the old cache in no set order with the write

  def loop(cache):
    return jax.lax.while_loop(lambda c: c[0] < 8, step, (jnp.zeros((), jnp.int32), cache, jnp.zeros(())))[1:]

  hlo = jax.jit(loop).lower(jnp.zeros(shape)).compile().as_text()
  copies, cache_copies = program_lib.loop_copies(hlo, shape)
  assert cache_copies >= 1 and copies >= cache_copies

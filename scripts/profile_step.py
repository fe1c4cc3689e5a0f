"""Measure the compiled decode step: copy instructions in its HLO and milliseconds per step.

    .venv/bin/python scripts/profile_step.py                      # default model, batch 1 and 8, prompts 8/200/900
    .venv/bin/python scripts/profile_step.py --compare            # the same, against the update-first attention
    .venv/bin/python scripts/profile_step.py --batches 1 --prompts 8 --repeats 3 --json out.json

For every (batch, prompt length) it builds the generation :class:`~thoughtjax.decode.program.Program` the
engine would build (prompt bucket, 64 new tokens), compiles its ``advance`` once, and reports

* ``copies/step``: top-level ``copy`` instructions in the decode loop's body (and the computations it
  calls), and how many of them have the shape of one layer's KV cache (``cache copies``);
* ``ms/step``: the median over ``--repeats`` of one decode chunk's wall time divided by its steps.
  The decode state starts at step 1 with an empty cache: a step's cost does not depend on the cache's
  contents, so the long prompts need no prefill; ``pad`` marks the prompt's length as a real one would.

``--compare`` also builds every program with the previous attention (``update-first``: write the new
keys into the cache, then attend over the updated cache) and times the two interleaved in one process.
Timings are noisy on a shared machine: the script prints the load average beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import thoughtjax
from thoughtjax import quantized, transformer
from thoughtjax.decode import program as program_lib
from thoughtjax.sampling import SamplingMode, SamplingParams, sampling_arrays


def _attention_update_first(self, x, cos, sin, cache_k, cache_v, write_at, mask):
  """The attention as it was before the lean step: update the cache, then attend over it (for --compare)."""
  cfg = self.cfg
  B, T, D = x.shape
  H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  mm, mat, bat = transformer._matmul, transformer._matrix, transformer._batched
  q = mm(x, mat(self.q[...], D, H * E)).reshape(B, T, H, E)
  k = mm(x, mat(self.k[...], D, K * E)).reshape(B, T, K, E)
  v = mm(x, mat(self.v[...], D, K * E)).reshape(B, T, K, E)
  if cfg.qkv_bias:
    q, k, v = q + self.q_bias[...][None, None], k + self.k_bias[...][None, None], v + self.v_bias[...][None, None]
  q, k = transformer.apply_rope(q, cos, sin), transformer.apply_rope(k, cos, sin)
  zero = jnp.zeros((), jnp.int32)
  at = (zero, zero, write_at, zero)
  cache_k = jax.lax.dynamic_update_slice(cache_k, k.transpose(0, 2, 1, 3).astype(cache_k.dtype), at)
  cache_v = jax.lax.dynamic_update_slice(cache_v, v.transpose(0, 2, 1, 3).astype(cache_v.dtype), at)
  G = cfg.group_size
  qg = q.reshape(B, T, K, G, E).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, E)
  scores = bat(qg, cache_k, 3).astype(jnp.float32) * (E**-0.5)
  allowed = jnp.broadcast_to(mask[:, None, :, None, :], (B, 1, T, G, mask.shape[-1]))
  scores = jnp.where(allowed.reshape(B, 1, T * G, -1), scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(cache_v.dtype)
  ctx = bat(probs, cache_v, 2)
  ctx = ctx.reshape(B, K, T, G, E).transpose(0, 2, 1, 3, 4).reshape(B, T, H * E)
  out = mm(ctx.astype(x.dtype), mat(self.o[...], H * E, D))
  return out, cache_k, cache_v


@contextlib.contextmanager
def attention(impl: str):
  """Trace programs with the library's attention ("lean") or the previous one ("update-first")."""
  if impl == "lean":
    yield
    return
  saved = transformer.Attention.__call__
  transformer.Attention.__call__ = _attention_update_first
  try:
    yield
  finally:
    transformer.Attention.__call__ = saved


def build(engine, batch: int, prompt: int, new: int, impl: str):
  """A compiled decode program of ``engine``'s path and its inputs; returns (run, copies, cache copies)."""
  T = program_lib.bucket(prompt)
  key = program_lib.ProgramKey(engine.layers, batch, T, new, 4, SamplingMode.GREEDY, False, kernels=engine.kernels)
  prog = program_lib.Program(key, engine._defs, engine.config)
  params = [SamplingParams(max_tokens=new, ignore_eos=True)] * batch
  samp = sampling_arrays(params, batch, engine.config.vocab_size, 4, None, False)
  tokens = jnp.zeros((batch, T), jnp.int32)
  pad = jnp.full((batch,), T - prompt, jnp.int32)
  with attention(impl):
    compiled = prog._advance.trace(engine.parts, tokens, pad, samp, jax.eval_shape(prog._init_impl)).lower().compile()
  copies, cache = program_lib.loop_copies(
    compiled.as_text(), transformer.kv_cache_shape(engine.config, batch, key.cache_len)
  )

  def chunk_ms() -> float:
    state = prog.init_state(engine.parts)
    state = state._replace(cursor=jnp.int32(T), start=pad, token=jnp.ones((batch,), jnp.int32))  # as after a prefill
    state = jax.block_until_ready(compiled(engine.parts, tokens, pad, samp, state))  # first chunk: warm
    before = int(state.cursor)  # the state is donated to the next call
    t0 = time.perf_counter()
    after = jax.block_until_ready(compiled(engine.parts, tokens, pad, samp, state))
    ms = (time.perf_counter() - t0) * 1e3
    return ms / (int(after.cursor) - before)

  return chunk_ms, copies, cache


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="model name or path (default: the default model)")
  ap.add_argument("--weights", default="f32", choices=("f32", "native"))
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--prompts", default="8,200,900")
  ap.add_argument("--new", type=int, default=64, help="new-token bucket (cache length = prompt bucket + this)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--compare", action="store_true", help="also time the previous (update-first) attention")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)

  engine = thoughtjax.load(args.model, weights=args.weights)
  impls = ["update-first", "lean"] if args.compare else ["lean"]
  rows = []
  for batch in (int(b) for b in args.batches.split(",")):
    for prompt in (int(p) for p in args.prompts.split(",")):
      runs = {i: build(engine, batch, prompt, args.new, i) for i in impls}
      times = {i: [] for i in impls}
      for _ in range(args.repeats):  # interleaved: the machine's load hits every variant alike
        for i in impls:
          times[i].append(runs[i][0]())
      for i in impls:
        rows.append(
          dict(
            impl=i,
            batch=batch,
            prompt=prompt,
            cache_len=program_lib.bucket(prompt) + args.new,
            copies_per_step=runs[i][1],
            cache_copies_per_step=runs[i][2],
            ms_per_step=statistics.median(times[i]),
            ms_all=times[i],
          )
        )
        r = rows[-1]
        print(
          f"{i:>12}  B={batch:<2} prompt={prompt:<4} S={r['cache_len']:<5} copies/step={r['copies_per_step']:<4} "
          f"cache copies/step={r['cache_copies_per_step']:<4} ms/step={r['ms_per_step']:7.2f}  "
          f"(runs {', '.join(f'{t:.1f}' for t in times[i])})",
          flush=True,
        )
  load = os.getloadavg()
  print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; jax {jax.__version__}, {jax.devices()[0].platform}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(rows=rows, load_average=load, precision=str(quantized.EXACT)), f, indent=1)
  return rows


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()

"""Replay: every thoughtlet kind, captured inside the full model, run alone, gives the same output.

The capture taps the model's own parts (Embed, Block, Head) while the monolithic Transformer
runs a causal forward; each thoughtlet restored from the registry then runs on the captured
input by itself, outside the model, and must reproduce the captured output.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from thoughtjax.model import Block, Embed, Head, abstract_model, kv_cache_shape
from thoughtjax.program import GraphDefs
from thoughtjax.registry import Registry
from thoughtjax.thoughtlet import Kind, as_state, run_blocks, run_embed, run_head, run_template


def _capture(monkeypatch, model, tokens):
  """Inputs and outputs of every part during one causal forward of the whole model."""
  records = {Embed: [], Block: [], Head: []}
  for cls in records:
    original = cls.__call__

    def tapped(self, x, *args, _original=original, _cls=cls, **kwargs):
      out = _original(self, x, *args, **kwargs)
      records[_cls].append((np.asarray(x), np.asarray(out[0] if isinstance(out, tuple) else out)))
      return out

    monkeypatch.setattr(cls, "__call__", tapped)
  cfg = model.cfg
  B, T = tokens.shape
  shape = kv_cache_shape(cfg, B, T)
  caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_layers)]
  positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))
  logits, _ = model.forward(tokens, positions, caches, jnp.zeros((), jnp.int32), mask)
  monkeypatch.undo()
  assert len(records[Block]) == cfg.num_layers
  return records, np.asarray(logits)


@pytest.mark.parametrize("kind", [k.value for k in Kind])
def test_replay(kind, monkeypatch, tiny, built):
  cfg, model, codec = tiny
  reg = Registry.open(built)
  abstract = abstract_model(cfg)
  defs = GraphDefs.from_model(abstract)
  table = reg.restore("embed")["table"]
  message = "replay me"
  user = codec.tokenizer.encode(message, add_special_tokens=False).ids
  tokens = codec.encode(codec.render_chat([{"role": "user", "content": message}]))
  tokens_a = jnp.asarray([tokens], jnp.int32)
  records, logits = _capture(monkeypatch, model, tokens_a)
  names = [n for n in reg.names if reg.manifest(n).kind.value == kind]
  assert names
  for name in names:
    m = reg.manifest(name)
    params = reg.restore(name)
    if m.kind is Kind.EMBED:
      x, want = records[Embed][0]
      got = run_embed(defs, as_state(abstract.embed, params), jnp.asarray(x))
    elif m.kind is Kind.BLOCKS:
      a, b = m.layers
      x, want = records[Block][a][0], records[Block][b - 1][1]
      states = [as_state(abstract.blocks[i], params[str(i)]) for i in range(a, b)]
      got, _ = run_blocks(defs, cfg, states, jnp.asarray(x))
    elif m.kind is Kind.HEAD:
      x, want = records[Head][0]
      assert np.array_equal(want, logits)
      got = run_head(defs, as_state(abstract.head, params), jnp.asarray(x), table)
    else:  # template: the embed rows of the whole chat prompt, from message tokens alone
      want = records[Embed][0][1]
      got = run_template(params, table, jnp.asarray([user], jnp.int32), jnp.asarray([len(user)], jnp.int32),
                         total_len=len(tokens), left_pad=False)
      assert list(np.asarray(params["prefix_ids"])) + user + list(np.asarray(params["suffix_ids"])) == tokens
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0, err_msg=name)

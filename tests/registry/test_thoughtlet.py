"""Thoughtlet identity (versioned hash), types, profiles and Ed25519 signing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from thoughtjax import signing
from thoughtjax.registry import codec_digest
from thoughtjax.thoughtlet import (Kind, Thoughtlet, TensorType, canonical_json, cut, measure_profile,
                                   signature_for, template_parts)
from tests.registry.helpers import FAST


def _blocks(tiny, layers=(0, 2)):
  cfg, model, codec = tiny
  sig = signature_for(Kind.BLOCKS, cfg, codec_digest(codec), layers=layers)
  return Thoughtlet(f"blocks[{layers[0]}:{layers[1]})", Kind.BLOCKS, sig, cut(model, Kind.BLOCKS, layers=layers),
                    cfg, layers)


def test_versioned_hash_is_sha3_512_of_weights_and_signature(tiny):
  t = _blocks(tiny)
  h = t.versioned_hash()
  assert len(h) == 128 and h == _blocks(tiny).versioned_hash()  # deterministic
  # One flipped bit in one weight changes it.
  params = jax_tree_copy(t.params)
  w = np.array(params["1"]["mlp"]["up"])
  w.view(np.uint32)[3, 5] ^= 1
  params["1"]["mlp"]["up"] = jnp.asarray(w)
  assert t.with_params(params).versioned_hash() != h
  # So does the signature (a tag).
  sig = dataclasses.replace(t.signature, tags=("other",))
  assert dataclasses.replace(t, signature=sig).versioned_hash() != h


def jax_tree_copy(tree):
  return {k: jax_tree_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def test_new_weights_must_keep_the_parameter_tree(tiny):
  t = _blocks(tiny)
  with pytest.raises(ValueError, match="must keep the parameter tree"):
    t.with_params({"0": t.params["0"]})


def test_signatures_type_the_links(tiny):
  cfg, _, codec = tiny
  tok = codec_digest(codec)
  embed = signature_for(Kind.EMBED, cfg, tok)
  head = signature_for(Kind.HEAD, cfg, tok)
  assert str(embed.input) == f"tokens[B,T] i32 family={tok}"
  assert str(embed.output) == f"residual[B,T,{cfg.d_model}] f32 family={cfg.family_hash}"
  assert str(head.output) == f"logits[B,T,{cfg.vocab_size}] f32 family={tok}"
  assert head.input.mismatch(embed.output) is None
  assert "role 'logits' is not 'residual'" in head.input.mismatch(head.output)
  other = TensorType("residual", ("B", "T", cfg.d_model), "f32", "0000")
  assert "family 0000" in head.input.mismatch(other)
  wide = TensorType("residual", ("B", "T", cfg.d_model + 1), "f32", cfg.family_hash)
  assert "dimension 2" in head.input.mismatch(wide)
  assert head.constraints["requires"] == ["embed"]  # tied head reads the embed table


def test_template_parts_wrap_one_message(tiny):
  _, _, codec = tiny
  prefix, suffix = template_parts(codec, None)
  message = codec.tokenizer.encode("hello there", add_special_tokens=False).ids
  rendered = codec.encode(codec.render_chat([{"role": "user", "content": "hello there"}]))
  assert prefix + message + suffix == rendered


def test_profile_is_measured_by_xla(tiny):
  cfg, model, _ = tiny
  t = _blocks(tiny)
  p = measure_profile(t, FAST)
  assert p.param_bytes == t.param_bytes == 2 * sum(
      np.asarray(x).nbytes for x in jax_leaves(t.params["0"]))
  # A decode step of 2 layers does at least the 2 * params multiply-adds of its matmuls.
  assert p.flops_per_token >= 2 * (t.param_bytes / 4) * 0.9
  assert p.peak_memory_bytes >= t.param_bytes
  assert p.samples == FAST.reps and p.latency_mean_s > 0 and p.latency_p99_s >= p.latency_mean_s - 1e-12
  assert (p.batch, p.context) == (FAST.batch, FAST.context)
  assert p.fingerprint["platform"] == "cpu" and p.fingerprint["jax"]


def jax_leaves(tree):
  import jax

  return jax.tree.leaves(tree)


def test_ed25519_sign_and_verify(tmp_path):
  priv, pub = signing.keygen(tmp_path / "k")
  assert oct(priv.stat().st_mode & 0o777) == "0o600"
  key = signing.load_private_key(priv)
  keys = {signing.key_id(signing.load_public_key(pub)): signing.load_public_key(pub)}
  msg = canonical_json({"b": 1, "a": [1.5, "x"]})
  assert msg == b'{"a":[1.5,"x"],"b":1}'
  rec = signing.SignatureRecord.from_json(signing.sign(key, msg).to_json())
  signing.verify(keys, msg, rec, "test")
  with pytest.raises(signing.SignatureError, match="does not verify"):
    signing.verify(keys, msg + b" ", rec, "test")
  other_priv, _ = signing.keygen(tmp_path / "other")
  rec2 = signing.sign(signing.load_private_key(other_priv), msg)
  with pytest.raises(signing.SignatureError, match="not among the trusted keys"):
    signing.verify(keys, msg, rec2, "test")
  with pytest.raises(FileExistsError):
    signing.keygen(tmp_path / "k")

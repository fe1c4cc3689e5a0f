"""Versioned hashes: SHA3-512 over weights and signature, pinned so published versions keep their names."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.registry.helpers import tiny_codec
from thoughtjax import signing
from thoughtjax.config import Architecture, ModelConfig
from thoughtjax.thoughtlet import Kind, Thoughtlet, canonical_json, cut, flat_params, param_spec, signature_for
from thoughtjax.transformer import init_random

# Computed by the single-module thoughtlet.py before it became a package (commit 70edf65).
# A change here renames every published thoughtlet: it needs a new HASH_DOMAIN, not new pins.
PINNED = {
  (True, "embed"): (
    "6abe1fd02a51f461de2433a581e049bb3142ce71f9af767eaa707dbf8f490393"
    "41f2fc3f62a177ba2e93cc98e9525bfa4c05bf3091603b00f2a496bbd4ddd0e0"
  ),
  (True, "blocks[1:3)"): (
    "948764591adaee151797f5819de3934dc33d1d60cee74aba761b61807c2a2e0a"
    "c0d38d5ee82f5c6c6fcfe9f35f432949151b91d58f27449112305ce2c6de1060"
  ),
  (True, "head"): (
    "7a7d7b54268010458dcf92257a20c74b12038754f4893cfd30b3d98f2e9b388f"
    "7b03562bd6bd599a93a120f792005d81dac5103f7a0001c72952b40b80fe323d"
  ),
  (True, "template"): (
    "2a7639f8ad35ff0e6e1e4b51dea0fedc6479f7aaf89fe166a11b2ba84a744692"
    "7b994810b83b3069f2d179dad7f012a91c1fa197f7fb67cb4c599ba8f2abef36"
  ),
  (False, "embed"): (
    "fc8ec0a56f59b468f10f03b108efa6475db9496adc9def924d2104aeeff7325c"
    "16a7c6d766c25ae5ca04fe230372ca496207478722be5ba1c9c141d092b2518e"
  ),
  (False, "blocks[1:3)"): (
    "c4c96f9f8480bf3eb630592ed72fe6437025b6d705f8dda1faba7654ae879cf8"
    "419c677d5bbece0ca1debcc897eba3283345d8c0f500de23b15ddade2e884591"
  ),
  (False, "head"): (
    "6fdcb6917612468c2fbda77a75ba896ef1ec86cbd515cbf6c1c6297fb840d94d"
    "d5262cf878d8bd2d1eb0046cda22baaa2342a2a85d3b0a01d7ec9aec44dc4823"
  ),
  (False, "template"): (
    "bb90008f256ea5040b8f769acc3bc8fb1ebb37f21dab40e6498613897ac82bf3"
    "299ea930ca44ccf16ba3abc822c26966214323dc3733f9a22e1b618e8e844dcf"
  ),
}
UNITS = {
  "embed": (Kind.EMBED, None),
  "blocks[1:3)": (Kind.BLOCKS, (1, 3)),
  "head": (Kind.HEAD, None),
  "template": (Kind.TEMPLATE, None),
}


def _exact_model(cfg: ModelConfig):
  """A model whose weights are small multiples of 1/256 set from the host: the same bytes on every
  backend (random init may differ in the last bit between CPU and GPU)."""
  model = init_random(cfg, seed=0)
  leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
  new = []
  for i, leaf in enumerate(leaves):
    n = int(np.prod(leaf.shape))
    v = (((np.arange(n, dtype=np.int64) * 37 + 11 * i) % 251) - 125).astype(np.float32) / 256
    new.append(jnp.asarray(v.reshape(leaf.shape)))
  nnx.update(model, jax.tree.unflatten(treedef, new))
  return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_versioned_hashes_are_pinned(tied):
  cfg = ModelConfig(
    Architecture.LLAMA,
    259,
    16,
    3,
    4,
    2,
    4,
    24,
    rope_theta=10000.0,
    max_context=64,
    bos_id=1,
    eos_id=2,
    tie_embeddings=tied,
  )
  model, codec = _exact_model(cfg), tiny_codec()
  for name, (kind, layers) in UNITS.items():
    sig = signature_for(kind, cfg, "tok0123456789abc", layers=layers, max_context=32, tags=("t",), description="d")
    t = Thoughtlet(name, kind, sig, cut(model, kind, layers=layers, codec=codec), cfg, layers)
    assert t.versioned_hash() == PINNED[(tied, name)], name


def _blocks(tiny, layers=(0, 2)):
  cfg, model, _ = tiny
  sig = signature_for(Kind.BLOCKS, cfg, "tok", layers=layers)
  return Thoughtlet(
    f"blocks[{layers[0]}:{layers[1]})", Kind.BLOCKS, sig, cut(model, Kind.BLOCKS, layers=layers), cfg, layers
  )


def _tree_copy(tree):
  return {k: _tree_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def test_versioned_hash_covers_every_weight_bit_and_the_signature(tiny):
  t = _blocks(tiny)
  h = t.versioned_hash()
  assert len(h) == 128 and h == _blocks(tiny).versioned_hash()  # deterministic
  params = _tree_copy(t.params)
  w = np.array(params["1"]["mlp"]["up"])
  w.view(np.uint32)[3, 5] ^= 1
  params["1"]["mlp"]["up"] = jnp.asarray(w)
  assert t.with_params(params).versioned_hash() != h
  sig = dataclasses.replace(t.signature, tags=("other",))
  assert dataclasses.replace(t, signature=sig).versioned_hash() != h


def test_param_paths_are_flat_and_sorted():
  params = {"b": {"y": np.zeros((2,), np.float32), "x": np.zeros((1, 3), np.int32)}, "a": np.zeros((), np.float32)}
  assert [p for p, _ in flat_params(params)] == ["a", "b/x", "b/y"]
  assert param_spec(params) == {
    "a": {"shape": [], "dtype": "float32"},
    "b/x": {"shape": [1, 3], "dtype": "int32"},
    "b/y": {"shape": [2], "dtype": "float32"},
  }


def test_canonical_json_is_what_gets_signed(tmp_path):
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
  with pytest.raises(ValueError, match="Out of range float values"):
    canonical_json({"x": float("nan")})  # NaN has no canonical text

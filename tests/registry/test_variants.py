"""int8 weight variants in the registry: ``build(..., variants=("int8",))`` publishes ``blocks[a:b)@int8``
thoughtlets that are hashed, signed, profiled and verified like any other; paths name and mix them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.registry.helpers import FAST, TINY_SPANS, largest_data_file
from thoughtjax import quantized
from thoughtjax.assembly import full_path
from thoughtjax.compose import compose
from thoughtjax.loading import LoadedModel
from thoughtjax.model import Model
from thoughtjax.registry import IntegrityError, Registry, TrustPolicy, UnknownThoughtletError, build

IDS = [5, 6, 7, 9, 11, 40, 3]
VARIANTS = [f"blocks[{a}:{b})@int8" for a, b in TINY_SPANS]


@pytest.fixture(scope="module")
def with_int8(tmp_path_factory, tiny, tiny_mapping, keypair):
  cfg, model, codec = tiny
  out = tmp_path_factory.mktemp("int8") / "registry"
  build(
    out, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=FAST, source="tiny-seed7", variants=("int8",)
  )
  return out


def test_variants_are_published_signed_profiled_and_verified(with_int8, built, keypair):
  reg = Registry.open(with_int8, TrustPolicy(public_keys=(keypair[1],), require_signatures=True))
  base = Registry.open(built)
  assert set(VARIANTS) <= set(reg.names) and set(base.names) <= set(reg.names)
  # Adding variants leaves the base thoughtlets' versions (their hashes) as they were.
  assert {n: reg.current[n] for n in base.names} == base.current
  assert sorted(reg.block_spans()) == TINY_SPANS and "@" not in full_path(reg)
  for name in VARIANTS:
    m = reg.manifest(name)
    assert m.signature.constraints["weights"] == "int8" and "int8" in m.signature.tags
    assert m.profile is not None and m.profile.param_bytes < base.manifest(name[: -len("@int8")]).profile.param_bytes
    assert m.version != base.current[name[: -len("@int8")]]
  reg.verify()  # every digest, signature and versioned hash
  stored = reg.restore("blocks[3:5)@int8")
  q = stored["3"]["mlp"]["gate"]
  assert set(q) == {"int8", "scale"} and np.asarray(q["int8"]).dtype == np.int8
  dense = np.asarray(base.restore("blocks[3:5)")["3"]["mlp"]["gate"])  # [D, F]
  deq = quantized.dequantize(quantized.RowInt8(np.asarray(q["int8"]), np.asarray(q["scale"])))  # [F, D]
  np.testing.assert_allclose(deq, dense.T, atol=float(np.max(np.abs(dense))) / 254 + 1e-7)


def test_verify_hardware_re_measures_a_variant(with_int8):
  from thoughtjax.registry.verify import Tolerance

  reg = Registry.open(with_int8)
  assert reg.verify_hardware(Tolerance(latency=None), names=["blocks[0:2)@int8"]) == []


def test_variant_hashes_are_stable_across_builds(with_int8, tmp_path, tiny, tiny_mapping):
  cfg, model, codec = tiny
  again = build(tmp_path / "again", tiny_mapping, model, codec=codec, settings=None, variants=("int8",))
  first = Registry.open(with_int8)
  assert {n: again.current[n] for n in VARIANTS} == {n: first.current[n] for n in VARIANTS}


def test_a_mixed_path_composes_and_generates(with_int8):
  reg = Registry.open(with_int8)
  full = compose("embed, blocks[0:6), head", reg)
  mixed = compose("embed, blocks[0:3)@int8, blocks[3:6), head", reg)
  assert [u for link in mixed.links for u, _ in link.units] == [
    "embed",
    "blocks[0:2)@int8",
    "blocks[2:3)@int8",
    "blocks[3:5)",
    "blocks[5:6)",
    "head",
  ]
  assert mixed.path_hash != full.path_hash
  a, b = full.logits(IDS), mixed.logits(IDS)
  assert 0 < np.max(np.abs(a - b)) < 0.05 * np.max(np.abs(a))
  assert np.mean(np.argmax(a, -1) == np.argmax(b, -1)) >= 0.8
  assert len(mixed.generate(IDS, max_tokens=6, ignore_eos=True).token_ids) == 6
  # One layer from both forms in one path: two slots, two sets of weights.
  both = compose("embed, blocks[0:2)@int8, blocks[0:2), blocks[2:6), head", reg)
  assert len(set(both.layers)) == 8 and both.logits(IDS).shape == a.shape
  pinned = compose(f"embed, blocks[0:2)@int8@{reg.current['blocks[0:2)@int8'][:12]}, blocks[2:6), head", reg)
  np.testing.assert_array_equal(
    pinned.logits(IDS), compose("embed, blocks[0:2)@int8, blocks[2:6), head", reg).logits(IDS)
  )


def test_a_variant_the_registry_lacks_is_named(built):
  with pytest.raises(UnknownThoughtletError, match=r"no int8 variant.*--variants int8"):
    compose("embed, blocks[0:6)@int8, head", Registry.open(built))


def test_a_tampered_variant_is_refused_named_and_counted(with_int8, tmp_path, keypair):
  import shutil

  root = tmp_path / "registry"
  shutil.copytree(with_int8, root)
  reg = Registry.open(root, TrustPolicy(public_keys=(keypair[1],)))
  m = reg.manifest("blocks[2:3)@int8")
  victim = largest_data_file(reg.version_dir(m.name, m.version))
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0x01
  victim.write_bytes(bytes(data))
  with pytest.raises(IntegrityError) as info:
    compose("embed, blocks[0:3)@int8, blocks[3:6), head", reg)
  assert (info.value.thoughtlet, info.value.version) == ("blocks[2:3)@int8", m.version)
  assert reg.stats().integrity_failures == 1
  assert reg.stats().failures[0]["thoughtlet"] == f"blocks[2:3)@int8@{m.version}"
  # The exact path does not read the variant and still runs.
  assert compose("embed, blocks[0:6), head", reg).logits(IDS).shape[0] == len(IDS)
  with pytest.raises(IntegrityError):
    reg.verify()


def test_cli_build_refuses_an_unknown_variant(capsys):
  from thoughtjax.cli import main

  with pytest.raises(SystemExit):
    main(["registry", "build", "--out", "x", "--variants", "int4"])
  assert "--variants 'int4'" in capsys.readouterr().err


def test_the_int8a8_variant_stores_int8_and_computes_with_int8_activations(tmp_path, tiny, tiny_mapping):
  """``int8a8`` publishes the same int8 arrays under its own signature and version; a path naming it computes with
  int8 activations (RowInt8A8), the same logits whether its blocks come from a registry or a loaded model."""
  cfg, model, codec = tiny
  reg = build(tmp_path / "reg", tiny_mapping, model, codec=codec, settings=None, variants=("int8", "int8a8"))
  m8, ma8 = reg.manifest("blocks[3:5)@int8"), reg.manifest("blocks[3:5)@int8a8")
  assert ma8.signature.constraints["weights"] == "int8a8" and "int8a8" in ma8.signature.tags
  assert ma8.version != m8.version
  a8, i8 = reg.restore("blocks[3:5)@int8a8")["3"]["mlp"]["gate"], reg.restore("blocks[3:5)@int8")["3"]["mlp"]["gate"]
  np.testing.assert_array_equal(np.asarray(a8["int8"]), np.asarray(i8["int8"]))
  path = "embed, blocks[0:6)@int8a8, head"
  from_reg, from_model = compose(path, reg), compose(path, Model(LoadedModel(cfg, model, codec, "tiny", "seed")))
  weight = from_reg.parts.blocks[0]["mlp"]["gate"]
  assert isinstance(weight.get_value() if hasattr(weight, "get_value") else weight, quantized.RowInt8A8)
  a, b = from_reg.logits(IDS), from_model.logits(IDS)
  np.testing.assert_allclose(a, b, atol=1e-5)
  int8 = compose("embed, blocks[0:6)@int8, head", reg).logits(IDS)
  assert from_reg.path_hash != compose("embed, blocks[0:6)@int8, head", reg).path_hash
  assert 0 < np.max(np.abs(a - int8)) < 0.05 * np.max(np.abs(a))

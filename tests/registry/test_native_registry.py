"""A registry built from a quantized GGUF stores its blocks packed (format 2).

Checked here on tiny GGUFs of each block type: the stored weights are the GGUF's bytes (same size);
restored for ``weights="f32"`` a path gives exactly the float32 load's logits, for ``"native"`` the
blocks stay packed; int8 variants compose with native blocks; a changed q byte or scale is refused
loudly (file digests) or, re-signed by a key holder, caught by the versioned hash; a registry of the
older format is refused with the command that rebuilds it, and the default registry rebuilds itself.
"""

from __future__ import annotations

import json
import os
import shutil

import gguf
import jax
import numpy as np
import pytest

import thoughtjax
from tests.registry.helpers import mapping_text, read_index, rewrite_manifest, write_index
from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax import quantized
from thoughtjax.assembly import full_path
from thoughtjax.compose import compose
from thoughtjax.errors import UserError
from thoughtjax.registry import (
  FORMAT,
  IntegrityError,
  Registry,
  RegistryError,
  RegistryFormatError,
  build,
  dir_name,
  is_older_format,
)
from thoughtjax.registry.checkpoint import save_checkpoint
from thoughtjax.transformer import init_random

KINDS = ("Q8_0", "Q4_0", "Q4_1")
CFG = TINY_CONFIGS["llama_gqa"]  # 3 layers, every matrix dimension a multiple of 32
IDS = [5, 77, 130, 9, 201, 64, 33]
PATH = "embed, blocks[0:1), blocks[1:3), head"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
  """kind -> (gguf path, f32 model, native model, registry dir); the weight cache kept in a temp dir."""
  root = tmp_path_factory.mktemp("native")
  old = os.environ.get("THOUGHTJAX_CACHE")
  os.environ["THOUGHTJAX_CACHE"] = str(root / "cache")
  try:
    (root / "mapping.yaml").write_text(mapping_text([(0, 1), (1, 3)], 3))
    model = init_random(CFG, 4, scale=0.08)
    out = {}
    for kind in KINDS:
      path = write_gguf(root / f"{kind}.gguf", CFG, model, kind)
      reg = root / f"reg-{kind}"
      build(reg, root / "mapping.yaml", path, settings=None, variants=("int8",) if kind == "Q4_1" else ())
      f32 = thoughtjax.load(path, weights="f32", compile_cache=False)
      native = thoughtjax.load(path, weights="native", compile_cache=False)
      out[kind] = (path, f32, native, reg)
    yield out
  finally:
    if old is None:
      os.environ.pop("THOUGHTJAX_CACHE", None)
    else:
      os.environ["THOUGHTJAX_CACHE"] = old


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_are_stored_packed_at_the_gguf_size(ggufs, kind):
  path, _, _, root = ggufs[kind]
  reg = Registry.open(root)
  spec = reg.manifest("blocks[0:1)").params
  assert spec[f"0/mlp/gate/{kind}"]["dtype"] == ("int8" if kind == "Q8_0" else "uint8")
  assert spec["0/mlp/gate/scale"]["dtype"] == "float16"
  assert ("0/mlp/gate/min" in spec) == (kind == "Q4_1")
  assert spec["0/attn_norm/weight"]["dtype"] == "float32"  # unquantized tensors stay as they are
  assert f"table/{kind}" in reg.manifest("embed").params
  # The model's weights take exactly the bytes the GGUF's tensors take.
  stored = sum(reg.manifest(n).param_bytes for n in ("embed", "blocks[0:1)", "blocks[1:3)", "head"))
  assert stored == sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_restore_is_the_float32_load_bit_for_bit(ggufs, kind):
  _, f32, _, root = ggufs[kind]
  reg = Registry.open(root)  # weights="f32", the default
  got = reg.restore("blocks[1:3)")["2"]["mlp"]["down"]
  want = f32.module.blocks[2].mlp.down.get_value()
  assert got.dtype == np.float32 and np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
  m = compose(PATH, reg, compile_cache=False)
  assert np.array_equal(m.logits(IDS), f32.logits(IDS))  # exactly, not within a tolerance
  assert (
    m.generate(IDS, max_tokens=8, ignore_eos=True).token_ids
    == f32.generate(IDS, max_tokens=8, ignore_eos=True).token_ids
  )


@pytest.mark.parametrize("kind", KINDS)
def test_native_restore_keeps_the_blocks_packed(ggufs, kind):
  _, f32, native, root = ggufs[kind]
  reg = Registry.open(root, weights="native")
  w = reg.restore("blocks[0:1)")["0"]["attn"]["q"]
  ref = native.module.blocks[0].attn.q.get_value()
  assert isinstance(w, quantized.BlockQuant) and w.kind == kind and w.q.dtype == ref.q.dtype
  assert np.array_equal(np.asarray(w.q), np.asarray(ref.q)) and np.array_equal(np.asarray(w.scale), ref.scale)
  assert quantized.is_packed(reg.restore("embed")["table"])
  assert reg.restore("embed")["table"].nbytes < 0.4 * CFG.vocab_size * CFG.d_model * 4  # f32 takes 4 bytes a value
  m = compose(full_path(reg), reg, compile_cache=False)
  assert np.max(np.abs(m.logits(IDS) - f32.logits(IDS))) <= 1e-5
  assert np.array_equal(m.logits(IDS), native.logits(IDS))
  # The same version restored in both forms: two resident entries, one hash.
  assert reg.restore("head", weights="f32") is not reg.restore("head")
  assert reg.verify().thoughtlets and all(t["versioned_hash"] == "ok" for t in reg.verify().thoughtlets)


def test_int8_variant_composes_with_native_blocks(ggufs):
  _, _, native, root = ggufs["Q4_1"]
  reg = Registry.open(root, weights="native")
  path = "embed, blocks[0:1)@int8, blocks[1:3), head"
  m = compose(path, reg, compile_cache=False)
  kinds = {
    type(leaf).__name__ for s in m.parts.blocks.values() for leaf in jax.tree.leaves(s, is_leaf=quantized.is_packed)
  }
  assert {"RowInt8", "BlockQuant"} <= kinds
  # The registry's variant was quantized from the blocks' float32 values, as a loaded model's is.
  np.testing.assert_allclose(m.logits(IDS), compose(path, native).logits(IDS), rtol=0, atol=1e-6)
  v = reg.manifest("blocks[0:1)@int8").params
  assert v["0/mlp/up/int8"]["dtype"] == "int8" and not any("Q4_1" in p for p in v)


def _signed_copy(ggufs, tmp_path, keypair):
  """A signed copy of the Q4_1 registry (built again with the key: versions do not depend on it)."""
  path = ggufs["Q4_1"][0]
  root = tmp_path / "signed"
  (tmp_path / "mapping.yaml").write_text(mapping_text([(0, 1), (1, 3)], 3))
  loaded = ggufs["Q4_1"][2].loaded
  build(root, tmp_path / "mapping.yaml", loaded, sign_key=keypair[0], settings=None, source=str(path))
  return root


def _tampered_checkpoint(reg, name, edit, tmp_path):
  """A valid Orbax checkpoint of ``name``'s stored arrays with ``edit`` applied: what an attacker writes."""
  params = jax.tree.map(np.array, reg.restore(name, weights="stored"))
  edit(params)
  dst = tmp_path / "forged"
  shutil.rmtree(dst, ignore_errors=True)
  save_checkpoint(dst, params)
  return dst


def _flip_scale(params):
  params["0"]["mlp"]["up"]["scale"].view(np.uint16)[3, 0] ^= 1  # the smallest change of one float16 scale


def _flip_nibble(params):
  params["0"]["mlp"]["up"]["Q4_1"][7, 5] ^= np.uint8(0x01)


def _plant_forged_checkpoint(ggufs, tmp_path, keypair, edit):
  """A signed Q4_1 registry whose blocks[0:1) checkpoint is replaced by one with ``edit`` applied:
  (root, version, version dir)."""
  root = _signed_copy(ggufs, tmp_path, keypair)
  reg = Registry.open(root)
  version = reg.resolve("blocks[0:1)")
  vdir = root / "thoughtlets" / dir_name("blocks[0:1)") / version
  forged = _tampered_checkpoint(reg, "blocks[0:1)", edit, tmp_path)
  shutil.rmtree(vdir / "checkpoint")
  shutil.copytree(forged, vdir / "checkpoint")
  return root, version, vdir


@pytest.mark.parametrize("edit", [_flip_scale, _flip_nibble], ids=["scale", "q"])
def test_a_changed_scale_or_q_byte_is_refused_loudly(ggufs, tmp_path, keypair, edit):
  root, version, vdir = _plant_forged_checkpoint(ggufs, tmp_path, keypair, edit)
  fresh = Registry.open(root)
  with pytest.raises(IntegrityError, match=r"blocks\[0:1\)@" + version) as err:
    fresh.restore("blocks[0:1)")
  assert isinstance(err.value, UserError)
  stats = fresh.stats()
  assert stats.integrity_failures == 1 and stats.failures[0]["thoughtlet"] == f"blocks[0:1)@{version}"
  assert stats.resident == []  # nothing was loaded from it


@pytest.mark.parametrize("edit", [_flip_scale, _flip_nibble], ids=["scale", "q"])
def test_a_resigned_change_is_caught_by_the_versioned_hash(ggufs, tmp_path, keypair, edit):
  """A key holder re-signs the manifest with the forged checkpoint's digests: files and signatures
  pass, the versioned hash over the packed bytes does not."""
  from thoughtjax.registry.layout import files_under, sha256_of_file

  root, version, vdir = _plant_forged_checkpoint(ggufs, tmp_path, keypair, edit)
  files = {
    str(p.relative_to(vdir)): {"sha256": sha256_of_file(p), "bytes": p.stat().st_size}
    for p in files_under(vdir / "checkpoint")
  }
  rewrite_manifest(vdir, lambda raw: raw.update(files=files), keypair[0], root)
  fresh = Registry.open(root)
  with pytest.raises(IntegrityError, match="hash to") as err:
    fresh.verify()
  assert "blocks[0:1)" in str(err.value) and fresh.stats().integrity_failures == 1
  assert fresh.stats().failures[0]["reason"] == "versioned hash mismatch"


def test_an_older_format_is_refused_with_the_rebuild_command(registry_copy, keypair, tiny_mapping, tiny):
  body, _ = read_index(registry_copy)
  body["format"] = "thoughtjax.registry/1"
  write_index(registry_copy, body, keypair[0])  # re-signed: only the format differs
  assert is_older_format(registry_copy)
  with pytest.raises(
    RegistryFormatError, match=r"format thoughtjax.registry/1.*thoughtjax registry build --out"
  ) as err:
    Registry.open(registry_copy)
  assert isinstance(err.value, UserError) and "--replace-old-format" in str(err.value)
  _, model, codec = tiny
  with pytest.raises(RegistryFormatError, match="Rebuild it"):
    build(registry_copy, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=None)
  assert read_index(registry_copy)[0]["format"] == "thoughtjax.registry/1"  # a refused build changes nothing
  stages = []
  build(
    registry_copy,
    tiny_mapping,
    model,
    codec=codec,
    sign_key=keypair[0],
    settings=None,
    replace_old_format=True,
    progress=lambda stage, name, done, total: stages.append(stage),
  )
  assert "replace" in stages and read_index(registry_copy)[0]["format"] == FORMAT
  assert Registry.open(registry_copy).sequence == 1  # a new registry, not a successor of the old one


def test_a_newer_format_asks_for_an_upgrade(registry_copy, keypair):
  body, _ = read_index(registry_copy)
  body["format"] = "thoughtjax.registry/99"
  write_index(registry_copy, body, keypair[0])
  assert not is_older_format(registry_copy)
  with pytest.raises(RegistryFormatError, match="newer.*upgrade thoughtjax"):
    Registry.open(registry_copy)


def test_restore_forms_are_checked(built):
  with pytest.raises(RegistryError, match=r"weights='int8'.*blocks\[a:b\)@int8"):
    Registry.open(built, weights="int8")


def test_the_default_registry_of_an_older_format_rebuilds_itself(ggufs, tmp_path, monkeypatch):
  """ensure_default on a cache holding a format-1 registry: says so, builds format 2 in its place."""
  import thoughtjax.fetch
  from thoughtjax.synthesis import calibrate as cal_lib
  from thoughtjax.synthesis import default_registry

  root = tmp_path / "default"
  root.mkdir()
  (root / "index.json").write_text(json.dumps({"index": {"format": "thoughtjax.registry/1"}, "signature": None}))
  (root / "thoughtlets" / "old").mkdir(parents=True)  # an old version directory, unreadable now
  mapping = tmp_path / "mapping.yaml"
  mapping.write_text(mapping_text([(0, 1), (1, 3)], 3))
  monkeypatch.setattr(thoughtjax.fetch, "DEFAULT_MODEL", str(ggufs["Q8_0"][0]))
  monkeypatch.setattr(default_registry, "_mapping_path", lambda: mapping)

  class Built(Exception):
    pass

  def stop(reg, **kw):  # the registry is built; calibrating it is another test's subject
    raise Built(reg.root)

  monkeypatch.setattr(cal_lib, "calibrate", stop)
  monkeypatch.setattr(default_registry, "shipped_calibration", lambda reg: None)
  said = []
  with pytest.raises(Built):
    default_registry.ensure_default(lambda stage, done, total, item: said.append(stage), root=root)
  assert said[0].startswith(f"rebuild: {root} holds a registry of an older format (thoughtjax.registry/1)")
  assert any(s == "build replace" for s in said)
  reg = Registry.open(root)
  assert "0/attn/q/Q8_0" in reg.manifest("blocks[0:1)").params and not (root / "thoughtlets" / "old").exists()


def test_native_thoughtlets_are_profiled_and_reprofile_alike(ggufs, tmp_path):
  """Profiles are measured on the packed weights at build, and `verify --hardware` measures the same form."""
  from tests.registry.helpers import FAST
  from thoughtjax.registry import Tolerance

  (tmp_path / "mapping.yaml").write_text(mapping_text([(0, 1), (1, 3)], 3))
  root = tmp_path / "profiled"
  build(root, tmp_path / "mapping.yaml", ggufs["Q4_1"][2].loaded, settings=FAST, variants=("int8",))
  reg = Registry.open(root)
  m = reg.manifest("blocks[1:3)")
  # One byte per 4-bit value, float32 scale and minimum per 32 values: what the packed weights take in memory.
  d, e = CFG.d_model, CFG.head_dim
  matrices = 2 * (2 * d * CFG.num_heads * e + 2 * d * CFG.num_kv_heads * e + 3 * d * CFG.ffn_dim)  # 2 layers
  assert m.profile.param_bytes == matrices * (1 + 8 / 32) + 2 * 2 * CFG.d_model * 4
  assert reg.verify_hardware(Tolerance(latency=None), FAST) == []


@pytest.mark.parametrize("weights", ["native", "f32"])
def test_packed_weights_restore_onto_a_mesh(ggufs, weights):
  """Tensor-parallel restore: a native weight is split by output rows (q) or whole input blocks (o)."""
  _, f32, _, root = ggufs["Q4_1"]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  reg = Registry.open(root, weights=weights)
  attn = reg.restore("blocks[0:1)", mesh=mesh)["0"]["attn"]
  if weights == "native":
    assert attn["q"].q.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert attn["o"].scale.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  else:
    assert attn["q"].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
  m = compose(PATH, reg, mesh=mesh, compile_cache=False)
  np.testing.assert_allclose(m.logits(IDS), f32.logits(IDS), rtol=0, atol=1e-5)


def test_cli_registry_route_takes_weights_native_and_names_int8_as_a_variant(ggufs):
  import argparse

  from thoughtjax.cli.args import CommandLineError
  from thoughtjax.cli.model_commands import _load

  _, _, native, root = ggufs["Q4_1"]
  args = dict(registry=str(root), model=None, path=None, kernels=None, public_key=None, require_signatures=False)
  m = _load(argparse.Namespace(**args, weights="native"))
  leaves = [leaf for s in m.parts.blocks.values() for leaf in jax.tree.leaves(s, is_leaf=quantized.is_packed)]
  assert any(quantized.is_packed(leaf) for leaf in leaves)
  assert np.array_equal(m.logits(IDS), native.logits(IDS))
  with pytest.raises(CommandLineError, match=r"@int8.*--variants int8"):
    _load(argparse.Namespace(**args, weights="int8"))


@pytest.mark.parametrize("form", ["native", "f32"])
def test_a_mapped_restore_gives_the_checkpoints_arrays_bit_for_bit(ggufs, form):
  """The second restore maps the mapped form the first one kept; native weights come back packed, same kind."""
  _, _, _, root = ggufs["Q4_1"]
  first = Registry.open(root, weights=form).restore("blocks[0:1)")
  reg = Registry.open(root, weights=form)
  got = reg.restore("blocks[0:1)")
  assert reg.stats().mapped_restores == 1
  want = Registry.open(root, weights=form, mapped=False).restore("blocks[0:1)")
  for tree in (first, got):
    assert jax.tree.structure(tree) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(want), strict=True):
      assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  w = got["0"]["attn"]["q"]
  assert (isinstance(w, quantized.BlockQuant) and w.kind == "Q4_1") == (form == "native")

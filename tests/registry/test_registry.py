"""Registry: layout, signatures, verification, integrity failures, lazy restore, LRU residency."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.registry.helpers import largest_data_file, rewrite_manifest
from thoughtjax import signing
from thoughtjax.compose import compose
from thoughtjax.registry import (
  IntegrityError,
  MemoryBudgetError,
  Registry,
  ResourceProfileMismatch,
  Tolerance,
  TrustPolicy,
  UnknownThoughtletError,
  collect_garbage,
  dir_name,
)


def test_build_layout(built, keypair):
  reg = Registry.open(built, TrustPolicy(public_keys=(keypair[1],)))
  assert reg.names == ["embed", "template", "blocks[0:2)", "blocks[2:3)", "blocks[3:5)", "blocks[5:6)", "head"]
  doc = json.loads((built / "index.json").read_text())
  assert doc["signature"]["algorithm"] == "ed25519" and doc["index"]["sequence"] == 1
  for name in reg.names:
    m = reg.manifest(name)
    vdir = built / "thoughtlets" / dir_name(name) / m.version
    assert (vdir / "checkpoint" / "_METADATA").exists()  # one Orbax checkpoint per version
    assert (vdir / "manifest.sig").exists() and m.signed_by == signing.key_id(signing.load_public_key(keypair[1]))
    assert m.versioned_hash.startswith(m.version) and len(m.versioned_hash) == 128
    assert m.profile.param_bytes == m.param_bytes > 0
    assert m.profile.flops_per_token > 0 and m.profile.peak_memory_bytes > 0
    assert m.profile.latency_mean_s > 0 and m.profile.fingerprint["device_kind"]
    assert set(m.files) == {str(p.relative_to(vdir)) for p in (vdir / "checkpoint").rglob("*") if p.is_file()}
  sig = reg.manifest("blocks[0:2)").signature
  assert sig.constraints["layers"] == [0, 2] and sig.constraints["max_context"] == 256


def test_verify_checks_every_hash_and_signature(built, keypair):
  report = Registry.open(built, TrustPolicy(public_keys=(keypair[1],))).verify()
  assert [t["versioned_hash"] for t in report.thoughtlets] == ["ok"] * 7 and report.index_signed


def test_untrusted_key_is_refused(built, tmp_path):
  _, other_pub = signing.keygen(tmp_path / "other")
  with pytest.raises(
    signing.SignatureError, match=r"index.json \(index signature\): signed by key .* not among the trusted keys"
  ):
    Registry.open(built, TrustPolicy(public_keys=(other_pub,)))


def test_flipped_byte_is_detected_named_and_counted(registry_copy, keypair):
  reg = Registry.open(registry_copy, TrustPolicy(public_keys=(keypair[1],)))
  m = reg.manifest("blocks[2:3)")
  victim = largest_data_file(reg.version_dir(m.name, m.version))
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0x01
  victim.write_bytes(bytes(data))

  with pytest.raises(IntegrityError) as info:
    compose("embed, blocks[0:6), head", reg)
  e = info.value
  assert (e.thoughtlet, e.version) == ("blocks[2:3)", m.version) and e.file == str(victim)
  assert f"blocks[2:3)@{m.version}" in str(e) and str(victim) in str(e)
  stats = reg.stats()
  assert stats.integrity_failures == 1
  assert stats.failures[0]["thoughtlet"] == f"blocks[2:3)@{m.version}"
  assert "blocks[2:3)" not in " ".join(stats.resident)  # nothing was loaded in its place
  # Loud every time, never a fallback; paths that avoid it still work.
  with pytest.raises(IntegrityError):
    reg.restore("blocks[2:3)")
  assert reg.stats().integrity_failures == 2
  assert compose("embed, blocks[0:2), head", reg).logits([5, 6, 7]).shape == (3, 264)
  with pytest.raises(IntegrityError):
    reg.verify()


def test_tampered_manifest_fails_its_signature(registry_copy, keypair):
  reg = Registry.open(registry_copy, TrustPolicy(public_keys=(keypair[1],)))
  m = reg.manifest("head")
  path = reg.version_dir("head", m.version) / "manifest.json"
  raw = json.loads(path.read_text())
  raw["resource_profile"]["latency_mean_s"] /= 10  # a "faster" thoughtlet
  path.write_text(json.dumps(raw))
  with pytest.raises(signing.SignatureError, match=f"head@{m.version} manifest.json .*: the Ed25519 signature"):
    reg.manifest("head")
  assert reg.stats().signature_failures == 1


def test_lazy_restore_reads_only_the_path(registry_copy):
  reg = Registry.open(registry_copy)
  # Remove every thoughtlet an early exit does not use: it must not notice.
  for name in ("template", "blocks[3:5)", "blocks[5:6)"):
    for vdir in (registry_copy / "thoughtlets" / dir_name(name)).iterdir():
      for f in vdir.rglob("*"):
        if f.is_file():
          f.unlink()
  m = compose("embed, blocks[0:3), head", reg)
  assert m.layers == (0, 1, 2)
  assert sorted(r.split("@")[0] for r in reg.stats().resident) == ["blocks[0:2)", "blocks[2:3)", "embed", "head"]
  assert np.isfinite(m.logits([5, 6, 7])).all()


def test_resident_set_is_an_lru_under_a_budget(built):
  sizes = {n: Registry.open(built).manifest(n).param_bytes for n in ("blocks[0:2)", "blocks[2:3)", "blocks[3:5)")}
  budget = sizes["blocks[0:2)"] + sizes["blocks[3:5)"] + 16  # not all three
  reg = Registry.open(built, memory_budget=budget)
  reg.restore("blocks[0:2)")
  reg.restore("blocks[2:3)")
  reg.restore("blocks[0:2)")  # hit; blocks[2:3) is now least recently used
  reg.restore("blocks[3:5)")  # evicts blocks[2:3)
  s = reg.stats()
  assert (s.hits, s.misses, s.evictions) == (1, 3, 1)
  assert [r.split("@")[0] for r in s.resident] == ["blocks[0:2)", "blocks[3:5)"]
  assert s.resident_bytes == sizes["blocks[0:2)"] + sizes["blocks[3:5)"] <= budget
  with pytest.raises(MemoryBudgetError, match=f"memory budget is {budget} bytes"):
    compose("embed, blocks[0:6), head", reg)


def test_unknown_refs_are_named(built):
  reg = Registry.open(built)
  with pytest.raises(UnknownThoughtletError, match="no thoughtlet 'bridge'"):
    compose("embed, bridge, head", reg)
  with pytest.raises(
    UnknownThoughtletError, match="layer 4 falls inside thoughtlet blocks\\[3:5\\); .* boundaries \\(0, 2, 3, 5, 6\\)"
  ):
    compose("embed, blocks[0:4), head", reg)
  with pytest.raises(UnknownThoughtletError, match="embed@'ffff': name a version by its 16 .* at least 12"):
    compose("embed@ffff, blocks[0:2), head", reg)
  with pytest.raises(UnknownThoughtletError, match="embed@ffffffffffff: no published version"):
    compose("embed@ffffffffffff, blocks[0:2), head", reg)


def test_verify_hardware_reports_declared_and_measured(registry_copy, keypair):
  reg = Registry.open(registry_copy, TrustPolicy(public_keys=(keypair[1],)))
  # Same machine, timing ignored: the measured shape-dependent values agree.
  assert reg.verify(hardware=True, tolerance=Tolerance(latency=None)).mismatches == []
  # Re-sign a manifest that declares wrong values (the publisher's mistake, not tampering).
  m = reg.manifest("blocks[0:2)")

  def wrong(raw):
    raw["resource_profile"]["flops_per_token"] *= 3
    raw["resource_profile"]["latency_mean_s"] = 1e-12

  rewrite_manifest(reg.version_dir(m.name, m.version), wrong, keypair[0], registry_copy)
  reg.refresh()
  with pytest.raises(ResourceProfileMismatch) as info:  # latency: only a 10^6-fold error counts here
    reg.verify_hardware(Tolerance(latency=1e6, latency_floor_s=0.0), names=["blocks[0:2)", "head"])
  fields = {(x.thoughtlet, x.field) for x in info.value.mismatches}
  assert fields == {(m.ref, "flops_per_token"), (m.ref, "latency_mean_s")}
  flops = next(x for x in info.value.mismatches if x.field == "flops_per_token")
  assert flops.declared == pytest.approx(3 * flops.measured, rel=0.02)
  assert f"{m.ref}: flops_per_token declared" in str(info.value) and "tolerance ±2%" in str(info.value)


def test_gc_keeps_current_and_recent(registry_copy, keypair):
  reg = Registry.open(registry_copy)
  v0 = reg.current["blocks[5:6)"]
  base = reg.thoughtlet("blocks[5:6)")
  versions = []
  for k in range(3):
    params = jax.tree.map(lambda x, k=k: x * (1.0 + 0.01 * (k + 1)), dict(base.params))
    versions.append(reg.publish([base.with_params(params)], sign_key=keypair[0], settings=None)["blocks[5:6)"])
  assert reg.versions("blocks[5:6)") == [v0] + versions
  reg.close()  # its lease held v0, which it restored (see test_gc.py)
  assert [p.name for p in collect_garbage(registry_copy, keep=2, dry_run=True).removed] == sorted([v0, versions[0]])
  report = collect_garbage(registry_copy, keep=2)
  assert [p.name for p in report.removed] == sorted([v0, versions[0]]) and report.skipped == []
  assert not any(p.exists() for p in report.removed)
  reg2 = Registry.open(registry_copy)
  assert reg2.current["blocks[5:6)"] == versions[-1]
  reg2.verify()


def test_codec_keeps_every_eos_id_and_is_checked(tiny, tmp_path):
  from tests.registry.helpers import TINY_SPANS, mapping_text, tiny_codec
  from thoughtjax.registry import build, codec_digest
  from thoughtjax.tokenizer import TextCodec

  _, model, _ = tiny
  base = tiny_codec()
  codec = TextCodec(base.tokenizer, base.chat_template, base.bos_id, base.eos_id, base.add_bos, eos_ids=(2, 3))
  (tmp_path / "mapping.yaml").write_text(mapping_text(TINY_SPANS, 6))
  reg = build(tmp_path / "reg", tmp_path / "mapping.yaml", model, codec=codec, settings=None)
  assert reg.codec.eos_ids == (2, 3) and reg.codec.eos_id == 2
  assert reg.tokenizer_hash == codec_digest(codec) != codec_digest(base)
  meta = tmp_path / "reg" / "codec" / reg.tokenizer_hash / "codec.json"
  meta.write_text(meta.read_text().replace("[2,3]", "[2]"))  # stop on fewer tokens
  fresh = Registry.open(tmp_path / "reg")
  with pytest.raises(IntegrityError, match=f"{meta}: sha256 does not match"):
    _ = fresh.codec
  assert fresh.stats().integrity_failures == 1

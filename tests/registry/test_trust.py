"""Registry trust: each attack is performed and must end in a loud, named, counted refusal.

Attacks: an edited index laundered by a writer's signature, an older signed index put back (rollback),
a keyless publish into a signed registry, stripped signatures, malformed signatures, index version strings
that escape their directory, a planted version directory signed by another key.
"""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from tests.registry.helpers import read_index, write_index
from thoughtjax import signing
from thoughtjax.errors import UserError
from thoughtjax.registry import (
  IntegrityError,
  Registry,
  RegistryError,
  ReusedVersionError,
  RollbackError,
  SignatureDowngradeError,
  SignatureError,
  TrustPolicy,
  UntrustedIndexError,
  collect_garbage,
  dir_name,
)
from thoughtjax.registry.trust import STATE_FORMAT, RollbackState

NAME = "blocks[5:6)"


def _bumped(reg, k: float, name: str = NAME):
  base = reg.thoughtlet(name)
  return base.with_params(jax.tree.map(lambda x: x * (1.0 + 0.01 * k), dict(base.params)))


def _index_bytes(root):
  return (root / "index.json").read_bytes()


def test_errors_are_user_errors():
  for cls in (
    RegistryError,
    SignatureError,
    SignatureDowngradeError,
    RollbackError,
    UntrustedIndexError,
    IntegrityError,
    ReusedVersionError,
    signing.SignatureError,
  ):
    assert issubclass(cls, UserError), cls
  assert issubclass(SignatureError, signing.SignatureError) and issubclass(RegistryError, RuntimeError)
  with pytest.raises(UserError, match="allow_unsigned=True contradicts"):
    TrustPolicy(require_signatures=True, allow_unsigned=True)


def test_writer_refuses_an_edited_index(registry_copy, keypair):
  """`current` pointed back at an older, validly signed version: a writer must not sign that."""
  reg = Registry.open(registry_copy)
  v0 = reg.current[NAME]
  v1 = reg.publish([_bumped(reg, 1)], sign_key=keypair[0], settings=None)[NAME]
  body, sig = read_index(registry_copy)
  body["current"][NAME]["version"] = v0  # the attacker has no key: the old signature stays
  (registry_copy / "index.json").write_text(json.dumps({"index": body, "signature": sig}))
  edited = _index_bytes(registry_copy)

  with pytest.raises(
    UntrustedIndexError,
    match=r"refusing to publish on top of .*index.json: .*index signature"
    r".*does not verify",
  ) as info:
    reg.publish([_bumped(reg, 2, "head")], sign_key=keypair[0], settings=None)
  assert isinstance(info.value.__cause__, SignatureError)
  s = reg.stats()
  assert (s.writer_refusals, s.signature_failures) == (1, 1)
  assert s.failures[-1]["kind"] == "writer" and str(registry_copy / "index.json") in s.failures[-1]["file"]
  assert _index_bytes(registry_copy) == edited  # nothing was signed or switched
  with pytest.raises(SignatureError, match="index signature"):  # readers refuse it too
    Registry.open(registry_copy)
  assert v1 != v0


def test_writer_refuses_an_edited_manifest_it_would_build_on(registry_copy, keypair):
  reg = Registry.open(registry_copy)
  vdir = reg.version_dir("head", reg.current["head"])
  raw = json.loads((vdir / "manifest.json").read_text())
  raw["resource_profile"]["latency_mean_s"] /= 10
  (vdir / "manifest.json").write_text(json.dumps(raw))
  with pytest.raises(UntrustedIndexError, match=r"head@.*manifest.json.*signature .* does not verify") as info:
    reg.publish([_bumped(reg, 1)], sign_key=keypair[0], settings=None)
  assert isinstance(info.value.__cause__, SignatureError)
  assert reg.stats().writer_refusals == 1


def test_rollback_is_refused_by_readers_and_writers(registry_copy, keypair, tmp_path):
  state = tmp_path / "state.json"
  trust = TrustPolicy(state_file=state)
  old = _index_bytes(registry_copy)
  reg = Registry.open(registry_copy, trust)
  assert reg.sequence == reg.generation == 1 and reg.registry_id
  reg.publish([_bumped(reg, 1)], sign_key=keypair[0], settings=None)
  assert reg.sequence == 2
  (registry_copy / "index.json").write_bytes(old)  # an older, validly signed index put back

  with pytest.raises(RollbackError, match=r"index.json: index sequence 1 is lower than 2.*rollback"):
    Registry.open(registry_copy, trust)
  with pytest.raises(RollbackError):  # an open reader refreshing: refused and counted
    reg.refresh()
  assert reg.sequence == 2 and reg.stats().rollback_refusals == 1
  with pytest.raises(RollbackError):  # a writer does not build on it either
    reg.publish([_bumped(reg, 2)], sign_key=keypair[0], settings=None)
  assert reg.stats().rollback_refusals == 2 and reg.stats().writer_refusals == 1
  with pytest.raises(RollbackError):  # nor does gc decide what is live from it
    collect_garbage(registry_copy, trust=trust)
  # Another user (another state file) has not seen sequence 2: the rule is per user, as in TUF.
  assert Registry.open(registry_copy, TrustPolicy(state_file=tmp_path / "other.json")).sequence == 1
  # The state is small: one entry per registry and directory, written whole.
  doc = json.loads(state.read_text())
  assert doc["format"] == STATE_FORMAT and len(doc["registries"]) == 1
  (entry,) = doc["registries"].values()
  assert entry["sequence"] == 2 and entry["signed"] is True and state.stat().st_size < 512


def test_a_newer_sequence_recorded_while_reading_is_not_a_rollback(registry_copy, keypair, tmp_path, monkeypatch):
  """Reader A reads index 1; before A checks it, a publish lands and reader B records sequence 2.
  A holds a consistent (older) snapshot, not a rolled-back one: it opens at 1. Then a genuine
  rollback (index 1 put back after 2 was seen) is still refused."""
  from thoughtjax.registry import store

  trust = TrustPolicy(state_file=tmp_path / "state.json")
  writer = Registry.open(registry_copy, trust)
  read_index = store.read_index

  def read_then_race(root):
    body = read_index(root)
    monkeypatch.setattr(store, "read_index", read_index)
    writer.publish([_bumped(writer, 1)], sign_key=keypair[0], settings=None)
    assert Registry.open(registry_copy, trust).sequence == 2  # reader B records 2
    return body

  old = _index_bytes(registry_copy)
  monkeypatch.setattr(store, "read_index", read_then_race)
  assert Registry.open(registry_copy, trust).sequence == 1
  (registry_copy / "index.json").write_bytes(old)
  with pytest.raises(RollbackError):
    Registry.open(registry_copy, trust)


def test_state_file_stays_small(tmp_path, monkeypatch):
  from thoughtjax.registry import trust as trust_mod

  monkeypatch.setattr(trust_mod, "STATE_ENTRIES", 2)
  state = RollbackState(tmp_path / "s.json")
  for i in range(4):
    state.record(f"r{i}:/x", i, False)
  assert sorted(json.loads((tmp_path / "s.json").read_text())["registries"]) == ["r2:/x", "r3:/x"]
  assert state.record("r3:/x", 1, False)["sequence"] == 3  # never lowered
  assert not list(tmp_path.glob("*.tmp"))


def test_keyless_publish_into_a_signed_registry_is_refused(registry_copy):
  reg = Registry.open(registry_copy)
  before = _index_bytes(registry_copy)
  with pytest.raises(SignatureDowngradeError, match=r"index.json: the registry is signed .* no signing key"):
    reg.publish([_bumped(reg, 1)], settings=None)
  s = reg.stats()
  assert (s.downgrade_refusals, s.signature_failures, s.writer_refusals) == (1, 1, 1)
  assert _index_bytes(registry_copy) == before and not (registry_copy / ".staging").exists()


def test_stripped_manifest_signature_is_refused(registry_copy):
  reg = Registry.open(registry_copy)
  vdir = reg.version_dir("head", reg.current["head"])
  (vdir / "manifest.sig").unlink()
  with pytest.raises(SignatureDowngradeError, match=r"head@.*manifest.sig is missing but the registry is signed"):
    reg.manifest("head")
  s = reg.stats()
  assert (s.downgrade_refusals, s.signature_failures) == (1, 1)
  # The explicit opt-out reads it (the digest in the signed index still binds its content).
  assert Registry.open(registry_copy, TrustPolicy(allow_unsigned=True)).manifest("head").name == "head"


def test_stripped_index_signature_is_refused(registry_copy, tmp_path):
  state = tmp_path / "state.json"
  Registry.open(registry_copy, TrustPolicy(state_file=state)).close()  # this user saw it signed
  body, _ = read_index(registry_copy)
  write_index(registry_copy, body, None)
  with pytest.raises(
    SignatureDowngradeError,
    match=r"index.json: the index is not signed, but the registry is "
    r"signed \(the index lists signing keys",
  ):
    Registry.open(registry_copy, TrustPolicy(state_file=state))
  # Removing every trace (the key list, the keys directory) does not help: this user saw it signed.
  body["signing_keys"] = []
  write_index(registry_copy, body, None)
  shutil.rmtree(registry_copy / "keys")
  with pytest.raises(SignatureDowngradeError, match="signed when this user last opened it"):
    Registry.open(registry_copy, TrustPolicy(state_file=state))
  reg = Registry.open(registry_copy, TrustPolicy(state_file=state, allow_unsigned=True))
  assert not reg.signed


def test_unsigned_registry_with_required_signatures_is_refused(deep, tmp_path):
  root = deep[3]
  with pytest.raises(SignatureError, match="index.json: the index is not signed, but signatures are required"):
    Registry.open(root, TrustPolicy(require_signatures=True))
  assert not Registry.open(root).signed  # never signed: readable by default


def test_malformed_manifest_sig_is_a_counted_signature_failure(registry_copy):
  reg = Registry.open(registry_copy)
  vdir = reg.version_dir("embed", reg.current["embed"])
  (vdir / "manifest.sig").write_bytes(b"{not a signature")
  with pytest.raises(SignatureError, match=f"{vdir / 'manifest.sig'} is not a signature record"):
    reg.restore("embed")
  s = reg.stats()
  assert s.signature_failures == 1 and s.integrity_failures == 0 and s.failures[0]["file"] == "manifest.sig"


def test_index_versions_cannot_escape_their_directory(registry_copy, keypair):
  """Even under a valid signature (a key holder's bad index), version strings are checked."""
  for bad in ("../../../../tmp", "abc/def", "0123456789ABCDEF", "0123"):
    body, _ = read_index(registry_copy)
    body["current"]["head"]["version"] = bad
    body["history"]["head"].append(bad)
    good = _index_bytes(registry_copy)
    write_index(registry_copy, body, keypair[0])
    with pytest.raises(IntegrityError, match=r"index.json: current version of 'head' is .*16 lowercase hex"):
      Registry.open(registry_copy)
    (registry_copy / "index.json").write_bytes(good)
  body, _ = read_index(registry_copy)
  body["codec"]["dir"] = "../elsewhere"
  write_index(registry_copy, body, keypair[0])
  with pytest.raises(IntegrityError, match="codec entry"):
    Registry.open(registry_copy)


def test_planted_version_directory_signed_by_another_key_is_refused(registry_copy, keypair, tmp_path):
  other_key, _ = signing.keygen(tmp_path / "keys" / "mallory")
  update = _bumped(Registry.open(registry_copy), 1)
  version = update.versioned_hash()[:16]
  # Mallory publishes the same content, with her key and a flattering profile, in her own copy...
  fork = tmp_path / "fork"
  shutil.copytree(registry_copy, fork)
  Registry.open(fork).publish([update], sign_key=other_key, settings=None)
  planted = registry_copy / "thoughtlets" / dir_name(NAME) / version
  # ...and plants the version directory where the next publish would find it.
  shutil.copytree(fork / "thoughtlets" / dir_name(NAME) / version, planted)
  reg = Registry.open(registry_copy)
  before = _index_bytes(registry_copy)
  with pytest.raises(
    ReusedVersionError,
    match=rf"{planted}: a version directory that no published index names"
    r".*not this publish's.*registry gc",
  ):
    reg.publish([update], sign_key=keypair[0], settings=None)
  assert reg.stats().writer_refusals == 1 and _index_bytes(registry_copy) == before
  # gc removes the unreferenced directory; the publish then stages its own, signed by its key.
  reg.close()
  assert collect_garbage(registry_copy).removed == [planted]
  reg = Registry.open(registry_copy)
  assert reg.publish([update], sign_key=keypair[0], settings=None)[NAME] == version
  assert reg.manifest(NAME).signed_by == signing.key_id(signing.load_private_key(keypair[0]).public_key())


def test_build_into_an_edited_registry_is_refused(registry_copy, keypair, tiny, tiny_mapping):
  from thoughtjax.registry import build

  _, model, codec = tiny
  body, sig = read_index(registry_copy)
  body["order"].reverse()  # any change under the old signature
  (registry_copy / "index.json").write_text(json.dumps({"index": body, "signature": sig}))
  edited = _index_bytes(registry_copy)
  with pytest.raises(UntrustedIndexError, match="refusing to publish on top of"):
    build(registry_copy, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=None)
  assert _index_bytes(registry_copy) == edited


def test_trust_takes_key_objects_and_names_an_unusable_state_file(built, keypair, tmp_path):
  key = signing.load_public_key(keypair[1])
  assert Registry.open(built, TrustPolicy(public_keys=(key,), state_file=tmp_path / "s.json")).signed
  (tmp_path / "file").write_text("")
  with pytest.raises(
    RegistryError, match=r"trust state .*file/s.json: cannot be read or written .*THOUGHTJAX_TRUST_STATE"
  ):
    Registry.open(built, TrustPolicy(state_file=tmp_path / "file" / "s.json"))


def test_a_corrupt_state_file_is_named(built, tmp_path):
  state = tmp_path / "s.json"
  state.write_text("{truncated")
  with pytest.raises(RegistryError, match=rf"trust state {state} is not valid JSON.*Delete it to start over"):
    Registry.open(built, TrustPolicy(state_file=state))


def test_signing_an_unsigned_registry_binds_its_older_manifests(deep, keypair, tmp_path):
  root = tmp_path / "reg"
  shutil.copytree(deep[3], root)
  reg = Registry.open(root)
  assert not reg.signed
  reg.publish([_bumped(reg, 1, "head")], sign_key=keypair[0], settings=None)
  assert reg.signed and reg.sequence == 2
  trusted = Registry.open(root, TrustPolicy(public_keys=(keypair[1],)))
  old = trusted.manifest("embed")  # published unsigned, bound by its digest in the signed index
  assert old.signed_by is None and trusted.manifest("head").signed_by
  path = trusted.version_dir("embed", old.version) / "manifest.json"
  path.write_text(path.read_text().replace('"parent"', '"parent" ', 1))  # a changed byte
  with pytest.raises(IntegrityError, match=f"{path}: sha256 .* does not match the .* that the index records"):
    trusted.manifest("embed")


def test_an_index_re_signed_by_a_foreign_key_is_refused_given_public_keys(
  registry_copy, keypair, tmp_path, tiny, tiny_mapping
):
  """Someone who can write the directory re-signs an edited index with their own key and records it."""
  mallory, mallory_pub = signing.keygen(tmp_path / "mallory")
  mallory_id = signing.key_id(signing.load_public_key(mallory_pub))
  body, _ = read_index(registry_copy)
  body["order"].reverse()
  body["signing_keys"].append(mallory_id)
  shutil.copy(mallory_pub, registry_copy / "keys" / f"{mallory_id}.pub")
  write_index(registry_copy, body, mallory)
  trusted = TrustPolicy(public_keys=(keypair[1],))
  with pytest.raises(SignatureError, match=f"signed by key {mallory_id}, which is not among the trusted keys"):
    Registry.open(registry_copy, trusted)
  assert Registry.open(registry_copy).signed  # default trust: integrity, not authenticity (README, Known limits)
  from thoughtjax.registry import build

  _, model, codec = tiny  # a writer that names its team's keys does not build on it
  with pytest.raises(UntrustedIndexError, match="not among the trusted keys"):
    build(registry_copy, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=None, trust=trusted)

"""Trust under attack: another registry signed by the same key swapped in, a re-pointed link, a revoked key
used again, a writer killed while it writes the trust state, a key file planted as a link.

Each test performs the attack and asserts the named refusal (and, where files are written, that nothing
outside was touched).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from tests.registry.helpers import REPO, read_index, write_index
from thoughtjax import cli, signing
from thoughtjax.registry import (
  Registry,
  RegistrySwapError,
  RevokedKeyError,
  RollbackError,
  TrustPolicy,
  accept,
  build,
)
from thoughtjax.registry import trust as trust_mod
from thoughtjax.registry.trust import STATE_FORMAT, RollbackState

NAME = "blocks[5:6)"


def _bumped(reg, k: float, name: str = NAME):
  base = reg.thoughtlet(name)
  return base.with_params(jax.tree.map(lambda x: x * (1.0 + 0.01 * k), dict(base.params)))


def _key_id(pub) -> str:
  return signing.key_id(signing.load_public_key(pub))


@pytest.fixture
def state(tmp_path):
  return TrustPolicy(state_file=tmp_path / "state.json")


# ---- 2. another registry signed by the same key ----------------------------------------------------------------


def test_another_registry_signed_by_the_same_key_is_refused_as_a_swap(
  registry_copy, keypair, tiny, tiny_mapping, tmp_path, state, monkeypatch
):
  _, model, codec = tiny
  with Registry.open(registry_copy, state) as reg:  # this user reads registry A here
    a_id, a_seq = reg.registry_id, reg.sequence
    live = Registry.open(registry_copy, state)  # a live reader (a server) keeps it open
  # Registry B: same model, same key, another build, and a higher sequence than A.
  other = tmp_path / "other"
  b = build(other, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=None, trust=state)
  b.publish([_bumped(b, 1)], sign_key=keypair[0], settings=None)
  b.publish([_bumped(b, 2)], sign_key=keypair[0], settings=None)
  assert b.registry_id != a_id and b.sequence > a_seq
  b.close()
  index_before = (other / "index.json").read_bytes()
  shutil.rmtree(registry_copy)
  shutil.copytree(other, registry_copy)  # B copied over A

  msg = rf"this user last read registry {a_id} .* now presents registry {b.registry_id} .* registry accept"
  with pytest.raises(RegistrySwapError, match=msg):
    Registry.open(registry_copy, state)
  with pytest.raises(RegistrySwapError):  # what ReloadRegistry does: a fresh open under the serving policy
    Registry.open(registry_copy, live.trust)
  with pytest.raises(RegistrySwapError):  # an open reader refreshing keeps A
    live.refresh()
  assert live.registry_id == a_id and live.stats().rollback_refusals == 1
  assert issubclass(RegistrySwapError, RollbackError)
  with pytest.raises(RegistrySwapError):  # a writer does not build on it either
    build(registry_copy, tiny_mapping, model, codec=codec, sign_key=keypair[0], settings=None, trust=state)
  live.close()
  assert (other / "index.json").read_bytes() == index_before

  # The deliberate way: accept it (CLI), then it opens; an older index of B is still a rollback.
  monkeypatch.setenv("THOUGHTJAX_TRUST_STATE", str(state.state_file))
  assert cli.main(["registry", "accept", str(registry_copy)]) == 0
  with Registry.open(registry_copy, state) as reg:
    assert reg.registry_id == b.registry_id and reg.sequence == b.sequence
  doc = json.loads(state.state_path().read_text())
  assert doc["format"] == STATE_FORMAT
  assert doc["registries"][os.path.realpath(registry_copy)]["registry_id"] == b.registry_id


def test_a_link_re_pointed_at_an_older_copy_is_a_rollback(registry_copy, keypair, tmp_path, state):
  old_copy = tmp_path / "old-copy"
  shutil.copytree(registry_copy, old_copy)  # sequence 1
  with Registry.open(registry_copy, state) as reg:
    reg.publish([_bumped(reg, 1)], sign_key=keypair[0], settings=None)  # sequence 2
  link = tmp_path / "served"
  link.symlink_to(registry_copy)
  Registry.open(link, state).close()  # read through the link: both locations recorded
  link.unlink()
  link.symlink_to(old_copy)  # re-pointed at the older copy of the same registry
  with pytest.raises(RollbackError, match="index sequence 1 is lower than 2"):
    Registry.open(link, state)


def test_a_new_build_at_a_path_replaces_what_was_seen_there(registry_copy, tiny, tiny_mapping, state):
  """A writer building a new registry (no index before) is the deliberate rebuild: no accept needed."""
  _, model, codec = tiny
  with Registry.open(registry_copy, state) as reg:
    a_id = reg.registry_id
  shutil.rmtree(registry_copy)
  with build(registry_copy, tiny_mapping, model, codec=codec, settings=None, trust=state) as reg:
    assert reg.registry_id != a_id
  with Registry.open(registry_copy, state) as reg:
    assert reg.registry_id != a_id


# ---- 6. revocation -----------------------------------------------------------------------------------------


def test_a_revoked_key_is_refused_and_rotation_keeps_the_registry_readable(registry_copy, keypair, tmp_path, state):
  old_key, old_pub = keypair
  new_key, new_pub = signing.keygen(tmp_path / "keys" / "team.v2")
  old_id, new_id = _key_id(old_pub), _key_id(new_pub)
  reg = Registry.open(registry_copy, state)
  reg.publish([_bumped(reg, 1)], sign_key=new_key, settings=None)  # rotation: the new key signs from now on
  assert sorted(reg.signing_keys) == sorted([old_id, new_id])
  before = reg.sequence
  reg.publish([], sign_key=new_key, settings=None, revoke_keys=[old_id])  # then the old key is revoked
  assert reg.signing_keys == [new_id] and reg.sequence == before + 1
  body, _ = read_index(registry_copy)
  assert body["revoked_keys"] == [old_id]
  # Manifests the old key signed stay readable: the index, signed by the new key, binds their digests.
  Registry.open(registry_copy, state).verify(deep=False)
  both = TrustPolicy(public_keys=(old_pub, new_pub), state_file=state.state_file)
  Registry.open(registry_copy, both).verify(deep=False)

  # The old key leaks: an index signed by it (listing it again, dropping the revocation, a higher sequence).
  good = (registry_copy / "index.json").read_bytes()
  body["signing_keys"] = [old_id, new_id]
  body.pop("revoked_keys")
  body["sequence"] += 5
  write_index(registry_copy, body, old_key)
  for trust in (state, both):
    with pytest.raises(RevokedKeyError, match=rf"signed by key {old_id}, which was revoked for the registry"):
      Registry.open(registry_copy, trust)
  (registry_copy / "index.json").write_bytes(good)

  # A manifest signed only by the revoked key, which the index does not bind by digest, is refused too.
  body, _ = read_index(registry_copy)
  embed = f"embed@{reg.current['embed']}"
  del body["manifest_sha256"][embed]
  body["sequence"] += 1
  write_index(registry_copy, body, new_key)
  with pytest.raises(RevokedKeyError, match=rf"{embed} manifest.json .* signed only by key {old_id}"):
    Registry.open(registry_copy, state).manifest("embed")
  (registry_copy / "index.json").write_bytes(good)

  # A writer does not sign with the revoked key.
  with pytest.raises(RevokedKeyError, match=f"key {old_id} was revoked"):
    Registry.open(registry_copy, TrustPolicy(state_file=tmp_path / "fresh.json")).publish(
      [_bumped(reg, 2)], sign_key=old_key, settings=None
    )
  assert (registry_copy / "index.json").read_bytes() == good


def test_revoke_key_command(registry_copy, keypair, tmp_path, capsys):
  new_key, new_pub = signing.keygen(tmp_path / "k2")
  old_id = _key_id(keypair[1])
  with pytest.raises(Exception, match="needs a signing key that is not revoked"):  # cannot revoke its own key
    Registry.open(registry_copy).publish([], sign_key=keypair[0], settings=None, revoke_keys=[old_id])
  capsys.readouterr()
  assert cli.main(["registry", "revoke-key", str(registry_copy), old_id, "--sign-key", str(new_key)]) == 0
  assert f"revoked keys {old_id}" in capsys.readouterr().out
  assert Registry.open(registry_copy).signing_keys == [_key_id(new_pub)]


# ---- 9. the trust-state file and keygen are written durably, never through a link --------------------------

KILLER = """
import os, signal, sys
from thoughtjax.registry import trust
path, point = sys.argv[1], sys.argv[2]
def hook(event):
  if event == point:
    print("killed at", event, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
trust._step = hook
trust.RollbackState(path).record(["/somewhere/registry"], 5, True, registry_id="b" * 32)
print("finished", flush=True)
"""


@pytest.mark.parametrize("point", ["state:tmp-written", "state:renamed"])
def test_kill_during_a_trust_state_write_leaves_the_old_or_the_new_state(tmp_path, point):
  path = tmp_path / "state.json"
  RollbackState(path).record(["/somewhere/registry"], 3, True, registry_id="b" * 32)
  proc = subprocess.run(
    [sys.executable, "-c", KILLER, str(path), point],
    capture_output=True,
    text=True,
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": str(REPO)},
    timeout=300,
  )
  assert proc.returncode == -9 and f"killed at {point}" in proc.stdout, (proc.stdout, proc.stderr)
  entry = RollbackState(path).get("/somewhere/registry")  # whole, valid JSON either way
  assert entry["sequence"] == (3 if point == "state:tmp-written" else 5)
  # The next writer is not blocked by what the dead one left behind.
  assert RollbackState(path).record(["/somewhere/registry"], 7, True, registry_id="b" * 32)["sequence"] == 7
  assert RollbackState(path).get("/somewhere/registry")["sequence"] == 7


def test_the_trust_state_is_fsynced_before_and_after_its_rename(tmp_path, monkeypatch):
  events = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(
    os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1]
  )
  monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), real_replace(a, b))[1])
  path = tmp_path / "state.json"
  RollbackState(path).record(["/r"], 1, False, registry_id="x")
  (rename,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(path)]
  tmp = events[rename][1]
  assert ("fsync", tmp) in events[:rename]
  assert ("fsync", str(tmp_path)) in events[rename:]


def test_a_trust_state_planted_as_a_link_is_refused(tmp_path, sentinel_file):
  path = tmp_path / "state.json"
  path.symlink_to(sentinel_file)
  with pytest.raises(Exception, match="is a symbolic link"):
    RollbackState(path).record(["/r"], 1, False, registry_id="x")
  assert sentinel_file.read_bytes() == b"keep me"


@pytest.fixture
def sentinel_file(tmp_path):
  p = tmp_path / "outside" / "sentinel"
  p.parent.mkdir()
  p.write_bytes(b"keep me")
  return p


def test_keygen_force_replaces_a_link_and_a_wide_file_with_a_0600_key(tmp_path, sentinel_file, monkeypatch):
  base = tmp_path / "keys" / "team"
  base.parent.mkdir()
  priv, pub = base.with_name("team.key"), base.with_name("team.pub")
  priv.symlink_to(sentinel_file)  # planted: --force used to write the private key through it
  mtime = sentinel_file.stat().st_mtime_ns
  with pytest.raises(FileExistsError):  # a link (even a dangling one) counts as existing
    signing.keygen(base)
  assert cli.main(["registry", "keygen", str(base), "--force"]) == 0
  assert sentinel_file.read_bytes() == b"keep me" and sentinel_file.stat().st_mtime_ns == mtime
  assert not priv.is_symlink() and (priv.stat().st_mode & 0o777) == 0o600
  signing.load_private_key(priv)
  # An existing world-readable key file: replaced by a 0600 one, durably (file, then directory, fsynced).
  os.chmod(priv, 0o644)
  synced = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
  signing.keygen(base, overwrite=True)
  assert (priv.stat().st_mode & 0o777) == 0o600 and (pub.stat().st_mode & 0o777) == 0o644
  assert str(base.parent) in synced and any(".team.key." in s for s in synced)


def test_accept_verifies_before_it_records(registry_copy, keypair, state):
  """accept is not a way around the signature checks: an edited index is refused and nothing is recorded."""
  body, sig = read_index(registry_copy)
  body["order"].reverse()
  (registry_copy / "index.json").write_text(json.dumps({"index": body, "signature": sig}))
  with pytest.raises(signing.SignatureError, match="does not verify"):
    accept(registry_copy, state)
  assert not state.state_path().exists() or json.loads(state.state_path().read_text())["registries"] == {}


def test_state_file_of_format_1_is_read(tmp_path, registry_copy, keypair, state):
  with Registry.open(registry_copy, state) as reg:
    rid, seq = reg.registry_id, reg.sequence
  path = state.state_path()
  old = {
    "format": "thoughtjax.trust-state/1",
    "registries": {f"{rid}:{registry_copy.absolute()}": {"sequence": seq + 3, "signed": True, "seen": 1.0}},
  }
  path.write_text(json.dumps(old))
  with pytest.raises(RollbackError, match=f"lower than {seq + 3}"):
    Registry.open(registry_copy, state)
  assert trust_mod.STATE_FORMAT_V1 == old["format"]

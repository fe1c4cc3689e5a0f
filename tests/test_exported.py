"""Serialized programs (:mod:`thoughtjax.exported`): stored once, loaded instead of traced, refused when damaged."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from tests.tiny import tiny_engine
from thoughtjax import cachedir, exported
from thoughtjax.decode import program
from thoughtjax.errors import UserError


class State(NamedTuple):
  acc: jax.Array  # [4] f32
  step: jax.Array  # i32


def _step(params, x, state):
  y = jnp.dot(x, params["w"], precision=jax.lax.Precision.HIGHEST) + params["b"]
  return State(state.acc + y, state.step + 1)


def _args(n: int = 3):
  params = {"w": jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4) / 7, "b": jnp.ones(4)}
  return params, jnp.arange(n, dtype=jnp.float32), State(jnp.zeros(4), jnp.zeros((), jnp.int32))


def _wrapped(tmp_path, fn=_step, key="step"):
  """A new wrapper over a new jit: as a fresh process would build it."""
  return exported.wrap(jax.jit(fn, donate_argnums=(2,)), key=key, donate_argnums=(2,), out_like=2, directory=tmp_path)


@pytest.fixture(autouse=True)
def _stats(tmp_path, monkeypatch):
  # This test's own cache directory: its secret keys the artifacts' HMAC.
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  exported.EXPORT_STATS.clear()
  yield
  exported.EXPORT_STATS.clear()


def _files(tmp_path):
  return sorted(tmp_path.glob(f"*{exported.SUFFIX}"))


def test_first_call_stores_the_program_and_a_later_wrapper_loads_it(tmp_path):
  want = jax.jit(_step)(*_args())
  out = _wrapped(tmp_path)(*_args())
  assert exported.EXPORT_STATS == {"exported": 1}
  assert len(_files(tmp_path)) == 1
  assert isinstance(out, State)
  np.testing.assert_array_equal(out.acc, want.acc)
  again = _wrapped(tmp_path)(*_args())
  assert exported.EXPORT_STATS == {"exported": 1, "loaded": 1}
  np.testing.assert_array_equal(again.acc, want.acc)
  assert int(again.step) == 1


def test_other_shapes_other_code_other_key_are_other_artifacts(tmp_path, monkeypatch):
  _wrapped(tmp_path)(*_args(3))
  _wrapped(tmp_path)(*_args(5))  # another argument signature
  _wrapped(tmp_path, key="another program")(*_args(3))
  monkeypatch.setattr(exported, "_source_hash", "f" * 64)  # the sources changed
  _wrapped(tmp_path)(*_args(3))
  assert exported.EXPORT_STATS == {"exported": 4}
  assert len(_files(tmp_path)) == 4


def test_the_same_weights_passed_again_are_not_signed_again_but_changed_ones_are(tmp_path, monkeypatch):
  """Weights passed call after call as the same arrays reuse their signature; a leaf swapped for another array
  (same shape or not) is signed again, so a new shape gets its own program and the values are the new ones."""
  f = _wrapped(tmp_path)
  params, x, state = _args()
  signed = []
  real = exported._leaf_sig
  monkeypatch.setattr(exported, "_leaf_sig", lambda leaf: signed.append(leaf) or real(leaf))
  state = f(params, x, state)
  first = len(signed)
  state = f(params, x, state)
  assert len(signed) - first == len(jax.tree.leaves(state))  # weights and input: the same arrays, not signed again
  params["b"] = jnp.full(4, 10.0)
  before = np.asarray(state.acc)
  state = f(params, x, state)
  want = before + np.asarray(jnp.dot(x, params["w"], precision=jax.lax.Precision.HIGHEST)) + 10.0
  np.testing.assert_allclose(np.asarray(state.acc), want, rtol=1e-6)
  wide = {"w": jnp.ones((3, 5)), "b": jnp.ones(5)}  # another shape: another program, not a stale one
  out = f(wide, x, State(jnp.zeros(5), jnp.zeros((), jnp.int32)))
  np.testing.assert_allclose(np.asarray(out.acc), np.full(5, 4.0))


def test_donated_state_is_donated(tmp_path):
  params, x, state = _args()
  _wrapped(tmp_path)(params, x, state)
  params, x, state = _args()
  _wrapped(tmp_path)(params, x, state)  # loaded
  assert exported.EXPORT_STATS["loaded"] == 1
  assert state.acc.is_deleted()
  assert not params["w"].is_deleted()


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "bad_magic", "other_key", "bad_header"])
def test_a_damaged_artifact_is_refused_loudly_counted_and_rebuilt(tmp_path, capfd, damage):
  _wrapped(tmp_path)(*_args())
  (path,) = _files(tmp_path)
  data = bytearray(path.read_bytes())
  if damage == "flip_payload":
    data[-100] ^= 0x40
  elif damage == "truncate":
    data = data[: len(data) - 1000]
  elif damage == "bad_magic":
    data[:5] = b"XXXXX"
  elif damage == "bad_header":
    at = len(exported.MAGIC)
    data[at : at + 2] = b"{{"
  else:  # a whole, valid artifact of another program under this program's name
    other = tmp_path / "other"
    _wrapped(other, key="another program")(*_args())
    data = bytearray(_files(other)[0].read_bytes())
  path.write_bytes(bytes(data))
  capfd.readouterr()
  out = _wrapped(tmp_path)(*_args())
  err = capfd.readouterr().err
  assert exported.EXPORT_STATS["refused"] == 1
  assert f"exported program {path} refused" in err
  expected = {
    "flip_payload": "HMAC does not match",
    "truncate": "truncated",
    "bad_magic": "expected it to start with",
    "bad_header": "header is unreadable",
    "other_key": "holds another program (key fields differ: key)",
  }[damage]
  assert expected in err
  np.testing.assert_array_equal(out.acc, jax.jit(_step)(*_args()).acc)
  # Rebuilt: the file now checks out and is loaded by the next wrapper.
  _wrapped(tmp_path)(*_args())
  assert exported.EXPORT_STATS["loaded"] == 1 and exported.EXPORT_STATS["refused"] == 1


def test_a_program_with_a_host_callback_runs_as_plain_jit(tmp_path, capfd):
  def with_callback(params, x, state):
    seen = io_callback(lambda v: np.asarray(v), jax.ShapeDtypeStruct((), jnp.int32), state.step, ordered=True)
    return State(state.acc + x.sum(), seen + 1)

  out = _wrapped(tmp_path, with_callback)(*_args())
  assert exported.EXPORT_STATS == {"unexportable": 1}
  assert "cannot be exported" in capfd.readouterr().err
  assert int(out.step) == 1 and not _files(tmp_path)


def test_turned_off_returns_the_jitted_function(monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", "off")
  jitted = jax.jit(_step)
  assert exported.wrap(jitted, key="k") is jitted


def test_wrapper_keeps_the_jitted_functions_attributes(tmp_path):
  wrapped = _wrapped(tmp_path)
  lowered = wrapped.trace(*_args()).lower()
  assert "dot" in lowered.as_text()


def test_a_tiny_models_program_from_its_artifact_gives_the_same_tokens(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", "off")
  monkeypatch.setattr(program, "PROGRAMS", program.ProgramCache())
  plain = tiny_engine("llama_gqa", seed=3).generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True).token_ids
  assert not exported.EXPORT_STATS

  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", str(tmp_path))
  for expect in ("exported", "loaded"):
    monkeypatch.setattr(program, "PROGRAMS", program.ProgramCache())  # a new process's empty program cache
    got = tiny_engine("llama_gqa", seed=3).generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True).token_ids
    assert got == plain
    assert exported.EXPORT_STATS[expect] == 1


@pytest.mark.parametrize("draft", ["ngram:3", "embed, blocks[0:1), head"])
def test_a_speculative_program_from_its_artifact_gives_the_same_tokens(tmp_path, monkeypatch, draft):
  """A drafted request's program is exported too: a later process loads draft and verify instead of tracing them."""
  from thoughtjax.decode.speculative import Draft

  def tokens():
    engine = tiny_engine("llama_gqa", seed=3)
    g = engine.generate([5, 6, 7, 8, 5, 6, 7], max_tokens=12, ignore_eos=True, draft=Draft(draft), draft_tokens=3)
    assert g.trace.verify_passes > 0
    return g.token_ids

  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", "off")
  monkeypatch.setattr(program, "PROGRAMS", program.ProgramCache())
  plain = tokens()
  assert not exported.EXPORT_STATS

  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", str(tmp_path))
  for expect in ("exported", "loaded"):
    monkeypatch.setattr(program, "PROGRAMS", program.ProgramCache())  # a new process's empty program cache
    assert tokens() == plain
    assert exported.EXPORT_STATS[expect] >= 1


# ---- attacks on the cache: planted, forged, linked artifacts and directories others may write ------------------


def _evil(params, x, state):
  """What an attacker would rather have run: the same signature, other numbers."""
  return State(state.acc + 1000.0, state.step + 7)


def _sentinel(tmp_path):
  """A file outside the cache whose bytes and mtime must survive every attack."""
  path = tmp_path / "outside" / "sentinel.bin"
  path.parent.mkdir(mode=0o700)
  path.write_bytes(b"keep me")
  return path, path.stat().st_mtime_ns


def _untouched(sentinel):
  path, mtime = sentinel
  assert path.read_bytes() == b"keep me" and path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("forge", ["another_users_secret", "plain_sha256"])
def test_a_planted_program_is_refused_and_the_real_one_runs(tmp_path, monkeypatch, capfd, forge):
  victim = tmp_path / "victim"
  _wrapped(victim)(*_args())  # the victim's own artifact: its name and key are what the attacker targets
  (path,) = _files(victim)
  # The attacker exports their program under the same key and argument signature (so the same file name and
  # header key) with their own cache secret, then writes it over the victim's artifact.
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "attacker-cache"))
  attacker = tmp_path / "attacker"
  _wrapped(attacker, fn=_evil)(*_args())
  (planted,) = _files(attacker)
  assert planted.name == path.name
  data = planted.read_bytes()
  if forge == "plain_sha256":  # the best a writer without the secret can do: a hash anyone can compute
    end = data.index(b"\n", len(exported.MAGIC))
    header = json.loads(data[len(exported.MAGIC) : end])
    payload = data[end + 1 :]
    header["hmac_sha256"] = hashlib.sha256(payload).hexdigest()
    data = exported.MAGIC + json.dumps(header).encode() + b"\n" + payload
  path.write_bytes(data)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))  # the victim again
  exported.EXPORT_STATS.clear()
  capfd.readouterr()
  out = _wrapped(victim)(*_args())
  err = capfd.readouterr().err
  assert exported.EXPORT_STATS == {"refused": 1, "exported": 1}
  assert f"exported program {path} refused" in err and "HMAC does not match" in err
  want = jax.jit(_step)(*_args())
  np.testing.assert_array_equal(out.acc, want.acc)  # the victim's program ran, not the planted one
  assert int(out.step) == 1
  assert path.read_bytes() != data  # replaced by the victim's own artifact, which now loads
  np.testing.assert_array_equal(_wrapped(victim)(*_args()).acc, want.acc)
  assert exported.EXPORT_STATS["loaded"] == 1


@pytest.mark.parametrize("target", ["file_outside", "fifo"])
def test_a_link_or_fifo_planted_as_an_artifact_is_not_followed(tmp_path, capfd, target):
  sentinel = _sentinel(tmp_path)
  directory = tmp_path / "exported"
  _wrapped(directory)(*_args())
  (path,) = _files(directory)
  path.unlink()
  if target == "fifo":
    os.mkfifo(path)  # reading it would block for ever
  else:
    path.symlink_to(sentinel[0])
  exported.EXPORT_STATS.clear()
  capfd.readouterr()
  out = _wrapped(directory)(*_args())
  err = capfd.readouterr().err
  assert exported.EXPORT_STATS == {"refused": 1, "exported": 1}
  assert "not a regular file" in err if target == "fifo" else "unreadable as a plain file" in err
  np.testing.assert_array_equal(out.acc, jax.jit(_step)(*_args()).acc)
  assert path.is_file() and not path.is_symlink()  # the link itself was replaced, not its target
  _untouched(sentinel)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_an_export_directory_others_may_write_is_refused_before_anything_is_read(tmp_path, mode):
  directory = tmp_path / "shared"
  _wrapped(directory)(*_args())  # a valid artifact: refused all the same, the directory is not trustworthy
  (path,) = _files(directory)
  before = path.read_bytes(), path.stat().st_mtime_ns
  os.chmod(directory, mode)
  exported.EXPORT_STATS.clear()
  with pytest.raises(cachedir.UnsafeCacheError, match=r"is writable by .*chmod 700") as err:
    _wrapped(directory)(*_args())
  assert isinstance(err.value, UserError) and str(directory) in str(err.value)
  assert not exported.EXPORT_STATS  # neither loaded nor exported
  assert (path.read_bytes(), path.stat().st_mtime_ns) == before and _files(directory) == [path]


def test_an_export_directory_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
  directory = tmp_path / "theirs"
  directory.mkdir(mode=0o700)
  monkeypatch.setattr(os, "getuid", lambda: directory.stat().st_uid + 1)  # as another user sees it
  with pytest.raises(cachedir.UnsafeCacheError, match=r"is owned by uid \d+, not by you"):
    _wrapped(directory)(*_args())
  assert not exported.EXPORT_STATS and not list(directory.iterdir())


def test_a_new_export_directory_is_made_private(tmp_path):
  old = os.umask(0)  # even a permissive umask: the mode is set explicitly
  try:
    _wrapped(tmp_path / "new" / "exported")(*_args())
  finally:
    os.umask(old)
  for d in (tmp_path / "new", tmp_path / "new" / "exported", tmp_path / "cache"):
    assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
  secret = tmp_path / "cache" / cachedir.SECRET_NAME
  assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and secret.stat().st_size == cachedir.SECRET_BYTES


def test_an_artifact_is_synced_before_and_after_its_rename(tmp_path, monkeypatch):
  events: list = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(
    os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1]
  )
  monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), real_replace(a, b))[1])
  directory = tmp_path / "exported"
  _wrapped(directory)(*_args())
  (path,) = _files(directory)
  (r,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(path)]
  assert ("fsync", events[r][1]) in events[:r]  # the data, under its temporary name
  assert ("fsync", str(directory)) in events[r:]  # the rename


def test_arguments_on_the_same_buffers_with_another_tree_get_their_own_program(tmp_path):
  """int8 and int8a8 weights share their arrays; the wrapper's same-arguments shortcut must not hand the
  int8a8 call the int8 program (jaxlib's PyTreeDef == does not compare a dataclass node's class)."""
  from thoughtjax import quantized

  q = jnp.ones((2, 2), jnp.int8)
  w = quantized.RowInt8(q, jnp.ones(2))
  a8 = quantized.int8_activations(w)
  fn = exported.wrap(
    jax.jit(lambda t: t.q.sum() * (2 if isinstance(t, quantized.RowInt8A8) else 1)), key="kinds", directory=tmp_path
  )
  assert [int(fn(x)) for x in (w, a8, w, a8)] == [4, 8, 4, 8]

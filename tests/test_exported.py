"""Serialized programs (:mod:`thoughtjax.exported`): stored once, loaded instead of traced, refused when damaged."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from tests.tiny import tiny_engine
from thoughtjax import exported, program


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
def _stats():
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
    "flip_payload": "differs from the recorded",
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

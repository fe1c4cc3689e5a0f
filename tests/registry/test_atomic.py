"""Atomic publishing: a writer killed at any step leaves the previous version complete and usable;
readers during a publish see the old or the new versions, never a mix."""

from __future__ import annotations

import subprocess
import sys
import threading

import jax
import numpy as np

from tests.registry.helpers import REPO
from thoughtjax.assembly import full_path
from thoughtjax.compose import compose
from thoughtjax.registry import Registry, TrustPolicy

IDS = [7, 70, 71, 72, 32, 73]
UPDATED = ("blocks[0:2)", "head")

# The writer: derive new versions of two thoughtlets and publish them in one update,
# SIGKILLing itself when the publish reaches the given step for the given time.
WRITER = f"""
import os, signal, sys
import jax
from thoughtjax.registry import Registry
root, point, nth, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
reg = Registry.open(root)
updates = [reg.thoughtlet(n) for n in {UPDATED!r}]
updates = [t.with_params(jax.tree.map(lambda x: x * 1.25, dict(t.params))) for t in updates]
seen = []
def hook(event, name):
  seen.append(event)
  if event == point and seen.count(event) == nth:
    print("killed at", event, name, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
reg.publish(updates, sign_key=key, on_step=hook, settings=None)
print("finished", flush=True)
"""

# (step, occurrence): every stage of an update, from staging to after the index switch.
KILL_POINTS = [
  ("stage:start", 2),
  ("stage:checkpoint", 1),
  ("stage:manifest", 2),
  ("verify", 1),
  ("commit:version", 1),
  ("commit:index-written", 1),
  ("commit:index", 1),
]


def _updates(reg, base=None):
  """The writer's update, derived from ``base`` versions (default: current)."""
  ts = [reg.thoughtlet(n, None if base is None else base[n]) for n in UPDATED]
  return [t.with_params(jax.tree.map(lambda x: x * 1.25, dict(t.params))) for t in ts]


def _logits(root, keypair):
  reg = Registry.open(root, TrustPolicy(public_keys=(keypair[1],)))
  return reg.current, compose(full_path(reg), reg).logits(IDS)


def test_kill_during_update_keeps_previous_version(built, keypair, tmp_path):
  import shutil

  old_current, old_logits = _logits(built, keypair)
  new_versions = {t.name: t.versioned_hash()[:16] for t in _updates(Registry.open(built))}
  roots, procs = {}, {}
  for point, nth in KILL_POINTS:  # all writers at once: they work on separate copies
    root = tmp_path / f"{point.replace(':', '_')}-{nth}"
    shutil.copytree(built, root)
    roots[point] = root
    procs[point] = subprocess.Popen(
      [sys.executable, "-c", WRITER, str(root), point, str(nth), str(keypair[0])],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=REPO,
      env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
  for point, _nth in KILL_POINTS:
    out, err = procs[point].communicate(timeout=300)
    assert procs[point].returncode == -9 and f"killed at {point}" in out, (point, out, err)
    root = roots[point]
    reg = Registry.open(root, TrustPolicy(public_keys=(keypair[1],)))
    reg.verify()  # every current version: digests, signatures, versioned hashes
    current, logits = _logits(root, keypair)
    if point == "commit:index":
      assert current == {**old_current, **new_versions}
      assert not np.allclose(logits, old_logits)
    else:
      assert current == old_current, point  # the previous version, complete and usable
      np.testing.assert_array_equal(logits, old_logits)
    # The next writer is not blocked by what the dead one left behind.
    versions = reg.publish(_updates(reg, old_current), sign_key=keypair[0], settings=None)
    assert versions == new_versions
    assert Registry.open(root, TrustPolicy(public_keys=(keypair[1],))).current == {**old_current, **new_versions}
    assert not (root / ".staging").exists()
    Registry.open(root, TrustPolicy(public_keys=(keypair[1],))).verify()


def test_readers_see_old_or_new_never_a_mix(registry_copy, keypair):
  old_current, old_logits = _logits(registry_copy, keypair)
  reg = Registry.open(registry_copy, TrustPolicy(public_keys=(keypair[1],)))
  updates = _updates(reg)
  new_current = {**old_current, **{t.name: t.versioned_hash()[:16] for t in updates}}
  seen_at_steps = []

  def reader_at(event, name):
    """A new reader at every step of the publish: one consistent generation, usable."""
    current, logits = _logits(registry_copy, keypair)
    assert current in (old_current, new_current), (event, current)
    seen_at_steps.append((event, current == new_current))
    if current == old_current:
      np.testing.assert_array_equal(logits, old_logits)

  # Readers in other threads, reading the index as fast as they can during the publish.
  stop = threading.Event()
  observed: list = []
  errors: list = []

  def reader_loop():
    try:
      while not stop.is_set():
        snapshot = Registry.open(registry_copy, TrustPolicy(public_keys=(keypair[1],))).current
        observed.append(snapshot == new_current)
        if snapshot not in (old_current, new_current):
          errors.append(snapshot)
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(e)

  threads = [threading.Thread(target=reader_loop) for _ in range(2)]
  for t in threads:
    t.start()
  try:
    reg.publish(updates, sign_key=keypair[0], on_step=reader_at, settings=None)
  finally:
    stop.set()
    for t in threads:
      t.join()
  assert not errors, errors[:3]
  assert observed
  events = [e for e, _ in seen_at_steps]
  assert events[-1] == "commit:index" and "commit:index-written" in events
  assert [new for _, new in seen_at_steps] == [False] * (len(events) - 1) + [True]

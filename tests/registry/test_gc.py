"""gc never removes a version an open reader holds (in this process or another), says what it skipped,
and is not blocked by readers that are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import jax
import pytest

from tests.registry.helpers import REPO
from thoughtjax.registry import Registry, collect_garbage, dir_name

NAME = "blocks[5:6)"

# A reader in another process: opens the registry, resolves an old version (as a pinned path would),
# says so, then keeps the registry open until its stdin closes (no sleeping on either side).
READER = f"""
import sys
from thoughtjax.registry import Registry
reg = Registry.open(sys.argv[1])
reg.resolve({NAME!r}, sys.argv[2])
print("holding", flush=True)
sys.stdin.read()
reg.close()
print("closed", flush=True)
"""


@pytest.fixture
def three_versions(registry_copy, keypair):
  """The registry with v0 (as built) and two newer versions of NAME; keep=1 would remove v0 and v1."""
  reg = Registry.open(registry_copy)
  v0 = reg.current[NAME]
  base = reg.thoughtlet(NAME)
  vs = [v0]
  for k in (1, 2):
    t = base.with_params(jax.tree.map(lambda x, k=k: x * (1.0 + 0.01 * k), dict(base.params)))
    vs.append(reg.publish([t], sign_key=keypair[0], settings=None)[NAME])
  reg.close()
  return registry_copy, vs


def _reader(root, version) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-c", READER, str(root), version],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": str(REPO)},
  )


def _vdir(root, v):
  return root / "thoughtlets" / dir_name(NAME) / v


def test_gc_skips_versions_an_open_reader_holds_in_process(three_versions):
  root, (v0, v1, v2) = three_versions
  with Registry.open(root) as reg:
    reg.resolve(NAME, v0)  # this reader may now restore v0
    report = collect_garbage(root, keep=1)
    assert report.removed == [_vdir(root, v1)]
    assert [p for p, _ in report.skipped] == [_vdir(root, v0)]
    assert "held by an open reader" in report.skipped[0][1] and str(os.getpid()) in report.skipped[0][1]
    assert _vdir(root, v0).exists()
    assert reg.restore(NAME, v0)  # still there for the reader that holds it
  report = collect_garbage(root, keep=1)  # closed: nothing holds it any more
  assert report.removed == [_vdir(root, v0)] and report.skipped == []
  assert _vdir(root, v2).exists()


def test_gc_skips_versions_a_reader_in_another_process_holds(three_versions):
  root, (v0, v1, v2) = three_versions
  with _reader(root, v0) as proc:
    assert proc.stdout.readline().strip() == "holding", proc.stderr.read()
    dry = collect_garbage(root, keep=1, dry_run=True)
    assert dry.removed == [_vdir(root, v1)] and _vdir(root, v1).exists()
    report = collect_garbage(root, keep=1)
    assert report.removed == [_vdir(root, v1)]
    assert [p for p, _ in report.skipped] == [_vdir(root, v0)] and f"pid {proc.pid}" in report.skipped[0][1]
    proc.stdin.close()
    assert proc.stdout.readline().strip() == "closed"
  assert collect_garbage(root, keep=1).removed == [_vdir(root, v0)]


def test_a_dead_reader_does_not_block_gc(three_versions):
  root, (v0, v1, v2) = three_versions
  with _reader(root, v0) as proc:
    assert proc.stdout.readline().strip() == "holding", proc.stderr.read()
    os.kill(proc.pid, signal.SIGKILL)  # its lease file stays behind, its lock dies with it
    proc.wait(timeout=60)
  assert list((root / ".readers").glob(f"{proc.pid}-*.lock"))
  report = collect_garbage(root, keep=1)
  assert sorted(report.removed) == sorted([_vdir(root, v0), _vdir(root, v1)]) and report.skipped == []
  assert not list((root / ".readers").glob(f"{proc.pid}-*"))  # the stale lease is cleaned up


def test_opening_a_directory_that_is_no_registry_leaves_it_as_it_was(tmp_path):
  from thoughtjax.registry import RegistryError

  with pytest.raises(RegistryError, match="is not a thoughtlet registry"):
    Registry.open(tmp_path)
  assert list(tmp_path.iterdir()) == []


def test_gc_command_says_what_it_removed_and_what_a_reader_kept(three_versions, capsys):
  from thoughtjax import cli

  root, (v0, v1, v2) = three_versions
  with Registry.open(root) as reg:
    reg.resolve(NAME, v0)
    capsys.readouterr()
    assert cli.main(["registry", "gc", str(root), "--keep", "1"]) == 0
  out = capsys.readouterr().out
  assert f"removed {_vdir(root, v1)}" in out
  assert f"kept {_vdir(root, v0)}: " in out
  assert "1 version directory removed, 1 kept because a reader holds them" in out
  assert _vdir(root, v0).is_dir() and not _vdir(root, v1).exists() and _vdir(root, v2).is_dir()

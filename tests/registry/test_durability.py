"""Durability: every checkpoint file and every new directory reaches the disk (fsync) before the rename
that makes it reachable, then the parent directory of each rename is synced. Checked by recording the
fsync and rename calls of a real publish and a real build."""

from __future__ import annotations

from pathlib import Path

import jax

from tests.registry.helpers import TINY_SPANS, mapping_text
from thoughtjax.registry import Registry, build, dir_name

UPDATED = ("blocks[0:2)", "head")


def _first(events, pred) -> int:
  return next((i for i, e in enumerate(events) if pred(e)), -1)


def test_publish_fsyncs_every_staged_file_and_directory_before_its_rename(registry_copy, keypair, recorded):
  reg = Registry.open(registry_copy)
  updates = [reg.thoughtlet(n) for n in UPDATED]
  updates = [t.with_params(jax.tree.map(lambda x: x * 1.25, dict(t.params))) for t in updates]
  staged: dict[Path, list[tuple[Path, bool]]] = {}

  def on_step(event, name):
    if event == "stage:manifest":  # the staged version is complete: list what must be durable
      (vdir,) = (registry_copy / ".staging").glob(f"*/thoughtlets/{dir_name(name)}/*")
      staged[vdir] = [(p, p.is_dir()) for p in [vdir, *sorted(vdir.rglob("*"))]]

  versions = reg.publish(updates, sign_key=keypair[0], on_step=on_step, settings=None)
  assert len(staged) == 2
  fsynced = [e for e in recorded if e[0] == "fsync"]
  assert fsynced
  for vdir, paths in staged.items():
    assert any(not d for _, d in paths) and any(d and p != vdir for p, d in paths)  # files and subdirectories
    r = _first(recorded, lambda e, v=vdir: e[0] == "rename" and e[1] == str(v))
    assert r >= 0, vdir
    for p, _ in paths:  # every file and directory, before the rename
      assert _first(recorded[:r], lambda e, p=p: e == ("fsync", str(p))) >= 0, (p, "not fsynced before rename")
    final = Path(recorded[r][2])
    assert final.parent.parent == registry_copy / "thoughtlets" and final.name in versions.values()
    assert _first(recorded[r:], lambda e, d=final.parent: e == ("fsync", str(d))) >= 0  # the rename itself
  i = _first(recorded, lambda e: e[0] == "rename" and e[2] == str(registry_copy / "index.json"))
  assert _first(recorded[:i], lambda e: e[0] == "fsync" and e[1].endswith("/index.json")) >= 0
  assert _first(recorded[i:], lambda e: e == ("fsync", str(registry_copy))) >= 0


def test_build_fsyncs_every_file_and_new_directory(tiny, keypair, tmp_path, recorded):
  cfg, model, codec = tiny
  (tmp_path / "mapping.yaml").write_text(mapping_text(TINY_SPANS, 6))
  out = tmp_path / "registry"
  build(out, tmp_path / "mapping.yaml", model, codec=codec, sign_key=keypair[0], settings=None)
  synced = {e[1] for e in recorded if e[0] == "fsync"}
  staged_prefix = str(out / ".staging") + "/"
  for p in sorted((out / "thoughtlets").rglob("*")) + sorted((out / "codec").rglob("*")):
    rel = p.relative_to(out)
    if rel.parts[0] == "thoughtlets" and len(rel.parts) == 2:  # thoughtlets/<name>: made in place
      assert str(p) in synced, rel
      continue
    # Synced where it was staged (the renamed directory carried it into place).
    assert any(s.startswith(staged_prefix) and s.endswith("/" + str(rel)) for s in synced), rel
  for d in ("thoughtlets", "codec", "keys"):  # new directories of the registry and their parent
    assert str(out / d) in synced, d
  assert str(out) in synced
  assert all(str(out / "thoughtlets" / dir_name(n)) in synced for n in ("embed", "head", "blocks[0:2)"))

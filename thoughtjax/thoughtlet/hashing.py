"""A thoughtlet's identity as bytes: the canonical JSON and the versioned hash.

``versioned_hash`` is SHA3-512 over a domain tag, then the length-prefixed
:func:`canonical_json` of the identity, then every weight in sorted path order as a
length-prefixed header (path, little-endian dtype, shape) and its length-prefixed
little-endian bytes. Published versions are named by it: any change here renames every
published thoughtlet, so the bytes are pinned by tests. Packed weights are hashed in their stored
form (:mod:`.stored`): the hash covers the packed bytes, and a weight hashes the same in memory and on disk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from thoughtjax.thoughtlet.stored import to_stored

HASH_DOMAIN = b"thoughtjax.thoughtlet/1\n"


def canonical_json(obj: Any) -> bytes:
  """The one byte serialization that is hashed and signed: sorted keys, no spaces, UTF-8."""
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def flat_params(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
  """(``a/b/c``, leaf) pairs in sorted path order."""
  out = []
  for key in sorted(params, key=str):
    value = params[key]
    path = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.extend(flat_params(value, path + "/"))
    else:
      out.append((path, value))
  return out


def param_spec(params: Mapping[str, Any]) -> dict[str, dict]:
  """``{path: {"shape": [...], "dtype": name}}`` of every weight as stored: the parameter tree's layout."""
  return {p: {"shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name} for p, x in flat_params(to_stored(params))}


def _update_weight(h, path: str, leaf) -> None:
  a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
  a = a.astype(a.dtype.newbyteorder("<"), copy=False)
  header = canonical_json({"path": path, "dtype": a.dtype.str, "shape": list(a.shape)})
  h.update(len(header).to_bytes(8, "little"))
  h.update(header)
  h.update(a.nbytes.to_bytes(8, "little"))
  h.update(a.reshape(-1).view(np.uint8).data)


def versioned_hash(identity: Mapping, params: Mapping[str, Any]) -> str:
  """SHA3-512 (128 hex digits) over the canonical identity, then each weight's header and bytes."""
  h = hashlib.sha3_512(HASH_DOMAIN)
  blob = canonical_json(identity)
  h.update(len(blob).to_bytes(8, "little"))
  h.update(blob)
  for path, leaf in flat_params(to_stored(params)):
    _update_weight(h, path, leaf)
  return h.hexdigest()

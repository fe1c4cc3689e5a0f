"""Who a reader trusts: public keys, required signatures."""

from __future__ import annotations

from typing import Iterable

from thoughtjax import signing


def _load_keys(keys: Iterable) -> dict:
  out = {}
  for k in keys:
    if not hasattr(k, "verify"):
      k = signing.load_public_key(k)
    out[signing.key_id(k)] = k
  return out

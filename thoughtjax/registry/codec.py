"""The tokenizer and chat template stored beside the thoughtlets (``DIR/codec/<digest>/``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from thoughtjax.registry.layout import _files_under, _sha256_file, _write_file
from thoughtjax.thoughtlet import canonical_json


def codec_digest(codec) -> str:
  """Hash of everything that fixes token ids: vocabulary, merges, specials, chat template."""
  return hashlib.sha3_256(canonical_json({
      "tokenizer": codec.tokenizer.to_str(), "chat_template": codec.chat_template,
      "bos_id": codec.bos_id, "eos_id": codec.eos_id, "add_bos": codec.add_bos})).hexdigest()[:16]


def _stage_codec(staging: Path, codec) -> tuple[str, dict]:
  digest = codec_digest(codec)
  cdir = staging / "codec" / digest
  cdir.mkdir(parents=True)
  _write_file(cdir / "tokenizer.json", codec.tokenizer.to_str().encode())
  _write_file(cdir / "codec.json", canonical_json({
      "chat_template": codec.chat_template, "bos_id": codec.bos_id, "eos_id": codec.eos_id,
      "add_bos": codec.add_bos}))
  return digest, {p.name: _sha256_file(p) for p in _files_under(cdir)}

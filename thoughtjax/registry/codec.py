"""The tokenizer and chat template stored beside the thoughtlets (``DIR/codec/<digest>/``)."""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from thoughtjax.registry.layout import (
  MAX_JSON_BYTES,
  UnsafeFile,
  files_under,
  read_regular,
  sha256_bytes,
  sha256_of_file,
  write_file,
)
from thoughtjax.thoughtlet import canonical_json
from thoughtjax.tokenizer import TextCodec


def _eos_ids(codec) -> tuple[int, ...]:
  ids = getattr(codec, "eos_ids", None)
  return tuple(int(i) for i in ids) if ids else (() if codec.eos_id is None else (int(codec.eos_id),))


def codec_digest(codec) -> str:
  """Hash of everything that fixes token ids and stops: vocabulary, merges, specials, chat template.
  Extra EOS ids enter only when there are several, so single-EOS digests stay what they were."""
  doc = {
    "tokenizer": codec.tokenizer.to_str(),
    "chat_template": codec.chat_template,
    "bos_id": codec.bos_id,
    "eos_id": codec.eos_id,
    "add_bos": codec.add_bos,
  }
  if len(_eos_ids(codec)) > 1:
    doc["eos_ids"] = list(_eos_ids(codec))
  return hashlib.sha3_256(canonical_json(doc)).hexdigest()[:16]


def stage_codec(staging: Path, codec) -> tuple[str, dict]:
  digest = codec_digest(codec)
  cdir = staging / "codec" / digest
  cdir.mkdir(parents=True)
  write_file(cdir / "tokenizer.json", codec.tokenizer.to_str().encode())
  write_file(
    cdir / "codec.json",
    canonical_json(
      {
        "chat_template": codec.chat_template,
        "bos_id": codec.bos_id,
        "eos_id": codec.eos_id,
        "eos_ids": list(_eos_ids(codec)),
        "add_bos": codec.add_bos,
      }
    ),
  )
  return digest, {p.name: sha256_of_file(p) for p in files_under(cdir)}


def load_codec(cdir: Path, files: dict, fail: Callable[[str, str], Exception], root: Path | None = None):
  """The :class:`~thoughtjax.tokenizer.TextCodec` stored in ``cdir``; each file is read once (a regular file
  reached from ``root``, default ``cdir``, without links, at most :data:`MAX_JSON_BYTES`) and its bytes are
  checked against ``files`` (name -> sha256, from the verified index) before use."""

  base = Path(root) if root is not None else Path(cdir)
  data = {}
  for rel in ("tokenizer.json", "codec.json"):
    if not isinstance(files, dict) or not isinstance(files.get(rel), str):
      raise fail(rel, "the index lists no digest for it")
    try:
      data[rel] = read_regular(base, Path(cdir).relative_to(base) / rel, MAX_JSON_BYTES)
    except FileNotFoundError:
      raise fail(rel, "the file is missing") from None
    except UnsafeFile as e:
      raise fail(rel, f"{e}; a codec file is a plain file") from None
    if sha256_bytes(data[rel]) != files[rel]:
      raise fail(rel, "sha256 does not match the digest in the index")
  try:
    meta = json.loads(data["codec.json"])
    kwargs = {}
    if meta.get("eos_ids") and "eos_ids" in inspect.signature(TextCodec).parameters:
      kwargs["eos_ids"] = tuple(int(i) for i in meta["eos_ids"])
    tokenizer = Tokenizer.from_str(data["tokenizer.json"].decode())
    return TextCodec(tokenizer, meta["chat_template"], meta["bos_id"], meta["eos_id"], meta["add_bos"], **kwargs)
  except Exception as e:  # noqa: BLE001 - parsers of content the index vouches for; any failure is a bad file
    raise fail("codec.json", f"not a codec ({type(e).__name__}: {str(e)[:200]})") from None

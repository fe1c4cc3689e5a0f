"""``load(name_or_path)``: a model name, a GGUF file or a safetensors directory -> model + codec.

Dequantizing a GGUF takes seconds; the float32 result is kept in the cache directory
(``weights/<sha256[:24]>-v<format>/``, keyed by the GGUF's sha256) so later processes map it
straight from disk. ``weights/index.json`` maps a GGUF's path, size and mtime to its sha256 so a
warm load does not hash the GGUF; the entry it names must record that GGUF's size and the sha256
of its sampled blocks, else the GGUF is hashed in full (an edited index cannot swap models).

With ``weights="native"`` an entry of its own (``weights/<sha256[:24]>-native-v<format>/``) holds the
GGUF's quantized matrices packed (:mod:`thoughtjax.quantized`: U8/I8 values, F32 block scales and
minimums; 165 MB instead of 538 MB for the default model), mapped and checked the same way.

Every tensor of an entry starts on a 64-byte boundary (:func:`save_aligned`), so on the CPU the mapped
tensors become the model's device arrays as they are (``jax.device_put`` adopts an aligned read-only
buffer): no copy of the weights is made, their pages are read from the file when first touched, and the
page cache shares them between processes.

Integrity of that derived cache. An entry holds ``weights.safetensors`` (float32, 538 MB for the
default model), ``tokenizer.json`` and ``meta.json``; ``meta.json`` records each file's size,
mtime and sha256, the sha256 of sampled blocks of the weights, and a hash of itself. A full
SHA-256 of the 538 MB weights costs 1.2 s in memory and 2.2 s from the file on this project's
2-core machine (measured; crc32 alone 0.4 s), several times the 0.7 s mapped load itself, so every
load checks instead (35 ms measured):

- ``meta.json`` against its own hash, ``tokenizer.json`` in full (small);
- the weights' size (a truncated file never maps), the safetensors header against the size, and
  the sha256 of the header plus 64 blocks of 64 KiB spread over the file (~4 MiB, milliseconds);
- the weights' mtime: when it differs from the recorded one (the file was written to, or copied
  without keeping times), the full sha256, and the new mtime is recorded once it passes.

An edit that keeps size and mtime and misses the sampled blocks is caught only by the full check,
:func:`verify_weight_cache` (or ``THOUGHTJAX_VERIFY_CACHE=full`` for every load). A failed check is
never repaired silently: it raises :class:`~thoughtjax.sources.errors.WeightCacheError` naming the
file, what was expected and found, and the fix (delete the entry; the next load rebuilds it from
the GGUF, which is itself checked). Refusals and checks are counted in :data:`CACHE_STATS`.

Durability. An entry is built in ``weights/.partial-dir-*``; every file in it and the directory itself are fsynced
before the one rename that makes it the entry, and ``weights/`` is fsynced after it; ``meta.json`` and
``index.json`` are replaced the same way (:mod:`thoughtjax.durable`). A load killed at any point leaves no
entry or a whole one; the next build removes what a killed one staged.

Imports inside functions here are deferred for start-up: importing this module does not load
``sources.safetensors_dir``; the functions that need them do.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from thoughtjax import durable, quantized, settings
from thoughtjax import fetch as fetch_lib
from thoughtjax.cachedir import cache_subdir
from thoughtjax.config import ModelConfig
from thoughtjax.sources.errors import ModelNotFoundError, UnsupportedModelError, WeightCacheError
from thoughtjax.sources.gguf_file import load_gguf
from thoughtjax.tokenizer import TextCodec
from thoughtjax.transformer import Transformer
from thoughtjax.weights import build_model, int8_params, params_from_hf, to_hf_tensors

# 2: float32 weights in the model layout, memory-mapped on load; 3: + integrity record and eos_ids;
# 4: every tensor starts on a 64-byte boundary (the mapped file becomes the device buffer, no copy).
_CACHE_FORMAT = 4
# Native entries (weights="native", ``<sha>-native-v<format>``): packed blocks as U8/I8 q plus F32 scale
# and min under ``<param>@q`` etc., their block types in meta["packed"]. 1: first version; 2: 64-byte aligned.
_NATIVE_FORMAT = 2
_DTYPES = {"F32": np.float32, "U8": np.uint8, "I8": np.int8}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
# XLA:CPU adopts a host buffer as a device array without copying it only when the buffer is aligned
# to this many bytes (and read-only); otherwise jax.device_put copies it (538 MB for the default model).
ALIGN = 64
_PAD_PREFIX = "__align__/"  # filler tensors that keep the next tensor aligned; never loaded
_SAMPLED_BLOCKS, _BLOCK = 64, 1 << 16
# Counted outcomes of cache checks: "sampled" and "full" passes, "refused" failures, "index_reset".
CACHE_STATS: collections.Counter = collections.Counter()


@dataclasses.dataclass
class LoadedModel:
  """A model ready to run: config, NNX module, text codec and where it came from."""

  config: ModelConfig
  model: Transformer
  codec: TextCodec
  source: str
  source_hash: str  # sha256 of the source file(s)

  @property
  def name(self) -> str:
    return self.source


def resolve_source(name_or_path: str | os.PathLike) -> Path:
  """A known model name (fetched on first use) or an existing path."""
  text = str(name_or_path)
  if text in fetch_lib.KNOWN_MODELS:
    return fetch_lib.fetch(text)
  path = Path(text).expanduser()
  if not path.exists():
    raise ModelNotFoundError(
      f"model {text!r} is neither a known name ({', '.join(fetch_lib.KNOWN_MODELS)}) nor an existing "
      f".gguf file or safetensors directory"
    )
  return path


def load_params(source: Path, weights: str = "f32") -> tuple[ModelConfig, dict, TextCodec, str]:
  """Config, parameters in the model layout (nested dict), codec and source hash.

  ``weights="f32"``: float32 arrays. ``"native"``: a GGUF's Q8_0 / Q4_0 / Q4_1 matrices stay packed
  (:class:`thoughtjax.quantized.BlockQuant`), everything else float32; a safetensors directory has no
  blocks, so its native form is its float32 one.
  """
  quantized.check_format(weights)
  if source.is_dir():
    from thoughtjax.sources.safetensors_dir import read_eos_ids, read_hf_config, read_safetensors

    cfg = read_hf_config(source)
    codec = TextCodec.from_hf_dir(source, cfg.bos_id, cfg.eos_id, read_eos_ids(source))
    return cfg, params_from_hf(cfg, read_safetensors(source)), codec, _dir_hash(source)
  if source.suffix != ".gguf":
    raise UnsupportedModelError(
      f"{source}: expected a .gguf file or a directory with config.json and *.safetensors, got a "
      f"{source.suffix or 'suffix-less'} file"
    )
  return _load_gguf_cached(source, weights)


def load_tensors(source: Path) -> tuple[ModelConfig, dict[str, np.ndarray], TextCodec, str]:
  """Like :func:`load_params`, with the weights under Hugging Face names ([out, in] layout)."""
  cfg, params, codec, digest = load_params(source)
  return cfg, to_hf_tensors(cfg, params), codec, digest


def load(
  name_or_path: str | os.PathLike = fetch_lib.DEFAULT_MODEL, dtype=jnp.float32, weights: str = "f32"
) -> LoadedModel:
  """Load a model by known name or path into a Flax NNX :class:`Transformer`.

  ``weights``: ``"f32"`` (dequantized float32), ``"native"`` (a GGUF's quantized blocks, read packed
  by every matmul and computed in float32: the same logits up to summation order), ``"int8"``
  (per-row int8 quantized from float32 at load; lossy) or ``"int8a8"`` (the int8 weights with each row of
  activations quantized to int8 too, an integer GEMM at M > 1; lossier, see ``quantized``).
  """
  source = resolve_source(name_or_path)
  derive = quantized.DERIVED_FORMATS.get(weights)
  base = derive[0] if derive else quantized.check_format(weights)
  cfg, params, codec, digest = load_params(source, "f32" if base == "int8" else base)
  if base == "int8":  # lossy: quantized per output row from the float32 weights at load
    params = int8_params(params)
  if derive:
    params = derive[1](params)
  return LoadedModel(cfg, build_model(cfg, params, dtype), codec, str(name_or_path), digest)


def _dir_hash(directory: Path) -> str:
  files = sorted(directory.glob("*.safetensors")) + [directory / "config.json"]
  h = fetch_lib.hashlib.sha256()
  for f in files:
    h.update(f.name.encode())
    h.update(fetch_lib.sha256_file(f).encode())
  return h.hexdigest()


def _stat_key(path: Path) -> str:
  st = path.stat()
  return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _flatten(params: dict, prefix: str = "", packed: dict | None = None) -> dict[str, np.ndarray]:
  """Flat ``a/b/c`` names; a packed weight becomes ``<name>@q``, ``@scale`` (and ``@min``), its block
  type recorded in ``packed[name]``."""
  out = {}
  for k, v in params.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(_flatten(v, key + "/", packed))
    elif quantized.is_packed(v):
      if packed is None:
        raise ValueError(f"{key}: packed weights need a record of their block types")
      packed[key] = v.kind
      parts = {"q": v.q, "scale": v.scale} | ({} if v.min is None else {"min": v.min})
      out.update({f"{key}@{n}": np.ascontiguousarray(a) for n, a in parts.items()})
    else:
      out[key] = np.ascontiguousarray(v)
  return out


def _unflatten(flat: dict[str, np.ndarray], packed: dict | None = None) -> dict:
  flat = dict(flat)
  for key, kind in (packed or {}).items():
    if not isinstance(kind, str) or kind not in quantized.KINDS or f"{key}@q" not in flat or f"{key}@scale" not in flat:
      raise WeightCacheError(
        f"weight cache: packed weight {key!r} ({kind!r}) lacks its q/scale tensors or has an "
        f"unknown block type; delete the entry and load again to rebuild it"
      )
    flat[key] = quantized.BlockQuant(flat.pop(f"{key}@q"), flat.pop(f"{key}@scale"), flat.pop(f"{key}@min", None), kind)
  out: dict = {}
  for key, v in flat.items():
    node = out
    *parents, leaf = [int(p) if p.isdigit() else p for p in key.split("/")]
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def _map_safetensors(path: Path, dtypes: tuple[str, ...] = ("F32",)) -> dict[str, np.ndarray]:
  """Read-only memory-mapped arrays of a safetensors file (we wrote it ourselves) of ``dtypes``.

  The format: 8-byte little-endian header size, a JSON header of name -> dtype, shape and
  byte range, then the data. Mapping skips the copy that reading the file would make. The header
  is checked against the file's size so that a short file is refused before it is mapped.
  """
  size = path.stat().st_size
  try:
    with open(path, "rb") as f:
      hsize = int.from_bytes(f.read(8), "little")
      if not 0 < hsize <= size - 8:
        raise ValueError(f"header length {hsize} does not fit a {size}-byte file")
      header = json.loads(f.read(hsize))
    end = max((info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"), default=0)
  except (ValueError, KeyError, TypeError, IndexError) as e:
    raise _cache_error(path, f"its safetensors header is unreadable ({e})") from None
  if 8 + hsize + end != size:
    raise _cache_error(path, f"its header describes {8 + hsize + end} bytes, the file has {size}")
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + hsize)
  out = {}
  for name, info in header.items():
    if name == "__metadata__" or name.startswith(_PAD_PREFIX):
      continue
    if info["dtype"] not in dtypes:
      raise _cache_error(
        path, f"tensor {name} is {info['dtype']}; this weight cache entry holds {', '.join(dtypes)} only"
      )
    a, b = info["data_offsets"]
    out[name] = data[a:b].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out


def save_aligned(tensors: dict[str, np.ndarray], path: Path) -> None:
  """Write ``tensors`` as a safetensors file whose every tensor starts on an ``ALIGN``-byte boundary.

  The header is padded with spaces (the format allows it) so the data starts aligned, and a tensor whose
  size is not a multiple of ``ALIGN`` is followed by a small U8 filler (``__align__/<n>``) rather than a
  hole, which the format forbids. Mapped by :func:`_map_safetensors`, each tensor is then a read-only
  aligned array that ``jax.device_put`` adopts on the CPU without a copy.
  """
  header: dict = {}
  order: list[tuple[str, np.ndarray]] = []
  offset = 0
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _DTYPE_NAMES:
      raise ValueError(f"{name}: dtype {a.dtype} is not one of {', '.join(map(str, _DTYPE_NAMES))}")
    header[name] = {"dtype": _DTYPE_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    order.append((name, a))
    offset += a.nbytes
    if offset % ALIGN:
      pad = ALIGN - offset % ALIGN
      filler = f"{_PAD_PREFIX}{len(order)}"
      header[filler] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
      order.append((filler, np.zeros(pad, np.uint8)))
      offset += pad
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-(8 + len(text)) % ALIGN)
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for _, a in order:
      f.write(memoryview(a.reshape(-1)).cast("B"))


def _cache_error(path: Path, problem: str) -> WeightCacheError:
  CACHE_STATS["refused"] += 1
  entry = path.parent
  return WeightCacheError(
    f"weight cache file {path} failed its check: {problem}. The cache is derived from the GGUF and "
    f"is not used like this; delete the entry (rm -r '{entry}') and load again to rebuild it."
  )


def _sampled_sha256(path: Path, size: int) -> str:
  """sha256 of the file's first block (header) and ``_SAMPLED_BLOCKS`` blocks spread up to its end."""
  h = hashlib.sha256()
  last = max(size - _BLOCK, 0)
  offsets = sorted({last * i // (_SAMPLED_BLOCKS - 1) for i in range(_SAMPLED_BLOCKS)})
  with open(path, "rb") as f:
    for off in offsets:
      f.seek(off)
      h.update(f.read(_BLOCK))
  return h.hexdigest()


def _file_record(path: Path) -> dict:
  st = path.stat()
  return {
    "size": st.st_size,
    "mtime_ns": st.st_mtime_ns,
    "sha256": fetch_lib.sha256_file(path),
    "sampled_sha256": _sampled_sha256(path, st.st_size),
  }


def _meta_digest(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k != "meta_sha256"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_meta(entry: Path, meta: dict) -> None:
  meta = dict(meta, meta_sha256=_meta_digest(meta))
  durable.write_atomic(entry / "meta.json", json.dumps(meta).encode())


def _read_meta(entry: Path) -> dict:
  path = entry / "meta.json"
  try:
    meta = json.loads(path.read_text())
    ok = isinstance(meta, dict) and meta.get("meta_sha256") == _meta_digest(meta)
  except (OSError, ValueError) as e:
    raise _cache_error(path, f"it is unreadable ({e})") from None
  if not ok:
    raise _cache_error(path, "its content does not match the hash it records (edited or corrupt)")
  return meta


def _check_entry(entry: Path, meta: dict, full: bool) -> None:
  """Raise WeightCacheError unless the entry's files match ``meta['files']`` (see the module docstring)."""
  records = meta.get("files") or {}
  for name in ("weights.safetensors", "tokenizer.json"):
    path, rec = entry / name, records.get(name)
    if rec is None:
      raise _cache_error(entry / "meta.json", f"it has no integrity record for {name}")
    if not path.is_file():
      raise _cache_error(path, "the file is missing")
    st = path.stat()
    if st.st_size != rec["size"]:
      what = "truncated" if st.st_size < rec["size"] else "longer than written"
      raise _cache_error(path, f"expected {rec['size']} bytes, got {st.st_size} ({what})")
    if name == "weights.safetensors" and not full and st.st_mtime_ns == rec["mtime_ns"]:
      if _sampled_sha256(path, st.st_size) != rec["sampled_sha256"]:
        raise _cache_error(
          path,
          "the sha256 of its header and sampled blocks differs from the one recorded "
          "when it was written (edited or corrupt)",
        )
      CACHE_STATS["sampled"] += 1
      continue
    digest = fetch_lib.sha256_file(path)
    if digest != rec["sha256"]:
      raise _cache_error(path, f"expected sha256 {rec['sha256']}, got {digest} (edited or corrupt)")
    CACHE_STATS["full"] += 1
    if st.st_mtime_ns != rec["mtime_ns"]:  # verified in full: remember the new time, check cheaply next time
      records[name] = dict(rec, mtime_ns=st.st_mtime_ns)
      _write_meta(entry, dict(meta, files=records))


def verify_weight_cache(root: Path | None = None) -> dict[str, str]:
  """Check every entry of the weight cache in full (sha256 of every file): ``{entry: "ok" | problem}``.

  Never raises for a bad entry and never deletes one; the caller decides (the fix is in the message).
  """
  root = root or cache_subdir("weights")
  report = {}
  for entry in sorted({*root.glob(f"*-v{_CACHE_FORMAT}"), *root.glob(f"*-native-v{_NATIVE_FORMAT}")}):
    try:
      _check_entry(entry, _read_meta(entry), full=True)
      report[str(entry)] = "ok"
    except WeightCacheError as e:
      report[str(entry)] = str(e)
  return report


def read_index(index_path: Path) -> dict:
  if not index_path.exists():
    return {}
  try:
    index = json.loads(index_path.read_text())
    if isinstance(index, dict) and all(isinstance(v, str) for v in index.values()):
      return index
    problem = "not a JSON object of path keys to sha256 strings"
  except (OSError, ValueError) as e:
    problem = str(e)
  # Only a lookup table of source hashes: starting it afresh costs one sha256 of the GGUF.
  CACHE_STATS["index_reset"] += 1
  print(
    f"thoughtjax: warning: weight cache index {index_path} is unreadable ({problem}); starting a new one "
    f"(GGUF files are hashed again)",
    file=sys.stderr,
    flush=True,
  )
  return {}


def _codec_from_entry(entry: Path, meta: dict) -> TextCodec:

  return TextCodec(
    Tokenizer.from_file(str(entry / "tokenizer.json")),
    meta["chat_template"],
    meta["bos_id"],
    meta["eos_id"],
    meta["add_bos"],
    eos_ids=meta.get("eos_ids", ()),
  )


def _entry_name(digest: str, weights: str) -> str:
  if weights == "native":  # not matched by the f32 entries' "<sha>-v*" clean-up glob
    return f"{digest[:24]}-native-v{_NATIVE_FORMAT}"
  return f"{digest[:24]}-v{_CACHE_FORMAT}"


def _params_from_entry(entry: Path, meta: dict) -> dict:
  packed = meta.get("packed") or {}
  dtypes = ("F32", "U8", "I8") if packed else ("F32",)
  return _unflatten(_map_safetensors(entry / "weights.safetensors", dtypes), packed)


def _load_gguf_cached(path: Path, weights: str = "f32"):
  root = cache_subdir("weights")
  index_path = root / "index.json"
  index = read_index(index_path)
  digest = index.get(_stat_key(path))
  indexed = digest is not None
  if not indexed:
    digest = fetch_lib.sha256_file(path)
  entry = root / _entry_name(digest, weights)
  if entry.exists() and not (entry / "meta.json").exists():  # entries appear whole (one rename)
    raise _cache_error(entry / "meta.json", "the file is missing")
  if (entry / "meta.json").exists():
    meta = _read_meta(entry)
    size = path.stat().st_size
    if (
      meta.get("sha256") == digest
      and meta.get("source_size") == size
      and (not indexed or meta.get("source_sampled_sha256") == _sampled_sha256(path, size))
    ):
      _check_entry(entry, meta, full=settings.current().verify_cache_full)
      cfg = ModelConfig.from_json(meta["config"])
      params = _params_from_entry(entry, meta)
      if not indexed:  # e.g. the GGUF was touched or copied: next time skip hashing it
        index[_stat_key(path)] = digest
        _write_index(root, index_path, index)
      return cfg, params, _codec_from_entry(entry, meta), digest
    # The index named an entry of another file (edited index): trust only the GGUF's own hash.
    digest = fetch_lib.sha256_file(path)
    entry = root / _entry_name(digest, weights)
    if (entry / "meta.json").exists():
      meta = _read_meta(entry)
      _check_entry(entry, meta, full=True)
      index[_stat_key(path)] = digest
      _write_index(root, index_path, index)
      return (
        ModelConfig.from_json(meta["config"]),
        _params_from_entry(entry, meta),
        _codec_from_entry(entry, meta),
        digest,
      )

  ckpt = load_gguf(path, weights)
  params = params_from_hf(ckpt.config, ckpt.tensors)
  codec = TextCodec.from_gguf(ckpt.tokenizer)
  with durable.writing(root):
    _store_entry(root, entry, path, digest, weights, ckpt, params, codec)
  index[_stat_key(path)] = digest
  _write_index(root, index_path, index)
  return ckpt.config, params, codec, digest


def _store_entry(root: Path, entry: Path, path: Path, digest: str, weights: str, ckpt, params, codec) -> None:
  """Build the entry in a staging directory, sync it whole, rename it into place (call under ``writing``)."""
  staging = Path(tempfile.mkdtemp(dir=root, prefix=durable.STAGING_PREFIX))
  try:
    packed: dict[str, str] = {}
    save_aligned(_flatten(params, packed=packed), staging / "weights.safetensors")
    codec.tokenizer.save(str(staging / "tokenizer.json"))
    meta = {
      "config": ckpt.config.to_json(),
      "chat_template": codec.chat_template,
      "bos_id": codec.bos_id,
      "eos_id": codec.eos_id,
      "eos_ids": list(codec.eos_ids),
      "add_bos": codec.add_bos,
      "source": str(path),
      "sha256": digest,
      "source_size": path.stat().st_size,
      "source_sampled_sha256": _sampled_sha256(path, path.stat().st_size),
      "types": ckpt.source_types,
      "weights": weights,
      "packed": packed,
      "files": {n: _file_record(staging / n) for n in ("weights.safetensors", "tokenizer.json")},
    }
    _write_meta(staging, meta)
    durable.fsync_tree(staging)  # every byte on disk before the rename makes it the entry
    try:
      os.rename(staging, entry)
    except OSError:  # another process won the race; its copy is identical
      shutil.rmtree(staging, ignore_errors=True)
    else:
      durable.fsync_path(root)
    stale_glob = f"{digest[:24]}-native-v*" if weights == "native" else f"{digest[:24]}-v*"
    for stale in root.glob(stale_glob):  # entries of older cache formats
      if stale != entry:
        shutil.rmtree(stale, ignore_errors=True)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def _write_index(root: Path, index_path: Path, index: dict) -> None:
  with durable.writing(root):
    durable.write_atomic(index_path, json.dumps(index).encode())

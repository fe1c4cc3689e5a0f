"""``load(name_or_path)``: a model name, a GGUF file or a safetensors directory -> model + codec.

Dequantizing a GGUF takes seconds; the float32 result is kept in the cache directory
(keyed by the file's sha256) so later processes map it straight from disk.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from thoughtjax import fetch as fetch_lib
from thoughtjax.config import ModelConfig
from thoughtjax.model import Transformer
from thoughtjax.tokenizer import TextCodec
from thoughtjax.weights import build_model, params_from_hf, to_hf_tensors

_CACHE_FORMAT = 2  # 2: float32 weights in the model layout, memory-mapped on load


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
    raise FileNotFoundError(
        f"model {text!r} is neither a known name ({', '.join(fetch_lib.KNOWN_MODELS)}) nor an existing "
        f".gguf file or safetensors directory"
    )
  return path


def load_params(source: Path) -> tuple[ModelConfig, dict, TextCodec, str]:
  """Config, float32 parameters in the model layout (nested dict), codec and source hash."""
  if source.is_dir():
    from thoughtjax.sources.safetensors_dir import read_hf_config, read_safetensors

    cfg = read_hf_config(source)
    codec = TextCodec.from_hf_dir(source, cfg.bos_id, cfg.eos_id)
    return cfg, params_from_hf(cfg, read_safetensors(source)), codec, _dir_hash(source)
  if source.suffix != ".gguf":
    raise ValueError(f"{source}: expected a .gguf file or a directory with config.json and *.safetensors")
  return _load_gguf_cached(source)


def load_tensors(source: Path) -> tuple[ModelConfig, dict[str, np.ndarray], TextCodec, str]:
  """Like :func:`load_params`, with the weights under Hugging Face names ([out, in] layout)."""
  cfg, params, codec, digest = load_params(source)
  return cfg, to_hf_tensors(cfg, params), codec, digest


def load(name_or_path: str | os.PathLike = fetch_lib.DEFAULT_MODEL, dtype=jnp.float32) -> LoadedModel:
  """Load a model by known name or path into a Flax NNX :class:`Transformer`."""
  source = resolve_source(name_or_path)
  cfg, params, codec, digest = load_params(source)
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


def _flatten(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
  out = {}
  for k, v in params.items():
    key = f"{prefix}{k}"
    out.update(_flatten(v, key + "/") if isinstance(v, dict) else {key: np.ascontiguousarray(v)})
  return out


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
  out: dict = {}
  for key, v in flat.items():
    node = out
    *parents, leaf = [int(p) if p.isdigit() else p for p in key.split("/")]
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def _map_safetensors(path: Path) -> dict[str, np.ndarray]:
  """Read-only memory-mapped arrays of a float32 safetensors file (we wrote it ourselves).

  The format: 8-byte little-endian header size, a JSON header of name -> dtype, shape and
  byte range, then the data. Mapping skips the copy that reading the file would make.
  """
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] != "F32":
      raise ValueError(f"{path}: tensor {name} is {info['dtype']}; the weight cache holds F32 only")
    a, b = info["data_offsets"]
    out[name] = data[a:b].view(np.float32).reshape(info["shape"])
  return out


def _load_gguf_cached(path: Path):
  from safetensors.numpy import save_file

  root = fetch_lib.cache_dir() / "weights"
  index_path = root / "index.json"
  index = json.loads(index_path.read_text()) if index_path.exists() else {}
  digest = index.get(_stat_key(path))
  if digest is None:
    digest = fetch_lib.sha256_file(path)
  entry = root / f"{digest[:24]}-v{_CACHE_FORMAT}"
  if (entry / "meta.json").exists():
    meta = json.loads((entry / "meta.json").read_text())
    cfg = ModelConfig.from_json(meta["config"])
    params = _unflatten(_map_safetensors(entry / "weights.safetensors"))
    from tokenizers import Tokenizer

    codec = TextCodec(Tokenizer.from_file(str(entry / "tokenizer.json")), meta["chat_template"],
                      meta["bos_id"], meta["eos_id"], meta["add_bos"])
    return cfg, params, codec, digest

  from thoughtjax.sources.gguf_file import load_gguf

  ckpt = load_gguf(path)
  params = params_from_hf(ckpt.config, ckpt.tensors)
  codec = TextCodec.from_gguf(ckpt.tokenizer)
  root.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
  try:
    save_file(_flatten(params), str(staging / "weights.safetensors"))
    codec.tokenizer.save(str(staging / "tokenizer.json"))
    meta = {"config": ckpt.config.to_json(), "chat_template": codec.chat_template,
            "bos_id": codec.bos_id, "eos_id": codec.eos_id, "add_bos": codec.add_bos,
            "source": str(path), "sha256": digest, "types": ckpt.source_types}
    (staging / "meta.json").write_text(json.dumps(meta))
    try:
      os.rename(staging, entry)
    except OSError:  # another process won the race; its copy is identical
      shutil.rmtree(staging, ignore_errors=True)
    for stale in root.glob(f"{digest[:24]}-v*"):  # entries of older cache formats
      if stale != entry:
        shutil.rmtree(stale, ignore_errors=True)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  index[_stat_key(path)] = digest
  tmp_index = root / f".index-{os.getpid()}.json"
  tmp_index.write_text(json.dumps(index))
  os.replace(tmp_index, index_path)
  return ckpt.config, params, codec, digest

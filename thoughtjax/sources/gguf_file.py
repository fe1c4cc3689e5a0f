"""Read a GGUF file: config, dequantized tensors under Hugging Face names, tokenizer data.

llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE can be
applied to adjacent pairs; :func:`unpermute_rows` undoes that so the one model
(rotate-half RoPE, Hugging Face order) runs GGUF and safetensors checkpoints alike.

Imports inside functions here are deferred for start-up: importing this module does not load ``gguf``; the functions
that need them do.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

from thoughtjax import quantized
from thoughtjax.config import Architecture, ModelConfig
from thoughtjax.sources.errors import ModelNotFoundError, TruncatedModelError, UnsupportedModelError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# RoPE scaling types the model computes exactly (thoughtjax.transformer.rope_tables: plain RoPE). llama.cpp
# writes "none" or leaves the key out for plain RoPE; Llama 3.x's "llama3" scaling has no type key
# and travels as a ``rope_freqs.weight`` tensor of per-frequency factors instead.
SUPPORTED_ROPE_SCALING = ("none",)
_FIX_TRUNCATED = (
  "The download or copy was interrupted: re-fetch a known model with `thoughtjax fetch --force`, "
  "or download / convert this file again."
)

_LAYER_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  if gguf_name.startswith("blk."):
    _, idx, rest = gguf_name.split(".", 2)
    if rest in _LAYER_NAMES:
      return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
  return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's Q/K row permutation; w is [n_heads*E, ...] (rows = outputs)."""
  rows = w.shape[0]
  head_dim = rows // n_heads
  return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's Q/K row permutation (Hugging Face order -> GGUF order)."""
  rows = w.shape[0]
  head_dim = rows // n_heads
  return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclasses.dataclass(frozen=True)
class TokenizerData:
  model: str  # "gpt2" (byte-level BPE) is the one supported
  pre: str | None
  tokens: list[str]
  token_types: list[int]
  merges: list[str]
  bos_id: int | None
  eos_id: int | None
  add_bos: bool
  chat_template: str | None
  eos_ids: tuple[int, ...] = ()  # every end-of-generation id: eos, then eot and eom when the file names them


@dataclasses.dataclass
class GGUFCheckpoint:
  config: ModelConfig
  tensors: dict[str, np.ndarray]  # Hugging Face names, float32 or (weights="native") packed blocks, [out, in]
  tokenizer: TokenizerData
  source_types: dict[str, str]  # HF name -> GGUF tensor type


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  if f is None:
    return default
  return f.contents()


def check_rope(reader, name: str, head_dim: int) -> None:
  """Refuse, by key and value, any RoPE variant other than plain RoPE over the whole head."""
  p = _field(reader, "general.architecture") + "."
  supported = (
    f"supported RoPE scaling types: {', '.join(SUPPORTED_ROPE_SCALING)} (plain RoPE). Loading it "
    f"with plain RoPE would rotate positions wrongly, so the model is refused; use a model without "
    f"RoPE scaling."
  )
  kind = _field(reader, p + "rope.scaling.type")
  if kind is not None and kind not in SUPPORTED_ROPE_SCALING:
    factor = _field(reader, p + "rope.scaling.factor")
    raise UnsupportedModelError(
      f"{name}: {p}rope.scaling.type = {kind!r} (factor {factor}) is not supported; {supported}"
    )
  linear = _field(reader, p + "rope.scale_linear")  # older files' linear scaling key
  if linear is not None and float(linear) != 1.0:
    raise UnsupportedModelError(
      f"{name}: {p}rope.scale_linear = {linear} (linear scaling) is not supported; {supported}"
    )
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise UnsupportedModelError(
      f"{name}: tensor rope_freqs.weight (per-frequency RoPE factors, Llama 3.x 'llama3' scaling) is "
      f"present; that scaling is not supported; {supported}"
    )
  dims = _field(reader, p + "rope.dimension_count")
  if dims is not None and int(dims) != head_dim:
    raise UnsupportedModelError(
      f"{name}: {p}rope.dimension_count = {dims} but the head dimension is {head_dim}; only RoPE over "
      f"the whole head is supported. Use a model that rotates every head dimension."
    )


def read_config(reader, name: str = "the GGUF file") -> ModelConfig:
  arch_name = _field(reader, "general.architecture")
  arch = Architecture.parse(arch_name)
  p = arch_name + "."
  D = int(_field(reader, p + "embedding_length"))
  H = int(_field(reader, p + "attention.head_count"))
  K = int(_field(reader, p + "attention.head_count_kv", H))
  check_rope(reader, name, int(_field(reader, p + "attention.key_length", D // H)))
  names = {t.name for t in reader.tensors}
  vocab = _field(reader, p + "vocab_size")
  if vocab is None:
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
  return ModelConfig(
    architecture=arch,
    vocab_size=int(vocab),
    d_model=D,
    num_layers=int(_field(reader, p + "block_count")),
    num_heads=H,
    num_kv_heads=K,
    head_dim=int(_field(reader, p + "attention.key_length", D // H)),
    ffn_dim=int(_field(reader, p + "feed_forward_length")),
    rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
    rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
    tie_embeddings="output.weight" not in names,
    qkv_bias="blk.0.attn_q.bias" in names,
    max_context=int(_field(reader, p + "context_length", 2048)),
    bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
  )


def read_tokenizer(reader) -> TokenizerData:
  model = _field(reader, "tokenizer.ggml.model")
  if model is None:
    raise UnsupportedModelError("the GGUF file carries no tokenizer (tokenizer.ggml.model is missing)")
  return TokenizerData(
    model=model,
    pre=_field(reader, "tokenizer.ggml.pre"),
    tokens=list(_field(reader, "tokenizer.ggml.tokens")),
    token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type", [])],
    merges=list(_field(reader, "tokenizer.ggml.merges", [])),
    bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    chat_template=_field(reader, "tokenizer.chat_template"),
    # llama.cpp ends generation on each of these (end of turn, end of message), not only on eos.
    eos_ids=tuple(
      dict.fromkeys(
        int(i) for i in (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")) if i is not None
      )
    ),
  )


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def expected_size(path: Path) -> int:
  """Bytes a GGUF file must have: the end of its last tensor's data, from the header alone.

  Reads only the header (magic, version, key/values, tensor infos) so that a truncated file is named
  before the gguf reader maps its data and fails with numpy's dtype-size error. Raises
  :class:`TruncatedModelError` when the file ends inside the header.
  """
  import gguf

  actual = path.stat().st_size
  with open(path, "rb") as f:
    if actual < 24:
      raise TruncatedModelError(f"{path}: {actual} bytes, shorter than a GGUF header (24 bytes). {_FIX_TRUNCATED}")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  try:
    if buf[:4] != b"GGUF":
      raise UnsupportedModelError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    pos = 8

    def take(fmt: str):
      nonlocal pos
      out = struct.unpack_from(order + fmt, buf, pos)
      pos += struct.calcsize(order + fmt)
      return out[0] if len(out) == 1 else out

    def string() -> bytes:
      nonlocal pos
      n = take("Q")
      if pos + n > actual:
        raise struct.error("string past the end")
      pos += n
      return bytes(buf[pos - n : pos])

    def skip_value(vtype: int) -> object:
      nonlocal pos
      if vtype == _STRING:
        return string()
      if vtype == _ARRAY:
        etype, count = take("I"), take("Q")
        if etype in _SCALARS:
          pos += count * struct.calcsize(order + _SCALARS[etype])
        elif etype == _STRING:  # vocabularies: ~10^5 strings, skipped without copying them
          length, at = struct.Struct(order + "Q").unpack_from, pos
          for _ in range(count):
            at += 8 + length(buf, at)[0]
          pos = at
        else:
          for _ in range(count):
            skip_value(etype)
        return None
      if vtype not in _SCALARS:
        raise UnsupportedModelError(f"{path}: metadata value type {vtype} is unknown; the file is corrupt")
      return take(_SCALARS[vtype])

    try:
      n_tensors, n_kv = take("Q"), take("Q")
      alignment = gguf.GGUF_DEFAULT_ALIGNMENT
      for _ in range(n_kv):
        key = string()
        value = skip_value(take("I"))
        if key == b"general.alignment" and isinstance(value, int) and value > 0:
          alignment = value
      end = 0
      for _ in range(n_tensors):
        string()
        dims = [take("Q") for _ in range(take("I"))]
        ttype, offset = take("I"), take("Q")
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        end = max(end, offset + int(np.prod(dims, dtype=np.int64)) // block * nbytes)
      if pos > actual:
        raise struct.error("header past the end")
    except struct.error:
      raise TruncatedModelError(
        f"{path}: the file ends inside its GGUF header (at {actual} bytes); it is truncated. {_FIX_TRUNCATED}"
      ) from None
    return pos + (-pos % alignment) + end
  finally:
    buf.close()


def check_complete(path: Path) -> None:
  """Raise :class:`TruncatedModelError` (file, expected and actual size, fix) for a truncated GGUF."""
  want, actual = expected_size(path), path.stat().st_size
  if actual < want:
    raise TruncatedModelError(
      f"{path}: truncated GGUF file: expected {want} bytes (the end of its last tensor, per its header), "
      f"got {actual} bytes ({want - actual} missing). {_FIX_TRUNCATED}"
    )


def load_gguf(path: str | Path, weights: str = "f32") -> GGUFCheckpoint:
  """Every tensor of a Llama-family GGUF file: dequantized to float32 (``weights="f32"``), or with
  ``weights="native"`` the 2-D Q8_0 / Q4_0 / Q4_1 tensors kept as their blocks
  (:class:`thoughtjax.quantized.BlockQuant`, numpy arrays; the same float32 values once dequantized)."""
  import gguf  # deferred: only GGUF users pay for the import

  quantized.check_format(weights)

  path = Path(path)
  if not path.is_file():
    raise ModelNotFoundError(f"GGUF file not found: {path}; pass an existing .gguf file or a known model name")
  check_complete(path)
  reader = gguf.GGUFReader(str(path))
  cfg = read_config(reader, str(path))
  tensors: dict[str, np.ndarray] = {}
  types: dict[str, str] = {}
  for t in reader.tensors:
    name = hf_name(t.name)
    if name is None:
      continue  # nothing else the model reads (rope_freqs is refused in check_rope)
    type_name = t.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
      raise UnsupportedModelError(
        f"tensor {t.name!r} in {path.name} has quantization type {type_name}; supported: "
        f"{', '.join(SUPPORTED_TYPES)}. Re-quantize the file to one of those."
      )
    if weights == "native" and type_name in quantized.KINDS and len(t.shape) == 2:
      w = quantized.from_gguf_blocks(t.data, type_name, (int(t.shape[1]), int(t.shape[0])))
    else:
      w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
      w = _rows(w, lambda a: unpermute_rows(a, cfg.num_heads))
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
      w = _rows(w, lambda a: unpermute_rows(a, cfg.num_kv_heads))
    tensors[name] = w
    types[name] = type_name
  return GGUFCheckpoint(cfg, tensors, read_tokenizer(reader), types)


def _rows(w, permute):
  """Apply a row (output) permutation to an array or to each part of packed blocks (rows are outputs)."""

  return w.map(permute) if quantized.is_packed(w) else permute(w)

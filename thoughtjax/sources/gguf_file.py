"""Read a GGUF file: config, dequantized tensors under Hugging Face names, tokenizer data.

llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE can be
applied to adjacent pairs; :func:`unpermute_rows` undoes that so the one model
(rotate-half RoPE, Hugging Face order) runs GGUF and safetensors checkpoints alike.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from thoughtjax.config import Architecture, ModelConfig, UnsupportedModelError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

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
  return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's Q/K row permutation (Hugging Face order -> GGUF order)."""
  rows = w.shape[0]
  head_dim = rows // n_heads
  return (w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


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


@dataclasses.dataclass
class GGUFCheckpoint:
  config: ModelConfig
  tensors: dict[str, np.ndarray]  # Hugging Face names, float32, [out, in]
  tokenizer: TokenizerData
  source_types: dict[str, str]  # HF name -> GGUF tensor type


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  if f is None:
    return default
  return f.contents()


def read_config(reader) -> ModelConfig:
  arch_name = _field(reader, "general.architecture")
  arch = Architecture.parse(arch_name)
  p = arch_name + "."
  D = int(_field(reader, p + "embedding_length"))
  H = int(_field(reader, p + "attention.head_count"))
  K = int(_field(reader, p + "attention.head_count_kv", H))
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
  )


def load_gguf(path: str | Path) -> GGUFCheckpoint:
  """Dequantize every tensor of a Llama-family GGUF file to float32."""
  import gguf  # deferred: only GGUF users pay for the import

  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  reader = gguf.GGUFReader(str(path))
  cfg = read_config(reader)
  tensors: dict[str, np.ndarray] = {}
  types: dict[str, str] = {}
  for t in reader.tensors:
    name = hf_name(t.name)
    if name is None:
      continue  # e.g. rope_freqs: derived, not needed
    type_name = t.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
      raise UnsupportedModelError(
          f"tensor {t.name!r} in {path.name} has quantization type {type_name}; supported: "
          f"{', '.join(SUPPORTED_TYPES)}. Re-quantize the file to one of those."
      )
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
      w = unpermute_rows(w, cfg.num_heads)
    elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
      w = unpermute_rows(w, cfg.num_kv_heads)
    tensors[name] = w
    types[name] = type_name
  return GGUFCheckpoint(cfg, tensors, read_tokenizer(reader), types)

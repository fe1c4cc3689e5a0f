"""Tiny seeded models shared by many tests: one table of configurations, writers for
the on-disk formats (safetensors directory, GGUF) and the matching Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from thoughtjax.config import Architecture, ModelConfig
from thoughtjax.transformer import init_random
from thoughtjax.weights import model_params, to_hf_tensors

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS)  # byte-level alphabet + specials

TINY_CONFIGS = {
  "llama_gqa": ModelConfig(
    Architecture.LLAMA,
    VOCAB,
    64,
    3,
    4,
    2,
    16,
    96,
    rope_theta=10000.0,
    rms_eps=1e-5,
    max_context=256,
    bos_id=1,
    eos_id=2,
  ),
  "qwen2_bias": ModelConfig(
    Architecture.QWEN2,
    VOCAB,
    64,
    2,
    4,
    1,
    16,
    128,
    rope_theta=1e6,
    rms_eps=1e-6,
    qkv_bias=True,
    max_context=256,
    bos_id=1,
    eos_id=2,
  ),
  "mistral_untied": ModelConfig(
    Architecture.MISTRAL,
    VOCAB,
    48,
    2,
    6,
    3,
    8,
    80,
    rope_theta=1e5,
    rms_eps=1e-5,
    tie_embeddings=False,
    max_context=256,
    bos_id=1,
    eos_id=2,
  ),
}

CHAT_TEMPLATE = (
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
  "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer():
  """A byte-level tokenizer with no merges: one token per byte, plus the specials at 0..2."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {s: i for i, s in enumerate(SPECIALS)}
  for ch in sorted(alphabet):
    vocab[ch] = len(vocab)
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
  return tok


def tiny_model(name: str, seed: int = 0):
  cfg = TINY_CONFIGS[name]
  return cfg, init_random(cfg, seed, scale=0.08)


def tiny_engine(name: str, seed: int = 0, *, chat: bool = False, **model_kw):
  """A :class:`thoughtjax.Model` over ``tiny_model(name, seed)`` with the byte-level tokenizer (and the
  chat template when ``chat``); ``model_kw`` go to the Model (``kernels=``, ``chunk=``)."""
  import thoughtjax
  from thoughtjax.loading import LoadedModel
  from thoughtjax.tokenizer import TextCodec

  cfg, model = tiny_model(name, seed)
  codec = TextCodec(tiny_tokenizer(), CHAT_TEMPLATE if chat else None, cfg.bos_id, cfg.eos_id)
  return thoughtjax.Model(LoadedModel(cfg, model, codec, f"tiny-{name}-seed{seed}", ""), **model_kw)


def write_safetensors_dir(directory: Path, cfg: ModelConfig, model) -> Path:
  """A Hugging Face-style directory: config.json, model.safetensors, tokenizer files."""
  from safetensors.numpy import save_file

  directory.mkdir(parents=True, exist_ok=True)
  tensors = to_hf_tensors(cfg, model_params(model))
  save_file(tensors, str(directory / "model.safetensors"))
  arch_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
  (directory / "config.json").write_text(
    json.dumps(hf_config_dict(cfg) | {"architectures": [arch_class[cfg.architecture.value]]})
  )
  tiny_tokenizer().save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
  return directory


def hf_config_dict(cfg: ModelConfig) -> dict:
  d = {
    "model_type": cfg.architecture.value,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "intermediate_size": cfg.ffn_dim,
    "rope_theta": cfg.rope_theta,
    "rms_norm_eps": cfg.rms_eps,
    "tie_word_embeddings": cfg.tie_embeddings,
    "max_position_embeddings": cfg.max_context,
    "bos_token_id": cfg.bos_id,
    "eos_token_id": cfg.eos_id,
    "hidden_act": "silu",
  }
  if cfg.architecture is Architecture.LLAMA:
    d["attention_bias"] = cfg.qkv_bias
  if cfg.architecture is Architecture.MISTRAL:
    d["sliding_window"] = None
  return d


def hf_model(cfg: ModelConfig, model):
  """The same weights in Hugging Face transformers (PyTorch, float32, eager attention)."""
  import torch
  import transformers

  classes = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
  }
  conf_cls, model_cls = classes[cfg.architecture.value]
  conf = conf_cls(**hf_config_dict(cfg), attn_implementation="eager", dtype=torch.float32)
  torch.manual_seed(0)
  hf = model_cls(conf).eval()
  state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in to_hf_tensors(cfg, model_params(model)).items()}
  if cfg.tie_embeddings:
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
  missing, unexpected = hf.load_state_dict(state, strict=False)
  missing = [m for m in missing if "rotary" not in m]
  if missing or unexpected:
    raise AssertionError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
  return hf


def write_gguf(path: Path, cfg: ModelConfig, model, qtype: str = "F32") -> Path:
  """A llama.cpp-style GGUF (Q/K rows permuted), 2-D weights stored as ``qtype``."""
  import gguf

  from thoughtjax.sources.gguf_file import _GLOBAL_NAMES, _LAYER_NAMES, permute_rows

  writer = gguf.GGUFWriter(str(path), cfg.architecture.value)
  arch = cfg.architecture.value
  writer.add_block_count(cfg.num_layers)
  writer.add_context_length(cfg.max_context)
  writer.add_embedding_length(cfg.d_model)
  writer.add_feed_forward_length(cfg.ffn_dim)
  writer.add_head_count(cfg.num_heads)
  writer.add_head_count_kv(cfg.num_kv_heads)
  writer.add_key_length(cfg.head_dim)
  writer.add_value_length(cfg.head_dim)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_layer_norm_rms_eps(cfg.rms_eps)
  writer.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
  tok = tiny_tokenizer()
  vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("gpt2")
  writer.add_token_list([t for t, _ in vocab])
  writer.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
  writer.add_token_merges([])
  writer.add_bos_token_id(cfg.bos_id)
  writer.add_eos_token_id(cfg.eos_id)
  writer.add_chat_template(CHAT_TEMPLATE)
  reverse = {v: k for k, v in _GLOBAL_NAMES.items()}
  reverse.update({f"model.layers.{{}}.{v}": f"blk.{{}}.{k}" for k, v in _LAYER_NAMES.items()})
  qt = getattr(gguf.GGMLQuantizationType, qtype)
  for name, w in to_hf_tensors(cfg, model_params(model)).items():
    if name.startswith("model.layers."):
      _, _, idx, rest = name.split(".", 3)
      gname = reverse["model.layers.{}." + rest].format(idx)
    else:
      gname = reverse[name]
    if "q_proj" in name:
      w = permute_rows(w, cfg.num_heads)
    elif "k_proj" in name:
      w = permute_rows(w, cfg.num_kv_heads)
    if w.ndim == 2 and qtype != "F32":
      data = gguf.quants.quantize(w, qt)
      writer.add_tensor(gname, data, raw_dtype=qt)
    else:
      writer.add_tensor(gname, np.ascontiguousarray(w, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def greedy_reference(model, ids, n: int, stop_at_eos: bool = False) -> list[int]:
  """Greedy continuation by re-running the full forward each step (no KV cache, no
  generation program): the reference the cached decode loop is checked against."""
  ids = list(ids)
  out = []
  for _ in range(n):
    nxt = int(np.argmax(model.logits(ids)[-1]))
    out.append(nxt)
    ids.append(nxt)
    if stop_at_eos and nxt == model.config.eos_id:
      break
  return out

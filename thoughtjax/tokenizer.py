"""Tokenizer (Hugging Face ``tokenizers``) and chat template (Jinja) for a model.

A GGUF file carries a byte-level BPE vocabulary and merges; we rebuild the same
tokenizer with the ``tokenizers`` library. A safetensors directory brings its own
``tokenizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from thoughtjax.config import UnsupportedModelError
from thoughtjax.sources.gguf_file import TokenizerData

# The GPT-2 split pattern; llama.cpp's "smollm" pre-tokenizer puts a split on every
# digit in front of it, as the model's original tokenizer.json does.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("smollm", "starcoder", "refact", "qwen2", "deepseek-llm", None, "default", "gpt2"):
    if pre in ("smollm", "starcoder", "refact"):
      return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level
  if pre in ("llama3", "llama-bpe", "smaug-bpe"):
    pattern = (
      r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
      r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    return pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  raise UnsupportedModelError(
    f"GGUF pre-tokenizer {pre!r} is not supported; supported: smollm, starcoder, gpt2, "
    f"llama-bpe, qwen2. Use a safetensors directory with its tokenizer.json instead."
  )


def tokenizer_from_gguf(data: TokenizerData) -> Tokenizer:
  if data.model != "gpt2":
    raise UnsupportedModelError(
      f"GGUF tokenizer model {data.model!r} is not supported; only byte-level BPE ('gpt2') is."
    )
  vocab = {tok: i for i, tok in enumerate(data.tokens)}
  merges = [tuple(m.split(" ", 1)) for m in data.merges]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = _pre_tokenizer(data.pre)
  tok.decoder = decoders.ByteLevel()
  special = [
    AddedToken(t, special=True, normalized=False)
    for t, kind in zip(data.tokens, data.token_types)
    if kind in (_CONTROL, _USER_DEFINED)
  ]
  tok.add_special_tokens(special)
  return tok


class TextCodec:
  """Encode/decode text and render chat prompts for one model."""

  def __init__(
    self,
    tokenizer: Tokenizer,
    chat_template: str | None,
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool = False,
    eos_ids: Sequence[int] = (),
  ):
    """``eos_ids``: every end-of-sequence id (generation stops on each); ``eos_id`` comes first and
    stays the one the chat template renders as ``eos_token``. Either may be given alone."""
    self.tokenizer = tokenizer
    self.chat_template = chat_template
    ids = ([] if eos_id is None else [int(eos_id)]) + [int(i) for i in eos_ids]
    self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
    self.bos_id, self.eos_id, self.add_bos = bos_id, (self.eos_ids[0] if self.eos_ids else None), add_bos
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    self._template = env.from_string(chat_template) if chat_template else None

  @classmethod
  def from_gguf(cls, data: TokenizerData) -> TextCodec:
    return cls(
      tokenizer_from_gguf(data), data.chat_template, data.bos_id, data.eos_id, data.add_bos, eos_ids=data.eos_ids
    )

  @classmethod
  def from_hf_dir(
    cls, directory: Path, bos_id: int | None, eos_id: int | None, eos_ids: Sequence[int] = ()
  ) -> TextCodec:
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    template = None
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.exists():
      template = json.loads(cfg_path.read_text()).get("chat_template")
    return cls(tok, template, bos_id, eos_id, eos_ids=eos_ids)

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if self.add_bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

  def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    if self._template is None:
      raise UnsupportedModelError("this model has no chat template; pass a plain prompt instead of --chat")
    return self._template.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=self._token_text(self.bos_id),
      eos_token=self._token_text(self.eos_id),
    )

  def chat_template_parts(self, system: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the chat template's fixed text before and after one user message."""
    sentinel = "\u241fTHOUGHTJAX_USER_MESSAGE\u241f"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": sentinel}]
    text = self.render_chat(messages)
    if text.count(sentinel) != 1:
      raise ValueError(
        "the chat template does not place the user message verbatim exactly once; its fixed parts cannot be cut from it"
      )
    before, after = text.split(sentinel)
    prefix = self.encode(before) if before else ([self.bos_id] if self.add_bos and self.bos_id is not None else [])
    suffix = self.tokenizer.encode(after, add_special_tokens=False).ids if after else []
    return prefix, suffix

  def _token_text(self, i: int | None) -> str:
    return "" if i is None else (self.tokenizer.id_to_token(i) or "")

  def token_id(self, text: str) -> int | None:
    return self.tokenizer.token_to_id(text)


def _raise_template_error(message: str):
  raise jinja2.exceptions.TemplateError(message)

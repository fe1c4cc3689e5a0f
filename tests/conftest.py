"""Shared test set-up: strict warnings (pyproject), seeded tiny models, the real default model."""

from __future__ import annotations

import os

import pytest

# Tests share the user cache (the default model is fetched once) unless CI points elsewhere.
os.environ.setdefault("THOUGHTJAX_CACHE", os.path.expanduser("~/.cache/thoughtjax"))


@pytest.fixture(scope="session")
def default_model():
  """The real default model (SmolLM2-135M-Instruct), fetched on first use."""
  import thoughtjax

  return thoughtjax.load()


@pytest.fixture(scope="session")
def hf_default_model():
  """Hugging Face transformers' own float32 load of the same GGUF: an independent reference
  (its own dequantization, Q/K un-permutation and Llama implementation in PyTorch)."""
  import torch
  import transformers

  from thoughtjax.fetch import fetch

  gguf = fetch()
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
  return model.eval(), tok

"""The model against an independent float32 implementation (Hugging Face transformers).

Tiny seeded configurations (GQA, q/k/v bias, untied head) run fast; the real default
model is compared with transformers' own load of the same GGUF file, with float32 weights and
with native weights (the GGUF's Q4_1 / Q8_0 blocks read packed, computed in float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import thoughtjax
from tests.conftest import DEFAULT_MODEL_PROMPTS
from tests.tiny import TINY_CONFIGS, hf_model, tiny_model, tiny_tokenizer
from thoughtjax.loading import LoadedModel
from thoughtjax.tokenizer import TextCodec

LOGIT_TOL = 1e-3


def _tiny_engine(name: str) -> tuple[thoughtjax.Model, object]:
  cfg, model = tiny_model(name, seed=1)
  codec = TextCodec(tiny_tokenizer(), None, cfg.bos_id, cfg.eos_id)
  return thoughtjax.Model(LoadedModel(cfg, model, codec, name, "")), hf_model(cfg, model)


def _hf_logits(hf, ids) -> np.ndarray:
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(hf, ids, n) -> list[int]:
  with torch.no_grad():
    out = hf.generate(
      torch.tensor([ids]),
      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
      max_new_tokens=n,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )
  return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_logits_match_transformers(name):
  engine, hf = _tiny_engine(name)
  rng = np.random.default_rng(0)
  ids = rng.integers(3, engine.config.vocab_size, size=23).tolist()
  ours, ref = engine.logits(ids), _hf_logits(hf, ids)
  assert ours.shape == ref.shape
  assert np.max(np.abs(ours - ref)) <= 1e-4


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_greedy_continuation_matches_transformers(name):
  engine, hf = _tiny_engine(name)
  ids = [5, 77, 130, 9, 201, 64, 33]
  # No stop token on either side: both run the full 32 steps.
  got = engine.generate(ids, max_tokens=32, ignore_eos=True).token_ids
  assert len(got) == 32
  assert got == _hf_greedy(hf, ids, 32)


@pytest.fixture(scope="session", params=["f32", "native"])
def default_model_as(request, default_model):
  """The default model with each weight format (one load per format for the session)."""
  return default_model if request.param == "f32" else thoughtjax.load(weights=request.param)


@pytest.mark.slow
@pytest.mark.parametrize("label,text", DEFAULT_MODEL_PROMPTS, ids=[p[0] for p in DEFAULT_MODEL_PROMPTS])
def test_default_model_matches_transformers(default_model_as, hf_default_model, label, text):
  default_model = default_model_as
  hf, hf_tok = hf_default_model
  if text is None:
    ids = default_model.prompt_ids("What is the capital of France?", chat=True)
  else:
    ids = default_model.prompt_ids(text)
    assert ids == hf_tok(text, add_special_tokens=False).input_ids  # same tokenizer
  ours, ref = default_model.logits(ids), _hf_logits(hf, ids)
  assert np.max(np.abs(ours - ref)) <= LOGIT_TOL, f"max |dlogit| {np.max(np.abs(ours - ref))}"
  got = default_model.generate(ids, max_tokens=32).token_ids
  want = _hf_greedy(hf, ids, 32)
  eos = default_model.config.eos_id
  if eos in want:
    want = want[: want.index(eos) + 1]
  assert got == want

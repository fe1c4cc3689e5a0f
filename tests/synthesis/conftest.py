"""What the synthesis tests share (a test file imports it from here, never from another test file): the router
tests' model and their synthetic labeled set. The tiny calibrated registry and its model are in tiny_synthesis.py."""

from __future__ import annotations

import numpy as np

import thoughtjax
from tests.tiny import tiny_engine

# The tiny tokenizer is byte-level (one token per character), so each label's words are drawn from
# its own letters; the filler words every label shares use letters of their own.
WORDS = {
  "alpha": ["cab", "bead", "faced", "badge", "egg", "cafe", "deaf", "gabbed"],
  "beta": ["hill", "milk", "limn", "kiln", "jinn", "hymn", "link", "mink"],
  "gamma": ["sort", "pours", "trout", "spurt", "port", "roost", "tours", "rust"],
}
FILLER = ["wxyz", "zwv", "vex", "xyz"]


def synthetic(n_per_label: int, seed: int) -> list[tuple[str, str]]:
  """(prompt, hint) pairs: 3-7 words of the hint's list and 0-2 shared filler words, shuffled."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n_per_label):
    for hint, words in WORDS.items():
      picked = list(rng.choice(words, rng.integers(3, 8))) + list(rng.choice(FILLER, rng.integers(0, 3)))
      rng.shuffle(picked)
      rows.append((" ".join(picked), hint))
  return rows


def router_model(seed: int = 0) -> thoughtjax.Model:
  """The router tests' model: the tiny GQA Llama with the byte-level tokenizer and the chat template."""
  return tiny_engine("llama_gqa", seed, chat=True)

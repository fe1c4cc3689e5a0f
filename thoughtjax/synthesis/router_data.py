"""The router's labeled prompts: ``registry/router_prompts/{train,heldout}.jsonl``.

One JSON object a line, ``{"prompt": str, "hint": str}``; every hint is an entry of the synthesis
dictionary. The two splits are disjoint (no prompt, nor a near copy of one, in both); the held-out
split is for measuring the router, never for training it. Every error names the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Literal

from thoughtjax.errors import UserError
from thoughtjax.synthesis.dictionary import SynthesisDictionary, default_dictionary_path, load_dictionary

ROUTER_SPLITS = ("train", "heldout")
RouterSplit = Literal["train", "heldout"]


class RouterDataError(UserError, ValueError):
  """A router prompt file is missing or invalid; names the file and the line."""


@dataclasses.dataclass(frozen=True)
class RouterPrompt:
  prompt: str
  hint: str
  line: int  # in its file


def default_router_prompts_dir() -> Path:
  """``router_prompts/`` beside the default synthesis dictionary."""
  return default_dictionary_path().parent / "router_prompts"


def load_router_prompts(
  split: RouterSplit, directory: str | os.PathLike | None = None, dictionary: SynthesisDictionary | None = None
) -> list[RouterPrompt]:
  """The labeled prompts of ``split`` in file order, each label checked against ``dictionary``
  (default: the default synthesis dictionary)."""
  if split not in ROUTER_SPLITS:
    raise RouterDataError(f"router prompt split must be one of {', '.join(ROUTER_SPLITS)}, got {split!r}")
  path = Path(directory if directory is not None else default_router_prompts_dir()) / f"{split}.jsonl"
  names = (dictionary if dictionary is not None else load_dictionary()).names
  try:
    text = path.read_text(encoding="utf-8")
  except FileNotFoundError:
    raise RouterDataError(
      f"{path}: no such file; the router's prompts live in registry/router_prompts/{{train,heldout}}.jsonl"
    ) from None
  except UnicodeDecodeError as e:
    raise RouterDataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  out = []
  for n, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise RouterDataError(
        f"{path}:{n}: not a JSON object ({e.msg}); each line is {{\"prompt\": \"...\", \"hint\": \"...\"}}"
      ) from None
    if not isinstance(row, dict) or set(row) != {"prompt", "hint"}:
      got = sorted(row) if isinstance(row, dict) else type(row).__name__
      raise RouterDataError(f"{path}:{n}: expected exactly the keys ['hint', 'prompt'], got {got}")
    prompt, hint = row["prompt"], row["hint"]
    if not isinstance(prompt, str) or not prompt.strip():
      raise RouterDataError(f"{path}:{n}: prompt must be a non-empty string, got {prompt!r}")
    if hint not in names:
      raise RouterDataError(
        f"{path}:{n}: hint {hint!r} is not in the synthesis dictionary; valid hints: {', '.join(names)}"
      )
    out.append(RouterPrompt(prompt, hint, n))
  if not out:
    raise RouterDataError(f"{path}: holds no prompt")
  return out

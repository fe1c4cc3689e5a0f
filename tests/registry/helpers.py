"""Helpers of the registry tests: tiny configs, codec, mappings, subprocess runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tiny import CHAT_TEMPLATE, tiny_tokenizer
from thoughtjax.config import Architecture, ModelConfig
from thoughtjax.thoughtlet import ProfileSettings

REPO = Path(__file__).resolve().parents[2]
# Cheap profiles: shapes and XLA analyses are real, timing is a handful of runs.
FAST = ProfileSettings(batch=1, context=32, reps=3, warmup=1)
TINY_SPANS = [(0, 2), (2, 3), (3, 5), (5, 6)]
# 30 layers like the default model, boundaries at 10, 12 and 20 like its mapping.
DEEP_SPANS = [
  (0, 2),
  (2, 4),
  (4, 6),
  (6, 8),
  (8, 10),
  (10, 12),
  (12, 15),
  (15, 18),
  (18, 20),
  (20, 22),
  (22, 24),
  (24, 26),
  (26, 28),
  (28, 30),
]


def tiny_codec():
  from thoughtjax.tokenizer import TextCodec

  return TextCodec(tiny_tokenizer(), CHAT_TEMPLATE, bos_id=1, eos_id=2)


def tiny_config(num_layers: int = 6, **kw) -> ModelConfig:
  base = dict(
    architecture=Architecture.LLAMA,
    vocab_size=264,
    d_model=32,
    num_layers=num_layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    rope_theta=10000.0,
    max_context=256,
    bos_id=1,
    eos_id=2,
  )
  base.update(kw)
  return ModelConfig(**base)


def mapping_text(spans, num_layers, template=True) -> str:
  lines = [
    "format: 1",
    "model: tiny",
    f"num_layers: {num_layers}",
    "thoughtlets:",
    "  - kind: embed",
    "    tags: [input]",
    "    description: tokens -> residual",
  ]
  if template:
    lines += ["  - kind: template", "    tags: [chat]", "    description: chat template rows"]
  for a, b in spans:
    lines += ["  - kind: blocks", f"    layers: [{a}, {b}]", "    description: layers"]
  lines += ["  - kind: head", "    description: residual -> logits"]
  return "\n".join(lines) + "\n"


def run_python(code: str, *, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
  """Run ``code`` in a fresh interpreter (a new JAX process) from the repository root."""
  full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO
  )


def largest_data_file(vdir: Path) -> Path:
  """The largest array data file (under a ``d/`` folder) of a version's checkpoint: the one tampering tests damage."""
  files = sorted(
    (p for p in (vdir / "checkpoint").rglob("*") if p.is_file() and "/d/" in str(p)), key=lambda p: p.stat().st_size
  )
  return files[-1]


def read_index(root: Path) -> tuple[dict, dict | None]:
  doc = json.loads((Path(root) / "index.json").read_text())
  return doc["index"], doc["signature"]


def write_index(root: Path, body: dict, key_path: Path | None) -> None:
  """Write ``index.json`` with ``body``, signed with the private key at ``key_path`` (None: unsigned):
  what someone holding a key (or no key) can put in place."""
  from thoughtjax import signing
  from thoughtjax.thoughtlet import canonical_json

  sig = None if key_path is None else signing.sign(signing.load_private_key(key_path), canonical_json(body)).to_json()
  (Path(root) / "index.json").write_text(json.dumps({"index": body, "signature": sig}))


def rewrite_manifest(vdir: Path, edit, key_path: Path | None, root: Path | None = None) -> dict:
  """Edit a version's manifest, re-sign it with ``key_path`` and, given ``root``, record its new digest in
  the index and re-sign that too (a key holder's republished mistake, not tampering)."""
  import hashlib

  from thoughtjax import signing
  from thoughtjax.thoughtlet import canonical_json

  raw = json.loads((vdir / "manifest.json").read_text())
  edit(raw)
  data = json.dumps(raw).encode()
  (vdir / "manifest.json").write_bytes(data)
  if key_path is not None:
    key = signing.load_private_key(key_path)
    (vdir / "manifest.sig").write_bytes(canonical_json(signing.sign(key, canonical_json(raw)).to_json()))
  if root is not None:
    body, _ = read_index(root)
    body["manifest_sha256"][f"{raw['name']}@{raw['version']}"] = hashlib.sha256(data).hexdigest()
    write_index(root, body, key_path)
  return raw

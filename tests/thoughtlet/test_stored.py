"""The stored form of packed weights: the GGUF's own bytes, round-tripped bit for bit, hashed as stored."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from thoughtjax import quantized
from thoughtjax.thoughtlet import param_spec, versioned_hash
from thoughtjax.thoughtlet.stored import block_from_stored, block_to_stored, has_blocks, stored_kind, to_stored

KINDS = ("Q8_0", "Q4_0", "Q4_1")


def _raw(rng, kind, rows=48, cols=96):
  w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
  w[0, :32] = 0.0  # an all-zero block
  w[1, 32:64] = 3.0  # a constant block
  return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_stored_block_is_the_gguf_bytes_and_round_trips_exactly(rng, kind):
  raw = _raw(rng, kind)
  w = quantized.from_gguf_blocks(raw, kind)
  node = block_to_stored(w)
  assert stored_kind(node) == kind and node["scale"].dtype == np.float16
  # Every byte of the GGUF's blocks is in the stored arrays, and nothing more: same size as the file.
  assert sum(a.nbytes for a in node.values()) == raw.nbytes
  size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
  blocks = raw.reshape(48, 96 // 32, size)
  assert np.array_equal(node["scale"].view(np.uint8).reshape(48, 3, 2), blocks[..., 0:2])
  at = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}[kind]
  assert np.array_equal(node[kind].view(np.uint8).reshape(48, 3, -1), blocks[..., at:])
  back = block_from_stored(node)
  assert back.kind == kind and back.q.dtype == w.q.dtype and np.array_equal(back.q, w.q)
  assert np.array_equal(back.scale.view(np.uint32), np.asarray(w.scale).view(np.uint32))
  assert np.array_equal(
    quantized.dequantize(back).view(np.uint32),
    gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).view(np.uint32),
  )


def test_hash_and_spec_cover_the_stored_bytes(rng):
  w = quantized.from_gguf_blocks(_raw(rng, "Q4_1"), "Q4_1")
  params = {"0": {"mlp": {"up": w}, "norm": {"weight": np.ones(4, np.float32)}}}
  stored = to_stored(params)
  assert has_blocks(stored) and not has_blocks({"norm": {"weight": np.ones(4, np.float32)}})
  assert to_stored(stored) == stored  # idempotent: stored trees pass through
  ident = {"name": "x"}
  assert versioned_hash(ident, params) == versioned_hash(ident, stored)
  assert param_spec(params)["0/mlp/up/Q4_1"] == {"shape": [48, 48], "dtype": "uint8"}
  # One scale changed (by the smallest float16 step) changes the hash; so does one nibble.
  bumped = to_stored(params)
  bumped["0"]["mlp"]["up"]["scale"] = bumped["0"]["mlp"]["up"]["scale"].copy()
  bumped["0"]["mlp"]["up"]["scale"].view(np.uint16)[5, 1] ^= 1
  assert versioned_hash(ident, bumped) != versioned_hash(ident, stored)
  nib = to_stored(params)
  nib["0"]["mlp"]["up"]["Q4_1"] = nib["0"]["mlp"]["up"]["Q4_1"] ^ np.uint8(0x10)
  assert versioned_hash(ident, nib) != versioned_hash(ident, stored)


def test_scales_that_are_not_float16_are_refused():
  w = quantized.BlockQuant(np.zeros((2, 32), np.int8), np.full((2, 1), 0.1, np.float32), None, "Q8_0")
  with pytest.raises(quantized.WeightFormatError, match="float16"):
    block_to_stored(w)
  with pytest.raises(quantized.WeightFormatError, match=r"\[O, I\]"):
    block_from_stored({"Q8_0": np.zeros((2, 32), np.int8), "scale": np.zeros((2, 2), np.float16)})

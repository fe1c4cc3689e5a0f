"""One decode program interface: plain, speculative and slot programs driven by the one host loop give the tokens
``Model.generate`` gives, and a program that is not one cannot be made."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from tests.tiny import tiny_engine
from thoughtjax.decode import program as program_lib
from thoughtjax.decode import speculative
from thoughtjax.decode.interface import DecodeInputs, DecodeProgram, run_chunks
from thoughtjax.decode.request import DecodeRequest
from thoughtjax.decode.stream import Rows, Trace
from thoughtjax.sampling import SamplingParams, program_mode, sampling_arrays
from thoughtjax.serving import SlotRequestError
from thoughtjax.serving.slot_program import SlotProgram, slot_program
from thoughtjax.transformer import GraphDefs

IDS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 12]]
PARAMS = [SamplingParams(max_tokens=11, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)]


@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", chunk=4)


def _drive(program: DecodeProgram, inputs: DecodeInputs, model, cancel_after: int | None = None) -> list[list[int]]:
  """Each row's tokens from the deltas of one :func:`run_chunks` call."""
  rows = Rows(model.codec, PARAMS, [[]] * len(IDS))
  trace = Trace(program.key, IDS, time.perf_counter(), tokens_out=[0] * len(IDS))
  cancelled = threading.Event()
  got: list[list[int]] = [[] for _ in IDS]
  for i, d in enumerate(run_chunks(program, inputs, rows, trace, cancelled)):
    got[d.row].extend(d.token_ids)
    if cancel_after is not None and i + 1 == cancel_after:
      cancelled.set()
  assert trace.first_token is not None and trace.end is not None
  return got


def _request(model) -> DecodeRequest:
  return DecodeRequest([tuple(i) for i in IDS], PARAMS, [()] * len(IDS))


def test_every_family_gives_the_tokens_of_generate(model):
  want = [model.generate(ids, max_tokens=p.max_tokens, ignore_eos=True).token_ids for ids, p in zip(IDS, PARAMS)]
  assert [len(w) for w in want] == [11, 6]
  request = _request(model)
  fields = request.key_fields()
  B, T = fields["batch"], fields["prompt_len"]
  tokens, pad = request.left_padded(B, T)
  samp = sampling_arrays(PARAMS, B, model.config.vocab_size, fields["stop_width"], None, False)
  parts = model.parts.by_position(model.layers)
  defs = GraphDefs.from_model(model.module)

  plain = program_lib.PROGRAMS.get(
    program_lib.ProgramKey(model.layers, **fields, chunk=model.chunk), defs, model.config, program_lib.Program
  )
  inputs = DecodeInputs(parts, jax.device_put(tokens), jax.device_put(pad), samp)
  assert _drive(plain, inputs, model) == want

  spec = speculative.prepare(model, request, "embed, blocks[0:1), head", draft_tokens=2)
  assert _drive(spec.program, spec.inputs, model) == want

  slots = slot_program(defs, model.config, model.layers, B, T + fields["max_new"], model.chunk, None)
  slot_inputs = inputs._replace(mode=program_mode(PARAMS))
  assert _drive(slots, slot_inputs, model) == want
  assert all(isinstance(p, DecodeProgram) for p in (plain, spec.program, slots))


def test_the_host_loop_stops_the_device_at_cancel(model):
  """Cancelled after its first delta, the loop ends every row as cancelled and runs no further chunk."""
  request = _request(model)
  fields = request.key_fields()
  B, T = fields["batch"], fields["prompt_len"]
  tokens, pad = request.left_padded(B, T)
  samp = sampling_arrays(PARAMS, B, model.config.vocab_size, fields["stop_width"], None, False)
  defs = GraphDefs.from_model(model.module)
  slots = slot_program(defs, model.config, model.layers, B, T + fields["max_new"], model.chunk, None)
  inputs = DecodeInputs(model.parts.by_position(model.layers), tokens, pad, samp, mode=program_mode(PARAMS))
  got = _drive(slots, inputs, model, cancel_after=1)
  assert [len(g) for g in got] == [1, 1]  # the prefill's first tokens, nothing after


def test_a_slot_programs_prefill_fills_every_slot(model):
  defs = GraphDefs.from_model(model.module)
  slots = slot_program(defs, model.config, model.layers, 4, 64, model.chunk, None)
  assert isinstance(slots, SlotProgram)
  samp = sampling_arrays(PARAMS, 2, model.config.vocab_size, 4, None, False)
  inputs = DecodeInputs(model.parts.by_position(model.layers), np.zeros((2, 16), np.int32), np.zeros(2, np.int32), samp)
  with pytest.raises(SlotRequestError, match="takes 4 prompts"):
    slots.prefill(inputs._replace(mode=program_mode(PARAMS)), slots.init_state())
  with pytest.raises(TypeError, match="abstract"):
    type("Half", (DecodeProgram,), {"init_state": lambda self, parts=None: None})()


def test_plain_generation_is_a_pool_of_one_prefill_the_slot_step_continues(model):
  """A plain program's state is a pool's state: after its prefill and a chunk, the slot program of the same rows and
  ring continues it, step for step, to the tokens and keys the plain program reaches on its own."""
  request = _request(model)
  fields = request.key_fields()
  B, T, N = fields["batch"], fields["prompt_len"], fields["max_new"]
  tokens, pad = request.left_padded(B, T)
  samp = sampling_arrays(PARAMS, B, model.config.vocab_size, fields["stop_width"], None, False)
  defs = GraphDefs.from_model(model.module)
  key = program_lib.ProgramKey(model.layers, **fields, chunk=model.chunk)
  plain = program_lib.PROGRAMS.get(key, defs, model.config, program_lib.Program)
  slots = slot_program(defs, model.config, model.layers, B, T + N, model.chunk, None)
  inputs = DecodeInputs(model.parts.by_position(model.layers), jax.device_put(tokens), jax.device_put(pad), samp)

  def started():
    return plain.advance(inputs, plain.prefill(inputs, plain.init_state(inputs.parts)))

  alone, pooled = started(), started()
  assert type(alone) is type(pooled) is type(slots.init_state())
  assert int(alone.cursor) == T + model.chunk and int(jax.device_get(alone.count).min()) > 1
  alone = plain.advance(inputs, alone)
  pooled = slots.advance(inputs._replace(mode=program_mode(PARAMS)), pooled)
  a, p = jax.device_get(alone), jax.device_get(pooled)
  assert int(a.cursor) == int(p.cursor) > T + model.chunk
  np.testing.assert_array_equal(a.count, p.count)
  np.testing.assert_array_equal(a.out, p.out)
  np.testing.assert_array_equal(a.done, p.done)
  for (ak, av), (pk, pv) in zip(a.caches, p.caches, strict=True):
    np.testing.assert_array_equal(ak, pk)
    np.testing.assert_array_equal(av, pv)

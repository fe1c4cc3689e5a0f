"""Every program family's key extends :class:`thoughtjax.decode.interface.DecodeKey`, and the one program cache holds
each family's programs under its key's shape: paths of one structure share a program, families never do."""

from __future__ import annotations

import dataclasses

from tests.tiny import tiny_engine
from thoughtjax.decode import program as program_lib
from thoughtjax.decode import speculative
from thoughtjax.decode.interface import DecodeKey
from thoughtjax.decode.request import DecodeRequest
from thoughtjax.sampling import SamplingParams
from thoughtjax.serving.slot_program import SlotKey, slot_program
from thoughtjax.transformer import GraphDefs


def test_plain_speculative_and_slot_programs_share_one_key_type_and_one_cache(monkeypatch):
  monkeypatch.setattr(program_lib, "PROGRAMS", program_lib.ProgramCache(capacity=8))
  model = tiny_engine("llama_gqa", seed=3)
  first, second = model.with_path((0, 1, 1, 2)), model.with_path((0, 2, 2, 1))  # both open on the draft's block
  defs = GraphDefs.from_model(model.module)
  request = DecodeRequest([[5, 6, 7]], [SamplingParams(max_tokens=4)], [[2]])
  plain = program_lib.ProgramKey(layers=first.layers, **request.key_fields())

  progs = {
    "plain": [
      program_lib.PROGRAMS.get(dataclasses.replace(plain, layers=m.layers), defs, m.config) for m in (first, second)
    ],
    "speculative": [speculative.prepare(m, request, "embed, blocks[0:1), head").program for m in (first, second)],
    "slot": [slot_program(defs, m.config, m.layers, 2, 64, 4, m.kernels) for m in (first, second)],
  }
  for name, (a, b) in progs.items():
    assert a is b, f"two paths of one shape compiled two {name} programs"
    assert isinstance(a.key, DecodeKey) and a.key.layers == (0, 1, 2, 3), name
  assert isinstance(progs["slot"][0].key, SlotKey)
  stats = program_lib.PROGRAMS.stats()
  assert (stats.misses, stats.hits, stats.size) == (3, 3, 3)  # one program per family, each family its own
  # A key of one family never names another's program, even where the fields it shares agree.
  assert SlotKey((0, 1, 2, 3), 1, 32, 8, None) != DecodeKey((0, 1, 2, 3))
  assert speculative.SpecKey(**dataclasses.asdict(plain)) != plain

"""``thoughtjax bench shapes`` on a tiny chat model: the second path of the same shape compiles nothing and adds no
program, the paths answer differently, a path of another length is refused; the table and the JSON report come out
(no timing asserted)."""

from __future__ import annotations

import json

import pytest

from tests.tiny import tiny_engine
from thoughtjax.bench import shapes


@pytest.fixture(scope="module")
def model():
  return tiny_engine("llama_gqa", seed=7, chat=True, chunk=4)


def test_the_second_path_compiles_nothing_and_answers_with_its_own_layers(model):
  res = shapes.run(model, first="embed, blocks[0:3), head", second="embed, blocks[2:3), blocks[0:2), head",
                   repeats=2, max_tokens=6)  # fmt: skip
  assert res["first_path"] == [0, 1, 2] and res["second_path"] == [2, 0, 1]
  assert res["second_first_compile_s"] == 0 and res["second_programs_added"] == 0
  assert res["warm_requests_that_compiled"] == 0 and res["paths_answer_differently"]
  assert len(res["warm_ttft_s"]["first"]) == len(res["warm_ttft_s"]["second"]) == 2


def test_paths_of_different_lengths_are_refused(model):
  with pytest.raises(SystemExit, match="differ in length"):
    shapes.run(model, first=None, second="embed, blocks[0:2), head", repeats=1, max_tokens=2)


def test_the_command_prints_the_table_and_writes_json(model, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr("thoughtjax.load", lambda *a, **k: model)
  out = tmp_path / "shapes.json"
  argv = [
    "--second",
    "embed, blocks[1:3), blocks[0:1), head",
    "--repeats",
    "1",
    "--max-tokens",
    "2",
    "--json",
    str(out),
  ]
  assert shapes.main(argv) == 0
  text = capsys.readouterr().out
  assert "second path, first request" in text and "compiling nothing" in text
  report = json.loads(out.read_text())
  assert report["second_path"] == [1, 2, 0] and report["weights"] == "f32"

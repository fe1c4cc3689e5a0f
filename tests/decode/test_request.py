"""One check of a request's fields (:func:`thoughtjax.decode.request.check_request`) for the Python API, the CLI
and the server: each bad field is refused by name, before any device work, with the same words everywhere."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_engine, tiny_model, write_safetensors_dir
from thoughtjax import cli
from thoughtjax.decode import program as program_lib
from thoughtjax.decode.request import ContextError, check_request
from thoughtjax.decode.stream import RequestError
from thoughtjax.errors import UserError
from thoughtjax.sampling import SamplingError, SamplingParams


@pytest.fixture(scope="module")
def engine():
  return tiny_engine("llama_gqa", seed=3)


def test_the_api_refuses_each_bad_field_by_name_before_building_a_program(engine):
  vocab, context = engine.config.vocab_size, engine.config.max_context
  cases = [
    (dict(prompts=[[3, vocab]]), RequestError, f"token id {vocab} is outside the vocabulary \\[0, {vocab}\\)"),
    (dict(prompts=[[3, -1]]), RequestError, "token id -1 is outside the vocabulary"),
    (dict(prompts=[[]]), RequestError, "prompt has no tokens"),
    (dict(top_k=vocab + 1), SamplingError, f"top_k must be at most the vocabulary size {vocab}"),
    (dict(stop_token_ids=(vocab,)), SamplingError, "stop_token_ids or logit_bias"),
    (dict(logit_bias={vocab + 5: 1.0}), SamplingError, f"token id {vocab + 5}"),
    (dict(max_tokens=context), ContextError, f"exceeds the model's context of {context} tokens"),
  ]
  before = program_lib.PROGRAMS.stats()
  for fields, error, match in cases:
    prompts = fields.pop("prompts", [[3, 4, 5]])
    with pytest.raises(error, match=match):
      engine.stream_batch(prompts, SamplingParams(**fields))
  assert program_lib.PROGRAMS.stats() == before  # refused before any program was asked for


def test_rows_that_fit_alone_but_not_in_one_program_are_refused_saying_why(engine):
  context = engine.config.max_context
  long_prompt, short_prompt = [3] * (context - 8), [3] * 4
  rows = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=context - 8)]
  check_request([long_prompt], rows[:1], vocab_size=engine.config.vocab_size, max_context=context)  # each fits
  check_request([short_prompt], rows[1:], vocab_size=engine.config.vocab_size, max_context=context)
  with pytest.raises(ContextError, match="rows of one call share one program"):
    engine.stream_batch([long_prompt, short_prompt], rows)


def test_a_request_needs_prompts_and_one_setting_per_prompt(engine):
  with pytest.raises(RequestError, match="no prompts"):
    engine.stream_batch([], SamplingParams())
  with pytest.raises(RequestError, match="got 2 prompts but 3 sampling settings"):
    engine.stream_batch([[3], [4]], [SamplingParams()] * 3)


def test_every_refusal_is_a_user_error_and_a_good_request_passes():
  check_request(
    [[0, 63]], [SamplingParams(top_k=64, max_tokens=14, stop_token_ids=(63,))], vocab_size=64, max_context=16
  )
  for prompts, params in (([[64]], SamplingParams()), ([[1] * 10], SamplingParams(max_tokens=7))):
    with pytest.raises(UserError):
      check_request(prompts, [params], vocab_size=64, max_context=16)


def test_the_cli_reports_the_same_refusal_in_one_line(tmp_path, capsys):
  cfg, model = tiny_model("llama_gqa", seed=2)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  code = cli.main(["generate", "--model", str(directory), "--prompt", "hello", "--top-k", str(cfg.vocab_size + 1)])
  err = capsys.readouterr().err
  assert code == 2 and f"top_k must be at most the vocabulary size {cfg.vocab_size}" in err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1

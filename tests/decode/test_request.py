"""One check of a request's fields (:func:`thoughtjax.decode.request.check_request`) for the Python API, the CLI
and the server: each bad field is refused by name, before any device work, with the same words everywhere."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_engine, tiny_model, write_safetensors_dir
from thoughtjax import cli
from thoughtjax.decode import program as program_lib
from thoughtjax.decode.request import ContextError, DecodeRequest, check_request
from thoughtjax.decode.stream import RequestError
from thoughtjax.errors import UserError
from thoughtjax.sampling import SamplingError, SamplingParams, program_mode


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


def test_a_decode_request_gives_the_bucketed_key_fields_and_left_padded_prompts():
  params = [
    SamplingParams(max_tokens=20, stop_token_ids=(7, 8)),
    SamplingParams(max_tokens=5, temperature=0.7, logit_bias={3: 1.0}),
  ]
  request = DecodeRequest.checked([[5, 6, 7], [9] * 17], params, vocab_size=64, max_context=128, eos_ids=(2, 8))
  assert request.stops == ((7, 8, 2), (2, 8))  # the row's own stop ids, then the end-of-sequence ids, once each
  fields = request.key_fields()
  assert fields == dict(batch=2, prompt_len=32, max_new=32, stop_width=4, mode=program_mode(params), has_bias=True)
  assert program_lib.ProgramKey(layers=(0,), **fields).cache_len == 64
  tokens, pad = request.left_padded(4, 32)
  assert pad.tolist() == [29, 15, 31, 31]  # rows past the prompts hold one inert token
  assert tokens[0].tolist() == [0] * 29 + [5, 6, 7] and tokens[1].tolist() == [0] * 15 + [9] * 17
  assert not tokens[2:].any()
  with pytest.raises(ContextError):
    DecodeRequest.checked([[5] * 120], [SamplingParams(max_tokens=20)], vocab_size=64, max_context=128, eos_ids=2)
  with pytest.raises(RequestError, match="one params and one stop set per prompt"):
    DecodeRequest([[5]], params, [[]])


def test_ignore_eos_keeps_only_the_rows_own_stop_ids():
  params = [SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,)), SamplingParams(max_tokens=4)]
  request = DecodeRequest.checked([[1], [1]], params, vocab_size=64, max_context=64, eos_ids=2)
  assert request.stops == ((9,), (2,))
  assert request.key_fields()["stop_width"] == 4 and request.key_fields()["batch"] == 2

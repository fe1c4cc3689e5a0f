"""``thoughtjax generate`` and ``score``: their JSON agrees with the library; a bad model path is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import thoughtjax
from tests.tiny import tiny_model, write_safetensors_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  cfg, model = tiny_model("llama_gqa", seed=2)
  return write_safetensors_dir(tmp_path_factory.mktemp("tiny") / "model", cfg, model)


def _cli(*args, env=None):
  return subprocess.run(
    [sys.executable, "-m", "thoughtjax.cli", *args],
    capture_output=True,
    text=True,
    env={**os.environ, **(env or {})},
    timeout=600,
  )


def test_generate_json_contract(tiny_dir, tmp_path):
  r = _cli(
    "generate",
    "--model",
    str(tiny_dir),
    "--prompt",
    "hello",
    "--max-tokens",
    "5",
    "--json",
    env={"THOUGHTJAX_CACHE": str(tmp_path)},
  )
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  # The command prints what the library computes for the same model and prompt (greedy by default).
  model = thoughtjax.load(tiny_dir, compile_cache=False)
  expected = model.generate("hello", max_tokens=5)
  assert out["prompt_ids"] == model.prompt_ids("hello")
  assert out["token_ids"] == expected.token_ids and out["text"] == expected.text
  assert out["finish_reason"] == expected.finish_reason
  assert 0 <= out["time_to_first_token_s"] <= out["total_s"]


def test_score_json_contract(tiny_dir, tmp_path):
  r = _cli(
    "score",
    "--model",
    str(tiny_dir),
    "--token-ids",
    "5,6,7,8",
    "--top-k",
    "3",
    "--json",
    env={"THOUGHTJAX_CACHE": str(tmp_path)},
  )
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert len(out["top_ids"]) == 4 and all(len(t) == 3 for t in out["top_ids"])
  assert all(row == sorted(row, reverse=True) for row in out["top_logits"])
  assert out["perplexity"] == pytest.approx(2.718281828 ** out["nll"], rel=1e-6)
  expected = thoughtjax.load(tiny_dir, compile_cache=False).score([5, 6, 7, 8], top_k=3)
  assert out["token_ids"] == [5, 6, 7, 8] and out["top_ids"] == expected.top_ids
  assert out["nll"] == pytest.approx(expected.nll, abs=1e-5)


def test_bad_model_path_is_a_clear_cli_error(tmp_path):
  r = _cli("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x", env={"THOUGHTJAX_CACHE": str(tmp_path)})
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert r.stderr.strip().splitlines() == [
    f"thoughtjax generate: error: CommandLineError: --model '{tmp_path / 'nope.gguf'}' is neither a known name "
    f"(smollm2-135m-instruct) nor an existing .gguf file or safetensors directory; pass a known name or fix the path"
  ]


@pytest.mark.slow
def test_chat_answer_on_the_default_model():
  r = _cli("generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0")
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "The capital of France is Paris."


def test_generate_with_a_regex_prints_text_in_the_language(tiny_dir, tmp_path):
  import re

  r = _cli(
    "generate",
    "--model",
    str(tiny_dir),
    "--prompt",
    "hello",
    "--max-tokens",
    "12",
    "--regex",
    "(yes|no)[0-9]{1,3}",
    "--json",
    env={"THOUGHTJAX_CACHE": str(tmp_path)},
  )
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out["finish_reason"] == "stop" and re.fullmatch("(yes|no)[0-9]{1,3}", out["text"])


@pytest.mark.parametrize(
  ("flags", "says"),
  [
    (["--regex", "(unclosed"], "regex"),
    (["--json-schema", "{schema}"], "json_schema"),
    (["--json-schema", "{missing}"], "--json-schema"),
  ],
)
def test_a_bad_constraint_is_one_line_and_exit_2(tiny_dir, tmp_path, capsys, flags, says):
  from thoughtjax import cli

  schema = tmp_path / "schema.json"
  schema.write_text('{"type": "object", "properties": {"a": {"type": "nope"}}}')
  argv = [f.format(schema=schema, missing=tmp_path / "missing.json") for f in flags]
  assert cli.main(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--max-tokens", "2", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and says in err[0] and "error" in err[0]


def test_two_constraints_are_a_usage_error(tiny_dir, capsys):
  from thoughtjax import cli

  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--regex", "a", "--grammar", "g.lark"])
  assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

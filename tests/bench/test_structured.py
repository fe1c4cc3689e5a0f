"""``thoughtjax bench structured``: the shipped extraction set, the scoring, the harness with a fake generator (the
seam a peer server plugs into), and the unconstrained branch end to end on a tiny model. Timings are never judged."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.tiny import tiny_engine, tiny_model, write_safetensors_dir
from thoughtjax.bench import structured
from thoughtjax.bench.structured import Extraction, ExtractionSetError, Output, load_extraction_set, run, score
from thoughtjax.cli import main

# What both llguidance and llama.cpp's json_schema grammar honour; llama.cpp takes ranges on integers only.
KEYWORDS = {
  "type",
  "properties",
  "required",
  "additionalProperties",
  "items",
  "minItems",
  "maxItems",
  "enum",
  "minimum",
  "maximum",
  "pattern",
  "minLength",
  "maxLength",
}


def _schemas(schema):
  yield schema
  for sub in schema.get("properties", {}).values():
    yield from _schemas(sub)
  if "items" in schema:
    yield from _schemas(schema["items"])


def test_the_shipped_set_has_50_varied_prompts_whose_answers_validate():
  items = load_extraction_set()
  assert len(items) == 50 and len({i.id for i in items}) == 50
  seen = set()
  for item in items:
    jsonschema.Draft202012Validator.check_schema(item.schema)
    jsonschema.validate(item.answer, item.schema)
    assert item.schema["type"] == "object" and item.schema["required"], item.id
    assert "JSON" in item.prompt and len(item.prompt) < 600, item.id
    for s in _schemas(item.schema):
      assert set(s) <= KEYWORDS, (item.id, set(s) - KEYWORDS)
      if "minimum" in s or "maximum" in s:
        assert s["type"] == "integer", (item.id, "llama.cpp ranges only integers")
      if "pattern" in s:
        assert s["pattern"].startswith("^") and s["pattern"].endswith("$"), item.id
      seen.add(s.get("type", "enum"))
      seen |= {"enum"} if "enum" in s else set()
      seen |= {"range"} if "minimum" in s else set()
      seen |= {"nested"} if s is not item.schema and s.get("type") == "object" else set()
      seen |= {"optional"} if set(s.get("properties", {})) - set(s.get("required", [])) else set()
  assert {"object", "array", "string", "integer", "number", "boolean", "enum", "range", "nested", "optional"} <= seen


@pytest.mark.parametrize(
  "line, message",
  [
    ("{", "not a JSON object"),
    ('{"id": "a", "prompt": "p"}', "expected an object with id, prompt, schema and answer"),
    ('{"id": "a", "prompt": "p", "schema": {"type": "integer"}, "answer": "x"}', "does not follow the schema"),
    ('{"id": "a", "prompt": "p", "schema": {"type": 5}, "answer": 1}', "not a valid JSON Schema"),
  ],
)
def test_a_bad_set_file_is_refused_naming_the_line(tmp_path, line, message):
  path = tmp_path / "set.jsonl"
  path.write_text('{"id": "ok", "prompt": "p", "schema": {"type": "integer"}, "answer": 1}\n\n' + line + "\n")
  with pytest.raises(ExtractionSetError, match=f"{path}:3: .*{message}"):
    load_extraction_set(path)


def test_a_repeated_id_is_refused(tmp_path):
  path = tmp_path / "set.jsonl"
  path.write_text('{"id": "a", "prompt": "p", "schema": {}, "answer": 1}\n' * 2)
  with pytest.raises(ExtractionSetError, match=":2: id 'a' is used twice"):
    load_extraction_set(path)


ITEM = Extraction(
  "person",
  "Tom is 34. Extract name and age as JSON.",
  {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
  },
  {"name": "Tom", "age": 34},
)


@pytest.mark.parametrize(
  "text, parsed, valid, fields",
  [
    ('{"name": "Tom", "age": 34}', True, True, 1.0),
    ('  \n{"name": " tom ", "age": 34}\n', True, True, 1.0),  # blanks around and case do not matter
    ('{"name": "Tim", "age": 34}', True, True, 0.5),
    ('{"name": "Tom", "age": -1}', True, False, 0.5),
    ('{"name": "Tom"}', True, False, 0.5),
    ('{"name": "Tom", "age": true}', True, False, 0.5),  # a boolean is not the number 1 or 34
    ("[1, 2]", True, False, 0.0),
    ('```json\n{"name": "Tom", "age": 34}\n```', False, False, 0.0),  # a fenced answer is not JSON output
    ('Sure! {"name": "Tom", "age": 34}', False, False, 0.0),
    ("", False, False, 0.0),
  ],
)
def test_score(text, parsed, valid, fields):
  s = score(ITEM, text)
  assert (s["parsed"], s["valid"], s["fields"]) == (parsed, valid, fields)
  assert (s["error"] is None) == valid
  fenced = text.startswith("```")
  assert s["parsed_fenced"] == (parsed or fenced) and s["valid_fenced"] == (valid or fenced)


def test_the_harness_counts_per_mode_through_the_generate_seam():
  """A fake generator stands where a model or a peer server (llama-server's response_format) would."""
  items = [ITEM, Extraction("n", "give a number as JSON", {"type": "object"}, {})]
  calls = []

  def generate(item, constrained, max_tokens):
    calls.append((item.id, constrained, max_tokens))
    if constrained:
      return Output(json.dumps(item.answer), 7, 0.5, 0.25)
    return Output("Here you go: " + json.dumps(item.answer), 9, 1.0, None)

  report = run(items, generate, max_tokens=33)
  # One warm-up call per mode, then every item once.
  assert calls == [
    ("person", False, 33),
    ("person", False, 33),
    ("n", False, 33),
    ("person", True, 33),
    ("person", True, 33),
    ("n", True, 33),
  ]
  un, con = report["modes"]["unconstrained"], report["modes"]["constrained"]
  assert un["summary"] | {} == {
    "prompts": 2,
    "parsed": 0,
    "valid": 0,
    "parsed_fenced": 0,
    "valid_fenced": 0,
    "fields": 0.0,
    "tokens": 18,
    "seconds": 2.0,
    "tok_s": 9.0,
    "decode_tok_s": None,
  }
  assert con["summary"]["parsed"] == con["summary"]["valid"] == 2 and con["summary"]["fields"] == 1.0
  assert con["summary"]["tok_s"] == 14.0 and con["summary"]["decode_tok_s"] == 12 / 0.5
  assert [r["id"] for r in con["rows"]] == ["person", "n"] and con["rows"][0]["text"] == '{"name": "Tom", "age": 34}'
  assert report["max_tokens"] == 33 and report["prompts"] == 2


def test_the_model_generator_uses_the_chat_template_greedy_and_the_schema():
  seen = []

  class FakeCompletion:
    text, token_ids, timings = '{"a": 1}', [1, 2, 3], {"start": 0.0, "first_token": 1.0, "end": 2.0}

  class FakeModel:
    def generate(self, prompt, **kw):
      seen.append((prompt, kw))
      return FakeCompletion()

  gen = structured.model_generator(FakeModel())
  out = gen(ITEM, True, 12)
  assert out.text == '{"a": 1}' and out.tokens == 3 and out.decode_seconds == 1.0
  gen(ITEM, False, 12)
  assert seen == [
    (ITEM.prompt, {"chat": True, "max_tokens": 12, "temperature": 0.0, "json_schema": ITEM.schema}),
    (ITEM.prompt, {"chat": True, "max_tokens": 12, "temperature": 0.0}),
  ]


def test_a_model_without_json_schema_says_to_run_unconstrained():
  class OldModel:  # a Model.generate from before constrained decoding: json_schema lands in SamplingParams
    def generate(self, prompt, **kw):
      raise TypeError("SamplingParams.__init__() got an unexpected keyword argument 'json_schema'")

  with pytest.raises(structured.BenchStructuredError, match="run with --modes unconstrained"):
    structured.model_generator(OldModel())(ITEM, True, 3)
  with pytest.raises(TypeError):  # any other TypeError is a bug and keeps its traceback
    structured.model_generator(OldModel())(ITEM, False, 3)


def test_the_reference_decoder_gives_valid_json_under_the_schema_and_greedy_tokens_without(capsys):
  """On a random tiny model the unconstrained output is noise, the constrained one validates; unconstrained, the
  reference decoder's tokens are the engine's greedy tokens."""
  model = tiny_engine("llama_gqa", seed=4, chat=True)
  schema = {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "role": {"enum": ["admin", "user"]},
      "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
    # Compact JSON: a random model would spend its 256-token context on the allowed blanks between tokens.
    "x-guidance": {"whitespace_pattern": ""},
  }
  item = Extraction("t", "Extract JSON.", schema, {"name": "a", "age": 1, "role": "user", "tags": []})
  report = run([item], structured.masked_greedy_generator(model), max_tokens=120, warmup=False)
  row = report["modes"]["constrained"]["rows"][0]
  assert row["parsed"] and row["valid"], row
  jsonschema.validate(json.loads(row["text"]), schema)
  ref = structured.masked_greedy_generator(model)(item, False, 12)
  engine = model.generate(item.prompt, chat=True, max_tokens=12)
  assert ref.text == engine.text and ref.tokens == len(engine.token_ids)


def test_bench_structured_unconstrained_end_to_end_on_a_tiny_model(tmp_path, capsys):
  cfg, model = tiny_model("llama_gqa", seed=3)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  out = tmp_path / "structured.json"
  args = ["bench", "structured", "--model", str(directory), "--prompts", "2", "--max-tokens", "4"]
  code = main(args + ["--modes", "unconstrained", "--json", str(out)])
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["prompts"] == 2 and d["max_tokens"] == 4 and list(d["modes"]) == ["unconstrained"] and d["weights"] == "f32"
  rows = d["modes"]["unconstrained"]["rows"]
  assert [r["id"] for r in rows] == [i.id for i in load_extraction_set()[:2]]
  for r in rows:
    assert 1 <= r["tokens"] <= 4 and set(r) >= {"parsed", "valid", "fields", "text", "error"}
  assert "structured output: 2 extraction prompts" in printed and "unconstrained" in printed


@pytest.mark.parametrize(
  "extra, message",
  [
    (["--prompts", "51"], "the set has 50 prompts"),
    (["--prompts", "0"], "expected a whole number >= 1"),
    (["--modes", "constrained,loose"], "expected a comma list of unconstrained, constrained"),
  ],
)
def test_bench_structured_refuses_bad_arguments(tmp_path, capsys, extra, message):
  cfg, model = tiny_model("llama_gqa", seed=3)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  try:
    code = main(["bench", "structured", "--model", str(directory)] + extra)
  except SystemExit as e:  # argparse's own refusals
    code = e.code
  _, err = capsys.readouterr()
  assert code == 2 and message in err


def test_the_engine_under_a_schema_gives_the_reference_decoders_tokens():
  """Greedy under a constraint equals greedy of the unconstrained model with the refused ids at -inf."""
  model = tiny_engine("llama_gqa", seed=4, chat=True)
  schema = {
    "type": "object",
    "properties": {"role": {"enum": ["admin", "user"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["role", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_pattern": ""},
  }
  item = Extraction("t", "Extract JSON.", schema, {"role": "user", "n": 1})
  ref = structured.masked_greedy_generator(model)(item, True, 60)
  engine = structured.model_generator(model)(item, True, 60)
  assert engine.text == ref.text and engine.tokens == ref.tokens
  jsonschema.validate(json.loads(engine.text), schema)


STUB_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
log = open(sys.argv[sys.argv.index("-m") + 1] + ".requests", "a")

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps(body) + "\\n"); log.flush()
        text = '{"city": "Paris"}' if "response_format" in body else "Sure! The city is Paris."
        self._send({"choices": [{"message": {"role": "assistant", "content": text}}],
                    "usage": {"completion_tokens": 7}, "timings": {"predicted_ms": 70.0}})

HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_bench_structured_runs_the_prompts_through_a_llama_server_peer(tmp_path, capsys):
  """A stub llama-server (same command line, same HTTP API) stands in for llama.cpp's: the peer gets the same
  chat message, greedy, with the schema as response_format only when constrained, and its rows are scored."""
  import sys

  stub = tmp_path / "llama-server"
  stub.write_text(f"#!{sys.executable}\n{STUB_SERVER}")
  stub.chmod(0o755)
  cfg, model = tiny_model("llama_gqa", seed=3)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  out = tmp_path / "structured.json"
  argv = ["bench", "structured", "--model", str(directory), "--prompts", "2", "--max-tokens", "4"]
  assert main(argv + ["--modes", "unconstrained", "--peer", "llama-server", "--llama-server", str(stub)]) == 0
  assert main(argv + ["--peer", "llama-server", "--llama-server", str(stub), "--json", str(out)]) == 0
  peer = json.loads(out.read_text())["peer"]
  assert peer["name"] == "llama-server" and set(peer["modes"]) == {"unconstrained", "constrained"}
  assert peer["modes"]["unconstrained"]["summary"]["parsed"] == 0
  assert peer["modes"]["constrained"]["summary"]["tokens"] == 14
  assert "llama-server (same GGUF)" in capsys.readouterr().out
  items = {i.prompt: i for i in load_extraction_set()[:2]}
  sent = [json.loads(x) for x in Path(f"{directory}.requests").read_text().splitlines()]
  assert len(sent) == 3 + 6  # per mode one warm-up request, then the 2 prompts
  for body in sent:
    item = items[body["messages"][0]["content"]]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 4 and body["messages"][0]["role"] == "user"
    if "response_format" in body:
      assert body["response_format"]["json_schema"]["schema"] == item.schema
  assert sum("response_format" in b for b in sent) == 3


def test_a_missing_llama_server_binary_is_a_named_error(tmp_path):
  from thoughtjax.bench.llama_server import LlamaServerError, find_binary

  with pytest.raises(LlamaServerError, match="not found"):
    find_binary(str(tmp_path / "nowhere" / "llama-server"))


def test_mask_overhead_times_a_free_and_a_constrained_batch_of_different_schemas():
  model = tiny_engine("llama_gqa", seed=4, chat=True)
  items = [
    Extraction(
      str(i),
      f"Give item {i} as JSON.",
      {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]},
      {f"k{i}": i},
    )
    for i in range(8)
  ]
  for batch, constrained in ((1, None), (8, None), (8, 1)):
    o = structured.mask_overhead(model, items, batch, constrained=constrained, max_tokens=6, repeats=1)
    assert o["batch"] == batch and o["constrained"] == (constrained or batch)
    assert o["plain_ms_per_step"] > 0 and o["masked_ms_per_step"] > 0
    assert o["overhead"] == pytest.approx(o["masked_ms_per_step"] / o["plain_ms_per_step"] - 1)
  with pytest.raises(structured.BenchStructuredError, match="needs 8 prompts"):
    structured.mask_overhead(model, items[:3], 8)
  with pytest.raises(structured.BenchStructuredError, match="constrained rows: expected 1 to 8, got 9"):
    structured.mask_overhead(model, items, 8, constrained=9)


def test_a_peer_that_dies_while_starting_is_a_named_error_quoting_its_output(tmp_path):
  import sys

  from thoughtjax.bench.llama_server import LlamaServer, LlamaServerError

  stub = tmp_path / "llama-server"
  stub.write_text(f"#!{sys.executable}\nimport sys\nprint('error: unknown argument --jinja')\nsys.exit(1)\n")
  stub.chmod(0o755)
  with pytest.raises(LlamaServerError, match="exited with 1 while starting") as e:
    with LlamaServer(stub, tmp_path / "model.gguf"):
      pass
  assert "unknown argument --jinja" in str(e.value)

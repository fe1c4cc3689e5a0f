"""``thoughtjax serve``'s settings, read in one place (server/config.py ``serve_config``): a flag over its
``THOUGHTJAX_*`` variable over the YAML file over the built-in default (HTTP on 8080); the command's flags as
llama-server and vLLM users type them; ``serve --model`` on a GGUF file; every argument of ``serve`` and
``client`` documented."""

from __future__ import annotations

import argparse

import pytest

from thoughtjax.cli import build_parser, main
from thoughtjax.server.config import DEFAULT_HTTP_PORT, ConfigError, ServerConfig, load_config, serve_config

KEY = "k" * 24


def yaml_file(tmp_path, text: str):
  path = tmp_path / "server.yaml"
  path.write_text(text)
  return path


# ---- precedence -------------------------------------------------------------------------------------------------
def test_http_is_on_by_default_and_null_in_the_file_or_no_http_turns_it_off(tmp_path):
  assert DEFAULT_HTTP_PORT == 8080 and load_config().http_port == 8080  # the shipped file says so too
  assert serve_config(yaml_file(tmp_path, "port: 0\n"), environ={}).http_port == 8080  # a file without the key
  assert serve_config(yaml_file(tmp_path, "http_port: null\n"), environ={}).http_port is None
  assert serve_config(yaml_file(tmp_path, "http_port: 9000\n"), {"http_port": "off"}, environ={}).http_port is None
  assert serve_config(yaml_file(tmp_path, "http_port: null\n"), {"http_port": 0}, environ={}).http_port == 0
  c = serve_config(yaml_file(tmp_path, "port: 0\n"), {"port": 50052, "bind": "::1"}, environ={})
  assert (c.port, c.bind, c.address) == (50052, "::1", "[::1]:50052")


def test_a_flag_wins_over_its_variable_which_wins_over_the_file(tmp_path):
  path = yaml_file(
    tmp_path,
    "max_concurrent: 5\nmodel_name: from-yaml\nwarm: {hints: [fast_draft], max_tokens: [8]}\n"
    f"clients: {{token_file: {tmp_path / 'nope'}}}\n",
  )
  env = {
    "THOUGHTJAX_SLOTS": "3",
    "THOUGHTJAX_MODEL_ALIAS": "from-env",
    "THOUGHTJAX_WARM": "general_purpose, code_generation",
    "THOUGHTJAX_API_KEY": KEY,
  }
  c = serve_config(path, environ=env)
  assert (c.max_concurrent, c.model_name, c.warm.hints) == (3, "from-env", ("general_purpose", "code_generation"))
  assert c.warm.max_tokens == (8,)  # the rest of the file's section stays
  assert c.clients.token == KEY and c.clients.token_file is None and c.clients.bearer() == KEY
  flags = {"max_concurrent": "7", "model_name": "from-flag", "warm.hints": "fast_draft", "clients.token": "f" * 16}
  c = serve_config(path, flags, environ=env)
  assert (c.max_concurrent, c.model_name, c.warm.hints, c.clients.token) == (7, "from-flag", ("fast_draft",), "f" * 16)
  c = serve_config(path, environ={"THOUGHTJAX_SLOTS": ""})  # empty: not given
  assert (c.max_concurrent, c.model_name, c.warm.hints) == (5, "from-yaml", ("fast_draft",))
  assert serve_config(path, {"strict_fields": True}, environ={}).strict_fields


def test_the_engine_layout_comes_from_the_file_or_its_variable_and_reaches_the_slot_engines(tmp_path):
  """``engine_layout`` (YAML, or THOUGHTJAX_ENGINE_LAYOUT over it) is the layout the continuous scheduler's pool
  gives its slot engines (by default indexed; null: each engine takes its model's); a value that is not a layout is
  refused."""
  from thoughtjax.server.scheduling import make_scheduler

  assert load_config().engine_layout == "indexed" == ServerConfig().engine_layout  # the shipped file and the default
  assert serve_config(yaml_file(tmp_path, "engine_layout: null\n"), environ={}).engine_layout is None
  path = yaml_file(tmp_path, "engine_layout: unrolled\n")
  assert serve_config(path, environ={}).engine_layout == "unrolled"
  c = serve_config(path, environ={"THOUGHTJAX_ENGINE_LAYOUT": "indexed"})
  scheduler = make_scheduler(c)
  try:
    assert c.engine_layout == "indexed" and scheduler.pool.layout == "indexed"
  finally:
    scheduler.close()
  with pytest.raises(ConfigError, match="engine_layout: expected one of"):
    serve_config(yaml_file(tmp_path, "engine_layout: scan\n"), environ={})


def test_the_name_from_model_is_a_default_the_file_the_variable_and_the_flag_override(tmp_path):
  given = {"model_name": "tiny"}
  assert serve_config(yaml_file(tmp_path, "model_name: null\n"), environ={}, defaults=given).model_name == "tiny"
  assert serve_config(yaml_file(tmp_path, "model_name: mine\n"), environ={}, defaults=given).model_name == "mine"
  env = {"THOUGHTJAX_MODEL_ALIAS": "env"}
  assert serve_config(yaml_file(tmp_path, "port: 1\n"), environ=env, defaults=given).model_name == "env"


@pytest.mark.parametrize(
  "flags, env, match",
  [
    ({}, {"THOUGHTJAX_SLOTS": "many"}, "THOUGHTJAX_SLOTS: expected the number of slots"),
    ({"max_concurrent": "0"}, {}, "--parallel/-np/--slots: expected the number of slots"),
    ({}, {"THOUGHTJAX_API_KEY": "short"}, "THOUGHTJAX_API_KEY: expected a client token of at least 16"),
    ({"clients.token": "short"}, {}, "--api-key: expected a client token of at least 16"),
    ({}, {"THOUGHTJAX_WARM": "a,,b"}, "THOUGHTJAX_WARM: expected hint names separated by commas"),
    ({"model_name": " "}, {}, "--alias/--served-model-name: expected a non-empty value"),
    ({}, {"THOUGHTJAX_ENGINE_LAYOUT": "scan"}, "THOUGHTJAX_ENGINE_LAYOUT: expected one of unrolled, indexed"),
  ],
)
def test_a_bad_flag_or_variable_is_a_config_error_naming_it(tmp_path, flags, env, match):
  with pytest.raises(ConfigError, match=match):
    serve_config(yaml_file(tmp_path, "port: 0\n"), flags, environ=env)


# ---- the command line -------------------------------------------------------------------------------------------
@pytest.fixture
def served_config(monkeypatch):
  """``main(["serve", ...])`` with the server replaced by a recorder of its config and load function."""
  import thoughtjax.server.app as app_mod

  got = {}

  async def fake_serve(_, config, *, load, **kw):
    got["config"], got["load"] = config, load

  monkeypatch.setattr(app_mod, "serve", fake_serve)
  for var in (
    "THOUGHTJAX_API_KEY",
    "THOUGHTJAX_MODEL_ALIAS",
    "THOUGHTJAX_SLOTS",
    "THOUGHTJAX_WARM",
    "THOUGHTJAX_ENGINE_LAYOUT",
  ):
    monkeypatch.delenv(var, raising=False)
  return got


def test_serve_takes_llama_server_and_vllm_flags(tiny_registry, served_config, monkeypatch):
  reg = ["--registry", str(tiny_registry.root)]
  assert main(["serve", *reg, "--host", "127.0.0.2", "-np", "3", "--served-model-name", "tiny", "--no-http"]) == 0
  c = served_config["config"]
  assert (c.bind, c.max_concurrent, c.model_name, c.http_port, c.port) == ("127.0.0.2", 3, "tiny", None, 50051)
  monkeypatch.setenv("THOUGHTJAX_API_KEY", KEY)
  monkeypatch.setenv("THOUGHTJAX_SLOTS", "2")
  argv = ["--bind", "0.0.0.0", "--port", "0", "--warm", "fast_draft", "--alias", "a", "--strict-fields"]
  assert main(["serve", *reg, *argv]) == 0
  c = served_config["config"]
  assert (c.bind, c.port, c.http_port, c.max_concurrent, c.clients.token) == ("0.0.0.0", 0, 8080, 2, KEY)
  assert c.warm.hints == ("fast_draft",) and c.model_name == "a" and c.strict_fields
  assert main(["serve", *reg, "--parallel", "4", "--slots", "5", "--http-port", "0"]) == 0  # the last one given
  assert (served_config["config"].max_concurrent, served_config["config"].http_port) == (5, 0)


def test_serve_refuses_a_bad_model_in_one_line(tmp_path, served_config, capsys):
  text = tmp_path / "notes.gguf"
  text.write_text("not a model")
  for argv, match in (
    (["--model", str(tmp_path / "missing.gguf")], "expected a file, found nothing"),
    (["--model", str(text)], "expected a GGUF file (its first bytes 'GGUF')"),
    (["--model", str(tmp_path)], "expected a .gguf file, found a directory"),
    (["--api-key", "short"], "--api-key: expected a client token"),
  ):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
  assert "config" not in served_config  # nothing started
  for argv in (["--model", str(text), "--registry", str(tmp_path)], ["--http-port", "0", "--no-http"]):
    with pytest.raises(SystemExit) as refused:  # argparse: flags that exclude each other
      main(["serve", *argv])
    assert refused.value.code == 2


def test_serve_model_builds_a_registry_of_another_gguf_once(tmp_path, served_config, monkeypatch):
  """A GGUF that is not the default model gets a registry keyed by its content under the cache, calibrated on its
  full path; the server names the model after the file."""
  from tests.tiny import TINY_CONFIGS, write_gguf
  from thoughtjax.synthesis import default_registry
  from thoughtjax.transformer import init_random

  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg = TINY_CONFIGS["llama_gqa"]
  gguf = write_gguf(tmp_path / "Tiny-Chat.Q4_1.gguf", cfg, init_random(cfg, 3, scale=0.08), "Q4_1")
  assert main(["serve", "--model", str(gguf), "--port", "0", "--http-port", "0"]) == 0
  assert served_config["config"].model_name == "Tiny-Chat.Q4_1"
  syn = served_config["load"]()  # what the server runs once its ports are bound
  root = syn.registry.root
  assert root.parent == tmp_path / "cache" / "registry" and root.name.startswith("gguf-")
  assert [c.path for c in syn.calibration.candidates] == [f"embed, blocks[0:{cfg.num_layers}), head"]
  assert syn.plan("hello", max_latency_ms=float("inf"), max_tokens=3).path == syn.calibration.candidates[0].path
  again = default_registry.ensure_gguf(gguf)  # found, not built or measured again
  assert again.root == root and again.sequence == syn.registry.sequence


def test_the_default_models_file_serves_the_default_registry(tmp_path, monkeypatch):
  """The GGUF is recognized by its sha256, not its name: a copy of the default model anywhere serves the default
  registry (here a stand-in file takes the known digest)."""
  import dataclasses

  from thoughtjax import fetch as fetch_lib
  from thoughtjax.synthesis import default_registry

  copy = tmp_path / "renamed.gguf"
  copy.write_bytes(b"GGUF" + bytes(60))
  known = fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL]
  stand_in = dataclasses.replace(known, sha256=fetch_lib.sha256_file(copy))
  monkeypatch.setitem(fetch_lib.KNOWN_MODELS, fetch_lib.DEFAULT_MODEL, stand_in)
  monkeypatch.setattr(default_registry, "ensure_default", lambda progress=None, **kw: ("default", kw))
  assert default_registry.ensure_gguf(copy, weights="native") == ("default", {"weights": "native"})


def test_every_serve_and_client_argument_has_help_and_client_prompt_is_required():
  parser = build_parser()
  commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
  for name in ("serve", "client"):
    missing = [a.dest for a in commands[name]._actions if not a.help]
    assert not missing, f"{name}: arguments without help: {missing}"
  prompt = next(a for a in commands["client"]._actions if a.dest == "prompt")
  assert prompt.required and "--prompt PROMPT" in commands["client"].format_usage().replace("[--prompt", "")
  with pytest.raises(SystemExit) as refused:
    main(["client", "--target", "127.0.0.1:1"])
  assert refused.value.code == 2

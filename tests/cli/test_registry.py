"""``thoughtjax registry ...`` commands and ``generate/score --registry``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.registry.helpers import REPO, mapping_text
from tests.tiny import tiny_model, write_safetensors_dir
from thoughtjax import cli
from thoughtjax.compose import compose
from thoughtjax.registry import Registry, dir_name


@pytest.fixture(scope="module")
def cli_registry(tmp_path_factory):
  """A registry built by the CLI from a safetensors directory, signed with a CLI key."""
  root = tmp_path_factory.mktemp("cli")
  cfg, model = tiny_model("llama_gqa", seed=2)
  src = write_safetensors_dir(root / "model", cfg, model)
  (root / "mapping.yaml").write_text(mapping_text([(0, 1), (1, 3)], 3))
  assert cli.main(["registry", "keygen", str(root / "keys" / "ci")]) == 0
  assert (
    cli.main(
      [
        "registry",
        "build",
        "--model",
        str(src),
        "--mapping",
        str(root / "mapping.yaml"),
        "--out",
        str(root / "reg"),
        "--sign-key",
        str(root / "keys" / "ci.key"),
        "--context",
        "32",
        "--reps",
        "2",
      ]
    )
    == 0
  )
  return root


def test_build_verify_list_show(cli_registry, capsys):
  reg_dir, pub = cli_registry / "reg", cli_registry / "keys" / "ci.pub"
  capsys.readouterr()
  assert cli.main(["registry", "verify", str(reg_dir), "--public-key", str(pub), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["index_signed"] and len(out["thoughtlets"]) == 5
  assert all(t["versioned_hash"] == "ok" for t in out["thoughtlets"])
  assert out["sequence"] == Registry.open(reg_dir).sequence >= 1
  assert cli.main(["registry", "verify", str(reg_dir), "--public-key", str(pub)]) == 0
  assert f"index sequence {out['sequence']} (signed)" in capsys.readouterr().out
  assert cli.main(["registry", "list", str(reg_dir)]) == 0
  listed = capsys.readouterr().out
  assert "blocks[1:3)" in listed and "logits" in listed
  assert cli.main(["registry", "show", str(reg_dir), "head"]) == 0
  manifest = json.loads(capsys.readouterr().out)
  assert manifest["resource_profile"]["context"] == 32 and manifest["resource_profile"]["flops_per_token"] > 0


def test_verify_reports_a_flipped_byte(cli_registry, tmp_path, capsys):
  import shutil

  reg_dir = tmp_path / "reg"
  shutil.copytree(cli_registry / "reg", reg_dir)
  version = Registry.open(reg_dir).current["blocks[0:1)"]
  vdir = reg_dir / "thoughtlets" / dir_name("blocks[0:1)") / version
  victim = max((p for p in (vdir / "checkpoint").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  data[-7] ^= 0x80
  victim.write_bytes(bytes(data))
  capsys.readouterr()
  assert cli.main(["registry", "verify", str(reg_dir)]) == 2
  err = capsys.readouterr().err
  assert f"IntegrityError: integrity check failed for blocks[0:1)@{version}: file {victim}" in err


def test_validate_names_the_line(tmp_path, capsys):
  bad = tmp_path / "bad.yaml"
  bad.write_text(mapping_text([(0, 2), (1, 3)], 3))
  assert cli.main(["registry", "validate", str(bad)]) == 2
  err = capsys.readouterr().err
  assert f"{bad}:15: entry 3 (blocks[1:3)): layers [1, 3) overlap entry 2" in err


def test_generate_and_score_resolve_paths_through_a_registry(cli_registry, tmp_path):
  reg_dir = cli_registry / "reg"
  path = "embed, blocks[0:1), blocks[0:1), head"
  code = (
    "import json, sys\n"
    "from thoughtjax import cli\n"
    "reg, path = sys.argv[1], sys.argv[2]\n"
    "cli.main(['generate', '--registry', reg, '--path', path, '--prompt', 'hello', '--max-tokens', '4', '--json'])\n"
    "cli.main(['score', '--registry', reg, '--path', path, '--token-ids', '5,6,7,8', '--json'])\n"
    "sys.exit(cli.main(['generate', '--registry', reg, '--path', 'embed, head, head', '--prompt', 'x']))\n"
  )
  env = {**os.environ, "THOUGHTJAX_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
  r = subprocess.run(
    [sys.executable, "-c", code, str(reg_dir), path], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
  )
  assert r.returncode == 2, r.stderr
  gen, score = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
  m = compose(path, Registry.open(reg_dir))
  assert gen["token_ids"] == m.generate("hello", max_tokens=4).token_ids
  assert score["nll"] == pytest.approx(m.score([5, 6, 7, 8]).nll, abs=1e-5)
  assert "PathTypeError: link 2 (head) expects residual" in r.stderr and "Traceback" not in r.stderr
  # As a module (`python -m thoughtjax.cli`), with a path only a registry can run (a template).
  tpath = "template, blocks[0:3), head"
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "thoughtjax.cli",
      "generate",
      "--registry",
      str(reg_dir),
      "--path",
      tpath,
      "--prompt",
      "hello",
      "--max-tokens",
      "3",
      "--json",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=env,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  m = compose(tpath, Registry.open(reg_dir))
  assert out["prompt_ids"] == m.prompt_ids("hello") and out["token_ids"] == m.generate("hello", max_tokens=3).token_ids


def test_relative_registry_paths_work(cli_registry, tmp_path, monkeypatch, capsys):
  """Paths as a user types them (relative to the working directory) for build, verify, generate."""
  monkeypatch.chdir(tmp_path)
  src = cli_registry / "model"
  (tmp_path / "mapping.yaml").write_text(mapping_text([(0, 1), (1, 3)], 3))
  assert (
    cli.main(
      ["registry", "build", "--model", str(src), "--mapping", "mapping.yaml", "--out", "rel/reg", "--no-profile"]
    )
    == 0
  )
  assert cli.main(["registry", "verify", "rel/reg"]) == 0
  capsys.readouterr()
  assert (
    cli.main(
      [
        "generate",
        "--registry",
        "rel/reg",
        "--path",
        "embed, blocks[0:1), head",
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
        "--json",
      ]
    )
    == 0
  )
  assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1


def test_trust_flags_reach_the_registry_end_to_end(cli_registry, tmp_path, capsys):
  """A key the registry was not signed with is refused by every reader command, in one line."""
  reg_dir, good = cli_registry / "reg", cli_registry / "keys" / "ci.pub"
  assert cli.main(["registry", "keygen", str(tmp_path / "other")]) == 0
  capsys.readouterr()
  assert cli.main(["registry", "verify", str(reg_dir), "--public-key", str(good), "--require-signatures"]) == 0
  capsys.readouterr()
  build = [
    "registry",
    "build",
    "--model",
    str(cli_registry / "model"),
    "--mapping",
    str(cli_registry / "mapping.yaml"),
    "--no-profile",
    "--out",
  ]
  for argv in (
    ["registry", "verify", str(reg_dir)],
    ["registry", "list", str(reg_dir)],
    ["registry", "gc", str(reg_dir), "--dry-run"],
    [*build, str(reg_dir)],
    ["generate", "--registry", str(reg_dir), "--prompt", "x", "--max-tokens", "1"],
  ):
    assert cli.main([*argv, "--public-key", str(tmp_path / "other.pub")]) == 2
    err = capsys.readouterr().err
    command = " ".join(argv[:2]) if argv[0] == "registry" else "generate"
    lines = err.splitlines()
    if argv[1] == "build":  # its progress bars go to stderr too
      lines = [line for line in lines if line.startswith("thoughtjax ")]
    # One line naming the file and the check that refused it.
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(
      rf"thoughtjax {command}: error: \w+Error: .*{re.escape(str(reg_dir))}/index\.json.*trusted.*", lines[0]
    ), err


def test_build_stores_a_quantized_gguf_packed_and_replaces_an_older_format(tmp_path, capsys, monkeypatch):
  """``registry build`` keeps a Q4_1 GGUF's blocks (``--weights f32``: float32); a registry of an older
  format is refused by every command with the rebuild command, which ``--replace-old-format`` runs."""
  from tests.registry.helpers import read_index, write_index
  from tests.tiny import write_gguf

  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg, model = tiny_model("llama_gqa", seed=2)
  src = write_gguf(tmp_path / "m.gguf", cfg, model, "Q4_1")
  (tmp_path / "mapping.yaml").write_text(mapping_text([(0, 1), (1, 3)], 3))
  common = ["registry", "build", "--model", str(src), "--mapping", str(tmp_path / "mapping.yaml"), "--no-profile"]
  assert cli.main([*common, "--out", str(tmp_path / "native")]) == 0
  assert cli.main([*common, "--out", str(tmp_path / "f32"), "--weights", "f32"]) == 0
  native, f32 = Registry.open(tmp_path / "native"), Registry.open(tmp_path / "f32")
  assert "0/mlp/up/Q4_1" in native.manifest("blocks[0:1)").params
  assert "0/mlp/up" in f32.manifest("blocks[0:1)").params
  assert native.manifest("blocks[1:3)").param_bytes < 0.2 * f32.manifest("blocks[1:3)").param_bytes
  ids = [5, 6, 7, 8]
  assert (
    compose("embed, blocks[0:3), head", native).logits(ids) == compose("embed, blocks[0:3), head", f32).logits(ids)
  ).all()

  body, _ = read_index(tmp_path / "native")
  body["format"] = "thoughtjax.registry/1"
  write_index(tmp_path / "native", body, None)
  capsys.readouterr()
  assert cli.main(["registry", "list", str(tmp_path / "native")]) == 2
  err = capsys.readouterr().err
  assert (
    "RegistryFormatError" in err
    and f"thoughtjax registry build --out {tmp_path / 'native'} --replace-old-format" in err
  )
  assert cli.main([*common, "--out", str(tmp_path / "native")]) == 2
  assert "--replace-old-format" in capsys.readouterr().err
  assert cli.main([*common, "--out", str(tmp_path / "native"), "--replace-old-format"]) == 0
  assert "older format" in capsys.readouterr().err
  assert Registry.open(tmp_path / "native").current == native.current  # the same content-addressed versions

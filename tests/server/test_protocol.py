"""The checked-in stubs are what grpc_tools generates from the proto; the config refuses typos."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from thoughtjax.server.config import ConfigError, ServerConfig, from_mapping, load_config

ROOT = Path(__file__).resolve().parents[2]
PROTO = "thoughtjax/proto/v1/synthesis.proto"
GENERATED = ("synthesis_pb2.py", "synthesis_pb2.pyi", "synthesis_pb2_grpc.py")


def test_regenerating_the_stubs_changes_nothing(tmp_path):
  (tmp_path / PROTO).parent.mkdir(parents=True)
  shutil.copy(ROOT / PROTO, tmp_path / PROTO)
  subprocess.run(
    [
      sys.executable,
      "-m",
      "grpc_tools.protoc",
      "-I",
      ".",
      "--python_out=.",
      "--pyi_out=.",
      "--grpc_python_out=.",
      PROTO,
    ],
    cwd=tmp_path,
    check=True,
  )
  for name in GENERATED:
    fresh = (tmp_path / PROTO).with_name(name).read_text()
    assert fresh == (ROOT / PROTO).with_name(name).read_text(), f"{name} is stale: regenerate (see {PROTO})"


def test_the_service_has_the_five_methods_and_streams_synthesize():
  from thoughtjax.proto.v1 import synthesis_pb2 as pb

  svc = pb.DESCRIPTOR.services_by_name["Synthesizer"]
  assert svc.full_name == "thoughtjax.v1.Synthesizer"
  assert {m.name for m in svc.methods} == {
    "GetOptimalPath",
    "Synthesize",
    "ListThoughtlets",
    "RegistryStats",
    "ReloadRegistry",
  }
  assert svc.methods_by_name["Synthesize"].server_streaming


def test_the_shipped_config_is_loopback_and_tolerates_pinging_clients():
  c = load_config()
  assert c.bind == "127.0.0.1" and not c.tls.enabled
  opts = dict(c.grpc_options())
  assert opts["grpc.keepalive_permit_without_calls"] == 1 and opts["grpc.http2.max_ping_strikes"] == 0
  # `thoughtjax serve` warms every calibrated hint, greedy and sampled; the Python API's default warms nothing.
  assert (c.warm.hints, c.warm.modes, c.warm.every_hint) == (("all",), ("greedy", "sample"), True)
  assert ServerConfig().warm.hints == ()


@pytest.mark.parametrize(
  "data, match",
  [
    ({"prot": 1}, r"unknown keys \['prot'\]"),
    ({"tls": {"cert": "a.pem"}}, "cert and key go together"),
    ({"tls": {"client_ca": "ca.pem"}}, "needs tls.cert"),
    ({"max_concurrent": 0}, "max_concurrent: expected an integer >= 1"),
    ({"port": 70000}, "port: expected an integer"),
    ({"keepalive": {"time_ms": "soon"}}, "keepalive.time_ms: expected an integer"),
    ({"warm": {"hints": "general_purpose"}}, "warm.hints: expected a list"),
    ({"warm": {"budgets_ms": [0]}}, r"warm.budgets_ms: expected a non-empty list of budgets in ms > 0"),
    ({"warm": {"budgets_ms": []}}, r"warm.budgets_ms: expected a non-empty list"),
    ({"warm": {"budgets_ms": ["fast"]}}, r"warm.budgets_ms: expected"),
    ({"warm": {"budgets_ms": [True]}}, r"warm.budgets_ms: expected"),
    ({"warm": {"modes": ["beam"]}}, r"warm.modes: expected a non-empty list of \['greedy', 'sample', 'sample_top_p'\]"),
    ({"warm": {"modes": []}}, r"warm.modes: expected a non-empty list"),
  ],
)
def test_a_bad_config_is_a_named_error(data, match):
  with pytest.raises(ConfigError, match=match):
    from_mapping(data)


def test_warm_budgets_read_from_yaml_with_infinity(tmp_path):
  assert load_config().warm.budgets_ms == (math.inf,)
  f = tmp_path / "c.yaml"
  f.write_text("warm:\n  hints: [fast_draft]\n  budgets_ms: [.inf, 1000]\n")
  assert load_config(f).warm.budgets_ms == (math.inf, 1000.0)


def test_a_missing_config_file_names_the_fix(tmp_path):
  with pytest.raises(ConfigError, match="no such file"):
    load_config(tmp_path / "nope.yaml")

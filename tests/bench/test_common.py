"""The helpers every benchmark shares. Behaviour only: what they return and refuse, never how fast."""

import json
import math
import sys

import pytest

from thoughtjax.bench import common


def test_median_of_nothing_is_nan_not_an_error():
  assert math.isnan(common.median([]))
  assert common.median([3.0, 1.0, 2.0]) == 2.0


def test_first_byte_waits_for_the_process_and_reports_its_memory():
  code = "import sys; sys.stdout.write('x'); sys.stdout.flush(); sys.stdout.write('y' * 100000)"
  run = common.first_byte([sys.executable, "-c", code])
  assert run.seconds > 0 and run.peak_rss_mib > 1  # a Python interpreter holds more than 1 MiB


def test_first_byte_survives_a_child_that_floods_stderr():
  """1 MiB on stderr before any stdout: a stderr pipe nobody reads would stall the child forever."""
  code = "import sys; sys.stderr.write('e' * (1 << 20)); sys.stderr.flush(); print('ok')"
  assert common.first_byte([sys.executable, "-c", code]).peak_rss_mib > 0


def test_first_byte_refuses_a_failed_process_and_quotes_its_stderr():
  code = "import sys; print('partial'); sys.stderr.write('model file is gone'); sys.exit(3)"
  with pytest.raises(RuntimeError, match="failed with exit 3: model file is gone"):
    common.first_byte([sys.executable, "-c", code])


def test_first_byte_refuses_a_process_that_prints_nothing():
  with pytest.raises(RuntimeError, match="failed with exit 0"):
    common.first_byte([sys.executable, "-c", "pass"])


@pytest.mark.parametrize("on", ["host", "device"])
def test_copy_bandwidth_probe_runs_on_host_and_device(on):
  assert common.copy_bandwidth_gbps(1 << 20, repeats=2, on=on) > 0


def test_copy_bandwidth_probe_names_a_wrong_target():
  with pytest.raises(ValueError, match="on must be 'host' or 'device', got 'gpu'"):
    common.copy_bandwidth_gbps(1 << 20, on="gpu")


@pytest.mark.parametrize("bench", ["decode", "registry", "kernels"])
def test_an_unwritable_json_path_is_refused_before_the_run(bench, tmp_path, capsys):
  from thoughtjax import cli

  with pytest.raises(SystemExit) as info:
    cli.main(["bench", bench, "--json", str(tmp_path / "missing" / "out.json")])
  assert info.value.code == 2
  assert f"argument --json: {tmp_path / 'missing' / 'out.json'}: expected a file in an existing directory" in (
    capsys.readouterr().err
  )


def test_table_and_json(tmp_path, capsys):
  common.print_table(
    "figures",
    ["name", "value"],
    [("decode tok/s", common.fmt(12.345, ".1f")), ("llama.cpp", common.fmt(None, ".1f"))],
    right=("value",),
  )
  out = capsys.readouterr().out
  assert "figures" in out and "12.3" in out and "llama.cpp" in out and " - " in out
  path = tmp_path / "r.json"
  common.write_json(path, {"a": [1, 2.5, None]}, indent=1)
  assert json.loads(path.read_text()) == {"a": [1, 2.5, None]}
  assert path.read_text() == json.dumps({"a": [1, 2.5, None]}, indent=1)

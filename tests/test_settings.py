"""thoughtjax.settings: every THOUGHTJAX_* variable read into one object, the defaults when unset, "off" values,
and a named refusal of a bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from thoughtjax import settings


def test_unset_variables_give_the_defaults():
  assert settings.current({}) == settings.Settings()
  assert settings.current({}).program_cache == 32


def test_each_variable_lands_in_its_field():
  s = settings.current(
    {
      "THOUGHTJAX_CACHE": "~/c",
      "THOUGHTJAX_COMPILE_CACHE": "/x/xla",
      "THOUGHTJAX_EXPORT_CACHE": "/x/exported",
      "THOUGHTJAX_TRUST_STATE": "/x/trust.json",
      "THOUGHTJAX_LATENCY_CORRECTIONS": " /x/corr.json ",
      "THOUGHTJAX_PROGRAM_CACHE": "4",
      "THOUGHTJAX_VERIFY_CACHE": "full",
      "THOUGHTJAX_PROGRAM_LEDGER": " Off",
    }
  )
  assert s.cache == Path("~/c").expanduser() and s.compile_cache == Path("/x/xla")
  assert (s.export_cache, s.export_off) == (Path("/x/exported"), False)
  assert s.trust_state == Path("/x/trust.json") and s.latency_corrections == Path("/x/corr.json")
  assert (s.program_cache, s.verify_cache_full, s.corrections_off) == (4, True, False)
  assert s.program_ledger_off and not settings.current({}).program_ledger_off


@pytest.mark.parametrize("off", ["off", "OFF", "0", "none", ""])
def test_export_off_values(off):
  s = settings.current({"THOUGHTJAX_EXPORT_CACHE": off})
  assert s.export_off and s.export_cache is None


@pytest.mark.parametrize("off", ["off", " Off", "0", "none"])
def test_turning_the_compile_cache_off_is_refused_by_name_not_made_a_folder(off, tmp_path, monkeypatch):
  from thoughtjax.decode import program

  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("THOUGHTJAX_COMPILE_CACHE", off)
  with pytest.raises(settings.SettingsError, match="THOUGHTJAX_COMPILE_CACHE names the folder"):
    program.compilation_cache_dir()
  assert list(tmp_path.iterdir()) == []


def test_corrections_off_and_the_module_readers_follow_the_environment(monkeypatch, tmp_path):
  from thoughtjax import exported
  from thoughtjax.synthesis import corrections

  monkeypatch.setenv("THOUGHTJAX_LATENCY_CORRECTIONS", "off")
  assert settings.current().corrections_off and corrections.corrections_path() is None
  monkeypatch.setenv("THOUGHTJAX_LATENCY_CORRECTIONS", str(tmp_path / "c.json"))
  assert corrections.corrections_path() == tmp_path / "c.json"
  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", "off")
  assert exported.export_dir() is None
  monkeypatch.setenv("THOUGHTJAX_EXPORT_CACHE", str(tmp_path / "e"))
  assert exported.export_dir() == tmp_path / "e"


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_a_bad_program_cache_size_is_refused_by_name(bad):
  with pytest.raises(settings.SettingsError, match="THOUGHTJAX_PROGRAM_CACHE must be a positive number"):
    settings.current({"THOUGHTJAX_PROGRAM_CACHE": bad})

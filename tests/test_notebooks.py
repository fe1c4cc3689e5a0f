"""Every notebook under ``notebooks/`` runs top to bottom, on a small budget, and shows its results.

The notebooks are the documentation (penzai style), so CI executes them with nbclient: no cell may
raise, and each must produce the outputs its narrative talks about (figures, tables). They read
``THOUGHTJAX_NOTEBOOK_BUDGET``: ``small`` (the default here) shrinks their loops so each runs in a
minute or two on 2 CPU cores; ``THOUGHTJAX_NOTEBOOK_BUDGET=full pytest tests/test_notebooks.py``
runs them as written for readers. The kernel is this interpreter (a kernel spec written for the
test), whatever Jupyter kernels the machine has installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
BUDGET_VAR = "THOUGHTJAX_NOTEBOOK_BUDGET"
_DEVICES_FLAG = "--xla_force_host_platform_device_count"  # set by tests/conftest.py
CELL_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  needs_default_model: bool
  min_figures: int
  texts: tuple[str, ...]  # printed by some cell; each names a result the narrative relies on


CASES = [
  Case(
    "01_paths.ipynb",
    needs_default_model=True,
    min_figures=1,
    texts=("thoughtlets, sequence", "'embed, head, blocks[0:2)':\n  link 2", "top-1 agreement=", "tok/s", "restores="),
  ),
  Case(
    "03_synthesis.ipynb",
    needs_default_model=True,
    min_figures=4,
    texts=(
      "meeting the floor:",
      "streams decoding in 1 engine; a step of the busy engine takes",
      "tight, under load",
      "\nunder load ",  # a choice made under load, measured in the pool (which path it is depends on this machine)
      "corrected hints:",
      "degraded=True reason=budget",
      "tokens fit; predicted",
      "router (",
      "    note: ",  # a fresh `thoughtjax plan --json` process's choice and its last note
    ),
  ),
  Case(
    "02_kernels_vs_xla.ipynb",
    needs_default_model=False,
    min_figures=3,
    texts=("identical: True", "pallas (interpret)", "GB/s"),
  ),
  Case(
    "05_healing_and_drafting.ipynb",
    needs_default_model=True,
    min_figures=3,
    texts=(
      "before: agreement",
      "after:  agreement",
      "refused: draft",
      "acceptance",
      "identical tokens: True",
      "speedup",
    ),
  ),
  Case(
    "04_serving.ipynb",
    needs_default_model=True,
    min_figures=1,
    texts=(
      "health SERVING",
      "trace in the trailer equals the final message's: True",
      "x-thoughtjax-tokens-out",
      "TTFT p50 ms",
      "thoughtjax_time_to_first_token_seconds_count",
    ),
  ),
]


def test_every_notebook_is_executed():
  assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(c.name for c in CASES), (
    "a notebook under notebooks/ has no entry in CASES (or an entry names a missing notebook)"
  )


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
  """A Jupyter kernel spec that runs this very interpreter, found first on JUPYTER_PATH."""
  spec = tmp_path / "jupyter" / "kernels" / "thoughtjax-tests"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(
    json.dumps(
      {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "thoughtjax tests",
        "language": "python",
      }
    )
  )
  monkeypatch.setenv(
    "JUPYTER_PATH", os.pathsep.join(filter(None, [str(spec.parent.parent), os.environ.get("JUPYTER_PATH")]))
  )
  monkeypatch.setenv(BUDGET_VAR, os.environ.get(BUDGET_VAR, "small"))
  monkeypatch.delenv("MPLBACKEND", raising=False)  # figures come back through IPython's inline backend
  # The kernel runs as a reader's would: one host device, not the test session's fake eight.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES_FLAG)]
  monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
  return spec.name


def _outputs(nb, kind: str) -> list:
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type in kind.split("|")]


@pytest.mark.parametrize(
  "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.needs_default_model else []) for c in CASES]
)
def test_notebook_runs_top_to_bottom(case: Case, kernel_name: str, tmp_path):
  import nbclient
  import nbformat

  nb = nbformat.read(NOTEBOOKS / case.name, as_version=4)
  # A last cell tells which interpreter ran the notebook.
  nb.cells.append(nbformat.v4.new_code_cell("import sys; print('INTERPRETER', sys.executable)"))
  client = nbclient.NotebookClient(
    nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NOTEBOOKS)}}
  )
  try:
    client.execute()  # a cell that raises fails the test with its traceback (CellExecutionError)
  finally:
    nbformat.write(nb, tmp_path / case.name)  # the executed notebook, to read when a check fails

  text = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
  text += "".join(o.get("data", {}).get("text/plain", "") for o in _outputs(nb, "execute_result|display_data"))
  assert f"INTERPRETER {sys.executable}" in text
  for expected in case.texts:
    assert expected in text, f"{case.name}: no output contains {expected!r} (executed: {tmp_path / case.name})"
  figures = [o for o in _outputs(nb, "display_data|execute_result") if "image/png" in o.get("data", {})]
  assert len(figures) >= case.min_figures, f"{case.name}: {len(figures)} figures, expected >= {case.min_figures}"
  assert not [o for o in _outputs(nb, "stream") if o.name == "stderr" and "Traceback" in o.text]

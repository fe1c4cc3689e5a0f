"""The package's own data files: the semantic mapping, the synthesis dictionary and its eval corpora, the default
calibration table and the router prompts.

They live in the repository's ``registry/`` folder and ship inside the package as ``thoughtjax/data``: in a
checkout (and an editable install) that is a link to ``registry/``; a wheel or an sdist carries the files
themselves (pyproject's package-data). Defaults are always these files, never files of the working directory:
running from another checkout must not change the default registry's mapping, quality table or hint floors. A
user who wants other files names them (``--mapping``, ``--dictionary``, ``--prompts``, or an argument).
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


def shipped_file(*parts: str) -> Path:
  """``thoughtjax/data/<parts>`` with links resolved (in a checkout: the file under ``registry/``)."""
  return DATA_DIR.joinpath(*parts).resolve()

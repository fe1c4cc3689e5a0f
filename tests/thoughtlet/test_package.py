"""The package's shape: one concept per module, importing nothing above it (no program, engine, registry)."""

from __future__ import annotations

import ast
from pathlib import Path

import thoughtjax.thoughtlet as thoughtlet

PACKAGE = Path(thoughtlet.__file__).parent
# What a thoughtlet may build on: the model's parts and attention layout, weight formats and config, path names, the error base, the kernels.
ALLOWED = {
  "thoughtjax.config",
  "thoughtjax.decode.layout",  # the attention layout: caches, positions and masks, on the transformer alone
  "thoughtjax.errors",
  "thoughtjax.quantized",
  "thoughtjax.transformer",
  "thoughtjax.path_syntax",
  "thoughtjax.template",
  "thoughtjax.kernels.template_embed",
}


def _imports(path: Path) -> set[str]:
  tree = ast.parse(path.read_text())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
  return {n for n in names if n.startswith("thoughtjax") and not n.startswith("thoughtjax.thoughtlet")}


def test_thoughtlet_builds_only_on_the_model_layer():
  for path in sorted(PACKAGE.glob("*.py")):
    outside = _imports(path) - ALLOWED
    assert not outside, f"{path.name} imports {sorted(outside)}; the thoughtlet package sits below them"


def _names_imported_from_the_package(path: Path) -> set[str]:
  try:
    tree = ast.parse(path.read_text())
  except (SyntaxError, UnicodeDecodeError):
    return set()
  return {
    a.name
    for node in ast.walk(tree)
    if isinstance(node, ast.ImportFrom) and node.module == "thoughtjax.thoughtlet"
    for a in node.names
  }


def test_every_name_the_repository_imports_is_exported():
  root = PACKAGE.parents[1]
  files = [p for d in ("thoughtjax", "tests", "scripts", "server") for p in (root / d).rglob("*.py")]
  wanted = set().union(*(_names_imported_from_the_package(p) for p in files))
  for nb in (root / "notebooks").glob("*.ipynb"):  # notebook cells hold "from thoughtjax.thoughtlet import X"
    for line in nb.read_text().split("\\n"):
      if "from thoughtjax.thoughtlet import " in line:
        wanted.update(n.strip(' ",()') for n in line.split(" import ", 1)[1].split(","))
  assert {"Kind", "ProfileSettings", "cut", "measure_profile", "run_blocks"} <= wanted  # the scan sees the users
  submodules = {p.stem for p in PACKAGE.glob("*.py")}  # "from thoughtjax.thoughtlet import bridge" imports a module
  missing = sorted(n for n in wanted if n and n not in submodules and not hasattr(thoughtlet, n))
  assert not missing, f"thoughtjax.thoughtlet no longer exports {missing}; re-export them from its __init__"
  assert set(thoughtlet.__all__) <= set(dir(thoughtlet))

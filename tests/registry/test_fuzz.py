"""Registry fuzz: mutate the index, a manifest and a signature record (types, sizes, hostile paths, unicode,
missing and extra keys) and open, verify and restore. Every outcome is a clean open or a named refusal (a
:class:`RegistryError`), never another exception; in a signed registry every mutation is refused.

Bounded: a fixed number of examples per registry (``derandomize``: the same mutations every run) and a deadline
per example.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thoughtjax.registry import Registry, RegistryError, TrustPolicy, dir_name

NAME = "blocks[2:3)"
EXAMPLES = 100  # per registry: 200 mutations in all

HOSTILE_TEXT = [
  "",
  "..",
  "../../../../etc/passwd",
  "/etc/passwd",
  "/dev/zero",
  "checkpoint/../../x",
  "checkpoint/./d",
  "checkpoint/d\x00x",
  "C:\\windows",
  "0123456789abcdef",
  "ffffffffffffffff/../..",
  "é" * 40,
  "\u202e\u0000\ud7ff",
  "x" * 70000,
  "ed25519",
  "thoughtjax.manifest/2",
  "thoughtjax.registry/2",
]

json_scalars = st.one_of(
  st.none(),
  st.booleans(),
  st.integers(min_value=-(2**70), max_value=2**70),
  st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**30]),
  st.floats(allow_nan=True, allow_infinity=True),
  st.text(max_size=30),
  st.sampled_from(HOSTILE_TEXT),
)
json_values = st.recursive(
  json_scalars,
  lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=10), st.sampled_from(HOSTILE_TEXT)), inner, max_size=4),
  ),
  max_leaves=12,
)


def _paths(doc, prefix=()):
  """Every path (tuple of keys and indexes) into a JSON document, the root included."""
  out = [prefix]
  if isinstance(doc, dict):
    for k, v in doc.items():
      out += _paths(v, (*prefix, k))
  elif isinstance(doc, list):
    for i, v in enumerate(doc[:50]):
      out += _paths(v, (*prefix, i))
  return out


def _mutate(doc, path, op, value, new_key):
  """``doc`` with the node at ``path`` replaced, deleted, wrapped, or given an extra key; None if unchanged."""
  if not path:
    return value if op == "replace" else [doc] if op == "wrap" else None
  parent = doc
  for k in path[:-1]:
    parent = parent[k]
  last = path[-1]
  if op == "replace":
    parent[last] = value
  elif op == "delete":
    del parent[last]
  elif op == "wrap":
    parent[last] = [parent[last]]
  elif op == "add_key" and isinstance(parent[last], dict):
    parent[last][new_key] = value
  elif op == "rename_key" and isinstance(parent, dict):
    parent[new_key] = parent.pop(last)
  else:
    return None
  return doc


def _setup(root: Path):
  reg = Registry.open(root, TrustPolicy(state_file=Path(tempfile.mkdtemp()) / "s.json"))
  vdir = reg.version_dir(NAME, reg.current[NAME])
  reg.close()
  files = {
    "index": root / "index.json",
    "manifest": vdir / "manifest.json",
    "signature": vdir / "manifest.sig",
  }
  pristine = {k: p.read_bytes() if p.exists() else None for k, p in files.items()}
  return files, pristine


@pytest.fixture(scope="module")
def fuzz_roots(tmp_path_factory, built, tiny, tiny_mapping):
  from thoughtjax.registry import build

  _, model, codec = tiny
  base = tmp_path_factory.mktemp("fuzz")
  unsigned = base / "unsigned"
  build(unsigned, tiny_mapping, model, codec=codec, settings=None).close()
  signed = base / "signed"
  shutil.copytree(built, signed)
  return {"unsigned": (unsigned, *_setup(unsigned)), "signed": (signed, *_setup(signed))}


@pytest.fixture(scope="module", autouse=True)
def _quiet_orbax():
  """Orbax logs every failed restore; the fuzz makes many."""
  import logging

  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.CRITICAL)
  yield
  logger.setLevel(level)


def _run(root: Path, files, pristine, target, path_pick, op, value, new_key, rebind) -> tuple[str, Exception | None]:
  for k, p in files.items():  # back to pristine
    if pristine[k] is None:
      p.unlink(missing_ok=True)
    else:
      p.write_bytes(pristine[k])
  if pristine[target] is None:
    return "skip", None
  doc = json.loads(pristine[target])
  paths = _paths(doc)
  path = paths[path_pick % len(paths)]
  mutated = _mutate(json.loads(pristine[target]), path, op, value, new_key)
  if mutated is None or mutated == doc:
    return "skip", None
  files[target].write_bytes(json.dumps(mutated).encode())
  if target == "manifest" and rebind:  # the index records the mutated manifest's digest (a writer's mistake)
    index = json.loads(pristine["index"])
    ref = f"{NAME}@{files['manifest'].parent.name}"
    index["index"]["manifest_sha256"][ref] = hashlib.sha256(files["manifest"].read_bytes()).hexdigest()
    files["index"].write_bytes(json.dumps(index).encode())
  state = Path(tempfile.mkdtemp()) / "s.json"
  try:
    with Registry.open(root, TrustPolicy(state_file=state)) as reg:
      reg.verify(deep=False)
      reg.restore(NAME)
  except Exception as e:  # noqa: BLE001 - the assertion is on its type
    return "refused", e
  finally:
    shutil.rmtree(state.parent, ignore_errors=True)
  return "opened", None


def _signed_part(target, doc):
  """What a signature covers in a file: the index body and its record, a manifest whole, a record's fields (an
  extra key beside them changes nothing that is checked)."""

  def record(r):
    return {k: r.get(k) for k in ("key_id", "signature", "algorithm")} if isinstance(r, dict) else r

  if target == "manifest":
    return doc
  if target == "signature":
    return record(doc)
  return (doc.get("index"), record(doc.get("signature"))) if isinstance(doc, dict) else doc


def _fuzz(kind):
  @settings(
    max_examples=EXAMPLES,
    deadline=20_000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
  )
  @given(
    target=st.sampled_from(["index", "manifest", "signature"]),
    path_pick=st.integers(min_value=0, max_value=10_000),
    op=st.sampled_from(["replace", "replace", "delete", "wrap", "add_key", "rename_key"]),
    value=json_values,
    new_key=st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_TEXT)),
    rebind=st.booleans(),
  )
  def mutate(fuzz_roots, target, path_pick, op, value, new_key, rebind):
    root, files, pristine = fuzz_roots[kind]
    outcome, error = _run(root, files, pristine, target, path_pick, op, value, new_key, rebind)
    TALLY[kind][outcome] += 1
    what = f"{kind} registry, {target} mutated ({op} at pick {path_pick}, value {repr(value)[:200]})"
    if error is not None:
      assert isinstance(error, RegistryError), f"{what}: {type(error).__name__}: {error}"
    if kind == "signed" and outcome == "opened":
      doc, mutated = json.loads(pristine[target]), json.loads(files[target].read_bytes())
      assert _signed_part(target, doc) == _signed_part(target, mutated), f"{what}: opened with changed signed content"

  def test(fuzz_roots):
    """Every mutation a clean open or a named refusal; and the fuzz did something: in a signed registry most
    mutations are refused, in an unsigned one some."""
    TALLY[kind] = {"opened": 0, "refused": 0, "skip": 0}
    mutate(fuzz_roots)
    print(f"registry fuzz tally ({kind}):", TALLY[kind])
    assert TALLY[kind]["refused"] > (EXAMPLES // 2 if kind == "signed" else 0), TALLY[kind]

  return test


TALLY = {k: {"opened": 0, "refused": 0, "skip": 0} for k in ("unsigned", "signed")}
test_fuzz_unsigned_registry = _fuzz("unsigned")
test_fuzz_signed_registry = _fuzz("signed")


def test_dir_name_is_not_a_path():  # the thoughtlet directory never escapes for any name
  for name in HOSTILE_TEXT:
    assert "/" not in dir_name(name) and dir_name(name) not in ("", ".", "..")

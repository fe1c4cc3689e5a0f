"""The default registry: the default model cut along the package's ``semantic_mapping.yaml``, under the cache
dir, built and calibrated on first use.

``<cache dir>/registry/default`` (``THOUGHTJAX_CACHE``, else ``~/.cache/thoughtjax``). First use:

1. **build** (:func:`thoughtjax.registry.build`, unsigned, without resource profiles, which synthesis does
   not read and which would double the first use; versions do not depend on them, so
   ``thoughtjax registry build --out DIR`` later adds them without changing a version): fetch the default
   model if needed, cut, publish, with the int8 and int8a8 variants of every block (:data:`VARIANTS`), so the
   whole full path in int8 weights, and in int8 weights with int8 activations, are candidates;
2. **calibrate**: quality comes from the shipped table ``default_calibration.json`` when its
   candidates pin to exactly this registry's current versions (versions are content hashes, so a build
   of the same model and mapping gives the same ones); latency is always measured here
   (:func:`~thoughtjax.synthesis.calibrate.recalibrate_latency`); the ratios the table holds (a drafted or variant
   path's factor over the full path, per hint for the drafts from the text, how a path batches) are kept, about a
   minute in all on an idle 2-core machine. The shipped table is what
   ``thoughtjax registry calibrate`` gives on the default registry: the cut paths, the full path in each variant
   (quality against the float32 full path on every hint's corpora) and the speculative candidates (the full path
   verifying the exit with the highest top-1 agreement, and the n-gram draft that looks its tokens up in the
   text, K from :class:`~thoughtjax.synthesis.calibrate_settings.SpeculativeSettings`). A candidate the table lacks (a
   table from before it existed) is added by the recalibration, a variant's quality then measured here. Without
   a matching table the full calibration runs (about 5 minutes on an idle 2-core machine). The result is stored
   in the registry.

3. **route**: the hint router (:mod:`~thoughtjax.synthesis.router_store`) is trained on the shipped router prompts
   over the registry's embed and published into it (a few seconds), so a request without hints (every OpenAI
   request) is routed; a default registry made before this gets its router at its next use.

Both files are the package's own (:mod:`thoughtjax.shipped`), wherever the process runs: a ``registry/``
folder in the working directory changes nothing.

Later uses open it and check the stored calibration; a calibration measured on another machine
(fingerprint), or one that lacks a speculative or weight-variant candidate a recalibration adds (stored before
they, or n-gram drafts, existed), has its latency re-measured. A default registry built before one of the
variants was part of it gets it in place: the build publishes the missing variant thoughtlets (every other version
unchanged), the calibration stored before carries over to the new sequence, and the recalibration adds the new
candidate.
Progress goes to ``progress(stage, done, total, item)``.

Another GGUF (:func:`ensure_gguf`, ``thoughtjax serve --model FILE.gguf``) gets a registry of its own beside it,
``<cache dir>/registry/gguf-<sha256 prefix>`` (keyed by the file's content, so a renamed copy finds it and an
edited file gets another), built and calibrated on first use the cheapest honest way: no semantic mapping is
known for it, so it is cut into the embedding, the chat template (when it has one), all its layers as one block
thoughtlet and the head, and its calibration holds the full path only (quality trivially the model's own on every
hint; latency measured here, as for the default registry). Synthesis then always runs the full path: hints and
budgets choose nothing else until ``thoughtjax registry build`` with a mapping and ``registry calibrate`` make
cut paths.

Imports inside functions here are deferred for start-up: importing this module does not load ``registry``,
``registry.layout``, ``synthesis.calibrate`` (nor its ``calibrate_*`` and ``derived_candidates`` step modules),
``synthesis.calibration``, ``synthesis.calibration_store``, ``synthesis.synthesize``; the functions that need them do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

from thoughtjax import fetch as fetch_lib
from thoughtjax.cachedir import default_registry_dir as default_registry_dir  # where callers find it
from thoughtjax.path_syntax import split_variant
from thoughtjax.shipped import shipped_file

Progress = Callable[[str, int, int, str], None]


VARIANTS = ("int8", "int8a8")  # the weight variants the default registry holds of every block


def speculative_settings():
  """The speculative candidates of the default registry: the calibrate defaults (no weight variant of the full path
  drafts: the int8 one measured 1.5-1.8x the plain full path's time per token on a 2-core CPU; it is a candidate of
  its own instead), so ``thoughtjax registry calibrate`` on it makes the same candidates."""
  from thoughtjax.synthesis.calibrate_settings import SpeculativeSettings

  return SpeculativeSettings()


def latency_settings():
  """The latency measurement of the default registry: the calibrate defaults plus the drafts from the text itself
  timed per hint on three of each hint's router prompts (LatencySettings.hint_prompts; about 100 s here), so a code
  or structured-output request can get the n-gram plan that prose would not. ``thoughtjax registry calibrate``
  measures the same; a first use keeps the shipped table's per-hint factors instead of timing them."""
  from thoughtjax.synthesis.calibrate_settings import LatencySettings

  return LatencySettings(hint_prompts=3)


def shipped_table_path() -> Path:
  """The package's quality table of the default registry."""
  return shipped_file("default_calibration.json")


def _mapping_path() -> Path:
  """The package's semantic mapping of the default model."""
  return shipped_file("semantic_mapping.yaml")


def shipped_calibration(registry):
  """The shipped quality table as a calibration of ``registry``, or None when it does not pin to the
  registry's current versions (another model, mapping or build)."""
  from thoughtjax.synthesis.calibration import Calibration, CalibrationError

  path = shipped_table_path()
  if not path.is_file():
    return None
  try:
    doc = json.loads(path.read_bytes())
    doc["sequence"] = registry.sequence  # the table is tied to versions, not to one build's sequence
    cal = Calibration.from_json(doc)
  except (json.JSONDecodeError, KeyError, TypeError, CalibrationError):
    return None
  current = registry.current
  if dict(cal.current) != {n: current.get(n) for n in cal.current}:
    return None
  return cal


def ensure_default(progress: Progress | None = None, *, root: Path | None = None, weights: str = "f32"):
  """Build and calibrate the default registry if needed; returns it opened (:class:`Registry`) with restores
  in ``weights`` (f32, or native: the blocks kept packed). Calibration measures the f32 form."""
  root = Path(root) if root is not None else default_registry_dir()
  with _first_use(root):
    return _ensure_default(progress, root=root, weights=weights)


@contextlib.contextmanager
def _first_use(root: Path):
  """Held while ``root`` is built or checked: two processes on first use (two commands, two test workers): one
  builds and measures, the other waits for it and then finds the registry and its calibration (measuring twice
  at once would also skew both)."""
  root.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(root.with_name(root.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
  try:
    with contextlib.suppress(ImportError):  # no flock (Windows): builds stay atomic, only not shared
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def gguf_registry_dir(digest: str) -> Path:
  """Where :func:`ensure_gguf` keeps the registry of the GGUF whose sha256 is ``digest``."""
  return fetch_lib.cache_dir() / "registry" / f"gguf-{digest[:16]}"


def gguf_calibration_settings():
  """The calibration of a GGUF's own registry: the full path only (no exits, skips, repeats, drafts or weight
  variants to measure), its quality on a few windows per hint, latency as the calibrate defaults measure it."""
  from thoughtjax.synthesis.calibrate_settings import CalibrateSettings
  from thoughtjax.synthesis.candidates import CandidateSettings

  return CalibrateSettings(
    candidates=CandidateSettings(exits=[], single_skips=0, greedy_removals=0, repeats=[]),
    max_windows=2,
    speculative=_no_drafts(),
    variants=(),
  )


def _no_drafts():
  from thoughtjax.synthesis.calibrate_settings import SpeculativeSettings

  return SpeculativeSettings(drafts=0, ngram=())


def ensure_gguf(path: str | os.PathLike, progress: Progress | None = None, *, weights: str = "f32"):
  """The registry serving the GGUF at ``path``, opened with restores in ``weights``: the default registry when
  the file is the default model (same sha256), else its own (see the module docstring), built and calibrated
  on first use."""
  path = Path(path)
  digest = fetch_lib.sha256_file(path)
  if digest == fetch_lib.KNOWN_MODELS[fetch_lib.DEFAULT_MODEL].sha256:
    return ensure_default(progress, weights=weights)
  root = gguf_registry_dir(digest)
  with _first_use(root):
    return _ensure_gguf(path, progress or (lambda stage, done, total, item: None), root, weights)


def _ensure_gguf(path: Path, report: Progress, root: Path, weights: str):
  from thoughtjax.registry import Registry, is_registry
  from thoughtjax.synthesis import calibrate as cal_lib
  from thoughtjax.synthesis.calibrate_latency import machine_fingerprint
  from thoughtjax.synthesis.calibration_store import MissingCalibrationError, read_calibration, write_calibration

  if not is_registry(root):
    _build_gguf(path, root, report)
  reg = Registry.open(root)
  try:
    stored = read_calibration(reg)
  except MissingCalibrationError:
    stored = None
  if stored is not None and stored.fingerprint == machine_fingerprint():
    return _in_form(reg, weights)
  if stored is not None:  # measured on another machine: its latency again, the full path's quality kept
    cal = cal_lib.recalibrate_latency(reg, stored, speculative=_no_drafts(), variants=(), progress=report)
  else:
    cal = cal_lib.calibrate(reg, settings=gguf_calibration_settings(), progress=report)
  write_calibration(reg, cal)
  return _in_form(reg, weights)


def gguf_mapping_text(name: str, num_layers: int, chat: bool) -> str:
  """The semantic mapping of a model no mapping is known for: embedding, chat template, every layer in one
  block thoughtlet, head."""
  template = "  - kind: template\n    system: null\n" if chat else ""
  return (
    f"format: 1\nmodel: {json.dumps(name)}\nnum_layers: {num_layers}\nthoughtlets:\n  - kind: embed\n{template}"
    f"  - kind: blocks\n    layers: [0, {num_layers}]\n    description: every layer of the model\n  - kind: head\n"
  )


def _build_gguf(path: Path, root: Path, report: Progress) -> None:
  from thoughtjax.loading import load
  from thoughtjax.mapping import load_mapping
  from thoughtjax.registry import build

  report("build load", 0, 1, str(path))
  loaded = load(path, weights="native")  # a quantized GGUF's blocks stored packed, as the default registry's
  chat = bool(getattr(loaded.codec, "chat_template", None))
  text = gguf_mapping_text(path.name, loaded.config.num_layers, chat)
  mapping = load_mapping(f"{path.name} (the full model)", loaded.config.num_layers, text=text)
  build(
    root,
    mapping,
    loaded,
    settings=None,
    progress=lambda stage, name, done, total: report(f"build {stage}", done, total, name),
  )


def _ensure_default(progress: Progress | None, *, root: Path, weights: str):
  from thoughtjax.registry import Registry, is_older_format, is_registry
  from thoughtjax.registry.layout import index_format
  from thoughtjax.synthesis.calibrate_latency import machine_fingerprint
  from thoughtjax.synthesis.calibration_store import MissingCalibrationError, read_calibration, write_calibration

  report = progress or (lambda stage, done, total, item: None)
  root = Path(root) if root is not None else default_registry_dir()
  older = is_older_format(root)  # a cache of an older thoughtjax: rebuilt in place, and said so
  if older:
    report(f"rebuild: {root} holds a registry of an older format ({index_format(root)}); building it anew", 0, 1, "")
  if older or not is_registry(root):
    _build(root, report, replace_old_format=older)
  reg = Registry.open(root)
  carried = None
  lacking = [v for v in VARIANTS if not any(split_variant(n)[1] == v for n in reg.names)]
  if lacking:  # built by a thoughtjax before these variants: added in place, the base versions unchanged
    report(f"upgrade: adding the {', '.join(lacking)} variant of every block to {root}", 0, 1, "")
    previous = reg.sequence
    reg.close()
    _build(root, report)
    reg = Registry.open(root)
    carried = _carried(reg, previous)
  try:
    stored = read_calibration(reg)
  except MissingCalibrationError:
    stored = carried
  fingerprint = machine_fingerprint()
  if stored is None or stored.fingerprint != fingerprint or _lacks_speculative(reg, stored):
    write_calibration(reg, _calibrated(reg, stored, report))
  _ensure_router(reg, report)
  return _in_form(reg, weights)


def _calibrated(reg, stored, report):
  """``reg``'s calibration for this machine, from ``stored`` (another machine's, or lacking candidates) or the
  shipped table (latency measured here, its ratios kept), else a full calibration."""
  from thoughtjax.synthesis import calibrate as cal_lib
  from thoughtjax.synthesis.calibrate_settings import CalibrateSettings

  base = stored or shipped_calibration(reg)
  if base is not None:
    cal = cal_lib.recalibrate_latency(
      reg,
      base,
      settings=latency_settings(),
      speculative=speculative_settings(),
      variants=VARIANTS,
      progress=report,
      keep_ratios=True,
    )
  else:
    settings = CalibrateSettings(latency=latency_settings(), speculative=speculative_settings(), variants=VARIANTS)
    cal = cal_lib.calibrate(reg, settings=settings, progress=report)
  return cal


def _ensure_router(reg, report) -> None:
  """Train the hint router on the shipped router prompts and publish it, when ``reg`` holds none: a request without
  hints (every OpenAI request) is then routed. The calibration moves to the new sequence unchanged (no path reads
  the router)."""
  from thoughtjax.synthesis.router_store import ROUTER_NAME, train_registry_router

  if ROUTER_NAME in reg.names:
    return
  report("router", 0, 1, "training the hint router on the shipped prompts")
  _, got, _ = train_registry_router(reg)
  report("router", 1, 1, f"held-out accuracy {got.accuracy:.3f} on {got.n_heldout} prompts")


def _build(root: Path, report, *, replace_old_format: bool = False) -> None:
  from thoughtjax.registry import build

  build(
    root,
    _mapping_path(),
    fetch_lib.DEFAULT_MODEL,
    settings=None,
    progress=lambda stage, name, done, total: report(f"build {stage}", done, total, name),
    replace_old_format=replace_old_format,
    variants=VARIANTS,
  )


def _carried(reg, sequence: int):
  """The calibration stored at ``sequence`` at ``reg``'s current sequence, when every version it names is still
  current (adding variants changes no base version); else None."""
  from thoughtjax.synthesis.calibration_store import MissingCalibrationError, read_calibration

  try:
    cal = read_calibration(reg, sequence)
  except MissingCalibrationError:
    return None
  current = reg.current
  if dict(cal.current) != {n: current.get(n) for n in cal.current}:
    return None
  return dataclasses.replace(cal, sequence=reg.sequence)


def _in_form(reg, weights: str):
  """``reg``, reopened so restores give ``weights`` when that is not f32."""
  from thoughtjax.registry import Registry

  if weights == "f32":
    return reg
  root = reg.root
  reg.close()
  return Registry.open(root, weights=weights)


def _lacks_speculative(reg, cal) -> bool:
  """``cal`` lacks a speculative or weight-variant candidate a recalibration would add (a calibration stored by
  a thoughtjax before they, or n-gram drafts, existed)."""
  from thoughtjax.synthesis import calibrate as cal_lib
  from thoughtjax.synthesis.derived_candidates import missing_speculative, missing_variants

  hint = cal_lib.first_hint(cal.hints)
  if hint is None:
    return False
  return bool(
    missing_speculative(cal.candidates, cal.quality, hint, speculative_settings(), registry=reg)
    or missing_variants(reg, cal.candidates, VARIANTS)
  )


def open_default(progress: Progress | None = None, **kwargs):
  """A :class:`~thoughtjax.synthesis.synthesize.Synthesizer` over the default registry (built and
  calibrated on first use)."""
  from thoughtjax.synthesis.synthesize import Synthesizer

  return Synthesizer.open(ensure_default(progress), **kwargs)

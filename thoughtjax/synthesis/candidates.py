"""Candidate paths: which shortened paths synthesis should measure, chosen from measurements.

>>> import thoughtjax
>>> from thoughtjax.synthesis.candidates import CandidateSettings, pin, propose
>>> model = thoughtjax.load()
>>> proposals = propose(model, calibration_docs, CandidateSettings(greedy_removals=3))
>>> [(p.kind.value, p.path) for p in proposals][:3]
[('full', 'embed, blocks[0:30), head'), ('exit', 'embed, blocks[0:15), head'), ...]
>>> candidates, refused = pin(proposals, registry)   # name@version units and path hashes, as compose reports

:func:`propose` returns :class:`Proposal`\\ s, in this order, equal layer sequences kept once (the
first wins): the full path; early exits after each depth of ``exits`` (default: every 2 layers from
half depth to L - 1); single-unit skips of the ``single_skips`` least influential units (influence:
mean over tokens of 1 - cos(residual in, residual out), one pass over the calibration split);
greedy skip sets (remove, one at a time, the unit whose removal adds the least ΔNLL on a sample of
the calibration split; every prefix of that sequence is a candidate); repeated spans
(``(a, b)``: layers 0..b-1, then a..L-1 again: ``blocks[0:b), blocks[a:L)``); the manual paths given.

:func:`bridged_proposals` adds, for each bridge thoughtlet a registry holds (``thoughtjax registry heal``),
the path it heals with the bridge at its cut (``embed, blocks[0:10), bridge.10-30, head``); in a layer
sequence a bridge is a negative slot (-1, -2, ... in the order the registry lists them), as in a program.
Other kinds of candidates plug in the same way: a function that returns proposals, appended by calibrate.

Units: a skip or a removal takes out a whole unit, an exit or a repeat starts and ends on unit
boundaries. By default every layer is a unit; pass ``spans=registry.block_spans()`` so that every
proposal composes from the registry's own block thoughtlets. :func:`pin` resolves proposals in a
registry (refusing, with the reason, any that do not compose) into
:class:`~thoughtjax.synthesis.candidate.Candidate`\\ s.

Imports inside functions here are deferred for start-up: importing this module does not load ``registry``,
``thoughtlet.bridge``; the functions that need them do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from thoughtjax import assembly
from thoughtjax.errors import UserError
from thoughtjax.path_syntax import PathSyntaxError, format_path, hash_refs, layers_of_path, parse_path
from thoughtjax.synthesis.candidate import Candidate, CandidateKind, Unit
from thoughtjax.synthesis.quality import DEFAULT_WINDOW, Document, Progress, Runner, windows

Span = tuple[int, int]


class CandidateError(UserError, ValueError):
  """Candidate settings or a manual path that cannot be turned into candidates."""


@dataclasses.dataclass(frozen=True)
class Proposal:
  """A candidate path over one model's own layers, before it is pinned to registry versions.

  ``layers``: the layer sequence it runs (repeats allowed); ``path``: its canonical path string;
  ``why``: what chose it (a depth, an influence, a ΔNLL).
  """

  path: str
  kind: CandidateKind
  layers: tuple[int, ...]
  why: str = ""

  @property
  def path_hash(self) -> str:
    """The hash compose reports for this path over a loaded model (bare refs, no versions)."""
    return hash_refs([str(r) for r in parse_path(self.path)])


@dataclasses.dataclass(frozen=True)
class CandidateSettings:
  """What :func:`propose` generates.

  ``exits``: depths (layers run before the head), each in 1..L-1 (None: every 2 from L//2 to L-1);
  ``single_skips``: how many of the least influential units to skip one at a time;
  ``greedy_removals``: length of the greedy removal sequence (0: none);
  ``greedy_windows``: how many windows of the calibration split the greedy search measures on;
  ``repeats``: spans ``(a, b)`` run twice (None: the unit boundaries nearest L/3 and 2L/3);
  ``window``: tokens per window.
  """

  exits: Sequence[int] | None = None
  single_skips: int = 3
  greedy_removals: int = 4
  greedy_windows: int = 8
  repeats: Sequence[Span] | None = None
  window: int = DEFAULT_WINDOW

  def __post_init__(self):
    for f in ("single_skips", "greedy_removals", "greedy_windows"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v < (1 if f == "greedy_windows" else 0):
        raise CandidateError(
          f"CandidateSettings.{f}: expected an integer >= {1 if f == 'greedy_windows' else 0}, got {v!r}"
        )


# ------------------------------------------------------------------------------ units
def unit_spans(num_layers: int, spans: Iterable[Span] | None = None) -> list[Span]:
  """The units skips remove, sorted; they must tile [0, L) exactly. Default: one unit per layer."""
  if spans is None:
    return [(i, i + 1) for i in range(num_layers)]
  out = sorted((int(a), int(b)) for a, b in spans)
  at = 0
  for a, b in out:
    if a != at or b <= a:
      raise CandidateError(
        f"unit spans {out}: expected half-open spans tiling [0, {num_layers}) with no gap or "
        f"overlap, but the span {(a, b)} follows layer {at}; pass registry.block_spans() of a "
        f"registry of this model"
      )
    at = b
  if at != num_layers:
    raise CandidateError(
      f"unit spans {out} end at layer {at}, but the model has {num_layers} layers; pass spans that cover every layer"
    )
  return out


def _layers(spans: Iterable[Span]) -> tuple[int, ...]:
  return tuple(i for a, b in spans for i in range(a, b))


def _label(span: Span) -> str:
  return f"blocks[{span[0]}:{span[1]})"


# ------------------------------------------------------------------------------ measurements
def block_influence(
  model,
  documents: Sequence[Document],
  *,
  spans: Iterable[Span] | None = None,
  window: int = DEFAULT_WINDOW,
  progress: Progress | None = None,
) -> dict[Span, float]:
  """``{unit: mean over tokens of 1 - cos(residual before it, residual after it)}`` inside the full path.

  One full pass per window; every real token position counts. 0 for a unit that leaves the residual
  unchanged; larger for a unit that turns it further.
  """
  runner = Runner(model)
  units = unit_spans(runner.num_layers, spans)
  wins = windows(runner.w.codec, documents, window)
  if not wins:
    raise CandidateError("block influence needs at least one document of 2 or more tokens")
  sums, count = np.zeros(len(units)), 0
  for done, ids in enumerate(wins, 1):
    win = runner.full_pass(ids)
    for j, (a, b) in enumerate(units):
      sums[j] += float(np.sum(runner.one_minus_cos(win.residuals[a], win.residuals[b], win.n)))
    count += win.n
    if progress is not None:
      progress(done, len(wins), "influence")
  return {u: float(s / count) for u, s in zip(units, sums)}


def greedy_removal(
  model,
  documents: Sequence[Document],
  removals: int,
  *,
  spans: Iterable[Span] | None = None,
  window: int = DEFAULT_WINDOW,
  max_windows: int | None = None,
  progress: Progress | None = None,
) -> list[tuple[Span, float]]:
  """Remove units one at a time, each time the one whose removal adds the least ΔNLL.

  ΔNLL is the mean over predicted tokens of the path's NLL minus the full path's, on the first
  ``max_windows`` windows of ``documents``; ties go to the earlier unit. Returns the removed units
  in order, each with the ΔNLL of the path after that removal. At most L_units - 1 removals.
  """
  runner = Runner(model)
  units = unit_spans(runner.num_layers, spans)
  wins = windows(runner.w.codec, documents, window)[:max_windows]
  if not wins:
    raise CandidateError("greedy removal needs at least one document of 2 or more tokens")
  removals = min(removals, len(units) - 1)
  kept, order = list(units), []
  passes = [runner.full_pass(ids) for ids in wins]  # every step starts from the same full passes
  for step in range(removals):
    sums, tokens = np.zeros(len(kept)), 0
    for win in passes:
      # The current path's residual before each of its units: a removal reruns only what follows it.
      layers = _layers(kept)
      # Units inside its shared prefix 0..at-1 start from the full pass; the rest follow on (``at`` is
      # where a removed unit was, so no kept unit straddles it).
      at = runner.shared_prefix(layers)
      starts, x = [], win.residuals[at]
      for a, b in kept:
        if b <= at:
          starts.append(win.residuals[a])
        else:
          starts.append(x)
          x = runner.run(win, range(a, b), start=x)
      for j in range(len(kept)):
        rest = _layers(kept[j + 1 :])
        sums[j] += float(np.sum(runner.compare(win, runner.run(win, rest, start=starts[j]))[2]))
      tokens += win.predicted
    best = int(np.argmin(sums))  # first minimum: ties go to the earlier unit
    order.append((kept.pop(best), float(sums[best] / tokens)))
    if progress is not None:
      progress(step + 1, removals, "greedy removal")
  return order


# ------------------------------------------------------------------------------ proposals
def _check_depth(d, units: list[Span], L: int, what: str) -> int:
  bounds = {a for a, _ in units} | {L}
  if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or int(d) not in bounds:
    raise CandidateError(
      f"{what}: expected a unit boundary in {sorted(bounds)}, got {d!r}; with registry spans, "
      f"exits and repeats start and end where a block thoughtlet does"
    )
  return int(d)


def default_exits(units: list[Span], L: int) -> list[int]:
  """Exit depths on unit boundaries from L//2 on, at least 2 layers apart, and the deepest boundary below L."""
  bounds = sorted({a for a, _ in units if a >= max(1, L // 2)})
  picked, last = [], None
  for d in bounds:  # every 2 layers, on unit boundaries
    if last is None or d - last >= 2:
      picked.append(d)
      last = d
  if bounds and bounds[-1] not in picked:
    picked.append(bounds[-1])
  return picked


def _nearest(bounds: list[int], target: float) -> int:
  return min(bounds, key=lambda b: (abs(b - target), b))


def default_repeats(units: list[Span], L: int) -> list[Span]:
  """One repeated span, between the unit boundaries nearest L/3 and 2L/3 (10..20 of 30 layers)."""
  bounds = sorted({a for a, _ in units} | {L})
  a, b = _nearest(bounds, L / 3), _nearest(bounds, 2 * L / 3)
  return [(a, b)] if a < b else []


def propose(
  model,
  calibration_docs: Sequence[Document],
  settings: CandidateSettings = CandidateSettings(),
  *,
  spans: Iterable[Span] | None = None,
  manual: Sequence[str] = (),
  progress: Progress | None = None,
) -> list[Proposal]:
  """Candidate paths of ``model`` (see the module docstring), measured on ``calibration_docs``."""
  runner = Runner(model)
  L = runner.num_layers
  units = unit_spans(L, spans)
  out: list[Proposal] = []
  seen: set[tuple[int, ...]] = set()

  def add(kind: CandidateKind, layers: Sequence[int], why: str) -> None:
    layers = tuple(layers)
    if layers not in seen:
      seen.add(layers)
      out.append(Proposal(format_path(layers), kind, layers, why))

  add(CandidateKind.FULL, range(L), "the full path (the reference)")
  exits = (
    default_exits(units, L)
    if settings.exits is None
    else [_check_depth(d, units, L, "exit depth") for d in settings.exits]
  )
  for d in exits:
    if not 1 <= d < L:
      raise CandidateError(f"exit depth: expected 1..{L - 1} layers before the head, got {d}")
    add(CandidateKind.EXIT, range(d), f"exit after {d} of {L} layers")

  if settings.single_skips and len(units) > 1:
    influence = block_influence(model, calibration_docs, spans=units, window=settings.window, progress=progress)
    least = sorted(units, key=lambda u: (influence[u], u))[: settings.single_skips]
    for u in least:
      add(
        CandidateKind.SKIP, _layers(v for v in units if v != u), f"skip {_label(u)}: influence 1-cos {influence[u]:.4g}"
      )

  if settings.greedy_removals and len(units) > 1:
    order = greedy_removal(
      model,
      calibration_docs,
      settings.greedy_removals,
      spans=units,
      window=settings.window,
      max_windows=settings.greedy_windows,
      progress=progress,
    )
    removed: list[Span] = []
    for u, dnll in order:
      removed.append(u)
      add(
        CandidateKind.SKIP,
        _layers(v for v in units if v not in removed),
        f"greedy removal of {', '.join(map(_label, removed))}: ΔNLL {dnll:.4g}",
      )

  repeats = default_repeats(units, L) if settings.repeats is None else list(settings.repeats)
  for rep in repeats:
    if not isinstance(rep, (tuple, list)) or len(rep) != 2:
      raise CandidateError(f"repeat: expected a span (a, b) with a < b, got {rep!r}")
    a, b = (_check_depth(v, units, L, f"repeat {tuple(rep)}") for v in rep)
    if not 0 <= a < b <= L:
      raise CandidateError(f"repeat {tuple(rep)}: expected 0 <= a < b <= {L}")
    add(CandidateKind.REPEAT, [*range(b), *range(a, L)], f"layers {a}..{b - 1} run twice")

  for text in manual:
    try:
      layers = layers_of_path(text, L)
    except PathSyntaxError as e:
      raise CandidateError(f"manual path {text!r}: {e}") from None
    add(CandidateKind.MANUAL, layers, f"given: {text}")
  return out


# ------------------------------------------------------------------------------ bridged paths
BRIDGE_PREFIX = "bridge."  # thoughtlet.bridge.bridge_name: bridge.<a>-<b>


def is_bridge(name: str) -> bool:
  return name.startswith(BRIDGE_PREFIX)


def bridge_slots(registry) -> dict[str, int]:
  """``{bridge name: slot}`` of the current bridges of ``registry``: -1, -2, ... in registry order."""
  return {n: -(i + 1) for i, n in enumerate(n for n in registry.names if is_bridge(n))}


def bridged_proposals(registry, num_layers: int) -> list[Proposal]:
  """One proposal per current bridge of ``registry``: the cut path its manifest records, with the bridge at
  the cut (:func:`thoughtjax.thoughtlet.bridge.bridged_path`), and why (its held-out quality when healed)."""
  from thoughtjax.thoughtlet import bridge as bridge_lib

  out = []
  for name, slot in bridge_slots(registry).items():
    constraints = registry.manifest(name).signature.constraints
    cut = constraints.get("cut_path")
    if not isinstance(cut, str):
      raise CandidateError(
        f"bridge {name} ({registry.root}): its manifest records no cut path (constraints.cut_path); "
        f"publish bridges with thoughtjax registry heal"
      )
    layers = layers_of_path(cut, num_layers)
    at, _ = bridge_lib.cut_point(cut, num_layers)
    path = bridge_lib.bridged_path(cut, name, num_layers)
    after = (constraints.get("training") or {}).get("after") or {}
    why = f"{name} heals {cut}" + (
      f": held-out top-1 {after['top1_agreement']:.3g}, KL {after['mean_kl']:.3g} when healed"
      if {"top1_agreement", "mean_kl"} <= set(after)
      else ""
    )
    out.append(Proposal(path, CandidateKind.BRIDGED, (*layers[:at], slot, *layers[at:]), why))
  return out


# ------------------------------------------------------------------------------ pinning
def pin(proposals: Sequence[Proposal], registry) -> tuple[list[Candidate], list[tuple[Proposal, str]]]:
  """Resolve proposals in ``registry`` to its current versions: (candidates, refused with the reason).

  Resolution and type checks are the path assembly's (:func:`thoughtjax.assembly.resolve`), so each candidate's
  ``path_hash`` is what ``compose(path, registry)`` reports; a proposal that does not compose (a range
  that does not start and end on the registry's block thoughtlets) is refused.
  """
  from thoughtjax.registry import UnknownThoughtletError

  candidates, refused = [], []
  for p in proposals:
    try:
      links = assembly.resolve(p.path, registry)
      assembly.check_chain(links)
    except (UnknownThoughtletError, PathSyntaxError, assembly.PathTypeError) as e:  # integrity failures stay loud
      refused.append((p, str(e)))
      continue
    units = []
    for link in links:
      for name, version in link.units:
        m = registry.manifest(name, version)
        units.append(Unit(name, m.version, m.param_bytes, 0 if m.layers is None else m.layers[1] - m.layers[0]))
    c = Candidate.build(p.path, p.kind, units)
    want = assembly.path_hash(links)
    if c.path_hash != want:  # pragma: no cover - both hash the same refs; a change in either must be loud
      raise RuntimeError(f"candidate {p.path!r}: path_hash {c.path_hash} differs from compose's {want}")
    candidates.append(c)
  return candidates, refused

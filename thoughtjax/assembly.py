"""A path resolved against a source, type-checked link by link, and assembled into the parts a Model runs.

A path is a list of refs (:func:`thoughtjax.path_syntax.parse_path`). :func:`resolve` turns each into one
published thoughtlet (``name@version``; no version = current) or, for ``blocks[a:b)`` that is
not itself a thoughtlet, the consecutive block thoughtlets that tile ``[a, b)`` exactly (a loaded
Model as source: its own embed, head, template and layer ranges).
Links are checked in order against the prompt's type (``tokens`` or, for a leading template,
``message``) and the required ``logits`` output; the first mismatch raises
:class:`PathTypeError` with the expected and the received type. :func:`assemble` reads the weights the
links name (from a registry: only those) into :class:`~thoughtjax.transformer.PathParts` and the layer
sequence the program runs. :func:`thoughtjax.compose.compose` and ``Model.with_path`` build a Model from it.

A source is a :class:`thoughtjax.registry.Registry` or a :class:`~thoughtjax.model.Model`: a loaded
model's own weights are sliced, a composed model stands for its source. Model sits above this module
(it composes through it), so a Model is recognised by what it holds: a :class:`~thoughtjax.loading.LoadedModel`.

Imports inside functions here are deferred for start-up: importing this module does not load ``registry``; the
functions that need them do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from thoughtjax.errors import UserError
from thoughtjax.loading import LoadedModel
from thoughtjax.path_syntax import PathSyntaxError, Ref, hash_refs, parse_path, split_variant
from thoughtjax.template import Template
from thoughtjax.thoughtlet import Kind, SemanticSignature, TensorType, as_state, cut, signature_for
from thoughtjax.transformer import PathParts, abstract_model
from thoughtjax.weights import from_stored_variant, variant_block


class PathTypeError(UserError, TypeError):
  """A path's links do not fit: names the first broken link, expected vs received type."""

  def __init__(self, message: str, *, link: int, expected: TensorType | str, received: TensorType | str):
    super().__init__(message)
    self.link, self.expected, self.received = link, expected, received


@dataclasses.dataclass(frozen=True)
class Link:
  """One ref of a path, resolved: the units (name, version) it reads and the layers it runs."""

  ref: Ref
  kind: Kind
  signature: SemanticSignature
  units: tuple[tuple[str, str | None], ...]
  layers: tuple[int, ...] = ()

  @property
  def label(self) -> str:
    return str(self.ref)


def check_chain(links: Sequence[Link]) -> tuple[TensorType, TensorType]:
  """Raise :class:`PathTypeError` at the first link whose input does not take the previous
  output; returns the path's input and output types."""
  if not links:
    raise PathSyntaxError('empty path; expected e.g. "embed, blocks[0:12), head"')
  for i, link in enumerate(links):
    if link.kind is Kind.ROUTER:  # composes by its types (it takes tokens), so refuse it by kind
      raise PathTypeError(
        f"link {i} ({link.label}) is a router thoughtlet: it picks a hint from the prompt and is not a link of "
        f"a path. Remove it from the path; synthesis runs it on its own when a request has no hints",
        link=i,
        expected="a thoughtlet of kind embed, template, blocks, bridge or head",
        received=link.signature.input,
      )
  first = links[0].signature.input
  if first.role not in ("tokens", "message"):
    raise PathTypeError(
      f"link 0 ({links[0].label}) expects {first}, but a path starts from the prompt: tokens[B,T] i32 "
      f"(or a user message, for a leading template). Start the path with embed or a template",
      link=0,
      expected=first,
      received="tokens[B,T] i32",
    )
  prev, prev_label = first, "the prompt"
  for i, link in enumerate(links):
    want = link.signature.input
    why = want.mismatch(prev) if i else None
    if why:
      raise PathTypeError(
        f"link {i} ({link.label}) expects {want} but receives {prev} from link {i - 1} ({prev_label}): "
        f"{why}. Put a thoughtlet producing {want.role} before {link.label}, or remove it",
        link=i,
        expected=want,
        received=prev,
      )
    prev, prev_label = link.signature.output, link.label
  if prev.role != "logits":
    raise PathTypeError(
      f"the path must end in logits[B,T,V] f32 for generation and scoring, but its last link "
      f"{len(links) - 1} ({prev_label}) outputs {prev}. End the path with head",
      link=len(links),
      expected="logits[B,T,V] f32",
      received=prev,
    )
  return first, prev


def full_path(reg) -> str:
  """The monolithic path of a registry: embed, every block thoughtlet in layer order, head."""
  blocks = sorted(
    (reg.manifest(n) for n in reg.names if n.startswith("blocks[") and split_variant(n)[1] is None),
    key=lambda m: m.layers,
  )
  return ", ".join(["embed", *(m.name for m in blocks), "head"])


def path_hash(links: Sequence[Link]) -> str:
  """Identity of a path: a hash of its resolved refs."""
  return hash_refs([n if v is None else f"{n}@{v}" for link in links for n, v in link.units])


# ------------------------------------------------------------------------------ sources
def _resolve_registry(refs: Sequence[Ref], reg) -> list[Link]:
  # Imported on use for start-up laziness: the registry brings orbax, which `import thoughtjax` does not need.
  from thoughtjax.registry import UnknownThoughtletError

  base_spans = reg.block_spans()
  links = []
  for ref in refs:
    if ref.unit in reg.names:
      m = reg.manifest(ref.unit, ref.version)
      layers = tuple(range(*m.layers)) if m.layers else ()
      links.append(Link(ref, m.kind, m.signature, ((m.name, m.version),), layers))
      continue
    span = ref.span
    if span is None:
      raise UnknownThoughtletError(f"{ref}: the registry has no thoughtlet {ref.unit!r}; it has {', '.join(reg.names)}")
    span_names = base_spans
    if ref.variant is not None:
      span_names = {Ref(n).span: n for n in reg.names if split_variant(n)[1] == ref.variant and Ref(n).span}
      if not span_names:
        raise UnknownThoughtletError(
          f"{ref}: the registry has no {ref.variant} variant of any block thoughtlet; rebuild it with "
          f"`thoughtjax registry build ... --variants {ref.variant}` or drop @{ref.variant}"
        )
    a, b = span
    chain, at = [], a
    while at < b:
      nxt = next(((lo, hi) for lo, hi in span_names if lo == at and hi <= b), None)
      if nxt is None:
        cut = next(((lo, hi) for lo, hi in span_names if lo < at < hi or (lo == at and hi > b)), None)
        bounds = sorted({x for s in span_names for x in s})
        detail = (
          f"layer {at if cut[0] < at else b} falls inside thoughtlet {span_names[cut]}"
          if cut is not None
          else f"no thoughtlet starts at layer {at}"
        )
        raise UnknownThoughtletError(
          f"{ref}: {detail}; a block range must start and end on thoughtlet boundaries "
          f"({', '.join(map(str, bounds))}) of this registry"
        )
      chain.append(reg.manifest(span_names[nxt]))
      at = nxt[1]
    if ref.version is not None:
      raise PathSyntaxError(
        f"{ref}: a version pins one thoughtlet, but {ref.unit} spans {len(chain)}: "
        f"{', '.join(m.name for m in chain)}; write each with its own @version"
      )
    sig = dataclasses.replace(
      chain[0].signature,
      output=chain[-1].signature.output,
      constraints={
        **chain[0].signature.constraints,
        "layers": [a, b],
        "max_context": min(m.signature.constraints["max_context"] for m in chain),
      },
    )
    links.append(Link(ref, Kind.BLOCKS, sig, tuple((m.name, m.version) for m in chain), tuple(range(a, b))))
  return links


def _resolve_model(refs: Sequence[Ref], model) -> list[Link]:
  # Imported on use for start-up laziness: the registry brings orbax, which `import thoughtjax` does not need.
  from thoughtjax.registry import codec_digest

  cfg = model.config
  tok = codec_digest(model.codec)
  links = []
  for ref in refs:
    if ref.version is not None:
      raise PathSyntaxError(
        f"{ref}: versions exist only in a registry; this path is composed from a "
        f"loaded model. Drop @{ref.version} or compose from a Registry"
      )
    if ref.span is not None:
      layers = ref.layers(cfg.num_layers)
      sig = signature_for(Kind.BLOCKS, cfg, tok, layers=ref.span)
      if ref.variant is not None:
        sig = dataclasses.replace(sig, constraints={**sig.constraints, "weights": ref.variant})
      links.append(Link(ref, Kind.BLOCKS, sig, ((ref.unit, None),), layers))
    elif ref.variant is not None:
      raise PathSyntaxError(f"{ref}: weight variants exist for block ranges only; drop @{ref.variant}")
    elif ref.name in ("embed", "head", "template"):
      kind = Kind(ref.name)
      links.append(Link(ref, kind, signature_for(kind, cfg, tok), ((ref.name, None),)))
    else:
      raise PathSyntaxError(
        f"{ref}: a loaded model has only embed, head, template and blocks[a:b); named thoughtlets live in a registry"
      )
  return links


def resolve(path: str | Sequence[Ref | str], source) -> list[Link]:
  """The one path resolver: each ref of ``path`` as a :class:`Link` of ``source`` (a Registry, or a
  Model: a loaded model's own parts, a composed model's source). Not yet type-checked
  (:func:`check_chain`); nothing is restored."""
  # Imported on use for start-up laziness: the registry brings orbax, which `import thoughtjax` does not need.
  from thoughtjax.registry import Registry

  if isinstance(path, str):
    refs = parse_path(path)
  else:
    refs = [r if isinstance(r, Ref) else parse_path(r)[0] for r in path]
  source = weights_source(source)
  if isinstance(source, Registry):
    return _resolve_registry(refs, source)
  if is_model(source):
    return _resolve_model(refs, source)
  raise TypeError(f"compose: source must be a Registry or a loaded Model, got {type(source).__name__}")


def is_model(source) -> bool:
  """Whether ``source`` is a Model (it holds a :class:`LoadedModel` as ``loaded``)."""
  return isinstance(getattr(source, "loaded", None), LoadedModel)


def weights_source(source):
  """Where a path over ``source`` reads its weights: a composed model's own source, else ``source`` itself."""
  return source.source if is_model(source) and source.source is not None else source


class Assembly(NamedTuple):
  """A path resolved, type-checked and read: what a Model over it is built from."""

  loaded: LoadedModel  # the config (max_context cut to the links'), abstract module, codec and source names
  layers: tuple[int, ...]  # the program's slot sequence (negative slots: bridges)
  parts: PathParts
  links: list[Link]
  source: Any  # the Registry or loaded Model the weights came from
  template: Template | None  # of a leading template link


def assemble(path: str | Sequence[Ref | str], source, *, mesh=None, dtype=None) -> Assembly:
  """Resolve, type-check and read a path's weights.

  ``source`` is a :class:`thoughtjax.registry.Registry` (weights restored lazily: only the
  path's thoughtlets, plus the embed table a tied head or a template reads) or a
  :class:`~thoughtjax.model.Model`. ``mesh``/``dtype`` restore the weights straight into
  ``NamedSharding``s on that mesh and into that dtype (registry sources).
  """
  # Imported on use for start-up laziness: the registry brings orbax, which `import thoughtjax` does not need.
  from thoughtjax.registry import Registry

  links = resolve(path, source)
  source = weights_source(source)
  check_chain(links)
  for i, link in enumerate(links):
    if link.kind is Kind.TEMPLATE and i != 0:
      raise PathTypeError(
        f"link {i} ({link.label}): a template takes the user message and must come first",
        link=i,
        expected="message[B,U] i32",
        received=links[i - 1].signature.output,
      )

  cfg = source.config
  context = min(link.signature.constraints.get("max_context", cfg.max_context) for link in links)
  run_cfg = dataclasses.replace(cfg, max_context=min(context, cfg.max_context))

  # Which units to read: the path's own, plus embed when something reads its table.
  units: list[tuple[str, str | None]] = []
  for link in links:
    units.extend(link.units)
  embed_units = [u for link in links if link.kind is Kind.EMBED for u in link.units]
  needs_table = any("embed" in link.signature.constraints.get("requires", ()) for link in links)
  if not embed_units:
    if not needs_table:  # pragma: no cover - check_chain forces embed or template first
      raise PathTypeError("the path has no embed", link=0, expected="embed", received="nothing")
    embed_units = [("embed", None)]
    units.append(embed_units[0])
  if len(set(embed_units)) > 1:
    raise PathTypeError(
      "a path can use one embed version (the decode loop embeds new tokens with it)",
      link=0,
      expected="one embed",
      received=", ".join(f"{n}@{v}" for n, v in embed_units),
    )

  if isinstance(source, Registry):
    wanted = list(dict.fromkeys(units))
    restored = dict(zip(wanted, source.restore_many(wanted, dtype=dtype, mesh=mesh), strict=True))
    for unit in wanted:  # a variant's int8 weights are stored as {"int8", "scale"} arrays
      variant = split_variant(unit[0])[1]
      if variant is not None:
        restored[unit] = from_stored_variant(restored[unit], variant)
    codec, module_src, source_hash = source.codec, f"registry:{source.root}", str(source.generation)
  else:
    if mesh is not None or dtype is not None:
      raise ValueError("mesh= and dtype= apply to registry sources (restored into that layout)")
    restored = _model_units(source, units)
    codec, module_src, source_hash = source.codec, source.loaded.source, source.loaded.source_hash

  abstract = abstract_model(cfg)
  embed_state = as_state(abstract.embed, restored[embed_units[0]])
  head_units = [u for link in links if link.kind is Kind.HEAD for u in link.units]
  head_state = as_state(abstract.head, restored[head_units[0]])
  blocks, layers, slot_of = {}, [], {}
  for link in links:
    if link.kind is Kind.BRIDGE:  # runs between blocks; negative slots keep it apart from the model's layers
      slot = -1 - sum(1 for s in blocks if s < 0)
      blocks[slot] = dict(restored[link.units[0]])
      layers.append(slot)
      continue
    if link.kind is not Kind.BLOCKS:
      continue
    for unit in link.units:
      params = restored[unit]
      for key in sorted(params, key=int):
        layer = int(key)
        # A registry unit is one version; a loaded model has one version of every layer (per variant).
        ident = (unit if isinstance(source, Registry) else split_variant(unit[0])[1], layer)
        if ident not in slot_of:
          # Two versions of one layer in a path get distinct slots; the program only sees slots.
          slot = layer
          while slot in blocks:
            slot += cfg.num_layers
          slot_of[ident] = slot
          blocks[slot] = as_state(abstract.blocks[layer], params[key])
        layers.append(slot_of[ident])
  template = None
  if links[0].kind is Kind.TEMPLATE:
    template = Template.from_params(restored[links[0].units[0]], links[0].signature.constraints.get("system"))
  loaded = LoadedModel(run_cfg, abstract, codec, module_src, source_hash)
  return Assembly(loaded, tuple(layers), PathParts(embed_state, blocks, head_state), links, source, template)


def _model_units(model, units) -> dict:
  """Params of each unit, cut (not copied) from a loaded model by the one slicer."""
  out = {}
  for name, version in dict.fromkeys(units):
    span = Ref(name).span
    out[(name, version)] = (
      cut(model.module, Kind.BLOCKS, layers=span)
      if span is not None
      else cut(model.module, Kind(name), codec=model.codec)
    )
    variant = split_variant(name)[1]
    if variant is not None:  # quantized here: a loaded model holds one form of its weights
      out[(name, version)] = {k: variant_block(v, variant) for k, v in out[(name, version)].items()}
  return out

"""The one slicer: a thoughtlet's weights taken (not copied) from a whole model, and back.

:func:`cut` returns the ``params`` of one thoughtlet (see :class:`Thoughtlet`) from an NNX
:class:`~thoughtjax.transformer.Transformer`; :func:`as_state` and :func:`block_states` turn such
params back into NNX states of the model's own parts, so a restored thoughtlet runs through
the same module code as the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from thoughtjax.config import ModelConfig
from thoughtjax.path_syntax import Ref
from thoughtjax.template import Template
from thoughtjax.thoughtlet.errors import ThoughtletError
from thoughtjax.thoughtlet.types import Kind
from thoughtjax.transformer import GraphDefs, Transformer, abstract_model


def unit_of(name: str) -> tuple[Kind, tuple[int, int] | None]:
  """(kind, layers) of a model-level thoughtlet name: embed, head, template or ``blocks[a:b)``."""
  span = Ref(name).span
  if span is not None:
    if span[0] >= span[1]:
      raise ThoughtletError(f"{name}: empty or reversed layer range; need blocks[a:b) with a < b")
    return Kind.BLOCKS, span
  if name in ("embed", "head", "template"):
    return Kind(name), None
  raise ThoughtletError(
    f"{name!r} is not a thoughtlet of a model; expected embed, head, template or "
    f"blocks[a:b) (half-open). Named thoughtlets live in a registry"
  )


def template_parts(codec, system: str | None) -> tuple[list[int], list[int]]:
  """Token ids of a chat template's fixed text before and after one user message."""
  return codec.chat_template_parts(system)


def _template(model: Transformer, codec, system: str | None) -> dict:
  if codec is None:
    raise ThoughtletError("cutting a template thoughtlet needs the model's text codec; pass codec=")
  return Template.build(codec, model.embed.table[...], system).params()  # the one template builder


def _blocks(model: Transformer, layers) -> dict:
  if layers is None:
    raise ThoughtletError("cutting blocks needs a layer range; pass layers=(a, b) or the name 'blocks[a:b)'")
  a, b = layers
  if not 0 <= a < b <= len(model.blocks):
    raise ThoughtletError(
      f"blocks[{a}:{b}): the model has layers 0..{len(model.blocks) - 1}; "
      f"give a half-open range inside [0, {len(model.blocks)})"
    )
  return {str(i): nnx.to_pure_dict(nnx.state(model.blocks[i])) for i in range(a, b)}


def cut(
  model: Transformer, kind: Kind | str, *, layers: tuple[int, int] | None = None, codec=None, system: str | None = None
) -> dict:
  """The params of one thoughtlet, taken (not copied) from a model.

  ``kind`` is a :class:`Kind` (blocks take ``layers=(a, b)``) or a name such as
  ``"blocks[3:5)"``; a template needs the model's ``codec`` (and optionally a ``system`` prompt).
  """
  if isinstance(kind, str):
    kind, layers = unit_of(kind)
  if kind is Kind.EMBED:
    return nnx.to_pure_dict(nnx.state(model.embed))
  if kind is Kind.HEAD:
    return nnx.to_pure_dict(nnx.state(model.head))
  if kind is Kind.BLOCKS:
    return _blocks(model, layers)
  return _template(model, codec, system)


def defs_for(cfg: ModelConfig) -> GraphDefs:
  """Graph definitions of a model with ``cfg`` (no weights are allocated)."""
  return GraphDefs.from_model(abstract_model(cfg))


def as_state(abstract_module, pure: Mapping) -> nnx.State:
  """An NNX state for ``abstract_module`` holding the arrays of ``pure`` (no copies)."""
  state = nnx.state(abstract_module)
  nnx.replace_by_pure_dict(state, pure)
  return state


def block_states(abstract: Transformer, params: Mapping) -> dict[int, nnx.State]:
  """``{layer: state}`` of a blocks thoughtlet's params over the model's own blocks."""
  return {int(i): as_state(abstract.blocks[int(i)], p) for i, p in params.items()}

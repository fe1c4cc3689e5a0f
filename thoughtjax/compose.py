"""``compose(path, source)``: a chain of thoughtlets, type-checked, running as one XLA program.

>>> reg = Registry.open("build/registry")
>>> m = compose("embed, blocks[0:12), head", reg)       # early exit: restores embed, head and the
...                                                      # block thoughtlets of layers 0..11 only
>>> m.generate("The capital of France is", max_tokens=8).text
>>> compose("embed, blocks[0:20), blocks[10:30), head", reg)  # repeat: layers 10..19 run twice,
...                                                           # their weights are held once
>>> compose("embed, blocks[0:10)@int8, blocks[10:30), head", reg)  # layers 0..9 from their int8 variant

A path is a list of refs (:func:`thoughtjax.path_syntax.parse_path`), resolved against the source, type-checked
link by link and read into the parts the program runs by :mod:`thoughtjax.assembly` (its
:func:`~thoughtjax.assembly.resolve`, :func:`~thoughtjax.assembly.check_chain`, and
:class:`~thoughtjax.assembly.PathTypeError` for the first link that does not fit).

The result is a :class:`thoughtjax.model.Model` carrying the resolved path (``links``,
``refs``, ``path_hash``, and the template of a leading template link): ``generate``, ``stream``,
``score`` and ``logits`` run the path through :mod:`thoughtjax.decode.program` as one compiled program
(prefill + decode loop). Programs are cached by the path's layer sequence and shape buckets;
weights are arguments, so two versions of the same layout share a program.
``source`` may also be a loaded :class:`~thoughtjax.model.Model` (no registry: its own weights
are sliced) for quick experiments in a notebook.

A ref may name a weight variant (``blocks[a:b)@int8``, :mod:`thoughtjax.path_syntax`): from a registry it reads
the published variant thoughtlets (``registry build --variants int8``) that tile the range, from a loaded
model it quantizes the sliced layers at compose time. A layer taken from two variants in one path gets
two slots, like two versions.
"""

from __future__ import annotations

from collections.abc import Sequence

from thoughtjax.decode import program as program_lib
from thoughtjax.model import Model
from thoughtjax.path_syntax import Ref

# compose() returns a Model; the old name stays importable.
ComposedModel = Model


def compose(
  path: str | Sequence[Ref | str],
  source,
  *,
  mesh=None,
  dtype=None,
  kernels: str | None = None,
  chunk: int = program_lib.DEFAULT_CHUNK,
  compile_cache: bool = True,
) -> Model:
  """Resolve, type-check and assemble a path into a model running as one XLA program.

  ``source`` is a :class:`thoughtjax.registry.Registry` (weights restored lazily: only the
  path's thoughtlets, plus the embed table a tied head or a template reads) or a loaded
  :class:`~thoughtjax.model.Model`. ``mesh``/``dtype`` restore the weights straight into
  ``NamedSharding``s on that mesh and into that dtype (registry sources). ``kernels`` and
  ``chunk`` are the :class:`~thoughtjax.model.Model`'s. ``compile_cache`` turns on JAX's
  persistent compilation cache, as :func:`thoughtjax.load` does. The model returned carries
  the resolved path (``links``); ``model.with_path(...)`` composes another over the same source.
  """
  if compile_cache:
    program_lib.configure_compilation_cache()
  return Model.composed(path, source, mesh=mesh, dtype=dtype, kernels=kernels, chunk=chunk)

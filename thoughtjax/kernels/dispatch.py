"""Which implementation of the kernel ops (fused sampling with stop detection, template embedding) runs.

One choice selects both ops: ``"xla"`` (the pure-jnp reference, fused by XLA) or ``"pallas"`` (the
hand-written Pallas kernels). :func:`resolve` turns a user's choice (``--kernels``, ``kernels=``) into
one of them:

- an explicit choice wins on every backend; anything else is a :class:`KernelChoiceError`;
- ``None`` means the default: ``"pallas"`` on a GPU (while :data:`PALLAS_DEFAULT_ON_GPU` holds),
  ``"xla"`` everywhere else, where Pallas only runs interpreted.

A default is earned on the hardware it applies to: ``scripts/gpu_check.sh`` runs the kernel tests
natively and benchmarks XLA against Pallas there. On an NVIDIA H200 (BENCHMARKS.md, "Kernels") every
kernel test passed natively, and the per-token op, ``sample_stop``, ran 1.3-2.3x faster as a Pallas
kernel than XLA's fusion of the reference at every measured shape; ``template_embed``, run once per
prefill, was 0.004-0.038 ms slower in four of six shapes and faster in two.
"""

from __future__ import annotations

from typing import Literal

from thoughtjax.errors import UserError

Implementation = Literal["xla", "pallas"]

# One line per implementation: what it is. The table is the list of valid choices.
IMPLEMENTATIONS: dict[Implementation, str] = {
  "xla": "pure-jnp reference ops, fused by XLA (the default but on a GPU)",
  "pallas": "hand-written Pallas kernels (the default on a GPU, via Triton; interpret mode elsewhere)",
}

# Earned by scripts/gpu_check.sh on an H200 (BENCHMARKS.md): set it False to make XLA the GPU default.
PALLAS_DEFAULT_ON_GPU = True


class KernelChoiceError(UserError, ValueError):
  """An unknown kernel implementation was asked for."""


def resolve(kernels: str | None, backend: str | None = None, *, name: str = "kernels") -> Implementation:
  """The implementation to run: ``kernels`` when given (validated), else the default for ``backend``.

  ``backend`` is a JAX backend name (``"cpu"``, ``"gpu"``, ``"tpu"``); None asks
  ``jax.default_backend()``, and only when the default is actually needed. ``name`` is the
  argument's name in the error message (``kernels``, ``--kernels``, ``implementation``).
  """
  if kernels is not None:
    if kernels not in IMPLEMENTATIONS:
      raise KernelChoiceError(
        f"{name} must be one of {', '.join(map(repr, IMPLEMENTATIONS))} or None (the default), got "
        f"{kernels!r}; pick 'xla' for the reference ops or 'pallas' for the Pallas kernels"
      )
    return kernels  # type: ignore[return-value]
  return default(backend)


def default(backend: str | None = None) -> Implementation:
  """The implementation used when the caller does not choose (see :data:`PALLAS_DEFAULT_ON_GPU`)."""
  if backend is None:
    import jax  # here: the command line reads IMPLEMENTATIONS without starting JAX

    backend = jax.default_backend()
  if backend == "gpu" and PALLAS_DEFAULT_ON_GPU:
    return "pallas"
  return "xla"


def interpret_default(backend: str | None = None) -> bool:
  """Whether a Pallas kernel runs in interpret mode: everywhere but on a GPU, where it compiles."""
  if backend is None:
    import jax

    backend = jax.default_backend()
  return backend != "gpu"

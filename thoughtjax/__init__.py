"""thoughtjax: a pretrained LLM cut into thoughtlets, composed into one XLA program.

``import thoughtjax`` is cheap: it imports neither JAX nor the engine, and changes no environment variable.
The names below load their modules on first use (PEP 562), so a command line or a client that needs only a
few modules starts without the rest.
"""

from __future__ import annotations

import importlib
import os

# XLA:CPU's default scheduler orders a program for concurrency, which lets every dequantization of native
# weights in a prefill run early and stay live at once: a float32 copy of the whole model (538 MB of temp
# buffers for the default model) where one layer's worth is needed. The memory-minimizing order keeps the
# prefill's temp to the largest single buffer (126 MB). :func:`use_memory_scheduler` selects it; the command
# line and the server do, before JAX starts.
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

# name -> the module that defines it
_LAZY = {
  "Completion": "thoughtjax.decode.stream",
  "Delta": "thoughtjax.decode.stream",
  "Generation": "thoughtjax.decode.stream",
  "Trace": "thoughtjax.decode.stream",
  "Model": "thoughtjax.model",
  "Score": "thoughtjax.model",
  "load": "thoughtjax.model",
  "SamplingParams": "thoughtjax.sampling",
  "Template": "thoughtjax.template",
}

__all__ = [*sorted(_LAZY), "MEMORY_SCHEDULER_FLAG", "use_memory_scheduler"]


def use_memory_scheduler() -> bool:
  """Select XLA:CPU's memory-minimizing scheduler (:data:`MEMORY_SCHEDULER_FLAG`) for this process.

  A process-level choice: it adds the flag to ``XLA_FLAGS``, which JAX reads once, when its CPU backend
  starts, so call it before the first computation. An ``XLA_FLAGS`` that already names the flag wins, and
  jaxlib releases before 0.5 (which abort on a flag they do not know) get nothing. True when the flag is set
  now (by this call or the user).
  """
  from importlib import metadata

  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_enable_concurrency_optimized_scheduler" in flags:
    return MEMORY_SCHEDULER_FLAG in flags.split()
  try:  # the distribution's metadata: importing jaxlib itself costs a second
    version = metadata.version("jaxlib")
  except metadata.PackageNotFoundError:
    return False
  if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (0, 5):
    return False
  os.environ["XLA_FLAGS"] = f"{flags} {MEMORY_SCHEDULER_FLAG}".strip()
  return True


def __getattr__(name: str):
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'thoughtjax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # once: later lookups do not come here
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})

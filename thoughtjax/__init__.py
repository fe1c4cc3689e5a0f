"""thoughtjax: a pretrained LLM cut into thoughtlets, composed into one XLA program."""

import os as _os

# XLA:CPU's default scheduler orders a program for concurrency, which lets every dequantization of native
# weights in a prefill run early and stay live at once: a float32 copy of the whole model (538 MB of temp
# buffers for the default model) where one layer's worth is needed. The memory-minimizing order keeps the
# prefill's temp to the largest single buffer (126 MB). It must be set before JAX starts its CPU backend;
# an XLA_FLAGS that already names the flag wins. XLA aborts on a flag it does not know, so only jaxlib
# releases that have it (0.5 on) get it.
MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _set_memory_scheduler() -> None:
  import jaxlib  # inside the function: keeps jaxlib out of the package namespace

  flags = _os.environ.get("XLA_FLAGS", "")
  major_minor = tuple(int(p) for p in jaxlib.__version__.split(".")[:2] if p.isdigit())
  if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags and major_minor >= (0, 5):
    _os.environ["XLA_FLAGS"] = f"{flags} {MEMORY_SCHEDULER_FLAG}".strip()


_set_memory_scheduler()

from thoughtjax.decode.stream import Completion, Delta, Generation, Trace  # noqa: E402
from thoughtjax.model import Model, Score, load  # noqa: E402
from thoughtjax.sampling import SamplingParams  # noqa: E402
from thoughtjax.template import Template  # noqa: E402

__all__ = ["Completion", "Delta", "Generation", "Model", "SamplingParams", "Score", "Template", "Trace", "load"]

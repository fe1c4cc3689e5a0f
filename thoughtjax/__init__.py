"""thoughtjax: a pretrained LLM cut into thoughtlets, composed into one XLA program."""

from thoughtjax.engine import Completion, Delta, Generation, Model, Score, Trace, load
from thoughtjax.sampling import SamplingParams
from thoughtjax.template import Template

__all__ = ["Completion", "Delta", "Generation", "Model", "SamplingParams", "Score", "Template", "Trace", "load"]

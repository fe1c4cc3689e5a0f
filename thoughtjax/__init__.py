"""thoughtjax: a pretrained LLM cut into thoughtlets, composed into one XLA program."""

from thoughtjax.engine import Completion, Delta, Model, Score, load
from thoughtjax.sampling import SamplingParams

__all__ = ["Completion", "Delta", "Model", "SamplingParams", "Score", "load"]

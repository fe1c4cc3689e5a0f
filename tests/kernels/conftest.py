"""Fixtures of the kernel tests.

The same tests run natively on a GPU and in Pallas interpret mode on CPU: they ask
for ``implementation="pallas"`` and leave ``interpret`` to the dispatch rule.
"""

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
  """A numpy generator with a fixed seed, fresh for every test."""
  return np.random.default_rng(20240611)

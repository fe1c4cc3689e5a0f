"""How hard the fuzz tests push. The test tiers run each fuzz at a count that still catches the faults these fuzzes
were written for (a status outside the documented set on one malformed field; tests/server/test_fuzz.py shows it by
planting one); ``THOUGHTJAX_FUZZ=full`` runs each at the count it was first written with (minutes more)."""

from __future__ import annotations

import os

FULL = os.environ.get("THOUGHTJAX_FUZZ", "") == "full"


def count(tier: int, full: int) -> int:
  """``tier`` examples in the test tiers, ``full`` under ``THOUGHTJAX_FUZZ=full``."""
  return full if FULL else tier

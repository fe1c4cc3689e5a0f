"""The error a caller gets for a thoughtlet request that cannot be met."""

from __future__ import annotations

from thoughtjax.errors import UserError


class ThoughtletError(UserError, ValueError):
  """A thoughtlet cannot be cut, re-weighted, measured or replayed as asked; the message says
  which thoughtlet, what was expected, what came, and the fix."""

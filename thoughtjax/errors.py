"""The one error policy of thoughtjax.

Every error that a user can cause and fix (a bad path, a missing file, a refused registry,
an unknown hint) derives from :class:`UserError`. Its message names the thing, what was
expected, what came, and the fix. The command line prints a ``UserError`` in one line and
exits with status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
  """A failure the caller caused and can fix; its message says how."""

"""Errors of the model loaders: every one is a :class:`~thoughtjax.errors.UserError` whose message
names the file, what was expected, what was found, and the fix."""

from __future__ import annotations

from thoughtjax.config import UnsupportedModelError
from thoughtjax.errors import UserError

__all__ = ["ModelNotFoundError", "TruncatedModelError", "UnsupportedModelError", "WeightCacheError"]


class ModelNotFoundError(UserError, FileNotFoundError):
  """A model name or path that names no known model, file or directory."""


class TruncatedModelError(UserError, ValueError):
  """A model file is shorter than its own header says (an interrupted download or copy)."""


class WeightCacheError(UserError, RuntimeError):
  """A file of the derived weight cache (``weights/`` under the cache directory) failed its check."""

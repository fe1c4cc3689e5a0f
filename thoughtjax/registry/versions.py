"""How a caller names a published version: its full hex digits, or a prefix long enough to stay unambiguous.

:func:`match_version` maps such a name to the one version in a thoughtlet's history it names, or raises
:class:`UnknownThoughtletError` listing the recent versions. It looks at the history alone: whether that version
is still on disk, and holding it against gc, is :meth:`~thoughtjax.registry.store.Registry.resolve`'s part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from thoughtjax.registry.errors import UnknownThoughtletError
from thoughtjax.registry.layout import VERSION_LEN

# A version named in a path or a call: the full 16 hex digits or a prefix this long (a client cannot pick
# an arbitrary old version with one character, and a prefix stays unambiguous as history grows).
MIN_VERSION_PREFIX = 12
_VERSION_PREFIX_RE = re.compile(f"[0-9a-f]{{{MIN_VERSION_PREFIX},{VERSION_LEN}}}")


def match_version(name: str, version, history: Sequence[str]) -> str:
  """The one version in ``history`` (oldest first) that ``version`` names: all :data:`VERSION_LEN` lowercase hex
  digits or a prefix of at least :data:`MIN_VERSION_PREFIX`; anything else, no match or more than one match
  raises :class:`UnknownThoughtletError`."""
  recent = ", ".join(history[-8:]) + (f" (and {len(history) - 8} older)" if len(history) > 8 else "")
  if not (isinstance(version, str) and _VERSION_PREFIX_RE.fullmatch(version)):
    raise UnknownThoughtletError(
      f"{name}@{repr(version)[:40]}: name a version by its {VERSION_LEN} lowercase hex digits or a prefix of at "
      f"least {MIN_VERSION_PREFIX} of them; versions of {name}: {recent}"
    )
  found = [v for v in history if v.startswith(version)]
  if len(found) != 1:
    raise UnknownThoughtletError(
      f"{name}@{version}: {'no' if not found else 'more than one'} published version matches; "
      f"versions of {name}: {recent}"
    )
  return found[0]

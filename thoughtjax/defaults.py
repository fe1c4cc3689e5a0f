"""What a request gets when it does not say: one home for each default, importable without JAX (the command
line reads them to build its parser)."""

from __future__ import annotations

# New tokens a request generates when it does not say. One number for the library and every command that runs
# or predicts a request (generate, plan, synthesize, paths, registry warm), so the same request costs the same
# whichever way it is made.
DEFAULT_MAX_TOKENS = 64

"""What a request gets when it does not say: one home for each default, importable without JAX (the command
line reads them to build its parser)."""

from __future__ import annotations

# New tokens a request generates when it does not say. One number for the library and every command that runs
# or predicts a request (generate, plan, synthesize, paths, registry warm), so the same request costs the same
# whichever way it is made.
DEFAULT_MAX_TOKENS = 64

# Hints a request may give, in priority order (every entry point refuses more).
MAX_HINTS = 3

# Tokens a self-speculative draft proposes per verify pass when the caller does not say.
DEFAULT_DRAFT_TOKENS = 4

# The shortest ring a server's slot engine is made with (a request's prompt + new tokens, bucketed, at least this).
DEFAULT_CACHE_LEN = 64

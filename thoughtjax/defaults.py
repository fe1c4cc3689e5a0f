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

# The shortest ring an engine pool (a server's slot engines) makes an engine with: a request's prompt + new tokens,
# bucketed, at least this. A path decodes in one engine, the longest ring it needed: long enough for a chat prompt
# and its answer, so that a server does not make a longer one (and compile its programs) under traffic.
MIN_POOL_RING = 512

# The ring (KV cache length, tokens) of a slot engine made directly without saying.
DEFAULT_SLOT_CACHE_LEN = 512

# Prompt tokens a slot engine prefills per program call (a longer prompt takes several calls, a shorter one is
# padded to it): one prefill program per number of rows, whatever the prompts' lengths.
DEFAULT_PREFILL_CHUNK = 64

"""Fixtures of the benchmark tests: the registry tests' rollback-state file, so no test writes the user's."""

from tests.registry.conftest import trust_state  # noqa: F401  (autouse, session scope)

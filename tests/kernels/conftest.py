"""Fixtures of the kernel tests.

The same tests run natively on a GPU and in Pallas interpret mode on CPU: they ask
for ``implementation="pallas"`` and leave ``interpret`` to the dispatch rule. The seeded
``rng`` and ``getkey`` fixtures come from ``tests/conftest.py``.
"""

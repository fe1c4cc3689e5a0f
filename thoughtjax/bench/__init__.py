"""Benchmark commands (`thoughtjax bench ...`): tables on stdout, JSON on request."""

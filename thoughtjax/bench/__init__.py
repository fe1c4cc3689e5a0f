"""Benchmark commands (`thoughtjax bench ...`): tables on stdout, JSON on request.

Imports inside the benchmark functions are deferred on purpose: ``thoughtjax bench X`` loads what X measures
(its peer's client, plotting, the server) and nothing the other benchmarks need. The command line names each
module with a one-line description (:data:`thoughtjax.cli.bench.BENCHMARKS`).
"""

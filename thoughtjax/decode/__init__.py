"""Decoding: what every way of generating tokens shares.

* :mod:`~thoughtjax.decode.stream`  the host side of one call: Delta, Trace, Completion, Rows, Generation
* :mod:`~thoughtjax.decode.constraint`  output constraints (JSON Schema, regex, grammar) and their matchers
* :mod:`~thoughtjax.decode.masks`  per-row allowed-token masks kept in step with those matchers
"""

"""Decoding: what every way of generating tokens shares.

* :mod:`~thoughtjax.decode.stream`  the host side of one call: Delta, Trace, Completion, Rows, Generation
* :mod:`~thoughtjax.decode.constraint`  JSON schema / regex / grammar constraints -> per-row allowed-token bitmasks
* :mod:`~thoughtjax.decode.masks`  a batch's masks kept in step with its rows' matchers
"""

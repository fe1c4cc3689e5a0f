"""Decoding: what every way of generating tokens shares.

* :mod:`~thoughtjax.decode.stream`  the host side of one call: Delta, Trace, Completion, Rows, Generation
* :mod:`~thoughtjax.decode.masks`  a batch's masks kept in step with its rows' matchers

Constraints themselves (JSON schema / regex / grammar -> allowed-token bitmasks) are
:mod:`thoughtjax.constraint`, below sampling, which validates them with the request.
"""

"""Decoding: what every way of generating tokens shares.

* :mod:`~thoughtjax.decode.interface`  the decode program interface every program family implements (init_state,
  prefill, advance, read), the key type every family's key extends, the one host loop of a call that runs alone
* :mod:`~thoughtjax.decode.state`  the decode state of a pool's rows and the one decode step: plain generation is
  a pool filled once by its prefill, a slot engine's pool refills its rows
* :mod:`~thoughtjax.decode.program`  plain programs (prefill, then chunks of decode steps) and the process's one
  bounded program cache that every program family shares
* :mod:`~thoughtjax.decode.speculative`  self-speculative programs: a draft/verify advance over the same state
* :mod:`~thoughtjax.decode.stream`  the host side of one call: Delta, Trace, Completion, Rows, Generation
* :mod:`~thoughtjax.decode.masks`  a batch's masks kept in step with its rows' matchers
* :mod:`~thoughtjax.decode.layout`  the attention layout: KV caches, RoPE positions and attention masks of
  left-padded rows and of a slot engine's ring
* :mod:`~thoughtjax.decode.request`  one check of a request's fields for every caller, and the checked request
  bound to its model that a caller runs alone or hands to a slot engine
* :mod:`~thoughtjax.decode.indexed`  the layer-indexed form: a loop over stacked layer weights

Constraints themselves (JSON schema / regex / grammar -> allowed-token bitmasks) are
:mod:`thoughtjax.constraint`, below sampling, which validates them with the request.
"""

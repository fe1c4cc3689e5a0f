"""Pallas kernels beside their pure-jnp references, dispatched by ``implementation=``."""

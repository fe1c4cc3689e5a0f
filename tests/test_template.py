"""Template rows: the same rows from a host table (numpy gather, nothing traced) and from any other table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.template import _rows

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def test_host_table_rows_are_gathered_without_tracing(rng):
  table = jnp.asarray(rng.standard_normal((50, 8), np.float32)).block_until_ready()
  ids = [3, 0, 49, 3]
  traced = []
  jax.monitoring.register_event_duration_secs_listener(lambda e, s, **k: traced.append(e) if e == TRACE_EVENT else None)
  got = _rows(table, ids)
  from_numpy = _rows(np.asarray(table), ids)
  assert not traced
  np.testing.assert_array_equal(got, jnp.take(table, jnp.asarray(ids), axis=0))
  np.testing.assert_array_equal(from_numpy, got)
  assert got.shape == (4, 8) and got.dtype == jnp.float32
  assert got.sharding.device_set == table.sharding.device_set


def test_table_sharded_over_devices_still_gives_its_rows(rng):
  devices = jax.devices()[:2]
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  host = rng.standard_normal((8, 4), np.float32)
  table = jax.device_put(host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  np.testing.assert_array_equal(_rows(table, [7, 1]), host[[7, 1]])

"""Sharding: thoughtlets restore straight into NamedShardings on a (data, model) mesh, and a
path compiled over 8 (fake CPU) devices gives the logits and tokens of one device.

The device count is fixed when JAX starts, so the mesh runs in a fresh interpreter.
"""

from __future__ import annotations

import json

from tests.registry.helpers import run_python

MESH_CHECK = r"""
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from thoughtjax.decode import program as program_lib
from thoughtjax.assembly import full_path
from thoughtjax.compose import compose
from thoughtjax.registry import Registry

root = sys.argv[1] if len(sys.argv) > 1 else {root!r}
assert jax.device_count() == 8, jax.devices()
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
reg = Registry.open(root)
params = reg.restore("blocks[0:2)", mesh=mesh)
q, down, norm = params["0"]["attn"]["q"], params["0"]["mlp"]["down"], params["0"]["attn_norm"]["weight"]
table = reg.restore("embed", mesh=mesh)["table"]
out = {{
  "q_spec": str(q.sharding.spec), "down_spec": str(down.sharding.spec), "norm_spec": str(norm.sharding.spec),
  "table_spec": str(table.sharding.spec), "q_shard": list(q.addressable_shards[0].data.shape),
  "q_devices": len(q.sharding.device_set),
}}
ids = [7, 70, 71, 72, 32, 73, 74, 75, 76]
single = compose(full_path(reg), reg)
sharded = compose(full_path(reg), reg, mesh=mesh)
a, b = single.logits(ids), sharded.logits(ids)
out["max_abs_diff"] = float(np.abs(a - b).max())
hlo = program_lib.score_logits.lower(sharded.defs, sharded.layers, sharded.parts,
                                     jax.numpy.zeros((1, 16), jax.numpy.int32)).compile().as_text()
out["collectives"] = sorted({{op for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
                              if op in hlo}})
out["tokens_single"] = single.generate(ids, max_tokens=5).token_ids
out["tokens_sharded"] = sharded.generate(ids, max_tokens=5).token_ids
print("RESULT " + json.dumps(out))
"""


def test_mesh_restore_and_equivalence(built):
  proc = run_python(
    MESH_CHECK.format(root=str(built)),
    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  r = json.loads(line[len("RESULT ") :])
  # Tensor parallel over "model" (heads / FFN width / vocabulary), replicated over "data".
  assert r["q_spec"] == "P(None, 'model', None)"
  assert r["down_spec"] == "P('model', None)"
  assert r["norm_spec"] == "P()"
  assert r["table_spec"] == "P('model', None)"
  assert r["q_shard"] == [32, 2, 8] and r["q_devices"] == 8
  assert r["max_abs_diff"] <= 1e-5
  assert r["collectives"], "a tensor-parallel program must communicate"
  assert r["tokens_sharded"] == r["tokens_single"]

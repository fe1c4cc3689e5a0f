"""Start-up path: preparing a generation call (prompt, template rows, sampling arrays) traces no program.

In a new process every traced function costs a trace, a lowering and a compile or persistent-cache fetch
before the first token; only the generation program itself should pay that.
"""

from __future__ import annotations

import jax

from tests.tiny import tiny_engine
from thoughtjax.sampling import SamplingParams

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def _traced_during(fn) -> list[str]:
  names: list[str] = []
  active = [True]
  jax.monitoring.register_event_time_span_listener(
    lambda e, a, b, fun_name=None, **k: names.append(fun_name) if active[0] and e == TRACE_EVENT else None
  )
  try:
    fn()
  finally:
    active[0] = False
  return names


def test_preparing_a_chat_call_traces_nothing():
  model = tiny_engine("llama_gqa", seed=5, chat=True)
  jax.block_until_ready(jax.tree.leaves(model.parts))
  jax.clear_caches()
  gens = []
  traced = _traced_during(
    lambda: gens.append(model.stream_batch(["hello", "hi there"], SamplingParams(max_tokens=3, seed=1), chat=True))
  )
  assert traced == []
  (g,) = gens
  assert len(g.completions()) == 2  # and the call then runs


def test_preparing_a_plain_call_traces_nothing():
  model = tiny_engine("llama_gqa", seed=5)
  jax.block_until_ready(jax.tree.leaves(model.parts))
  jax.clear_caches()
  gens = []
  params = SamplingParams(max_tokens=3, temperature=0.7, top_k=5, logit_bias={7: 1.5})
  traced = _traced_during(lambda: gens.append(model.stream_batch([[5, 6, 7]], params)))
  assert traced == []
  assert len(gens[0].result().token_ids) == 3

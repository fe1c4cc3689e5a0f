"""The warm set (config ``warm``) is compiled where requests run: with the continuous scheduler, in the slot engine
of each hint's path, so requests of any length after SERVING trace no program (the prefill runs in chunks of a fixed
size, one program per number of rows)."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import jax

from tests.server.conftest import config, stub_of, wait_ready
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import PrefixCacheConfig, WarmConfig

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # every program made for a new shape starts with a trace
_traced: list[str] = []
_tracing = threading.Event()
jax.monitoring.register_event_duration_secs_listener(
  lambda e, s, **k: _traced.append(threading.current_thread().name) if e == TRACE_EVENT and _tracing.is_set() else None
)

PROMPT = "The quick brown fox"
# Past one prefill chunk (64 tokens), and its first blocks shared by the next one: a prefix-cache hit.
LONG = " ".join(["the river ran past the old mill and the dog slept in the sun"] * 2)
HINT = "general_purpose"


def _final(stub, prompt: str = PROMPT, **fields) -> pb.Final:
  *_, last = stub.Synthesize(pb.SynthesizeRequest(prompt=prompt, hints=[HINT], **fields), timeout=120)
  return last.final


def test_warm_hints_compile_the_slot_engine_so_requests_of_any_length_alone_and_together_trace_nothing(synthesizer):
  # Three slots and a 12-token answer: a layout no other test compiles in this process. The warmed ring holds the
  # longest prompt; shorter ones join the same engine.
  T, n = len(synthesizer.prompt_ids(LONG + " and then")), 12
  assert T > 64
  warm = WarmConfig(hints=(HINT,), prompt_tokens=(T,), max_tokens=(n,))
  cfg = config(
    scheduler="continuous", max_concurrent=3, warm=warm, prefix_cache=PrefixCacheConfig(max_mb=8, report_reuse=True)
  )
  with BackgroundServer(synthesizer, cfg, timeout=300) as srv:
    wait_ready(srv)
    pool = srv.app.service.scheduler.pool
    assert pool.stats()["engines"] == 1  # made by the warm-up, before any request
    ch, stub = stub_of(srv)
    with ch:
      _tracing.set()
      try:
        alone = _final(stub, max_tokens=n)
        prompts = [PROMPT, LONG, LONG + " and then"]  # the third reuses the second's blocks
        with ThreadPoolExecutor(3) as ex:  # prefilled together (or not), decoded in one chunk of up to 3 rows
          together = list(ex.map(lambda k: _final(stub, prompts[k], max_tokens=n, logit_bias={k: 1.0}), range(3)))
        again = _final(stub, LONG + " and then", max_tokens=n)
      finally:
        _tracing.clear()
    stats = pool.stats()
  assert _traced == []
  assert stats["engines"] == 1  # the five ran in the warmed engine, the only one
  assert alone.usage.tokens_out > 0 and all(f.usage.tokens_out > 0 for f in [*together, again])
  assert again.trace.prefix_cache_tokens > 0


def test_warm_budgets_plan_each_budget_before_serving(synthesizer):
  """A warm-up with a generous and an impossible budget plans both (the second degrades to the fastest
  floor-meeting path, which is warmed too) before health says SERVING."""
  T = len(synthesizer.prompt_ids(PROMPT))
  warm = WarmConfig(hints=(HINT,), prompt_tokens=(T,), max_tokens=(4,), budgets_ms=(math.inf, 1e-3))
  before = synthesizer.planner.counters.snapshot()
  with BackgroundServer(synthesizer, config(scheduler="continuous", max_concurrent=2, warm=warm), timeout=300) as srv:
    wait_ready(srv)
    after = synthesizer.planner.counters.snapshot()
  assert after["plans"] - before["plans"] == 2 and after["degraded_budget"] - before["degraded_budget"] == 1


def test_warming_every_hint_in_greedy_and_sampled_modes_leaves_nothing_to_compile_under_a_mixed_load(synthesizer):
  """The shipped config's warm set (hints ``all``, modes greedy and sample): after SERVING, a load of concurrent
  requests with and without hints (routed), greedy and sampled, of mixed prompt lengths, traces no program; every
  request ran in an engine the warm-up made."""
  warm = WarmConfig(hints=("all",), modes=("greedy", "sample"))
  cfg = config(scheduler="continuous", max_concurrent=4, warm=warm, prefix_cache=PrefixCacheConfig(max_mb=8))
  prompts = [PROMPT, LONG, LONG + " and then", "Hi", PROMPT + " jumps over the lazy dog " * 3]
  hints = [[], *([h] for h in synthesizer.calibration.hints)]
  with BackgroundServer(synthesizer, cfg, timeout=600) as srv:
    wait_ready(srv)
    pool = srv.app.service.scheduler.pool
    engines = pool.stats()["engines"]
    assert engines >= 1  # made by the warm-up, before any request
    ch, stub = stub_of(srv)

    def call(k: int) -> pb.Final:
      sampled = {"temperature": 0.8, "seed": k} if k % 2 else {}
      request = pb.SynthesizeRequest(
        prompt=prompts[k % len(prompts)], hints=hints[k % len(hints)], max_tokens=4 + 3 * (k % 4), **sampled
      )
      *_, last = stub.Synthesize(request, timeout=300)
      return last.final

    with ch:
      _tracing.set()
      try:
        with ThreadPoolExecutor(4) as ex:
          finals = list(ex.map(call, range(12)))
      finally:
        _tracing.clear()
    stats = pool.stats()
  assert _traced == []
  assert stats["engines"] == engines and all(f.usage.tokens_out > 0 for f in finals)

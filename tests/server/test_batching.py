"""The continuous scheduler behind the server on the tiny registry: concurrent streams share one slot engine and
each gives the tokens it gives alone; a cancelled stream frees its slot within one chunk; a request whose
predicted latency outlasts its deadline is refused before it takes a slot; a full queue is RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import threading
import time
import types

import grpc
import pytest

from tests.server.conftest import code_of, config, stub_of, wait_ready
from tests.tiny import tiny_engine
from thoughtjax.decode.request import RequestRun
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.sampling import SamplingParams
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import ConfigError, load_config
from thoughtjax.server.scheduling import ContinuousScheduler, DeadlineExpired, SimpleScheduler, make_scheduler

C = grpc.StatusCode
PROMPTS = ["The quick brown fox", "Once upon a time", "A haiku about rain", "Numbers: 1, 2, 3"]


@pytest.fixture(scope="module")
def batched(synthesizer):
  with BackgroundServer(synthesizer, config(scheduler="continuous", max_concurrent=4, max_queue=4)) as srv:
    wait_ready(srv)
    yield srv


def _alone(synthesizer, prompt: str, n: int):
  ids = synthesizer.prompt_ids(prompt)
  return synthesizer.synthesize(ids, ["general_purpose"], max_latency_ms=math.inf, max_tokens=n).finish()


def _request(prompt: str, n: int, request_id: str, **kw) -> pb.SynthesizeRequest:
  return pb.SynthesizeRequest(prompt=prompt, hints=["general_purpose"], max_tokens=n, request_id=request_id, **kw)


def test_the_config_selects_the_continuous_scheduler(batched, tmp_path):
  assert isinstance(batched.app.service.scheduler, ContinuousScheduler)
  assert load_config().scheduler == "continuous" and isinstance(make_scheduler(load_config()), ContinuousScheduler)
  assert isinstance(make_scheduler(config(scheduler="simple")), SimpleScheduler)
  bad = tmp_path / "bad.yaml"
  bad.write_text("scheduler: fifo\n")
  with pytest.raises(ConfigError, match=r"scheduler: expected one of \['continuous', 'simple'\], got 'fifo'"):
    load_config(bad)


def test_concurrent_streams_share_one_engine_and_each_gives_its_alone_tokens(batched, synthesizer):
  """Four streams at once (and a long one holding a slot meanwhile) go through one slot engine of the path;
  each of the four gives the greedy tokens, text and usage it gives alone through the library."""
  lengths = [12, 20, 7, 16]
  alone = [_alone(synthesizer, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
  sched = batched.app.service.scheduler
  before = sched.snapshot()["slots_freed"]  # counts engines closed meanwhile too
  ch, stub = stub_of(batched)
  with ch:
    long = stub.Synthesize(_request(PROMPTS[0], 200, "long", logit_bias={0: 50.0}), timeout=120)
    it = iter(long)
    assert next(it).WhichOneof("kind") == "plan" and next(it).WhichOneof("kind") == "delta"  # in its slot
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      got = list(
        pool.map(lambda i: list(stub.Synthesize(_request(PROMPTS[i], lengths[i], f"r{i}"), timeout=120)), range(4))
      )
    long.cancel()
  for responses, want in zip(got, alone, strict=True):
    ids = [t for r in responses[1:-1] for t in r.delta.token_ids]
    final = responses[-1].final
    assert ids == want.token_ids and final.text == want.text and final.usage.tokens_out == len(ids)
  assert batched.call(lambda: sched.wait_idle(60))
  snap = sched.snapshot()
  # One engine per path and ring length: the four short requests share the 64-token ring of their path, the long
  # one has a longer ring (the plan of each request is the planner's: equal-quality paths can swap as it learns).
  drivers = sched.pool.drivers()
  paths = {(d.engine.model.path_hash, d.engine.layers, d.engine.kernels, d.engine.chunk) for d in drivers}
  assert 1 <= len(paths) <= 2 and snap["engines"] <= 2 * len(paths), snap
  assert snap["slots_in_use"] == 0 and snap["running"] == 0, snap
  engines = [d.engine for d in drivers]
  assert snap["slots_freed"] - before == 5 and {e.slots for e in engines} == {4}
  assert {e.cache_len for e in engines} <= {64, 256}


def test_a_cancelled_stream_frees_its_slot_within_one_chunk(batched):
  sched = batched.app.service.scheduler
  ch, stub = stub_of(batched)
  with ch:
    call = stub.Synthesize(_request(PROMPTS[1], 200, "cancel-me", logit_bias={0: 50.0}), timeout=120)
    it = iter(call)
    assert next(it).WhichOneof("kind") == "plan" and next(it).WhichOneof("kind") == "delta"
    call.cancel()
  assert batched.call(lambda: sched.wait_idle(60))
  rec = next(r for r in sched.records if r.request_id == "cancel-me")
  assert rec.ended_by == "cancelled" and rec.closed and rec.tokens_out < 200
  assert rec.decode_chunks_end - rec.decode_chunks_at_cancel <= 1
  assert sched.snapshot()["slots_in_use"] == 0 and sched.free_turns == sched.max_concurrent


def test_a_constraint_past_its_matchers_limits_ends_its_own_stream_and_its_neighbours_go_on(batched, synthesizer):
  """Attack: a regex whose matcher needs ever more lexer expressions (nested counted repeats) with every output
  token pushed to 'a' runs past llguidance's limits after 16 tokens, in the slot engine beside another stream. The
  hostile stream ends INVALID_ARGUMENT naming the limits (no parser state in the message); the neighbour, in the
  same engine, gives the greedy tokens it gives alone (it used to end with the same error)."""
  from tests.tiny import tiny_tokenizer

  a = tiny_tokenizer().token_to_id("a")
  n = 48
  alone = _alone(synthesizer, PROMPTS[2], n)
  sched = batched.app.service.scheduler
  ch, stub = stub_of(batched)
  with ch:
    neighbour = stub.Synthesize(_request(PROMPTS[2], n, "neighbour"), timeout=120)
    it = iter(neighbour)
    assert next(it).WhichOneof("kind") == "plan" and next(it).WhichOneof("kind") == "delta"  # in its slot
    hostile = _request("aaaa", 40, "hostile", regex="((((a{1,100}){1,100}){1,100}){1,100})", logit_bias={a: 100.0})
    code, details = code_of(stub.Synthesize, hostile, timeout=120)
    rest = list(it)
  assert code == C.INVALID_ARGUMENT and "limits" in details and "regular expression" in details, (code, details)
  assert "<" not in details and "⟦" not in details  # no parser state or token dump
  ids = [t for r in rest[:-1] for t in r.delta.token_ids]
  first = alone.token_ids[: len(alone.token_ids) - len(ids)]
  assert first + ids == alone.token_ids and rest[-1].final.text == alone.text
  assert batched.call(lambda: sched.wait_idle(60))
  assert sched.snapshot()["slots_in_use"] == 0


def test_plans_are_predicted_under_the_engines_load_in_their_context(batched, synthesizer):
  """While a stream holds a slot, the scheduler reports its engine's streams, and a plan (GetOptimalPath or a
  Synthesize's) is predicted under that load in the slot engines' context; once it ends the machine is idle."""
  sched = batched.app.service.scheduler
  ch, stub = stub_of(batched)
  with ch:
    call = stub.Synthesize(_request(PROMPTS[2], 200, "busy", logit_bias={0: 50.0}), timeout=120)
    it = iter(call)
    busy = next(it).plan
    assert next(it).WhichOneof("kind") == "delta" and next(it).WhichOneof("kind") == "delta"  # a chunk stepped
    load = sched.load()
    (engine,) = load.engines
    assert engine.path_hash == busy.path_hash and engine.rows == 1 and load.slots == 4
    assert engine.width == 1 and engine.step_ms > 0  # its latest steps, as measured
    plan = stub.GetOptimalPath(_request(PROMPTS[3], 8, "plan"), timeout=60)
    assert "predicted under load (1 stream decoding in 1 engine); idle the choice is the same" in plan.notes or (
      "under load (1 stream decoding in 1 engine)" in plan.reason
    )
    got = synthesizer.plan(PROMPTS[3], ["general_purpose"], max_latency_ms=math.inf, max_tokens=8, load=load)
    assert got.predicted.context.key == f"slots|{synthesizer.context.weights}|b4|{synthesizer.context.kernels}"
    assert got.predicted.load == load
    call.cancel()
  assert batched.call(lambda: sched.wait_idle(60))
  assert sched.load().engines == ()


def test_a_stream_in_a_slot_engine_is_learned_at_the_width_its_steps_computed(batched, synthesizer, monkeypatch):
  """The trace a finished stream teaches the latency model carries the mean rows of the steps it shared: streams
  that joined its engine after it was planned are the load's doing, not the model's error."""
  traces = []
  monkeypatch.setattr(synthesizer, "learn", True)
  monkeypatch.setattr(synthesizer.latency, "update", traces.append)  # recorded, not learned: other tests plan alike
  ch, stub = stub_of(batched)
  with ch:
    calls = [
      stub.Synthesize(_request(p, 12, f"w{i}", logit_bias={0: 50.0}), timeout=120) for i, p in enumerate(PROMPTS[:2])
    ]
    for call in calls:
      list(call)
  assert batched.call(lambda: batched.app.service.scheduler.wait_idle(60))
  assert len(traces) == 2
  for t in traces:
    assert isinstance(t.width, float) and 1.0 <= t.width <= 2.0 and t.context.engine == "slots"


class _Forwarding:
  """A run that forwards to another and declares that it runs alone (no slot engine)."""

  def __init__(self, run):
    self.__dict__["_run"] = run

  def __getattr__(self, name):
    return getattr(self._run, name)

  request = types.SimpleNamespace(slot=lambda: None)  # runs alone

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._run)


@pytest.mark.parametrize("alone", [False, True], ids=["slot", "alone"])
def test_a_deadline_the_plan_cannot_meet_is_refused_before_a_slot(synthesizer, alone):
  """The plan predicts an hour of decode; a 30 s deadline is refused with DEADLINE_EXCEEDED before the
  request takes a slot or, for a run that goes alone (as a speculative plan does), before it runs
  (no engine, nothing decoded, counted)."""

  class Slow:
    def __getattr__(self, name):
      return getattr(synthesizer, name)

    def synthesize(self, *a, **kw):
      r = synthesizer.synthesize(*a, **kw)
      r.plan = dataclasses.replace(r.plan, predicted=dataclasses.replace(r.plan.predicted, decode=3.6e6))
      return _Forwarding(r) if alone else r

  with BackgroundServer(Slow(), config(scheduler="continuous", max_concurrent=2, max_queue=2)) as srv:
    wait_ready(srv)
    ch, stub = stub_of(srv)
    with ch:
      req = pb.SynthesizeRequest(prompt=PROMPTS[1], max_tokens=8, request_id="too-late", max_latency_ms=1e9)
      code, details = code_of(stub.Synthesize, req, timeout=30)
    sched = srv.app.service.scheduler
    assert code == C.DEADLINE_EXCEEDED and "refused before taking a slot" in details, details
    assert srv.call(lambda: sched.wait_idle(60))
    assert sched.refused_deadline == 1 and sched.snapshot()["engines"] == 0
    rec = next(r for r in sched.records if r.request_id == "too-late")
    assert rec.closed and rec.tokens_out == 0 and rec.decode_chunks_end == 0


def test_a_full_queue_is_resource_exhausted_at_once(synthesizer):
  gate, entered = threading.Event(), threading.Semaphore(0)

  class Gated:
    def __getattr__(self, name):
      return getattr(synthesizer, name)

    def synthesize(self, *a, **kw):
      entered.release()
      gate.wait(60)
      return synthesizer.synthesize(*a, **kw)

  with BackgroundServer(Gated(), config(scheduler="continuous", max_concurrent=1, max_queue=1)) as srv:
    wait_ready(srv)
    sched = srv.app.service.scheduler
    ch, stub = stub_of(srv)
    with ch:
      req = pb.SynthesizeRequest(prompt=PROMPTS[2], max_tokens=4)
      running = stub.Synthesize(req, timeout=120)
      assert entered.acquire(timeout=60)  # the first holds the only turn
      queued = stub.Synthesize(req, timeout=120)
      srv.call(lambda: _until(lambda: sched.waiting == 1))
      code, details = code_of(stub.Synthesize, req, timeout=60)
      assert code == C.RESOURCE_EXHAUSTED and "max_queue 1" in details
      assert sched.shed == 1
      gate.set()
      assert list(running)[-1].final.usage.tokens_out >= 1 and list(queued)[-1].WhichOneof("kind") == "final"
    assert srv.call(lambda: sched.wait_idle(60)) and sched.completed == 2


def test_the_scheduler_refuses_late_requests_without_a_server():
  """Scheduler level: a run whose plan cannot meet the deadline never reaches an engine."""

  class Gen:
    trace = types.SimpleNamespace(decode_chunks=0, tokens_out=[0])
    closed = False

    def close(self):
      Gen.closed = True

  class Run:
    reservation = None

    def __init__(self):
      self.generation = Gen()

    request = types.SimpleNamespace(
      slot=lambda: ((1, 2, 3), SamplingParams(max_tokens=4)),
      model=types.SimpleNamespace(path_hash="p", config=types.SimpleNamespace(max_context=2048)),
    )

    plan = type("P", (), {"path": "p", "predicted": type("Q", (), {"compile": 0.0, "prefill": 5e3, "decode": 5e3})})

    def close(self):
      self.generation.close()

  async def go():
    sched = ContinuousScheduler(2, 2)
    with pytest.raises(DeadlineExpired, match="refused before taking a slot"):
      async for _ in sched.stream(Run, request_id="x", deadline=time.monotonic() + 1.0):
        pass
    await sched.wait_idle(30)
    return sched

  sched = asyncio.run(go())
  assert sched.refused_deadline == 1 and sched.snapshot()["engines"] == 0 and Gen.closed
  assert sched.pool.occupancy() == []  # its reservation went with it
  sched.close()


def test_requests_arriving_together_are_planned_one_after_another_each_under_the_rows_before_it():
  """Three requests at once, each plan slow (200 ms): through the scheduler's planning block each is planned under
  the load of those planned before it (their reserved rows, before any has reached its engine), not all three under
  an idle pool; a request blocked before or after its plan holds up no other plan; afterwards nothing stays
  reserved and each stream gave its alone tokens."""
  model = tiny_engine("llama_gqa", seed=3, chunk=4)
  params = SamplingParams(max_tokens=40, ignore_eos=True)
  prompts = [[5, 6, 7, 8 + i] for i in range(3)]
  seen, outside = [], threading.Barrier(3, timeout=30)

  def start(ids):
    def plan():
      outside.wait()  # all three are in their start at once (a restore, say): nothing serializes this part
      with sched.planning() as load:
        seen.append(load.rows)
        time.sleep(0.2)
        reservation = sched.reserve(model.path_hash, len(ids) + params.max_tokens)
      run = RequestRun(model.request([ids], params))
      run.reservation = reservation
      return run

    return plan

  async def consume(ids):
    return [t async for d in sched.stream(start(ids), request_id=str(ids)) for t in getattr(d, "token_ids", ())]

  async def go():
    got = await asyncio.gather(*(consume(ids) for ids in prompts))
    assert await sched.wait_idle(60)
    return got

  sched = ContinuousScheduler(4, 4)
  try:
    got = asyncio.run(go())
    assert sorted(seen) == [0, 1, 2]
    assert all(rows == 0 for _, rows, _, _ in sched.pool.occupancy())
  finally:
    sched.close()
  for ids, tokens in zip(prompts, got, strict=True):
    assert tokens == model.generate(ids, max_tokens=40, ignore_eos=True).token_ids


async def _until(cond):
  while not cond():
    await asyncio.sleep(0)


def test_a_request_draining_when_the_serving_loop_stops_is_still_counted():
  """Attack: the server's loop closes while a cancelled request's run is still closing on its release thread.
  The thread must not raise (posting to a closed loop); the request is still counted as cancelled."""
  closing, may_close = threading.Event(), threading.Event()

  class Gen:
    trace = types.SimpleNamespace(decode_chunks=0, tokens_out=[0])

  class Run:
    generation = Gen()
    cancelled = False
    plan = reservation = None

    def start(self):
      pass

    def __next__(self):
      if self.cancelled:
        raise StopIteration
      return "token"

    def cancel(self):
      self.cancelled = True

    def close(self):
      closing.set()
      may_close.wait(30)

  sched = SimpleScheduler(1, 1)

  async def go():
    stream = sched.stream(Run, request_id="draining")
    async for _ in stream:
      break
    await stream.aclose()  # the caller leaves early: the run is cancelled and closed on a release thread

  asyncio.run(go())  # returns (and closes its loop) while the release thread is inside close()
  assert closing.wait(30)
  release = next(t for t in threading.enumerate() if t.name == "thoughtjax-release-draining")
  may_close.set()
  release.join(30)
  assert not release.is_alive()
  assert sched.cancelled == 1 and sched.draining == 0 and sched.records[-1].closed
  sched.close()

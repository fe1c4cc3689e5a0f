"""Idle release (scale to zero) on the tiny registry: a path unused for ``idle_release_s`` drops its engines and
weights (no array of them stays alive), the next request restores them and answers token for token as before;
a request that arrives while a release runs gets its answer; a path with a stream in flight, and an engine with
queued or handed-out work, is never released. The release is called with an explicit ``now`` (what the server's
timer passes implicitly), so no test waits for the idle time to pass; the timer itself is checked by awaiting
the release it runs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import threading
import time
import weakref

import jax
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import config, stub_of, wait_ready
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import ConfigError, from_mapping, load_config
from thoughtjax.server.scheduling import ContinuousScheduler
from thoughtjax.serving.pool import PoolFull

IDLE_S = 1000.0  # the servers' idle time: never reached by the clock while a test runs
LATER = 10 * IDLE_S  # ``now`` past every path's idle time
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def registry():
  """A registry of this module's own: its resident set is emptied here, not under other modules' tests."""
  from tests.synthesis.tiny_synthesis import tiny_setup
  from thoughtjax.registry import Registry

  with Registry.open(tiny_setup().registry) as reg:
    yield reg


@pytest.fixture(scope="module")
def syn(registry):
  from thoughtjax.synthesis.synthesize import Synthesizer

  return Synthesizer.open(registry, learn=False)


@pytest.fixture(scope="module")
def srv(syn):
  with BackgroundServer(syn, config(max_concurrent=2, max_queue=4, idle_release_s=IDLE_S)) as s:
    wait_ready(s)
    yield s


@pytest.fixture(scope="module")
def path(registry):
  from thoughtjax.assembly import full_path

  return full_path(registry)


def _ask(srv, path: str | None, n: int = 12, request_id: str = "r", **kw) -> list[int]:
  """A greedy stream's token ids (an explicit path, or planned from a hint); raises on any error status."""
  req = pb.SynthesizeRequest(prompt=PROMPT, max_tokens=n, request_id=request_id, **kw)
  if path is not None:
    req.path = path
  else:
    req.hints.append("general_purpose")
  ch, stub = stub_of(srv)
  with ch:
    responses = list(stub.Synthesize(req, timeout=120))
  assert responses[-1].WhichOneof("kind") == "final"
  return [t for r in responses if r.WhichOneof("kind") == "delta" for t in r.delta.token_ids]


def _resident_arrays(service) -> list:
  """Every array of the models, engines and resident registry entries the server holds now."""
  s = service.serving
  sched = service.scheduler
  holders = [*s.syn.models(), *s.paths.values(), *sched.resident_models()]
  holders += [d.engine.state for d in sched.pool.drivers()]
  holders += s.registry.resident_params()
  return [x for x in jax.tree.leaves(holders) if isinstance(x, jax.Array)]


def _release(srv, now: float = LATER, settle: bool = True) -> list[str]:
  """The server's idle release at ``now`` seconds from now; ``settle``: once the streams that ended are drained
  (a release skips a pass while one is)."""
  service = srv.app.service
  if settle:
    assert srv.call(lambda: service.scheduler.wait_idle(60))
  return service.release_idle(now=time.monotonic() + now)


def test_the_idle_release_setting_is_checked(tmp_path):
  assert load_config().idle_release_s == 300 and load_config().idle_release == 300.0
  assert from_mapping({"idle_release_s": 0}).idle_release is None
  assert from_mapping({"idle_release_s": None}).idle_release is None
  assert from_mapping({"idle_release_s": 2.5}).idle_release == 2.5
  for bad in (-1, "300", float("nan"), float("inf"), True, [300]):
    with pytest.raises(ConfigError, match=r"idle_release_s: expected a finite number of seconds >= 0"):
      from_mapping({"idle_release_s": bad})
  assert load_config().idle_release_programs is False
  with pytest.raises(ConfigError, match=r"idle_release_programs: expected true or false, got 'yes'"):
    from_mapping({"idle_release_programs": "yes"})
  f = tmp_path / "c.yaml"
  f.write_text("idle_release_s: -5\n")
  with pytest.raises(ConfigError, match=r"got -5"):
    load_config(f)


def test_an_idle_path_drops_its_engines_and_weights_and_comes_back_token_identical(srv, path):
  service = srv.app.service
  sched = service.scheduler
  assert isinstance(sched, ContinuousScheduler)
  want_path = _ask(srv, path, request_id="before-path")
  want_hint = _ask(srv, None, request_id="before-hint")
  assert service.resident_paths() and sched.pool.drivers() and service.serving.registry.stats().resident
  assert not _release(srv, now=0.0)  # not idle long enough yet
  arrays = _resident_arrays(service)
  assert arrays
  alive = [weakref.ref(a) for a in arrays]
  buffers = {a.unsafe_buffer_pointer() for a in arrays}
  resident = service.resident_paths()
  releases = service.metrics.sample("thoughtjax_idle_releases_total")
  del arrays

  released = _release(srv)
  gc.collect()
  assert sorted(released) == sorted(resident)
  assert not sched.pool.drivers() and not service.serving.syn.models() and not service.serving.paths
  assert service.serving.registry.stats().resident == []
  assert service.resident_paths() == set()
  # Nothing of the released weights, KV caches included, stays alive: no array object, no array on their buffers.
  assert [r for r in alive if r() is not None] == []
  assert not buffers & {a.unsafe_buffer_pointer() for a in jax.live_arrays() if not a.is_deleted()}
  assert service.metrics.sample("thoughtjax_idle_releases_total") == releases + len(released)
  assert service.metrics.sample("thoughtjax_resident_paths") == 0
  with stub_of(srv)[0] as ch:  # still SERVING: the next request brings the path back
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert h.status == health_pb2.HealthCheckResponse.SERVING

  assert _ask(srv, path, request_id="after-path") == want_path
  assert _ask(srv, None, request_id="after-hint") == want_hint
  assert sched.pool.drivers() and service.metrics.sample("thoughtjax_resident_paths") >= 1


def test_a_request_arriving_while_a_release_runs_gets_its_answer(srv, path, monkeypatch):
  """The release is stopped inside (its engines closed, references being dropped) until a request has arrived
  and reached its start; the request then waits for the release to end, restores and answers as before."""
  service = srv.app.service
  want = _ask(srv, path, request_id="race-warm")
  inside, arrived = threading.Event(), threading.Event()
  release_path = service._release_path

  def slow_release(p, s):
    ok = release_path(p, s)
    inside.set()
    assert arrived.wait(60), "the request never reached its start"
    return ok

  starting = service.idle.starting

  def start_gate():
    arrived.set()
    return starting()

  monkeypatch.setattr(service, "_release_path", slow_release)
  monkeypatch.setattr(service.idle, "starting", start_gate)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    releasing = pool.submit(_release, srv)
    assert inside.wait(60)
    answer = pool.submit(_ask, srv, path, 12, "race")
    released = releasing.result(60)
    got = answer.result(120)
  assert released and got == want
  assert srv.app.service.scheduler.pool.drivers()  # the request brought its path back


def test_no_release_while_a_request_is_starting(srv, path, monkeypatch):
  """A request between its turn and its path (planning, restoring, composing) keeps every release out."""
  service = srv.app.service
  want = _ask(srv, path, request_id="start-warm")
  entered, go = threading.Event(), threading.Event()
  start = service._start

  def slow_start(r):
    entered.set()
    assert go.wait(60)
    return start(r)

  monkeypatch.setattr(service, "_start", slow_start)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    answer = pool.submit(_ask, srv, path, 12, "starting")
    assert entered.wait(60)
    assert _release(srv, settle=False) == []
    go.set()
    assert answer.result(120) == want
  assert _release(srv)  # nothing starting any more


def test_a_path_with_a_stream_in_flight_is_not_released(srv, path):
  """A stream has its first token and waits to take its slot (its engine held by the test, so it cannot finish
  meanwhile): its path is not released; once it ran to its end, it is."""
  service = srv.app.service
  sched = service.scheduler
  _ask(srv, path, request_id="engine")  # the path's engine exists
  ch, stub = stub_of(srv)
  with ch, contextlib.ExitStack() as held:
    for d in sched.pool.drivers():
      held.enter_context(d.engine.paused())
    req = pb.SynthesizeRequest(prompt=PROMPT, path=path, max_tokens=40, request_id="long", logit_bias={0: 50.0})
    it = iter(stub.Synthesize(req, timeout=120))
    assert next(it).WhichOneof("kind") == "plan" and next(it).WhichOneof("kind") == "delta"
    hashes = sched.pool.resident_paths()
    assert hashes and not set(_release(srv, settle=False)) & hashes
    assert sched.pool.resident_paths() >= hashes and service.resident_paths() >= hashes
    held.close()  # the stream takes its slot and runs to its end
    rest = list(it)
  assert rest[-1].WhichOneof("kind") == "final" and rest[-1].final.usage.tokens_out == 40
  assert set(_release(srv)) >= hashes and not sched.pool.drivers()


def test_an_engine_with_handed_out_queued_prefilling_or_placed_work_is_never_closed(syn, path):
  """Below the server: a driver handed to a request that has not submitted yet (a lease), one whose request is
  prefilled but not yet placed (the engine held), one with a request queued behind it, and one with a request in
  its slot is neither released nor evicted for another path; once free it is released."""
  from thoughtjax.compose import compose
  from thoughtjax.sampling import SamplingParams

  model = compose(path, syn.registry)
  other = model.with_chunk(model.chunk + 1)  # another engine key over the same weights
  ids = syn.registry.codec.encode(PROMPT)
  params = SamplingParams(max_tokens=40, logit_bias={0: 50.0})
  sched = ContinuousScheduler(2, 2, max_engines=1)
  try:
    driver = sched.pool.lease(model, 16)  # handed out: a lease, nothing submitted
    assert sched.release_path(model.path_hash) is False
    with pytest.raises(PoolFull, match="none is idle"):
      sched.pool.lease(other, 16)  # the only engine is handed out: not evicted for another path
    sched.pool.give_back(driver)
    with driver.engine.paused():  # the driver prefills, delivers the first token, then waits to place it
      first = driver.submit(ids, params)
      assert next(first).token_ids  # prefilled, not placed: not queued and not in a slot
      assert driver.waiting == 0 and driver.engine.active == 0
      assert sched.release_path(model.path_hash) is False
      queued = driver.submit(ids, params)  # behind the one being placed
      assert driver.waiting == 1 and sched.release_path(model.path_hash) is False
      queued.cancel()
    assert driver.alive and sched.pool.drivers() == [driver]
    assert sched.release_path(model.path_hash) is False or first.finished  # placed: in its slot
    first.cancel()
    assert first.freed.wait(60) and queued.freed.wait(60)
    assert sched.release_path(model.path_hash) is True
    assert not sched.pool.drivers() and not driver.alive
  finally:
    sched.close()


def test_the_timer_releases_an_idle_path_and_health_stays_serving(syn, path):
  """With a tiny idle time the server's own timer releases the path (awaited through the release it runs)."""
  with BackgroundServer(syn, config(max_concurrent=2, max_queue=2, idle_release_s=0.05)) as s:
    wait_ready(s)
    service = s.app.service
    done = threading.Event()
    release = service.release_idle

    def observed(now=None):
      got = release(now)
      if got:
        done.set()
      return got

    service.release_idle = observed
    want = _ask(s, path, request_id="timer-1")
    assert done.wait(60), "the timer never released the idle path"
    assert service.metrics.sample("thoughtjax_idle_releases_total") >= 1
    with stub_of(s)[0] as ch:
      h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
      assert h.status == health_pb2.HealthCheckResponse.SERVING
    assert _ask(s, path, request_id="timer-2") == want


def test_scaled_to_zero_with_idle_release_programs_drops_compiled_programs_too(syn, path):
  """``idle_release_programs``: once no path is resident the compiled programs go (the program cache empties);
  the next request compiles again and answers token for token as before."""
  from thoughtjax.decode import program
  from thoughtjax.serving import slot_program

  cfg = config(max_concurrent=2, max_queue=2, idle_release_s=IDLE_S, idle_release_programs=True)
  with BackgroundServer(syn, cfg) as s:
    wait_ready(s)
    want = _ask(s, path, request_id="programs-1")
    assert program.PROGRAMS.held(slot_program.SlotProgram)
    assert _release(s)
    assert len(program.PROGRAMS) == 0 and not s.app.service.resident_paths()
    assert _ask(s, path, request_id="programs-2") == want
    assert program.PROGRAMS.held(slot_program.SlotProgram)

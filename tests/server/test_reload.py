"""ReloadRegistry switches to a newly published sequence while streams are in flight (they finish on the version
they started with, token for token); a tampered new version is refused loudly, counted, and the old one keeps
serving; a sequence without a calibration is served from the previous one only where that is still valid."""

from __future__ import annotations

import dataclasses
import json
import threading

import grpc
import jax
import pytest

from tests.server.conftest import config, wait_ready
from tests.synthesis.tiny_synthesis import SETTINGS, registry_copy, tiny_setup
from thoughtjax.client import Client, ClientError
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.registry import Registry, TrustPolicy
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import WarmConfig

PROMPTS = ("The quick brown fox", "Once upon a time", "In the beginning")
MAX_TOKENS = 12


class Holding:
  """The served synthesizer, except that while ``hold`` is set a request waits for ``gate`` (so it is in flight,
  admitted on the old sequence, when the reload switches): at its start (``"start"``: admitted, planned on the
  old sequence, any scheduler) or after its first delta (``"stream"``: mid-generation, model bound; the simple
  scheduler, which pulls each chunk on a worker thread)."""

  def __init__(self, syn):
    self._syn, self.hold = syn, None
    self.gate, self.entered = threading.Event(), threading.Semaphore(0)

  def __getattr__(self, name):
    return getattr(self._syn, name)

  def wait(self) -> None:
    self.entered.release()
    assert self.gate.wait(120), "the test never opened the gate"

  def synthesize(self, *a, **kw):
    if self.hold == "start":
      self.wait()
    r = self._syn.synthesize(*a, **kw)
    return _Held(r, self) if self.hold == "stream" else r


class _Held:
  def __init__(self, result, owner: Holding):
    object.__setattr__(self, "_r", result)
    object.__setattr__(self, "_owner", owner)
    object.__setattr__(self, "_n", 0)

  def __getattr__(self, name):
    return getattr(self._r, name)

  def __setattr__(self, name, value):  # a scheduler may replace the run's generation: the run's, not ours
    setattr(self._r, name, value)

  def __iter__(self):
    return self

  def __next__(self):
    if self._n == 1:
      self._owner.wait()
    object.__setattr__(self, "_n", self._n + 1)
    return next(self._r)


@pytest.fixture
def reloadable(tmp_path, request):
  """A private copy of the tiny registry (own rollback state) served by a holding synthesizer (indirect
  parameter: server config changes, e.g. the scheduler)."""
  from thoughtjax.synthesis.synthesize import Synthesizer

  root = registry_copy(tmp_path / "reg")
  trust = TrustPolicy(state_file=tmp_path / "trust-state.json")
  changes = getattr(request, "param", None) or {}
  with Registry.open(root, trust) as reg:
    syn = Holding(Synthesizer.open(reg))
    with BackgroundServer(syn, config(max_concurrent=len(PROMPTS) + 1, max_queue=4, **changes)) as srv:
      wait_ready(srv)
      yield srv, syn, root, trust


def publish_next(root, trust, name: str, *, calibrate: bool) -> tuple[int, str]:
  """Publish a changed version of ``name`` (weights moved by a seeded perturbation) as the next sequence,
  calibrated and stored when ``calibrate``; returns (sequence, version)."""
  from thoughtjax.synthesis.calibrate import calibrate as run_calibration
  from thoughtjax.synthesis.calibrate import store

  key = tiny_setup().key
  with Registry.open(root, trust) as reg:
    t = reg.thoughtlet(name)
    leaves, tree = jax.tree.flatten(t.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    moved = [
      x + 0.05 * jax.random.normal(k, x.shape, x.dtype) if x.dtype.kind == "f" else x for x, k in zip(leaves, keys)
    ]
    version = reg.publish(
      [dataclasses.replace(t, params=jax.tree.unflatten(tree, moved), profile=None)], sign_key=key, settings=None
    )[name]
    if calibrate:
      store(reg, run_calibration(reg, settings=SETTINGS), sign_key=key)
    return reg.sequence, version


def tamper(root, name: str, version: str) -> None:
  vdir = root / "thoughtlets" / name.replace("[", "_").replace(":", "_").replace(")", "") / version
  victim = max((p for p in (vdir / "checkpoint").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0xFF
  victim.write_bytes(bytes(data))


def tokens_of(responses) -> tuple[list[int], pb.Final]:
  return [t for r in responses if r.WhichOneof("kind") == "delta" for t in r.delta.token_ids], responses[-1].final


@pytest.mark.parametrize(
  "reloadable, hold",
  [({}, "start"), ({"scheduler": "simple"}, "stream")],
  indirect=["reloadable"],
  ids=["admitted", "streaming"],
)
def test_reload_under_load_switches_and_streams_in_flight_finish_on_their_version(reloadable, hold):
  srv, syn, root, trust = reloadable
  old = syn.calibration.sequence
  target = f"127.0.0.1:{srv.port}"
  with Client(target, timeout=120) as c:
    before = {p: tokens_of(list(c.synthesize(p, ["general_purpose"], max_tokens=MAX_TOKENS))) for p in PROMPTS}
  new, version = publish_next(root, trust, "blocks[2:3)", calibrate=True)
  assert new == old + 1

  syn.hold = hold
  with grpc.insecure_channel(target) as ch:
    stub = rpc.SynthesizerStub(ch)
    calls = [
      stub.Synthesize(pb.SynthesizeRequest(prompt=p, hints=["general_purpose"], max_tokens=MAX_TOKENS), timeout=120)
      for p in PROMPTS
    ]
    for _ in PROMPTS:
      assert syn.entered.acquire(timeout=120)  # each request is in flight, waiting at the gate
    syn.hold = None

    with Client(target, timeout=120) as c:
      r = c.reload_registry()
      assert (r.switched, r.previous_sequence, r.serving_sequence, r.published_sequence) == (True, old, new, new)
      assert r.calibration == "stored" and not r.dropped_paths
      # New requests plan and run on the new sequence while the old streams are still open.
      final = c.generate(PROMPTS[0], ["general_purpose"], max_tokens=MAX_TOKENS)
      assert c.last_plan.registry_sequence == final.trace.registry_sequence == new
      assert c.list_thoughtlets().registry_sequence == new
      assert any(t.version == version for t in c.list_thoughtlets().thoughtlets if t.name == "blocks[2:3)")
      syn.gate.set()
      for p, call in zip(PROMPTS, calls):
        ids, last = tokens_of(list(call))
        want_ids, want = before[p]
        assert ids == want_ids and last.text == want.text  # token for token, on the version it started with
        assert last.trace.registry_sequence == old and list(last.trace.refs) == list(want.trace.refs)
      stats = c.registry_stats()
      assert stats.registry_sequence == new and json.loads(stats.stats_json)["reload"]["switched"] == 1
      assert c.reload_registry().switched is False  # the same sequence again: nothing to do
  assert srv.app.service.metrics.sample("thoughtjax_reloads_total", {"result": "switched"}) == 1


def test_a_tampered_new_version_is_refused_counted_and_the_old_one_keeps_serving(reloadable):
  srv, syn, root, trust = reloadable
  old = syn.calibration.sequence
  new, version = publish_next(root, trust, "blocks[2:3)", calibrate=True)
  tamper(root, "blocks[2:3)", version)
  with Client(f"127.0.0.1:{srv.port}", timeout=120) as c:
    for attempt in (1, 2):  # refused every time, counted every time
      with pytest.raises(ClientError) as e:
        c.reload_registry()
      assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
      assert f"blocks[2:3)@{version}" in e.value.details and "request id" in e.value.details
      assert "IntegrityError" not in e.value.details and str(root) not in e.value.details  # detail: the log
      assert f"sequence {new}" in e.value.details and f"Still serving sequence {old}" in e.value.details
      stats = c.registry_stats()
      reload = json.loads(stats.stats_json)["reload"]
      assert reload["refused"] == attempt and reload["switched"] == 0
      assert json.loads(stats.stats_json)["integrity_failures"] == attempt
    assert stats.registry_sequence == old
    final = c.generate(PROMPTS[0], ["general_purpose"], max_tokens=4)
    assert final.trace.registry_sequence == old and final.usage.tokens_out >= 1
    assert c.health() == "SERVING"
  m = srv.app.service.metrics
  assert m.sample("thoughtjax_reloads_total", {"result": "refused"}) == 2
  assert m.sample("thoughtjax_registry_failures_total", {"kind": "integrity"}) == 2


def test_no_calibration_for_a_changed_full_path_is_refused_naming_calibrate(reloadable):
  srv, syn, root, trust = reloadable
  old = syn.calibration.sequence
  publish_next(root, trust, "blocks[0:2)", calibrate=False)
  with Client(f"127.0.0.1:{srv.port}", timeout=120) as c:
    with pytest.raises(ClientError) as e:
      c.reload_registry()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "thoughtjax registry calibrate" in e.value.details and "blocks[0:2)@" in e.value.details
    assert c.generate(PROMPTS[0], max_tokens=3).trace.registry_sequence == old


@pytest.mark.parametrize(
  "reloadable", [{"warm": WarmConfig(hints=("fast_draft",), prompt_tokens=(4,), max_tokens=(4,))}], indirect=True
)
def test_a_sequence_without_calibration_reuses_the_paths_whose_versions_are_unchanged(reloadable):
  """The template is on no calibrated path: every path keeps its versions, so its records stay valid. The
  configured warm set is warmed on the new sequence before the switch."""
  srv, syn, root, trust = reloadable
  old_paths = sorted(c.path for c in syn.calibration.candidates)
  new, _ = publish_next(root, trust, "template", calibrate=False)
  with Client(f"127.0.0.1:{srv.port}", timeout=120) as c:
    r = c.reload_registry()
    assert r.switched and r.serving_sequence == new and r.calibration == "derived" and not r.dropped_paths
    assert any(f"recorded at sequence {new - 1}" in n for n in r.notes)
    assert len(r.warmed_paths) == 1 and c.plan(PROMPTS[0], ["fast_draft"], max_latency_ms=1e9).registry_sequence == new
    final = c.generate(PROMPTS[0], ["general_purpose"], max_tokens=4)
    assert final.trace.registry_sequence == new
  serving = srv.app.service.serving
  assert serving.sequence == new and sorted(c.path for c in serving.syn.calibration.candidates) == old_paths
  assert r.warmed_paths[0] in old_paths and serving.syn.residency().compiled  # restored and compiled before the switch

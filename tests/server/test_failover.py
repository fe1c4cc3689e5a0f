"""Two replicas behind gRPC's own round_robin policy, no home-made layer: a load spreads over both; one is killed
(SIGKILL) with streams in flight: those end with UNAVAILABLE, every new call (on a channel opened after the kill)
succeeds on the other, and nothing hangs (every call has a deadline). One replica is ``thoughtjax serve`` itself, the other the same server in
``tests/server/replica.py`` (which can hold streams in flight until it is killed). A channel with client-side
health checking sends nothing to a replica that is not SERVING."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import config, wait_ready
from tests.server.replica import ADMIN_TOKEN, HOLD_SEED
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.server.app import BackgroundServer

DEADLINE_S = 120  # every call's deadline: a hang fails the test instead of stalling it
PROMPT = "The quick brown fox"


@contextlib.contextmanager
def process(argv: list[str], log: Path):
  """A server process (stderr to ``log``: a pipe nobody reads could fill and stall it); yields (process, port)
  once it printed ``serving on HOST:PORT``."""
  err = open(log, "w")  # closed below, after the process
  proc = subprocess.Popen(
    [sys.executable, *argv],
    stdout=subprocess.PIPE,
    stderr=err,
    text=True,
    env=dict(os.environ),
    cwd=Path(__file__).resolve().parents[2],  # the repository root: tests.server.replica is importable
  )
  try:
    line = proc.stdout.readline()  # blocks until the port is bound (or the process died)
    assert line.startswith("serving on 127.0.0.1:"), (line, log.read_text() if proc.poll() is not None else "")
    yield proc, int(line.split(":")[-1])
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(60)
    proc.stdout.close()
    err.close()


def wait_serving(port: int) -> None:
  """Until the replica's health says SERVING (a Watch stream, not a poll)."""
  with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
    for r in watch:
      if r.status == health_pb2.HealthCheckResponse.SERVING:
        watch.cancel()
        return


def completed(port: int) -> tuple[int, int]:
  """(requests the replica completed, requests in flight on it), from its RegistryStats."""
  with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    stats = rpc.SynthesizerStub(ch).RegistryStats(
      pb.RegistryStatsRequest(), timeout=DEADLINE_S, metadata=[("authorization", f"Bearer {ADMIN_TOKEN}")]
    )
  return json.loads(stats.planner_json)["scheduler"]["completed"], stats.in_flight


def finish(call) -> tuple[grpc.StatusCode, list]:
  try:
    return grpc.StatusCode.OK, list(call)
  except grpc.RpcError as e:
    return e.code(), []


def test_round_robin_over_two_replicas_survives_killing_one_mid_load(tiny_registry, tmp_path):
  cli = ["-c", "from thoughtjax.cli import main; raise SystemExit(main())", "serve"]
  (tmp_path / "server.yaml").write_text(f"admin:\n  token: {ADMIN_TOKEN}\n")  # RegistryStats is an admin call
  serve = [*cli, "--registry", str(tiny_registry.root), "--port", "0", "--config", str(tmp_path / "server.yaml")]
  with (
    process(serve, tmp_path / "b.log") as (_, port_b),
    process(["-m", "tests.server.replica", "--registry", str(tiny_registry.root), "--hold"], tmp_path / "a.log") as (
      victim,
      port_a,
    ),
  ):
    wait_serving(port_a)
    wait_serving(port_b)
    channel = grpc.insecure_channel(
      f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}", [("grpc.lb_policy_name", "round_robin")]
    )
    with channel:
      stub = rpc.SynthesizerStub(channel)
      request = pb.SynthesizeRequest(prompt=PROMPT, max_tokens=6)
      # A load over both replicas: every call succeeds and each replica served some.
      for _ in range(8):
        code, out = finish(stub.Synthesize(request, timeout=DEADLINE_S))
        assert code == grpc.StatusCode.OK and out[-1].WhichOneof("kind") == "final"
      assert completed(port_a)[0] >= 1 and completed(port_b)[0] >= 1

      # Mid-load: calls in flight on both; the victim holds its own (and says so on stdout), the survivor's run
      # to their end. Each call is read to its end on its own thread.
      held_request = pb.SynthesizeRequest(prompt=PROMPT, max_tokens=40, seed=HOLD_SEED)
      n = 4
      outcomes: list = []
      state = {"held": 0}
      changed = threading.Condition()

      def read_to_end(call):
        got = finish(call)
        with changed:
          outcomes.append(got)
          changed.notify_all()

      def count_held():
        for line in victim.stdout:
          if line.strip() == "held":
            with changed:
              state["held"] += 1
              changed.notify_all()

      counter = threading.Thread(target=count_held, daemon=True)
      counter.start()
      readers = [
        threading.Thread(target=read_to_end, args=(stub.Synthesize(held_request, timeout=DEADLINE_S),))
        for _ in range(n)
      ]
      for t in readers:
        t.start()
      with changed:  # every call either ended (on the survivor) or is held (on the victim)
        assert changed.wait_for(lambda: len(outcomes) + state["held"] == n, timeout=DEADLINE_S), (outcomes, state)
      on_victim = state["held"]
      assert on_victim >= 1 and completed(port_a)[1] == on_victim  # the victim counts them in flight
      assert all(code == grpc.StatusCode.OK for code, _ in outcomes)
      victim.send_signal(signal.SIGKILL)
      for t in [*readers, counter]:  # the counter ends at the victim's end of output
        t.join(DEADLINE_S)
        assert not t.is_alive()
      codes = [code for code, _ in outcomes]
      assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
      assert codes.count(grpc.StatusCode.UNAVAILABLE) == on_victim  # exactly the victim's calls
      for code, rest in outcomes:
        if code == grpc.StatusCode.OK:  # the survivor's ran to their end
          assert rest[-1].WhichOneof("kind") == "final" and rest[-1].final.usage.tokens_out >= 1

    # New calls all succeed on the survivor. A channel that saw the victim die may still pick its subchannel
    # once before the closed connection is noticed; a client that keeps calling connects anew (or sets a retry
    # policy), so the new calls go through a new channel over the same two addresses, as a restarted client's would.
    before = completed(port_b)[0]
    with grpc.insecure_channel(
      f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}", [("grpc.lb_policy_name", "round_robin")]
    ) as fresh:
      stub = rpc.SynthesizerStub(fresh)
      for _ in range(6):
        code, out = finish(stub.Synthesize(request, timeout=DEADLINE_S))
        assert code == grpc.StatusCode.OK and out[-1].WhichOneof("kind") == "final"
    assert completed(port_b)[0] == before + 6
    assert victim.wait(60) == -signal.SIGKILL


def test_a_health_checking_round_robin_channel_sends_nothing_to_a_replica_still_warming(synthesizer):
  """gRPC's client-side health checking (service config ``healthCheckConfig``) follows each replica's
  grpc.health.v1 status: a replica that is NOT_SERVING gets no calls; without it, half the calls hit it."""
  gate = threading.Event()
  with (
    BackgroundServer(synthesizer, config(), warm=lambda: gate.wait(DEADLINE_S)) as warming,
    BackgroundServer(synthesizer, config()) as ready,
  ):
    wait_ready(ready)
    try:
      target = f"ipv4:127.0.0.1:{warming.port},127.0.0.1:{ready.port}"
      checked = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": "thoughtjax.v1.Synthesizer"},
      }
      for options, expected in (
        ([("grpc.service_config", json.dumps(checked))], {grpc.StatusCode.OK}),
        ([("grpc.lb_policy_name", "round_robin")], {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}),
      ):
        with grpc.insecure_channel(target, options) as ch:
          stub = rpc.SynthesizerStub(ch)
          codes = set()
          for _ in range(10):
            try:
              stub.GetOptimalPath(pb.SynthesizeRequest(prompt=PROMPT), timeout=DEADLINE_S, wait_for_ready=True)
              codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as e:
              codes.add(e.code())
              assert "warming" in e.details()
          assert codes == expected, (options, codes)
    finally:
      gate.set()

"""Trace and billing in the trailing metadata (read back by the client), and the Prometheus endpoint: scraped
before and after requests, its series move; two servers with metrics run side by side in one process."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import config, wait_ready
from thoughtjax.client import TEXT_PREFIX, TRACE_KEY, USAGE_KEY, Client, read_trailer
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.proto.v1 import synthesis_pb2_grpc as rpc
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import PrefixCacheConfig

PROMPT = "The quick brown fox"


def test_the_trace_and_usage_come_in_the_trailing_metadata_too(served):
  with Client(f"127.0.0.1:{served.port}", timeout=120) as c:
    final = c.generate(PROMPT, ["general_purpose"], max_tokens=6, request_id="trailer-1")
    got = c.last_trailer
  assert got.trace == final.trace and got.usage == final.usage
  f = got.fields
  assert f["request-id"] == "trailer-1" and f["finish-reason"] == final.finish_reason
  assert f["path-hash"] == final.trace.path_hash and f["registry-sequence"] == str(final.trace.registry_sequence)
  assert (f["tokens-in"], f["tokens-out"]) == (str(final.usage.tokens_in), str(final.usage.tokens_out))
  assert float(f["compute-seconds"]) == pytest.approx(final.usage.compute_seconds, abs=1e-6)
  assert f["degraded"] == "false" and f["program-cache"] in ("hit", "miss") and "degraded-reason" not in f
  assert {"queue", "synthesis", "prefill", "decode", "total"} <= set(final.trace.actual_ms)

  # On the wire: lowercase keys, bytes for -bin keys, ASCII text for the rest (any gRPC client reads them).
  with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
    call = rpc.SynthesizerStub(ch).Synthesize(pb.SynthesizeRequest(prompt=PROMPT, max_tokens=3), timeout=120)
    last = list(call)[-1].final
    md = call.trailing_metadata()
  keys = [k for k, _ in md]
  assert TRACE_KEY in keys and USAGE_KEY in keys and all(k == k.lower() for k in keys)
  for k, v in md:
    if k.startswith("thoughtjax-"):
      assert k.endswith("-bin") and isinstance(v, bytes)
    elif k.startswith(TEXT_PREFIX):
      assert isinstance(v, str) and v.isascii()
  assert read_trailer(md).usage.tokens_out == last.usage.tokens_out


def test_an_explicit_path_has_its_trailer_and_sequence(served, tiny_registry):
  with Client(f"127.0.0.1:{served.port}", timeout=120) as c:
    final = c.generate(PROMPT, path="embed, blocks[0:2), head", max_tokens=3)
    assert c.last_trailer.trace.path == final.trace.path == c.last_plan.path
    assert c.last_trailer.fields["registry-sequence"] == str(tiny_registry.sequence)


def scrape(port: int) -> dict:
  """Every sample of the endpoint: (name, sorted label items) -> value."""
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
    text = r.read().decode()
  return {
    (s.name, tuple(sorted(s.labels.items()))): s.value
    for fam in text_string_to_metric_families(text)
    for s in fam.samples
  }


def value(samples: dict, name: str, **labels) -> float:
  return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_endpoint_series_move_after_requests(synthesizer, served):
  """A second server with its own metrics registry beside ``served`` (no clash over global collectors)."""
  # No prefix cache: the second run of the same prompt would reuse its prefix through another program (compiled
  # on that first reuse), and this test counts program cache hits (tests/server/test_prefix_cache.py counts reuse).
  off = PrefixCacheConfig(max_mb=0)
  with (
    BackgroundServer(synthesizer, config(metrics_port=0, prefix_cache=off)) as a,
    BackgroundServer(synthesizer, config(metrics_port=0, prefix_cache=off)) as b,
  ):
    wait_ready(a)
    wait_ready(b)
    assert a.app.metrics_port not in (None, b.app.metrics_port)
    before = scrape(a.app.metrics_port)
    assert value(before, "thoughtjax_time_to_first_token_seconds_count") == 0
    assert value(before, "thoughtjax_registry_sequence") == synthesizer.registry.sequence
    with Client(f"127.0.0.1:{a.port}", timeout=120) as c:
      for _ in range(2):  # the second run of the same shapes finds its program compiled
        final = c.generate(PROMPT, ["general_purpose"], max_tokens=8, logit_bias={0: 50.0})
      c.generate(PROMPT, ["general_purpose"], max_tokens=4, max_latency_ms=1e-3)  # nothing fits: degraded
      assert c.last_trailer.fields["degraded"] == "true" and c.last_trailer.fields["degraded-reason"] == "budget"
      with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        c.plan("x", ["poetry_in_klingon"])
    assert a.call(lambda: a.app.service.scheduler.wait_idle(60))  # a request counts as completed once released
    after = scrape(a.app.metrics_port)
    assert value(after, "thoughtjax_time_to_first_token_seconds_count") == 3
    assert value(after, "thoughtjax_token_latency_seconds_count") >= final.usage.tokens_out - 1
    assert value(after, "thoughtjax_synthesis_overhead_seconds_count") == 3
    assert value(after, "thoughtjax_prediction_error_ratio_count") == 3
    hits = value(after, "thoughtjax_program_cache_total", result="hit")
    assert hits >= 1 and hits + value(after, "thoughtjax_program_cache_total", result="miss") == 3
    assert value(after, "thoughtjax_degraded_total", reason="budget") == 1
    assert value(after, "thoughtjax_requests_total", method="Synthesize", code="OK") == 3
    assert value(after, "thoughtjax_requests_total", method="GetOptimalPath", code="INVALID_ARGUMENT") == 1
    # Gauges from the scheduler's snapshot, read at scrape time: idle again.
    assert ("thoughtjax_queue_depth", ()) in after and value(after, "thoughtjax_slots_in_use") == 0
    assert value(after, "thoughtjax_scheduler", field="completed") == 3
    assert value(after, "thoughtjax_registry_failures_total", kind="integrity") == 0
    # The other server saw none of it.
    assert value(scrape(b.app.metrics_port), "thoughtjax_time_to_first_token_seconds_count") == 0


def test_metrics_are_off_by_default_and_a_bad_port_is_a_config_error():
  from thoughtjax.server.config import ConfigError, ServerConfig, from_mapping

  assert ServerConfig().metrics_port is None and ServerConfig().metrics_bind == "127.0.0.1"
  with pytest.raises(ConfigError, match="metrics_port"):
    from_mapping({"metrics_port": 70000})
  with pytest.raises(ConfigError, match="metrics_port"):
    from_mapping({"metrics_port": "9090"})

"""The prefix cache behind the server (continuous scheduler, tiny registry): a request that starts like an earlier
one reuses its prompt keys and still gives its alone tokens; the reuse is in the final trace, the trailer, the
metrics and the scheduler's snapshot; ``prefix_cache`` in the config turns it off and refuses bad values. Requests
share keys only within one ``cache_salt``, and only a salted request (or every request under ``report_reuse``) is told
its reuse: a client cannot read from the count whether another sent a prefix."""

from __future__ import annotations

import math

import pytest

from tests.server.conftest import config, stub_of, wait_ready
from thoughtjax.client import read_trailer
from thoughtjax.proto.v1 import synthesis_pb2 as pb
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import ConfigError, PrefixCacheConfig, from_mapping, load_config

SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly. "  # > 4 blocks of 16 byte tokens
QUESTIONS = ["Why is the sky blue?", "What is rain?", "Why is the sky blue?"]


def _request(prompt: str, request_id: str, salt: str = "") -> pb.SynthesizeRequest:
  return pb.SynthesizeRequest(
    prompt=prompt, hints=["general_purpose"], max_tokens=8, request_id=request_id, cache_salt=salt
  )


def _run(srv, prompt: str, request_id: str, salt: str = ""):
  ch, stub = stub_of(srv)
  with ch:
    call = stub.Synthesize(_request(prompt, request_id, salt), timeout=120)
    responses = list(call)
    return responses, read_trailer(call.trailing_metadata())


def test_a_shared_prefix_is_reused_exactly_and_counted(synthesizer):
  told = PrefixCacheConfig(report_reuse=True)  # every request is told its reuse
  with BackgroundServer(synthesizer, config(scheduler="continuous", max_concurrent=2, prefix_cache=told)) as srv:
    wait_ready(srv)
    got = [_run(srv, SYSTEM + q, f"p{i}") for i, q in enumerate(QUESTIONS)]
    sched, metrics = srv.app.service.scheduler, srv.app.service.metrics
    snap = sched.snapshot()
  reused = []
  for q, (responses, trailer) in zip(QUESTIONS, got, strict=True):
    final = responses[-1].final
    ids = [t for r in responses[1:-1] for t in r.delta.token_ids]
    prompt_ids = synthesizer.prompt_ids(SYSTEM + q)
    alone = synthesizer.synthesize(prompt_ids, ["general_purpose"], max_latency_ms=math.inf, max_tokens=8).finish()
    assert ids == alone.token_ids and final.text == alone.text
    assert final.trace.HasField("prefix_cache_tokens")
    assert trailer.fields["prefix-cache-tokens"] == str(final.trace.prefix_cache_tokens)
    assert trailer.trace.prefix_cache_tokens == final.trace.prefix_cache_tokens
    reused.append(final.trace.prefix_cache_tokens)
  # The first sees an empty cache; the others share at least the system prompt's whole blocks (one engine each).
  assert reused[0] == 0 and all(n >= 16 * (len(SYSTEM) // 16 - 1) for n in reused[1:]), reused
  assert metrics.sample("thoughtjax_prefix_cache_total", {"result": "miss"}) == 1
  assert metrics.sample("thoughtjax_prefix_cache_total", {"result": "hit"}) == 2
  assert metrics.sample("thoughtjax_prefix_cache_tokens_total") == sum(reused)
  assert snap["prefix_cache_hits"] == 2 and snap["prefix_cache_bytes"] > 0 and snap["prefix_cache_blocks"] > 0


def _alone(synthesizer, prompt: str) -> list[int]:
  ids = synthesizer.prompt_ids(prompt)
  return synthesizer.synthesize(ids, ["general_purpose"], max_latency_ms=math.inf, max_tokens=8).finish().token_ids


def test_salts_scope_the_cache_and_only_the_owner_is_told_its_reuse(synthesizer):
  with BackgroundServer(synthesizer, config(scheduler="continuous", max_concurrent=2)) as srv:
    wait_ready(srv)
    metrics = srv.app.service.metrics
    # The shared scope: the second prompt reuses the first's blocks, but is not told so (nor anyone else).
    shared = [_run(srv, SYSTEM + q, f"s{i}") for i, q in enumerate(QUESTIONS[:2])]
    hits_shared = metrics.sample("thoughtjax_prefix_cache_total", {"result": "hit"})
    # Tenant a sends the system prompt; tenant b, the same system prompt with its own question: no reuse across
    # salts, and b is told 0. Then a again: its own blocks come back, and it is told how many.
    a1 = _run(srv, SYSTEM + QUESTIONS[0], "a1", salt="tenant-a")
    b = _run(srv, SYSTEM + QUESTIONS[1], "b", salt="tenant-b")
    a2 = _run(srv, SYSTEM + QUESTIONS[2], "a2", salt="tenant-a")
  for responses, trailer in shared:
    assert not responses[-1].final.trace.HasField("prefix_cache_tokens")
    assert "prefix-cache-tokens" not in trailer.fields and not trailer.trace.HasField("prefix_cache_tokens")
  assert hits_shared == 1  # the operator's metrics still count it
  told = [r[-1].final.trace.prefix_cache_tokens for r, _ in (a1, b, a2)]
  assert told[0] == 0 and told[1] == 0 and told[2] >= 16 * (len(SYSTEM) // 16 - 1), told
  assert a2[1].fields["prefix-cache-tokens"] == str(told[2])
  for (responses, _), q in zip((*shared, a1, b, a2), (*QUESTIONS[:2], *QUESTIONS), strict=True):
    assert [t for r in responses[1:-1] for t in r.delta.token_ids] == _alone(synthesizer, SYSTEM + q)


def test_a_salt_past_the_limit_is_refused(synthesizer):
  import grpc

  with BackgroundServer(synthesizer, config(scheduler="continuous", max_concurrent=2)) as srv:
    wait_ready(srv)
    with pytest.raises(grpc.RpcError) as e:
      _run(srv, "hello", "long", salt="x" * 257)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()


def test_max_mb_zero_turns_it_off(synthesizer):
  cfg = config(scheduler="continuous", max_concurrent=2, prefix_cache=PrefixCacheConfig(max_mb=0))
  with BackgroundServer(synthesizer, cfg) as srv:
    wait_ready(srv)
    runs = [_run(srv, SYSTEM + q, f"off{i}") for i, q in enumerate(QUESTIONS[:2])]
    snap = srv.app.service.scheduler.snapshot()
    hits = srv.app.service.metrics.sample("thoughtjax_prefix_cache_total", {"result": "hit"})
  for responses, trailer in runs:
    assert not responses[-1].final.trace.HasField("prefix_cache_tokens")
    assert "prefix-cache-tokens" not in trailer.fields
  assert "prefix_cache_hits" not in snap and hits == 0


def test_the_config_key_is_on_by_default_and_bad_values_are_refused_by_name():
  c = load_config().prefix_cache
  assert c.max_mb > 0 and c.block_tokens == 16 and c.report_reuse is False
  with pytest.raises(ConfigError, match=r"prefix_cache.report_reuse: expected true or false"):
    from_mapping({"prefix_cache": {"report_reuse": "yes"}})
  assert from_mapping({"prefix_cache": {"max_mb": 0}}).prefix_cache.max_mb == 0
  with pytest.raises(ConfigError, match=r"prefix_cache.max_mb: expected an integer >= 0"):
    from_mapping({"prefix_cache": {"max_mb": -5}})
  with pytest.raises(ConfigError, match=r"prefix_cache.block_tokens: expected an integer in \[1, 1024\]"):
    from_mapping({"prefix_cache": {"block_tokens": 0}})
  with pytest.raises(ConfigError, match=r"prefix_cache: unknown keys \['max_bytes'\]"):
    from_mapping({"prefix_cache": {"max_bytes": 1}})
  with pytest.raises(ConfigError, match="prefix_cache: expected a mapping"):
    from_mapping({"prefix_cache": True})

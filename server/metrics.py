"""Prometheus metrics of one server, on its own :class:`prometheus_client.CollectorRegistry` (never the
process-global one, so several servers run side by side in one process: tests, notebooks).

Series (``thoughtjax_`` prefix):
  time_to_first_token_seconds      histogram  request arrival -> first token sent (queue, plan, restore,
                                              compile and prefill included: what a client waits)
  token_latency_seconds            histogram  time between tokens after the first (per token)
  synthesis_overhead_seconds       histogram  hint normalization + GetOptimalPath of a request
  prediction_error_ratio           histogram  actual / predicted total latency of a planned request
  program_cache_total{result}      counter    hit: the request's program was compiled already; miss
  prefix_cache_total{result}       counter    hit: a slot engine reused the keys of the request's prompt prefix
                                              (prefix_cache in the config); miss: it looked and found none
  prefix_cache_tokens_total        counter    prompt tokens whose prefill the prefix cache saved
  degraded_total{reason}           counter    requests run on a degraded plan (reason: budget, unavailable)
  requests_total{method,code}      counter    answers by gRPC status; method: the gRPC method or the HTTP
                                              endpoint's path (server/http.py), so each protocol is counted
  queue_depth, slots_in_use        gauge      the scheduler's ``snapshot()`` at scrape time
  scheduler{field}                 gauge      every numeric field of that snapshot (the continuous scheduler's
                                              prefix_cache_bytes, _blocks, _evictions, _hits, ... over its engines)
  registry_failures_total{kind}    counter    integrity, signature, downgrade, rollback and restore
                                              refusals over the server's life (reloads included)
  registry_sequence                gauge      the sequence served
  reloads_total{result}            counter    ReloadRegistry: switched, unchanged, refused
  idle_releases_total              counter    paths released after idle_release_s unused (engines and weights)
  resident_paths                   gauge      paths whose engines or weights are resident (0: scaled to zero)

The HTTP endpoint (``metrics_port`` in the config; off by default, loopback when on) serves the text format
on ``/metrics``. Collection reads the servicer's state when scraped, never on the request path.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds: a warm token on a CPU is ~1 ms, a cold first token (restore and compile) tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)
FAILURE_FIELDS = {
  "integrity": "integrity_failures",
  "signature": "signature_failures",
  "downgrade": "downgrade_refusals",
  "rollback": "rollback_refusals",
  "restore": "restore_failures",
}


class _StateCollector(Collector):
  """Gauges and totals read from the servicer at scrape time."""

  def __init__(self, snapshot: Callable[[], dict], failures: Callable[[], dict], sequence: Callable[[], int]):
    self._snapshot, self._failures, self._sequence = snapshot, failures, sequence

  def collect(self):
    snap = self._snapshot()
    yield GaugeMetricFamily(
      "thoughtjax_queue_depth", "requests waiting for a turn or slot", value=snap.get("waiting", 0)
    )
    # A slot engine reports its slots; the one-generation-per-request scheduler its running requests.
    slots = snap.get("slots_in_use", snap.get("running", 0))
    yield GaugeMetricFamily("thoughtjax_slots_in_use", "decode slots (or turns) held by requests", value=slots)
    fields = GaugeMetricFamily("thoughtjax_scheduler", "the scheduler's snapshot, per field", labels=["field"])
    for k, v in sorted(snap.items()):
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        fields.add_metric([k], v)
    yield fields
    fails = CounterMetricFamily(
      "thoughtjax_registry_failures", "registry refusals over the server's life, reloads included", labels=["kind"]
    )
    totals = self._failures()
    for kind, field in FAILURE_FIELDS.items():
      fails.add_metric([kind], totals.get(field, 0))
    yield fails
    yield GaugeMetricFamily("thoughtjax_registry_sequence", "the registry sequence served", value=self._sequence())


class ServerMetrics:
  """The metrics of one server (see the module docstring); ``bind(service)`` connects the scrape-time
  gauges, ``serve(bind, port)`` starts the endpoint and returns its port."""

  def __init__(self):
    self.registry = CollectorRegistry(auto_describe=True)
    r = self.registry
    self.ttft = Histogram(
      "thoughtjax_time_to_first_token_seconds",
      "request arrival to the first token sent",
      buckets=LATENCY_BUCKETS,
      registry=r,
    )
    self.token_latency = Histogram(
      "thoughtjax_token_latency_seconds", "time per token after the first", buckets=TOKEN_BUCKETS, registry=r
    )
    self.synthesis = Histogram(
      "thoughtjax_synthesis_overhead_seconds",
      "hint normalization and GetOptimalPath of a request",
      buckets=LATENCY_BUCKETS,
      registry=r,
    )
    self.prediction = Histogram(
      "thoughtjax_prediction_error_ratio",
      "actual / predicted total latency of a planned request",
      buckets=RATIO_BUCKETS,
      registry=r,
    )
    self.program_cache = Counter(
      "thoughtjax_program_cache", "requests whose program was compiled already (hit) or not", ["result"], registry=r
    )
    self.prefix_cache = Counter(
      "thoughtjax_prefix_cache", "requests whose prompt prefix's keys were reused (hit) or not", ["result"], registry=r
    )
    self.prefix_tokens = Counter(
      "thoughtjax_prefix_cache_tokens", "prompt tokens whose prefill the prefix cache saved", registry=r
    )
    self.degraded = Counter("thoughtjax_degraded", "requests run on a degraded plan", ["reason"], registry=r)
    self.requests = Counter("thoughtjax_requests", "answers by method and gRPC status", ["method", "code"], registry=r)
    self.reloads = Counter("thoughtjax_reloads", "ReloadRegistry calls by result", ["result"], registry=r)
    # ---- idle release (scale to zero) ----
    self.idle_releases = Counter(
      "thoughtjax_idle_releases", "paths released after idle_release_s unused (engines and weights)", registry=r
    )
    self.resident_paths = Gauge(
      "thoughtjax_resident_paths", "paths whose engines or weights are resident (0: scaled to zero)", registry=r
    )
    self._http = None
    self.port: int | None = None
    self._lock = threading.Lock()

  def bind(self, snapshot: Callable[[], dict], failures: Callable[[], dict], sequence: Callable[[], int]) -> None:
    self.registry.register(_StateCollector(snapshot, failures, sequence))

  # ---- events (called by the servicer) ------------------------------------------------------
  def answered(self, method: str, code: str) -> None:
    self.requests.labels(method, code).inc()

  def first_token(self, seconds: float) -> None:
    self.ttft.observe(seconds)

  def tokens(self, seconds: float, n: int) -> None:
    """``n`` tokens arrived ``seconds`` after the previous ones."""
    if n > 0:
      per = seconds / n
      for _ in range(n):
        self.token_latency.observe(per)

  def finished(self, trace, usage, program_cache_hit: bool | None) -> None:
    """A stream's final trace (``thoughtjax.v1.Trace``): overhead, cache, degradation, prediction."""
    if "synthesis" in trace.actual_ms:
      self.synthesis.observe(trace.actual_ms["synthesis"] / 1e3)
    if program_cache_hit is not None:
      self.program_cache.labels("hit" if program_cache_hit else "miss").inc()
    if trace.HasField("prefix_cache_tokens"):
      self.prefix_cache.labels("hit" if trace.prefix_cache_tokens else "miss").inc()
      self.prefix_tokens.inc(trace.prefix_cache_tokens)
    if trace.degraded:
      self.degraded.labels(trace.reason.split(":", 1)[0].strip() or "unknown").inc()
    predicted, actual = trace.predicted_ms.get("total", 0.0), trace.actual_ms.get("total", 0.0)
    if predicted > 0 and actual > 0 and usage.tokens_out > 0:
      self.prediction.observe(actual / predicted)

  def bind_residency(self, resident_paths: Callable[[], int]) -> None:
    """The resident-paths gauge reads ``resident_paths()`` at scrape time."""
    self.resident_paths.set_function(resident_paths)

  # ---- endpoint -----------------------------------------------------------------------------
  def serve(self, bind: str, port: int) -> int:
    """Serve ``/metrics`` on ``bind:port`` (0: any free port) from a daemon thread; the bound port."""
    with self._lock:
      if self._http is None:
        self._http, _ = start_http_server(port, addr=bind, registry=self.registry)
        self.port = int(self._http.server_port)
      return self.port

  def stop(self) -> None:
    with self._lock:
      if self._http is not None:
        self._http.shutdown()
        self._http.server_close()
        self._http = None

  def sample(self, name: str, labels: dict | None = None) -> float:
    """The current value of one series (0 when absent), e.g. ``sample("thoughtjax_requests_total",
    {"method": "Synthesize", "code": "OK"})``."""
    got = self.registry.get_sample_value(name, labels or {})
    return 0.0 if got is None else got


def failure_totals(*stats) -> dict:
  """The refusal counters of several :class:`~thoughtjax.registry.RegistryStats` (or dicts of them) added."""
  out: collections.Counter = collections.Counter()
  for s in stats:
    d = s if isinstance(s, dict) else s.to_json()
    for field in FAILURE_FIELDS.values():
      out[field] += int(d.get(field, 0))
  return dict(out)

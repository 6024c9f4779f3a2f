"""Prometheus metrics of ``chatkv serve`` (``GET /metrics``), named in vLLM's style.

Counters and histograms are updated as requests finish; the gauges of the
engine (requests waiting, KV per tier, pool usage, scheduler counters) and of
the store (quarantined chunks) are read when ``/metrics`` is scraped. Every
metric carries the label ``model_name``.

=========================================  ===============================================================
metric                                     what
=========================================  ===============================================================
``chatkv:prompt_tokens_total``             prompt tokens of finished requests
``chatkv:generation_tokens_total``         generated tokens
``chatkv:prefix_cache_queries_total``      prompt tokens looked up in the KV cache (= prompt tokens)
``chatkv:prefix_cache_hits_total``         of those, tokens whose KV was reused, from any tier
                                           (the sum of ``usage.prompt_tokens_details.cached_tokens``)
``chatkv:prefilled_tokens_total``          prompt tokens computed by prefill
``chatkv:request_success_total``           finished requests, by ``finished_reason`` (stop, length, abort)
``chatkv:request_errors_total``            requests answered with an error, by ``status``
``chatkv:request_kv_source_total``         requests by where their KV came from (``source``: device,
                                           quantized, host, disk, recomputed)
``chatkv:session_match_total``             requests by how their session was found (``match``: explicit,
                                           prefix, branch, new)
``chatkv:time_to_first_token_seconds``     histogram: request arrival to the first piece of the reply
``chatkv:inter_token_latency_seconds``     histogram: between two streamed pieces of a reply
``chatkv:e2e_request_latency_seconds``     histogram: request arrival to the reply's end
``chatkv:num_requests_running``            requests in flight, less those waiting to start
``chatkv:num_requests_waiting``            turns queued in the engine's scheduler, not yet started
``chatkv:kv_cache_usage_perc``             fraction of the device block pool in use (0-1)
``chatkv:kv_cache_bytes``                  KV bytes per ``tier`` (device, quantized, host, disk)
``chatkv:kv_cache_sessions``               sessions per ``tier``
``chatkv:kv_tier_hits_total``              turns served per ``tier`` (device: a hit; others: promotions)
``chatkv:num_preemptions_total``           turns preempted under memory pressure
``chatkv:open_sessions``                   sessions the server holds open
``chatkv:session_restores_total``          sessions opened whose KV was loaded from disk
``chatkv:session_restore_bytes_total``     bytes of chunk files those restores read
``chatkv:session_restore_seconds``         histogram: wall time of those restores
``chatkv:quarantined_chunks``              chunk files in ``$CHATKV_HOME/quarantine`` (failed verification)
=========================================  ===============================================================
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from chatkv.engine import Engine

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0)
_RESTORE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    """Reads the engine's and the store's state at scrape time."""

    def __init__(self, model_name: str, engine: "Engine", quarantine_dir: Path | None,
                 open_sessions: Callable[[], int], running: Callable[[], int]) -> None:
        self.model_name = model_name
        self.engine = engine
        self.quarantine_dir = quarantine_dir
        self.open_sessions = open_sessions
        self.running = running

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only (no describe-time engine calls)

    def collect(self) -> Iterator[Any]:
        labels = ["model_name"]
        name = [self.model_name]
        engine = self.engine
        g = GaugeMetricFamily("chatkv:num_requests_waiting", "Turns queued in the scheduler, not yet started.",
                              labels=labels)
        g.add_metric(name, engine.scheduler.num_waiting)
        yield g
        g = GaugeMetricFamily("chatkv:num_requests_running", "Requests in flight, less those waiting to start.",
                              labels=labels)
        g.add_metric(name, max(0, self.running() - engine.scheduler.num_waiting))
        yield g
        g = GaugeMetricFamily("chatkv:open_sessions", "Sessions the server holds open.", labels=labels)
        g.add_metric(name, self.open_sessions())
        yield g
        try:
            pool = engine.pool_stats()
            tiers = engine.tier_stats()
        except Exception as exc:  # a scrape must not fail because the engine is busy shutting down
            log.warning("metrics: could not read the engine's state: %s", exc)
            return
        g = GaugeMetricFamily("chatkv:kv_cache_usage_perc", "Fraction of the device block pool in use.",
                              labels=labels)
        g.add_metric(name, pool.used_blocks / pool.num_blocks if pool.num_blocks else 0.0)
        yield g
        g = GaugeMetricFamily("chatkv:kv_cache_bytes", "KV bytes per tier.", labels=labels + ["tier"])
        for tier, value in tiers.bytes.items():
            g.add_metric(name + [tier], value)
        yield g
        g = GaugeMetricFamily("chatkv:kv_cache_sessions", "Sessions per tier.", labels=labels + ["tier"])
        for tier, value in tiers.sessions.items():
            g.add_metric(name + [tier], value)
        yield g
        c = CounterMetricFamily("chatkv:kv_tier_hits", "Turns served per tier (device is a hit).",
                                labels=labels + ["tier"])
        for tier, value in tiers.hits.items():
            c.add_metric(name + [tier], value)
        yield c
        c = CounterMetricFamily("chatkv:num_preemptions", "Turns preempted under memory pressure.", labels=labels)
        c.add_metric(name, engine.scheduler.stats.preemptions)
        yield c
        if engine.scheduler.threads is not None:
            g = GaugeMetricFamily("chatkv:loop_threads", "Threads the engine runs the model on, fitted to the CPUs "
                                  "other processes leave free.", labels=labels)
            g.add_metric(name, engine.scheduler.stats.threads)
            yield g
        g = GaugeMetricFamily("chatkv:quarantined_chunks", "Chunk files that failed verification.", labels=labels)
        n = 0
        if self.quarantine_dir is not None and self.quarantine_dir.is_dir():
            n = sum(1 for p in self.quarantine_dir.iterdir() if p.suffix == ".safetensors")
        g.add_metric(name, n)
        yield g


class Metrics:
    """The server's metrics, in a registry of their own (so several apps in one
    process, as in the tests, do not collide)."""

    def __init__(self, model_name: str) -> None:
        """Metrics labelled ``model_name``."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("chatkv:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("chatkv:generation_tokens", "Generated tokens.", m, registry=r)
        self.prefix_queries = Counter("chatkv:prefix_cache_queries", "Prompt tokens looked up in the KV cache.", m,
                                      registry=r)
        self.prefix_hits = Counter("chatkv:prefix_cache_hits", "Prompt tokens whose KV was reused (any tier).", m,
                                   registry=r)
        self.prefilled = Counter("chatkv:prefilled_tokens", "Prompt tokens computed by prefill.", m, registry=r)
        self.success = Counter("chatkv:request_success", "Finished requests.", m + ["finished_reason"], registry=r)
        self.errors = Counter("chatkv:request_errors", "Requests answered with an error.", m + ["status"],
                              registry=r)
        self.kv_source = Counter("chatkv:request_kv_source", "Requests by where their KV came from.",
                                 m + ["source"], registry=r)
        self.session_match = Counter("chatkv:session_match", "Requests by how their session was found.",
                                     m + ["match"], registry=r)
        self.ttft = Histogram("chatkv:time_to_first_token_seconds", "Request arrival to the first piece.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("chatkv:inter_token_latency_seconds", "Between two streamed pieces.", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("chatkv:e2e_request_latency_seconds", "Request arrival to the reply's end.", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.restores = Counter("chatkv:session_restores", "Sessions opened whose KV was loaded from disk.", m,
                                registry=r)
        self.restore_bytes = Counter("chatkv:session_restore_bytes", "Bytes of chunk files restores read.", m,
                                     registry=r)
        self.restore_seconds = Histogram("chatkv:session_restore_seconds", "Wall time of restores.", m,
                                         buckets=_RESTORE_BUCKETS, registry=r)

    def attach(self, engine: "Engine", quarantine_dir: Path | None, open_sessions: Callable[[], int],
               running: Callable[[], int]) -> None:
        """Add the scrape-time gauges of ``engine`` and the store."""
        self.registry.register(_EngineCollector(self.model_name, engine, quarantine_dir, open_sessions, running))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

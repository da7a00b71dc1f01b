"""The server's Prometheus metrics, in a registry of its own (one per app, so several servers share a process).

Speculative counters carry vLLM's names (spec_decode/metrics.py defines them) under the `specquant:` prefix:
spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens and
spec_decode_num_accepted_tokens_per_pos{position}; mean acceptance length = 1 + accepted / drafts.
prefix_cache_queries / prefix_cache_hits count prompt tokens looked up / restored (vLLM's names), with
prefix_cache_requests{result=hit|miss} and the cache's entries and bytes. The rolling gauge averages the last
`window` requests, and a warning is logged when it first drops below the threshold (acceptance collapse under a
quantized target is otherwise invisible)."""

from __future__ import annotations

import logging
import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specquant.spec_decode.metrics import SpecMetrics

log = logging.getLogger("specquant.serve")
PREFIX = "specquant:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    def __init__(self, window: int, warn_below: float):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "requests answered, by endpoint and outcome",
                                ("endpoint", "outcome"), registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "requests queued for the engine worker", registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "requests the engine is generating", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "mean time per token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        name = PREFIX + "spec_decode_"
        self.num_drafts = Counter(name + "num_drafts", "verify steps that carried drafts", registry=r)
        self.num_draft_tokens = Counter(name + "num_draft_tokens", "draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(name + "num_accepted_tokens", "draft tokens accepted", registry=r)
        self.per_pos = Counter(name + "num_accepted_tokens_per_pos", "drafts whose token at position was accepted",
                               ("position",), registry=r)
        self.mal = Gauge(name + "mean_acceptance_length_rolling",
                         "1 + accepted / drafts over the last requests (0 before any draft)", registry=r)
        # prefix cache (vLLM's names for the token counters): hit rate = hits / queries
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "prompt tokens the prefix cache restored (not "
                                   "prefilled)", registry=r)
        self.prefix_requests = Counter(PREFIX + "prefix_cache_requests", "prefix cache lookups, by result",
                                       ("result",), registry=r)
        self.prefix_entries = Gauge(PREFIX + "prefix_cache_entries", "prompts the prefix cache holds", registry=r)
        self.prefix_bytes = Gauge(PREFIX + "prefix_cache_bytes", "bytes of snapshots the prefix cache holds",
                                  registry=r)
        self.window = deque(maxlen=window)  # (drafts, accepted) per request
        self.warn_below = warn_below
        self.warned = False
        self.lock = threading.Lock()  # the worker records, the event loop scrapes

    def record_spec(self, spec: SpecMetrics) -> None:
        """One finished request's speculative counters."""
        if not spec.num_drafts:
            return
        self.num_drafts.inc(spec.num_drafts)
        self.num_draft_tokens.inc(spec.num_draft_tokens)
        self.num_accepted_tokens.inc(spec.num_accepted_tokens)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.per_pos.labels(position=str(pos)).inc(n)
        with self.lock:
            self.window.append((spec.num_drafts, spec.num_accepted_tokens))
            drafts = sum(d for d, _ in self.window)
            mal = 1.0 + sum(a for _, a in self.window) / drafts
        self.mal.set(mal)
        low = self.warn_below > 0 and mal < self.warn_below
        if low and not self.warned:
            log.warning("rolling mean acceptance length %.2f over the last %d requests is below %.2f: the drafter "
                        "barely helps (a quantized target that drifted from its drafter?)", mal, len(self.window),
                        self.warn_below)
        self.warned = low

    def render(self) -> bytes:
        return generate_latest(self.registry)
